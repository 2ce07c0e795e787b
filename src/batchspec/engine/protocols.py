"""What each swappable part of a round must provide. ``Parts`` (``engine.py``) holds one of each; an injected fault
(``faults.py``) replaces exactly one. The concrete parts: layouts in ``layouts/``, schedulers in ``schedulers/``,
drafters in ``batchspec.drafters``, speculation policies in ``batchspec.speculation``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    import torch

    from ..drafters.base import Proposal
    from ..speculation.budget import DraftBudget, Outcome, RoundView
    from ..speculation.plan import DraftPlan, Offer
    from ..batch import Sequences, SlotState


@runtime_checkable
class Layout(Protocol):
    """How ragged rows live in one rectangular cache: called after every round for every cache (target and draft);
    ``width`` is the most valid slots any row needs. It may move slots (compaction) but never changes what a row
    sees."""

    name: str

    def align(self, state: SlotState, width: int) -> None: ...


@runtime_checkable
class Scheduler(Protocol):
    """Which requests join and which running rows form each round's batch (``schedulers/base.py``)."""

    name: str

    def admit(self, running: int, waiting: Sequence[int], batch_size: int, token_budget: int | None = None,
              fits: Callable[[int], bool] | None = None) -> int: ...

    def select(self, lengths: list[int], batch_size: int) -> tuple[list[int] | None, bool | None]: ...

    def forget(self, keep: list[int]) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    """Offers up to k tokens per row each round and drafts exactly the plan speculation makes of the offer (``drafters/base.py`` documents each member). Per-row state lives
    in the object ``prefill`` returns, which the running batch owns and moves with its rows."""

    name: str
    needs_hidden: bool  # commit reads the target's final hidden states
    sizes_own_drafts: bool  # greedy offers carry candidates that speculation sizes each row by
    packs_rows: bool  # it may size each row on its own where the target's runner packs verification
    takes_forced: bool  # propose drafts a plan's forced tokens (those a grammar forces) first

    def prefill(self, prompts: list[list[int]], hidden: torch.Tensor | None = None, joining: bool = False): ...

    def offer(self, seqs: Sequences, state, k: int) -> Offer: ...

    def propose(self, seqs: Sequences, state, plan: DraftPlan) -> Proposal: ...

    def commit(self, state, proposal: Proposal, accepted: torch.Tensor, target) -> None: ...

    def states(self, state) -> tuple: ...

    def processed(self, seqs: Sequences, state) -> torch.Tensor: ...


@runtime_checkable
class SpeculationPolicy(Protocol):
    """How much a round drafts (``batchspec.speculation``): a budget decided before the round (a query), told what the
    round did after its one host read (the only place its state changes)."""

    name: str

    def bind(self, target_runner, drafter: Drafter, batch_size: int) -> None: ...

    def budget(self, view: RoundView) -> DraftBudget: ...

    def plan(self, offer: Offer, budget: DraftBudget) -> DraftPlan: ...

    def record(self, seqs: Sequences, accepted: torch.Tensor, k: int, plan: DraftPlan | None = None,
               proposal: Proposal | None = None, target=None) -> None: ...

    def estimates(self, seqs: Sequences, k_max: int) -> torch.Tensor | None: ...

    def observe(self, outcome: Outcome) -> None: ...

    def dry(self) -> bool:
        """Whether the drafter has gone unused for a while (a query): rows joining now leave their prompt for the
        drafter to catch up on when it next runs, rather than cache it for a drafter that may not run."""
        ...
