"""How many tokens the rows draft in a round (the speculation length), chosen before the round is drafted.

A policy has ``length(rows, k_max, sampling) -> k`` (0..k_max) and two hooks the engine calls after each round's one
host read: ``estimates(seqs, k_max)`` returns a small device tensor to read with it (or None), and
``observe(rows, k, width, seconds, values)`` gets what was read and the round's wall time.

One length serves the whole round. The verification forward is one rectangle as wide as its widest row, and a draft
model drafts for every row at once, so a row drafting fewer tokens than the others saves nothing and can only
accept fewer: the per-row acceptance estimates enter the choice through the expected tokens of the whole batch.
"""

from .adaptive import AdaptiveLength
from .fixed import FixedLength
from .row_values import expected_tokens, row_values

POLICIES = {"fixed": FixedLength, "adaptive": AdaptiveLength}


def get_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"unknown speculation {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()


__all__ = ["AdaptiveLength", "FixedLength", "POLICIES", "expected_tokens", "get_policy", "row_values"]
