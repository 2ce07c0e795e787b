"""The fixed speculation length: every row drafts K tokens every round, the drafter's default way."""

from __future__ import annotations

from .budget import FIXED, NO_ROOM, DraftBudget, RoundView
from .plan import Plans


class FixedLength(Plans):
    """Every round drafts ``k_max`` (K, clipped near the context's end), every candidate a drafter offers up to it; a
    subclass may choose another ``length``."""

    name = "fixed"

    def bind(self, target_runner, drafter, batch_size: int) -> None:
        """Nothing to measure: a fixed length needs no costs."""

    def length(self, rows: int, k_max: int, sampling: bool = False) -> int:
        return k_max

    def budget(self, view: RoundView) -> DraftBudget:
        if view.k_max == 0:
            return DraftBudget.plain(NO_ROOM)
        return DraftBudget(self.length(view.rows, view.k_max, view.seqs.sampling), reason=FIXED)

    def record(self, seqs, accepted, k: int, plan=None, proposal=None, target=None) -> None:
        """What the round's drafts did: the planner's acceptance learns (device only)."""
        self.learn(plan, proposal, accepted, target)

    def estimates(self, seqs, k_max: int):
        return None

    def observe(self, outcome) -> None:
        pass

    def dry(self) -> bool:
        return False  # it drafts every round
