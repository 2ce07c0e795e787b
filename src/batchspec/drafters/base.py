"""The drafter interface. A drafter keeps no per-batch state of its own: what it needs per row (a draft model's
cache, say) is a *state* object that it creates at prefill and that the running batch owns and moves with its rows
(``select_rows`` / ``take`` / ``put`` / ``merge``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    """A round's drafts: ``drafts`` ``[B, k]`` (entries past ``n_drafts[b]`` are meaningless), ``n_drafts`` ``[B]``
    and ``q`` ``[B, k, V]``, the distributions they were sampled from (None for greedy or deterministic drafting:
    one-hot on the drafts); ``match`` ``[B]``: what a drafter wants back at ``commit`` (prompt lookup's match
    lengths), or None."""

    drafts: torch.Tensor
    n_drafts: torch.Tensor
    q: torch.Tensor | None = None
    match: torch.Tensor | None = None
    kind: str | None = None  # for a drafter with ``kinds``: which kind of round this proposal is
    # extra work the round does on top of a round of kind ``base`` of its width (the head's catch-up: the pairs it
    # caches), for the policy to price per unit of work
    work: int = 0
    base: str | None = None

    @classmethod
    def empty(cls, rows: int, device) -> "Proposal":
        """No drafts for any row (a plain decoding step)."""
        return cls(torch.empty((rows, 0), dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device))


class Drafter:
    name = "drafter"
    needs_hidden = False  # whether ``commit`` reads the target's final hidden states
    # whether ``propose`` picks its own width under greedy decoding from ``costs`` (a round verifying j = 0..k drafts,
    # in plain steps), which the engine sets from the policy before each round (``policy.drafter_length``)
    sizes_own_drafts = False
    # whether the drafter may size each row on its own against per-token costs: where the target's runner packs
    # (``Runner.packed_rows``) the engine sets ``per_token``, and ``costs[m]`` is then a round verifying m drafts in all
    # (each row's slots past its own drafts are not computed), not a block of width m + 1
    packs_rows = False
    per_token = False
    # with ``per_token``: what a token of each row is worth ``[B]``, in tokens of a row (``policy.row_values``), or
    # None for 1 each; a row's drafts count for their expected tokens times its worth
    row_value: torch.Tensor | None = None
    # rounds of different kinds that cost differently (the policy measures each width per kind and ``costs`` is then
    # a dict kind -> list, or None for "draft K your default way"); None: one kind. With kinds, ``costs["work"]``
    # is a dict kind -> measured cost of one unit of a round's ``work`` (``Proposal.work``) in plain steps, or None
    kinds: tuple | None = None

    def worth(self, chance: torch.Tensor) -> torch.Tensor:
        """``[B, ...]`` each row's expected tokens ``chance`` at what its tokens are worth (``row_value``)."""
        return chance if self.row_value is None else chance * self.row_value[:, None]

    def prefill(self, prompts: list[list[int]], hidden: torch.Tensor | None = None):
        """The state of rows starting with ``prompts`` (None for drafters that keep no per-row state). A drafter
        that ``needs_hidden`` gets the target's final hidden states at every prompt token but the last, ``[B, W,
        H]`` right-aligned (``batch.prefill``)."""
        return None

    def propose(self, seqs, state, k: int) -> Proposal:
        """Up to ``k`` (>= 1) proposed tokens per row; a round that drafts nothing does not ask."""
        raise NotImplementedError

    def commit(self, state, proposal: Proposal, accepted: torch.Tensor, target) -> None:
        """After verification: row b accepted ``accepted[b]`` drafts; ``target`` is the verification's
        ``TargetOutput``."""

    def states(self, state) -> tuple:
        """The ``SlotState``s inside ``state`` that the layout keeps aligned and the invariant checker checks."""
        return ()

    def processed(self, seqs, state) -> torch.Tensor:
        """Tokens each of those caches must hold, per row (for the invariant checker)."""
        raise NotImplementedError
