"""The one value a round's speculation decision hands the drafter: a ``DraftBudget``.

Terms, once: a row's round emits its *accepted* drafts (the longest prefix equal to the target's own choices) and then
one token of the target's, the *bonus* token (under sampling, after a rejection, the *recovered* token drawn from the
residual distribution). A *plain step* is a round that drafts nothing: one token per row, one forward; every cost
below is in plain steps of the same number of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# why a round drafted nothing, or how its budget was set (``Stats.decisions`` counts rounds by these)
DRAFT = "draft"  # the drafter was asked with costs to size its round by (it may still draft nothing)
FIXED = "fixed"  # the drafter drafts k its default way: fixed length, or sampling (a seed's tokens must not depend
# on the machine's speed, so the length never comes from timings there)
PROBE = "probe"  # one draft a row after rounds without evidence, to keep the acceptance estimates current
NO_ROOM = "no-room"  # the context's end is reached: nothing may be drafted
NOT_WORTH = "not-worth-it"  # the expected tokens per plain step of every length were below a plain step's
DRY = "dry"  # the drafter verified nothing for a while: it is asked only every few rounds
NO_DRAFTER = "no-drafter"
REASONS = (DRAFT, FIXED, PROBE, NO_ROOM, NOT_WORTH, DRY, NO_DRAFTER)


@dataclass
class DraftBudget:
    """What a drafter may draft in one round, and what a drafted token is worth; decided before the round.

    - ``k``: the most drafts any row may propose (0: a plain step; the drafter is not asked).
    - ``verify``: ``[m]``, a round verifying m drafts costs ``verify[m]`` plain steps, m = 0..len-1 (m counts the
      batch's drafts in all where ``per_row``, else the drafts of each row, the block being m + 1 wide); None: draft k
      the drafter's default way (a fixed length, or sampling).
    - ``step``: one forward of the drafter's own model over the batch, in plain steps (0 for model-free drafters);
      ``pair``: caching one token (a head's feature pair) of every row in that model, in plain steps.
    - ``per_row``: rows are sized one by one (the target's runner computes only each row's real tokens, so a row that
      drafts little costs little beside one that drafts much).
    - ``worth``: ``[B]`` what a token of each row is worth, in tokens of a row (``row_values``), or None: 1 each.
    - ``reason``: why the budget is what it is (``REASONS``).
    - ``context``: what the rows' cached tokens add to ``verify`` (``CostModel.context``): ``(base, per_draft)``, in
      plain steps, ``base`` to every size (0 included), ``per_draft[b]`` to each draft of row b; None: nothing.
    """

    k: int
    verify: list[float] | None = None
    step: float = 0.0
    pair: float = 0.0
    per_row: bool = False
    worth: torch.Tensor | None = None
    reason: str = FIXED
    context: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def plain(cls, reason: str) -> "DraftBudget":
        return cls(0, reason=reason)

    @property
    def sized(self) -> bool:
        """Whether the drafter sizes its round from costs (else it drafts k its default way)."""
        return self.verify is not None

    def verify_tensor(self, most: int, device) -> torch.Tensor:
        """``[most + 1]`` the verification costs, never falling with m, past the priced ones ``inf``."""
        given = list(self.verify or [1.0])[: most + 1]
        given += [float("inf")] * (most + 1 - len(given))
        return torch.tensor(given, dtype=torch.float64, device=device).cummax(0).values

    def weigh(self, chance: torch.Tensor) -> torch.Tensor:
        """``[B, ...]`` each row's expected tokens ``chance`` at what its tokens are worth."""
        return chance if self.worth is None else chance * self.worth[:, None]


@dataclass
class RoundView:
    """What the speculation decision reads about the coming round (nothing here is changed by reading it)."""

    rows: int
    k_max: int  # the most drafts a row may verify (the context's end clips K)
    seqs: object  # the round's ``Sequences`` (device tensors: lengths, limits, acceptance evidence)
    waiting: bool = False  # requests wait to take a finished row's place
    packed_rows: int = 0  # rows (real new tokens) the target's runner computes without padding (0: none)


@dataclass
class Outcome:
    """What a round did, read with its one host read: ``drafted`` drafts verified in all, the drafter's ``kind`` of
    round, and ``values`` (the acceptance estimates read, or None)."""

    rows: int
    k_max: int
    budget: DraftBudget
    drafted: int
    kind: str | None = None
    values: list[float] | None = None
