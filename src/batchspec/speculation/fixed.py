"""The fixed speculation length: every row drafts K tokens every round."""

from __future__ import annotations

from .row_values import FIXED_SHARE


class FixedLength:
    """Every row drafts ``num_draft_tokens`` (K) tokens every round: the verification block is K+1 wide."""

    name = "fixed"

    def length(self, rows: int, k_max: int, sampling: bool = False) -> int:
        return k_max

    def drafter_length(self, rows: int, k_max: int, kinds=None, step: int = 1) -> tuple[int, list | dict | None]:
        """For a drafter that sizes its own proposals (prompt lookup): the round's maximum, and what a round
        verifying j = 0..k drafts costs (equal costs: offer every candidate, the classic behaviour). A drafter with
        kinds of rounds (``kinds``) gets None: it drafts K its default way."""
        k = self.length(rows, k_max)
        return k, None if kinds else [1.0] * (k + 1)

    def record(self, seqs, accepted, k: int) -> None:
        pass

    def estimates(self, seqs, k_max: int):
        return None

    def observe(self, rows: int, k: int, width: int, seconds: float, values, kind=None, work=0, base=None) -> None:
        pass

    def fixed_share(self, rows: int) -> float:
        """The share of a step of ``rows`` rows that does not grow with its rows (``row_values``)."""
        return FIXED_SHARE
