"""A draft model with its own persistent, synchronised KV cache (a ``SlotState`` under the same layout).

Each round appends K+1 draft slots per row: ``[carry, pending]`` then ``d1..d(K-1)``. ``carry`` is the previous
round's K-th draft token when that round accepted all K (the draft never cached it), else a hidden hole.
"""

from __future__ import annotations

import torch

from ..batch import prefill
from ..runner import Runner
from ..sampling import DRAFT, draw
from .base import Drafter, Proposal


class DraftState:
    """Per row: the draft model's slots, and the carried token (``carry``, visible when ``carry_valid``)."""

    def __init__(self, slots, carry: torch.Tensor, carry_valid: torch.Tensor):
        self.slots, self.carry, self.carry_valid = slots, carry, carry_valid

    def select_rows(self, rows):
        self.slots.select_rows(rows)
        self.carry, self.carry_valid = self.carry[rows], self.carry_valid[rows]

    def take(self, rows) -> "DraftState":
        return DraftState(self.slots.take(rows), self.carry[rows], self.carry_valid[rows])

    def put(self, rows, part: "DraftState") -> None:
        self.slots.put(rows, part.slots)
        self.carry[rows], self.carry_valid[rows] = part.carry, part.carry_valid

    def merge(self, other: "DraftState") -> "DraftState":
        return DraftState(self.slots.merge(other.slots), torch.cat([self.carry, other.carry]),
                          torch.cat([self.carry_valid, other.carry_valid]))


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model):
        self.model = model
        self.runner = Runner(model)

    def prefill(self, prompts):
        carry = torch.zeros(len(prompts), dtype=torch.long, device=self.runner.device)
        return DraftState(prefill(self.runner, prompts, name="draft"), carry, carry.bool())

    def propose(self, seqs, state: DraftState, k):
        pending = seqs.pending()
        ids = torch.stack([state.carry, pending], 1)
        valid = torch.stack([state.carry_valid, torch.ones_like(state.carry_valid)], 1)
        logits = state.slots.append(ids, valid, logits_to_keep=1).logits
        u = seqs.uniforms(k, DRAFT) if seqs.sampling else None
        drafts, qs = [], []
        for i in range(k):
            if i:
                logits = state.slots.append(drafts[-1][:, None], logits_to_keep=1).logits
            if u is None:
                drafts.append(logits[:, -1].argmax(-1))
            else:  # sample from the warped draft distribution, keep it for the rejection sampler
                qs.append(seqs.warp(logits[:, -1:])[:, 0])
                drafts.append(draw(qs[-1], u[:, i]))
        return Proposal(torch.stack(drafts, 1), torch.full_like(pending, k), torch.stack(qs, 1) if qs else None)

    def commit(self, state: DraftState, proposal: Proposal, accepted, target) -> None:
        k = proposal.drafts.shape[1]
        state.slots.hide_tail(k + 1, 2 + accepted.clamp(max=k - 1))
        state.carry_valid = accepted == k
        state.carry = proposal.drafts[:, -1]

    def states(self, state):
        return (state.slots,)

    def processed(self, seqs, state):
        return seqs.length - 1 - state.carry_valid.long()
