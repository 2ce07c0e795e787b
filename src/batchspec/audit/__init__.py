"""Correctness audit: compare engines with batch-size-1 greedy decoding and diagnose how they diverge.

``audit(target, draft, prompts, engines=[...], batch_sizes=[...])`` returns an ``AuditReport``. Definitions live next
to the code that applies them: metrics (``metrics``), the oracle and its cache (``oracle``), margin attribution and
signature rules (``attribution``), engine names and callables (``engines``). With ``sampling=SamplingParams(
temperature>0)`` the audit is distributional instead (``distribution``: TVD and chi-square against the exact
distribution of plain sampling).
"""

from .attribution import DEFAULT_TOLERANCE, SIGNATURES, Divergence
from .core import audit
from .distribution import DistributionReport, distribution_audit
from .report import AuditReport, AuditRow

__all__ = ["audit", "AuditReport", "AuditRow", "Divergence", "SIGNATURES", "DEFAULT_TOLERANCE", "distribution_audit",
           "DistributionReport"]
