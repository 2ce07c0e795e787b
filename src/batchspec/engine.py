"""The engine loop: admit -> select a batch -> round (draft -> verify -> accept -> emit) -> keep rows aligned.
Rows that finish leave the batch."""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch

from .batch import InvariantError, check_invariants, merge, prefill
from .params import Stats
from .layouts.slotmask import SlotMask
from .sequences import Sequences
from .sampling import ACCEPT, TARGET
from .verify import emitted_block, greedy_accept, rejection_sample


@dataclass
class Finished:
    request_id: int
    token_ids: list[int]
    stopped: bool
    rounds: int
    drafted: int
    accepted: int


@dataclass
class Parts:
    """The swappable components of a round (an injected fault replaces exactly one of them)."""

    target: torch.nn.Module
    drafter: object
    layout: object
    k: int
    accept: Callable = greedy_accept
    sample: Callable = rejection_sample
    prefill: Callable = prefill


class Timer:
    def __init__(self, stats: Stats, device: torch.device):
        self.stats, self.cuda = stats, device.type == "cuda"

    @contextmanager
    def __call__(self, stage: str):
        t = time.perf_counter()
        yield
        if self.cuda:
            torch.cuda.synchronize()
        setattr(self.stats, stage, getattr(self.stats, stage) + time.perf_counter() - t)


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_tokens: int
    stop_ids: set
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@torch.inference_mode()
def run(parts: Parts, requests: list[Request], scheduler, batch_size: int, stats: Stats, check: bool = False,
        on_finish: Callable | None = None) -> list[Finished]:
    """Generate for every request. At each round boundary ``scheduler.admit(running, waiting, batch_size)`` says how
    many waiting requests join the running rows (prefilled and spliced in) and ``scheduler.select(lengths,
    batch_size)`` which running rows form this round's batch (None: all). Returns rows in finishing order."""
    timer = Timer(stats, parts.target.device)
    drafter, layout = parts.drafter, parts.layout
    waiting = deque(requests)
    seqs = target = None
    lengths: list[int] = []  # each running row's length (prompt + generated), read with the round's one host sync
    done: list[Finished] = []
    rnd = 0
    scheduler.forget([])
    while waiting or seqs is not None:
        n_join = min(len(waiting), scheduler.admit(len(seqs) if seqs else 0, len(waiting), batch_size))
        if n_join:
            joins = [waiting.popleft() for _ in range(n_join)]
            with timer("prefill"):
                seqs, target = _admit(parts, joins, seqs, target, stats)
            lengths += [len(r.prompt) for r in joins]
        rnd += 1
        rows, grouped = scheduler.select(lengths, batch_size)
        if grouped is not None:
            stats.grouped_rounds += grouped
            stats.fallback_rounds += not grouped
        if rows is None:
            finished, *counts = speculative_round(parts, seqs, target, drafter, timer)
        else:
            finished, *counts = _round_from_window(parts, rows, lengths, seqs, target, drafter, timer)
        with timer("align"):
            fin, lengths, width = _account(stats, seqs, finished, *counts)  # the round's one host sync
            if any(fin):
                done += _collect(seqs, fin)
                if on_finish:
                    on_finish(done[-sum(fin):])
                keep = _refill_from_tail(fin)
                lengths = [lengths[i] for i in keep]
                scheduler.forget(keep)
                if not keep:
                    seqs = target = None
                    drafter.reset()
                    continue
                idx = torch.tensor(keep, dtype=torch.long, device=seqs.length.device)
                for holder in (seqs, target, drafter):
                    holder.select_rows(idx)
            # a window keeps the layout's slots between batches; its waste is bounded like slotmask's
            window_layout = layout if rows is None else WINDOW
            for state in (target, *drafter.states):
                window_layout.align(state, width)
        if check:
            check_round(target, drafter, seqs, rnd)
    return done


WINDOW = SlotMask(max_waste=0.5)


def _round_from_window(parts: Parts, rows: list[int], lengths: list[int], seqs, target, drafter, timer: Timer):
    """A round on ``rows`` of the window: copy them out (aligned by the layout), run the round, write them back.
    Returns ``speculative_round``'s results with ``finished`` spread over every window row."""
    with timer("schedule"):
        idx = torch.tensor(rows, device=seqs.length.device)
        batch = seqs.take(idx), target.take(idx), drafter.take(idx)
        for state in (batch[1], *batch[2].states):
            parts.layout.align(state, max(lengths[r] for r in rows) - 1)
    finished, *counts = speculative_round(parts, *batch, timer)
    with timer("schedule"):
        for holder, part in zip((seqs, target, drafter), batch):
            holder.put(idx, part)
        finished = torch.zeros(len(seqs), dtype=torch.bool, device=idx.device).index_copy(0, idx, finished)
    return finished, *counts


