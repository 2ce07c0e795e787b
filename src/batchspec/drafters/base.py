"""The drafter interface. A drafter keeps no per-batch state of its own: what it needs per row (a draft model's
cache, say) is a *state* object that it creates at prefill and that the running batch owns and moves with its rows
(``select_rows`` / ``take`` / ``put`` / ``merge``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..speculation.plan import DraftPlan, Offer


@dataclass
class Proposal:
    """A round's drafts. Shapes: ``drafts`` ``[B, k]`` (entries past ``n_drafts[b]`` are meaningless), ``n_drafts``
    ``[B]``, ``q`` ``[B, k, V]`` the distributions the drafts were sampled from (None for greedy or deterministic
    drafting: one-hot on the drafts). ``kind``: the kind of round, for drafters whose rounds come in kinds (the
    head's "copy" and "head"), counted in ``Stats.kinds``. ``first`` ``[B]``: a head round's first drafts by the head
    (before any copies replaced them), which speculation scores against the target's tokens; else None."""

    drafts: torch.Tensor
    n_drafts: torch.Tensor
    q: torch.Tensor | None = None
    kind: str | None = None
    first: torch.Tensor | None = None

    @classmethod
    def empty(cls, rows: int, device) -> "Proposal":
        """No drafts for any row (a plain decoding step)."""
        return cls(torch.empty((rows, 0), dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device))


def widened(candidates: torch.Tensor | None, rows: int, width: int, device) -> torch.Tensor:
    """``candidates`` ``[B, w]`` (None: none) cut or zero-padded to ``[rows, width]``: a block of drafts as wide as the
    plan's, which forced tokens may have widened past the candidates."""
    if candidates is None:
        return torch.zeros((rows, width), dtype=torch.long, device=device)
    return torch.nn.functional.pad(candidates[:, :width], (0, max(width - candidates.shape[1], 0)))


class Drafter:
    """The default members of a drafter (the contract: ``engine/protocols.py``)."""

    name = "drafter"
    needs_hidden = False  # whether ``prefill`` and ``commit`` read the target's features (its hidden states)
    # whether its greedy offers carry per-row candidates that speculation sizes each round by, from the budget's
    # costs (prompt lookup, the head with copies); otherwise the policy chooses one length for the batch: ``budget.k``
    sizes_own_drafts = False
    # whether the drafter may size each row on its own (``DraftBudget.per_row``) where the target's runner packs
    packs_rows = False
    # ``timing()`` -> (runner, input layer or None, hidden): what the cost profile times as one drafting forward, for
    # drafters with a model of their own (None: model-free, drafting costs nothing worth pricing)
    timing = None
    # whether ``propose`` drafts a plan's forced tokens (``DraftPlan.forced``: those a grammar forces) first; a drafter
    # that does not (the head) gets none
    takes_forced = False

    def prefill(self, prompts: list[list[int]], hidden: torch.Tensor | None = None, joining: bool = False):
        """The state of rows starting with ``prompts`` (None for drafters that keep no per-row state). A drafter
        that ``needs_hidden`` gets the target's features at every prompt token but the last, ``[B, W, H]``
        right-aligned (``batch.prefill``'s ``FEATURES``), and ``joining``: whether the rows join a running batch."""
        return None

    def offer(self, seqs, state, k: int) -> Offer:
        """What it could draft this round, up to k (>= 1) a row (``speculation.plan.Offer``); it decides nothing. By
        default no candidates: it drafts the plan's k a row its default way."""
        return Offer(len(seqs.length), seqs.length.device, sampling=seqs.sampling)

    def propose(self, seqs, state, plan: DraftPlan) -> Proposal:
        """Exactly ``plan.drafts`` tokens per row, in a block ``plan.width`` (>= 1) wide (``speculation.plan``
        decided them from ``offer``); a round that drafts nothing does not ask."""
        raise NotImplementedError

    def forced_first(self, plan: DraftPlan, drafts: torch.Tensor, n: torch.Tensor) -> Proposal:
        """``drafts`` ``[B, plan.width]`` (``n`` ``[B]`` a row) with the plan's forced tokens first: a row keeps its
        own drafts after them only where they agree with its forced ones (a model drafting on from them does)."""
        if plan.forced is None:
            return Proposal(drafts, n)
        col, f = torch.arange(drafts.shape[1], device=n.device)[None, :], plan.n_forced[:, None]
        forced = torch.nn.functional.pad(plan.forced, (0, drafts.shape[1] - plan.forced.shape[1]))
        agree = ((drafts == forced) | (col >= f) | (col >= n[:, None])).all(1)
        return Proposal(torch.where(col < f, forced, drafts), torch.where(agree, torch.maximum(n, f[:, 0]), f[:, 0]))

    def commit(self, state, proposal: Proposal, accepted: torch.Tensor, target) -> None:
        """After verification: row b accepted ``accepted[b]`` drafts; ``target`` is the verification's
        ``TargetOutput``."""

    def states(self, state) -> tuple:
        """The ``SlotState``s inside ``state`` that the layout keeps aligned and the invariant checker checks."""
        return ()

    def processed(self, seqs, state) -> torch.Tensor:
        """Tokens each of those caches must hold, per row (for the invariant checker)."""
        raise NotImplementedError
