"""The round's one host read: what the host needs of a round, packed into one int64 tensor, brought back with one
``tolist()`` and split by name into a ``RoundReadback``."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..batch import Sequences
    from .engine import RoundResult


def read_once(segments: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """Each named tensor's values, as its ``tolist()`` would give them, from one device->host transfer: integer and
    bool tensors travel as int64, floating ones as the bits of their float64 values (so one transfer carries both)."""
    ints = [(name, t) for name, t in segments if not t.is_floating_point()]
    reals = [(name, t) for name, t in segments if t.is_floating_point()]
    flat = torch.cat([t.flatten().long() for _, t in ints] + [t.flatten().double().view(torch.int64) for _, t in reals])
    values = flat.tolist()  # the one read
    n_ints = sum(t.numel() for _, t in ints)
    if reals:  # the bits back to floats, on the host
        values[n_ints:] = array("d", array("q", values[n_ints:]).tobytes()).tolist()
    out, at = {}, 0
    for name, t in ints + reals:
        out[name] = _nest(values[at : at + t.numel()], tuple(t.shape))
        at += t.numel()
    return out


def _nest(flat: list, shape: tuple[int, ...]):
    """``flat`` (row-major) as nested lists of ``shape``; a scalar for shape ``()``."""
    if not shape:
        return flat[0]
    if len(shape) == 1:
        return flat
    step = math.prod(shape[1:])
    return [_nest(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]


@dataclass
class RoundReadback:
    """What the host learns of a round (``read``). Per running row: ``finished``, ``lengths``; ``width`` the most
    slots a remaining row needs. Of the round's batch: ``generated`` tokens emitted, ``drafted`` drafts verified,
    ``accepted`` drafts accepted and emitted (in all, and the most and fewest of a row that verified drafts, -1 when
    none did), ``full_accepts`` rows that accepted all their drafts, ``cut`` verified tokens dropped after a stop
    token; per row ``emitted`` and ``block`` (the round's tokens, the first ``emitted`` of each row new).
    ``estimates``: the policy's acceptance estimates (None when not asked). ``chosen``, ``top_ids``, ``top_values``:
    the block's log-probabilities for the rows that asked (``RoundLogprobs``; None when none did)."""

    finished: list[bool]
    lengths: list[int]
    width: int
    generated: int
    drafted: int
    accepted: int
    accepted_max: int
    accepted_min: int
    full_accepts: int
    cut: int
    emitted: list[int]
    block: list[list[int]]
    estimates: list[float] | None = None
    chosen: list[list[float]] | None = None
    top_ids: list[list[list[int]]] | None = None
    top_values: list[list[list[float]]] | None = None

    @classmethod
    def read(cls, seqs: Sequences, r: RoundResult, estimates: torch.Tensor | None = None) -> RoundReadback:
        """The readback of round ``r`` on the running rows ``seqs`` (and ``estimates``, a 1D tensor), in one read."""
        acc = r.accepted.masked_fill(r.n_drafts == 0, -1)  # rows that had nothing to verify don't count as ragged
        segments = [
            ("finished", r.finished), ("lengths", seqs.length),
            ("width", (seqs.length - 1).masked_fill(r.finished, 0).max()), ("generated", r.emitted.sum()),
            ("drafted", r.n_drafts.sum()), ("accepted", r.accepted.sum()), ("accepted_max", acc.max()),
            ("accepted_min", acc.masked_fill(acc < 0, acc.max() + 1).min()),
            ("full_accepts", ((r.accepted == r.n_drafts) & (r.n_drafts > 0)).sum()), ("cut", r.cut.sum()),
            ("emitted", r.emitted), ("block", r.block),
        ]
        if estimates is not None:
            segments.append(("estimates", estimates))
        if r.logprobs is not None:
            segments += [("chosen", r.logprobs.chosen), ("top_ids", r.logprobs.ids), ("top_values", r.logprobs.values)]
        values = read_once(segments)
        values["finished"] = [bool(f) for f in values["finished"]]
        return cls(**values)
