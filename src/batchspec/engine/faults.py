"""Injected faults that reproduce published bug classes, for the audit to catch. Off in normal use.

Each fault replaces exactly one component of ``engine.Parts`` (the target's slot state, or the acceptance rule);
nothing in the engine tests for faults.

- ``bsp-stale-positions``: position ids follow the physical slot index instead of the count of valid tokens (BSP).
- ``bsp-keep-rejected-kv``: rejected draft tokens stay visible in the KV cache (BSP's masking without removal).
- ``dsd-draft-token-accepted``: at the first mismatch the draft's token is emitted instead of the target's, and no
  bonus token follows full acceptance (DSD's off-by-one).
- ``dsd-unmasked-padding``: padding slots are visible to attention, as with an all-ones attention mask (DSD).
- ``kv-realign-off-by-one``: the realignment gather moves keys and values from one slot too far right.
- ``draft-bonus`` (sampling): after a rejection the replacement token is drawn from the draft's distribution (DSD's
  bug class; invisible at temperature 0).
- ``no-residual`` (sampling): after a rejection the replacement is drawn from the target's distribution instead of
  the residual ``max(0, p - q)`` (over-produces tokens the draft already proposed).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch

from ..model import kv
from ..batch import SlotState
from .verify import greedy_accept, rejection_sample


class StalePositions(SlotState):
    def new_positions(self, new_valid):
        return self.width + torch.arange(new_valid.shape[1], device=new_valid.device).expand_as(new_valid)


class KeepRejected(SlotState):
    def hide_tail(self, q, keep):
        pass


class UnmaskedPadding(SlotState):
    def count(self):
        return (self.valid & (self.tokens >= 0)).sum(1)

    def append(self, input_ids, new_valid=None, logits_to_keep=0, hidden=False, embeds=None, counts=None):
        self.valid = self.valid | (self.tokens < 0)
        return super().append(input_ids, new_valid, logits_to_keep, hidden, embeds, counts)


class RealignOffByOne(SlotState):
    def gather(self, index, pad):
        shifted = (index + 1).clamp(max=self.width - 1)
        kv.gather_slots(self.cache, shifted, pad)
        self.store(self.valid.gather(1, index) & ~pad, self.tokens.gather(1, shifted).masked_fill(pad, -1),
                   self.positions.gather(1, shifted).masked_fill(pad, 0))


def draft_token_accepted(target_ids, drafts, n_drafts):
    accepted, bonus = greedy_accept(target_ids, drafts, n_drafts)
    if drafts.shape[1] == 0:
        return accepted, bonus
    wrong = torch.minimum(accepted, (n_drafts - 1).clamp(min=0))
    draft_tok = drafts.gather(1, wrong[:, None]).squeeze(1)
    has = n_drafts > 0
    return torch.where(has, wrong, accepted), torch.where(has, draft_tok, bonus)


def _target_state(cls):
    def apply(parts):
        base = parts.prefill

        def prefill(runner, prompts, name="target", **kw):
            out = base(runner, prompts, name, **kw)
            state = out[0] if isinstance(out, tuple) else out
            faulty = cls.__new__(cls)
            faulty.__dict__.update(state.__dict__)
            return (faulty, *out[1:]) if isinstance(out, tuple) else faulty

        return dataclasses.replace(parts, prefill=prefill)

    return apply


FAULTS = {
    "bsp-stale-positions": _target_state(StalePositions),
    "bsp-keep-rejected-kv": _target_state(KeepRejected),
    "dsd-draft-token-accepted": lambda parts: dataclasses.replace(parts, accept=draft_token_accepted),
    "dsd-unmasked-padding": _target_state(UnmaskedPadding),
    "kv-realign-off-by-one": _target_state(RealignOffByOne),
    "draft-bonus": lambda parts: dataclasses.replace(parts, sample=partial(rejection_sample, residual="q")),
    "no-residual": lambda parts: dataclasses.replace(parts, sample=partial(rejection_sample, residual="p")),
}
SAMPLING_FAULTS = ("draft-bonus", "no-residual")  # only visible when sampling (temperature > 0)


def apply_fault(parts, name):
    if name is None:
        return parts
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; choose one of {sorted(FAULTS)}")
    return FAULTS[name](parts)
