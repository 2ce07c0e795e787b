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
        """The readback of round ``r`` on the running rows ``seqs`` (and ``estimates``, a 1D tensor), in one read.
        The per-row values travel; their sums and extremes are taken on the host (a few rows' worth of Python, where
        each tensor reduction cost a dispatch: ~50 us of a 3.8 ms round at batch 1 on a CPU)."""
        segments = [("finished", r.finished), ("lengths", seqs.length), ("emitted", r.emitted),
                    ("n_drafts", r.n_drafts), ("accepted", r.accepted), ("cut", r.cut), ("block", r.block)]
        if estimates is not None:
            segments.append(("estimates", estimates))
        if r.logprobs is not None:
            segments += [("chosen", r.logprobs.chosen), ("top_ids", r.logprobs.ids), ("top_values", r.logprobs.values)]
        values = read_once(segments)
        finished = values["finished"] = [bool(f) for f in values["finished"]]
        n_drafts, accepted, cut = values.pop("n_drafts"), values.pop("accepted"), values.pop("cut")
        acc = [a if d else -1 for a, d in zip(accepted, n_drafts)]  # rows with nothing to verify aren't ragged
        most = max(acc)
        return cls(**values, width=max([n - 1 for n, f in zip(values["lengths"], finished) if not f], default=0),
                   generated=sum(values["emitted"]), drafted=sum(n_drafts), accepted=sum(accepted),
                   accepted_max=most, accepted_min=min(a if a >= 0 else most + 1 for a in acc),
                   full_accepts=sum(a == d > 0 for a, d in zip(accepted, n_drafts)), cut=sum(cut))