def speculative_round(parts: Parts, seqs: Sequences, target, drafter, timer: Timer):
    """One round on a batch: draft -> verify -> accept -> hide rejected slots -> emit. Returns (finished [B],
    emitted [B], verified tokens dropped after a stop token [B], accepted [B], drafted [B])."""
    with timer("draft"):
        drafts, n_drafts, q = drafter.propose(seqs, parts.k)
        kr = drafts.shape[1]  # this round's block: a drafter may propose fewer than k for every row
    with timer("verify"):
        logits = target.append(torch.cat([seqs.pending()[:, None], drafts], 1))
        if seqs.sampling:
            u_accept, u_target = seqs.uniforms(kr, ACCEPT), seqs.uniforms(kr + 1, TARGET)
            accepted, bonus = parts.sample(seqs.warp(logits), q, drafts, n_drafts, u_accept, u_target)
        else:
            accepted, bonus = parts.accept(logits.argmax(-1), drafts, n_drafts)
    with timer("align"):
        target.hide_tail(kr + 1, accepted + 1)
        drafter.commit(accepted, kr)
        finished, n, cut = seqs.extend(emitted_block(drafts, accepted, bonus), accepted + 1)
        seqs.rounds += 1
        seqs.drafted += n_drafts
        seqs.accepted += accepted
    return finished, n, cut, accepted, n_drafts


def _admit(parts: Parts, joins: list[Request], seqs, target, stats: Stats):
    """Prefill the joining requests and splice them after the running rows (target, draft and sequence state)."""
    new = Sequences(joins, parts.k, parts.target.device)
    new_target = parts.prefill(parts.target, [r.prompt for r in joins])
    parts.drafter.add([r.prompt for r in joins])
    if seqs is None:
        return new, new_target
    stats.joined_running += len(joins)
    return seqs.merge(new), merge(target, new_target)


def _account(stats: Stats, seqs: Sequences, finished, n, cut, accepted, n_drafts) -> tuple[list, list, int]:
    """Update global counters with one host read; returns (finished flags, row lengths, widest remaining row).
    ``finished`` covers every running row; the other arguments, this round's batch."""
    width = (seqs.length - 1).masked_fill(finished, 0).max()
    acc = accepted.masked_fill(n_drafts == 0, -1)  # rows that had nothing to verify don't count as ragged
    full = ((accepted == n_drafts) & (n_drafts > 0)).sum()
    ctrl = torch.stack([width, n.sum(), n_drafts.sum(), accepted.sum(), acc.max(),
                        acc.masked_fill(acc < 0, acc.max() + 1).min(), full, cut.sum()])
    r = len(seqs)
    ctrl = torch.cat([finished.long(), seqs.length, ctrl]).tolist()
    fin, lengths, (width, generated, drafted, acc_sum, acc_max, acc_min, full, cut) = ctrl[:r], ctrl[r : 2 * r], ctrl[2 * r :]
    stats.generated += generated
    stats.drafted += drafted
    stats.accepted += acc_sum
    stats.ragged_rounds += acc_max > acc_min >= 0
    stats.full_accepts += full
    stats.dropped_after_stop += cut
    stats.rounds += 1
    stats.verify_calls += 1
    stats.row_rounds += len(accepted)
    return fin, lengths, width


def _refill_from_tail(fin: list) -> list[int]:
    """The rows that stay, as ``new[i] = old[keep[i]]``: rows keep their place, and the last surviving rows move into
    the places of finished ones, so removing rows moves few of them."""
    n = len(fin) - sum(fin)
    keep = list(range(n))
    holes = [i for i in range(n) if fin[i]]
    movers = [i for i in range(n, len(fin)) if not fin[i]]
    for h, m in zip(holes, movers):
        keep[h] = m
    return keep


def _collect(seqs: Sequences, fin: list) -> list[Finished]:
    rows = [i for i, f in enumerate(fin) if f]
    idx = torch.tensor(rows, device=seqs.length.device)
    hist = seqs.history[idx].tolist()
    start, end = seqs.prompt_len[idx].tolist(), seqs.length[idx].tolist()
    stopped, rounds = seqs.stopped[idx].tolist(), seqs.rounds[idx].tolist()
    drafted, accepted = seqs.drafted[idx].tolist(), seqs.accepted[idx].tolist()
    return [
        Finished(seqs.request_ids[r], hist[j][start[j] : end[j]], stopped[j], rounds[j], drafted[j], accepted[j])
        for j, r in enumerate(rows)
    ]


def check_round(target: SlotState, drafter, seqs: Sequences, rnd: int) -> None:
    """Assert I1 and I2 on the target cache and on the draft model's cache (if any)."""
    check_invariants(target, seqs.history, seqs.length - 1, rnd)
    for state in drafter.states:
        check_invariants(state, seqs.history, drafter.processed(seqs), rnd)
    for state in (target, *drafter.states):
        if state.valid.shape[0] != len(seqs):
            raise InvariantError("I1", "shape", f"cache has {state.valid.shape[0]} rows, batch has {len(seqs)}", None, rnd, state.name)
