"""A draft model with its own persistent, synchronised KV cache (a ``SlotState`` under the same layout).

A drafting round appends ``M + k - 1`` draft slots per row: the ``M`` tokens the draft has not cached yet (right-
aligned; rows missing fewer have hidden holes on the left), ending with the pending token, then ``d1..d(k-1)``.
After a round that drafted, a row misses one token (the bonus, now pending) or two (the k-th draft, accepted but
never cached, and the bonus): ``M = 2``. A round that drafts nothing (``k = 0``: a plain decoding step) runs no draft
forward; each such round adds one token to catch up on, all in the next drafting round's first forward.
"""

from __future__ import annotations

import torch

from ..batch import prefill
from ..sampling import Stream, draw, greedy
from ..model.runner import Runner
from .base import Drafter, Proposal


class DraftState:
    """Per row: the draft model's slots and ``processed`` ``[B]``, the tokens it has cached. ``skips`` counts rounds
    since the last one that drafted (each adds at most one token to catch up on)."""

    def __init__(self, slots, processed: torch.Tensor, skips: int = 0):
        self.slots, self.processed, self.skips = slots, processed, skips

    @property
    def catch_up(self) -> int:
        """Slots a drafting round's first forward needs: the most tokens any row has not cached."""
        return 2 + self.skips

    def select_rows(self, rows):
        self.slots.select_rows(rows)
        self.processed = self.processed[rows]

    def take(self, rows) -> "DraftState":
        return DraftState(self.slots.take(rows), self.processed[rows], self.skips)

    def put(self, rows, part: "DraftState") -> None:
        self.slots.put(rows, part.slots)
        self.processed[rows] = part.processed
        self.skips = max(self.skips, part.skips)  # a bound over every row

    def merge(self, other: "DraftState") -> "DraftState":
        return DraftState(self.slots.merge(other.slots), torch.cat([self.processed, other.processed]),
                          max(self.skips, other.skips))


class ModelDrafter(Drafter):
    name = "model"
    takes_forced = True

    def __init__(self, model, graphs: str = "auto"):
        self.model = model
        self.runner = Runner(model, graphs)

    def timing(self):
        """What the cost profile times as one drafting forward: the draft model's runner (token inputs)."""
        return self.runner, None, False

    def prefill(self, prompts):
        processed = torch.tensor([len(p) - 1 for p in prompts], dtype=torch.long, device=self.runner.device)
        return DraftState(prefill(self.runner, prompts, name="draft"), processed)

    def propose(self, seqs, state: DraftState, plan):
        """``plan.width`` drafts a row (the plan's k for every row: a model's drafts are not known before it runs),
        a row's forced tokens in place of its first ones (q one-hot on them), so that it drafts on from them and its
        cache holds what the target verifies."""
        k, m = plan.width, state.catch_up
        at = seqs.length[:, None] - m + torch.arange(m, device=seqs.length.device)[None, :]  # ends at the pending token
        ids = seqs.history.gather(1, at.clamp(min=0))
        logits = state.slots.append(ids, at >= state.processed[:, None], logits_to_keep=1).logits
        state.processed = seqs.length.clone()
        u = seqs.uniforms(k, Stream.DRAFT) if seqs.sampling else None
        drafts, qs = [], []
        for i in range(k):
            if i:
                logits = state.slots.append(drafts[-1][:, None], logits_to_keep=1).logits
            x = logits[:, -1:]
            if seqs.processors:  # processed as the target's will be, so its drafts stay likely to be accepted
                x = seqs.process(x, torch.stack(drafts, 1) if drafts else x.new_zeros(len(seqs), 0).long(), i)
            if u is None:
                drafts.append(greedy(x[:, 0]))
            else:  # sample from the warped draft distribution, keep it for the rejection sampler
                qs.append(seqs.warp(x)[:, 0])
                drafts.append(draw(qs[-1], u[:, i]))
            if plan.forced is not None and i < plan.forced.shape[1]:
                here = i < plan.n_forced
                drafts[-1] = torch.where(here, plan.forced[:, i], drafts[-1])
                if qs:
                    one_hot = torch.nn.functional.one_hot(drafts[-1], qs[-1].shape[-1]).to(qs[-1].dtype)
                    qs[-1] = torch.where(here[:, None], one_hot, qs[-1])
        drafts = torch.stack(drafts, 1)
        proposal = self.forced_first(plan, drafts, plan.drafts)
        return Proposal(drafts, proposal.n_drafts, torch.stack(qs, 1) if qs else None)

    def commit(self, state: DraftState, proposal: Proposal, accepted, target) -> None:
        k = proposal.drafts.shape[1]
        if k == 0:  # a plain decoding step (the engine did not ask to draft): catch up when next drafting
            state.skips += 1
            return
        m, kept = state.catch_up, accepted.clamp(max=k - 1)  # d1..d(k-1) were cached; the k-th never is
        state.slots.hide_tail(m + k - 1, m + kept)
        state.processed = state.processed + kept
        state.skips = 0

    def states(self, state):
        return (state.slots,)

    def processed(self, seqs, state):
        return state.processed
