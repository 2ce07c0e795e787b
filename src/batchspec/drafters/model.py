"""A draft model with its own persistent, synchronised KV cache (a ``SlotState`` under the same layout).

Each round appends K+1 draft slots per row: ``[carry, pending]`` then ``d1..d(K-1)``. ``carry`` is the previous
round's K-th draft token when that round accepted all K (the draft never cached it), else a hidden hole.
"""

import torch

from ..batch import merge, prefill
from ..sampling import DRAFT, draw
from .base import Drafter


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model):
        self.model = model
        self.reset()

    @property
    def states(self):
        return (self.state,) if self.state is not None else ()

    def reset(self):
        self.state = self.carry = self.carry_valid = None

    def add(self, prompts):
        new = prefill(self.model, prompts, name="draft")
        carry = torch.zeros(len(prompts), dtype=torch.long, device=self.model.device)
        if self.state is None:
            self.state, self.carry, self.carry_valid = new, carry, carry.bool()
        else:
            self.state = merge(self.state, new)
            self.carry = torch.cat([self.carry, carry])
            self.carry_valid = torch.cat([self.carry_valid, carry.bool()])

    def propose(self, seqs, k):
        pending = seqs.pending()
        ids = torch.stack([self.carry, pending], 1)
        valid = torch.stack([self.carry_valid, torch.ones_like(self.carry_valid)], 1)
        logits = self.state.append(ids, valid, logits_to_keep=1)
        u = seqs.uniforms(k, DRAFT) if seqs.sampling else None
        drafts, qs = [], []
        for i in range(k):
            if i:
                logits = self.state.append(drafts[-1][:, None], logits_to_keep=1)
            if u is None:
                drafts.append(logits[:, -1].argmax(-1))
            else:  # sample from the warped draft distribution, keep it for the rejection sampler
                qs.append(seqs.warp(logits[:, -1:])[:, 0])
                drafts.append(draw(qs[-1], u[:, i]))
        drafts = torch.stack(drafts, 1)
        self.last = drafts[:, -1]
        return drafts, torch.full_like(pending, k), torch.stack(qs, 1) if qs else None

    def commit(self, accepted, k):
        self.state.hide_tail(k + 1, 2 + accepted.clamp(max=k - 1))
        self.carry_valid = accepted == k
        self.carry = self.last

    def processed(self, seqs):
        return seqs.length - 1 - self.carry_valid.long()

    def take(self, rows):
        part = ModelDrafter(self.model)
        part.state, part.carry, part.carry_valid = self.state.take(rows), self.carry[rows], self.carry_valid[rows]
        return part

    def put(self, rows, part):
        self.state.put(rows, part.state)
        self.carry[rows], self.carry_valid[rows] = part.carry, part.carry_valid

    def select_rows(self, rows):
        self.state.select_rows(rows)
        self.carry, self.carry_valid = self.carry[rows], self.carry_valid[rows]
