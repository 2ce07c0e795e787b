"""Per-request state of the running batch: token history (prompt + generated), lengths, limits, stop sets, counters,
and which rows asked for log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import uniforms, warp
from . import processors

FIELDS = ("prompt_len", "limit", "history", "length", "stop", "stopped", "rounds", "drafted", "accepted", "evidence",
          "temperature", "top_k", "top_p", "seed", "repetition", "presence", "frequency", "min_p", "min_tokens",
          "bias_ids", "bias_values", "bad_words")


@dataclass
class RoundLogprobs:
    """A round's log-probabilities for the rows that asked, still on the device: ``rows`` (host indices into the
    round's batch) and each one's ``tops`` (alternatives asked for); ``chosen`` ``[R, W]`` the log-probability of each
    token of the round's block, ``ids`` and ``values`` ``[R, W, T]`` the T most likely tokens at each position (T the
    most any of these rows asked for), most likely first. Only a row's first emitted entries mean anything."""

    rows: list[int]
    tops: list[int]
    chosen: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor


class Sequences:
    def __init__(self, requests, k, device):
        """``requests``: objects with ``id``, ``prompt`` (token ids), ``max_tokens``, ``stop_ids``, the sampling
        parameters ``temperature``, ``top_k``, ``top_p``, ``seed`` and ``logprobs`` (alternatives asked for, None:
        no log-probabilities), and optionally the logits processors' fields (``processors.tables``)."""
        prompts = [r.prompt for r in requests]
        max_tokens = [r.max_tokens for r in requests]
        stop_sets = [r.stop_ids for r in requests]
        b = len(prompts)
        self.request_ids = [r.id for r in requests]
        self.prompt_len = torch.tensor([len(p) for p in prompts], device=device)
        self.limit = torch.tensor(max_tokens, device=device)
        width = max(len(p) + m for p, m in zip(prompts, max_tokens)) + k + 2  # + room for one block + dump column
        self.history = torch.full((b, width), -1, dtype=torch.long, device=device)
        for i, p in enumerate(prompts):  # once per request
            self.history[i, : len(p)] = torch.tensor(p, device=device)
        self.length = self.prompt_len.clone()
        m = max((len(s) for s in stop_sets), default=0)
        self.stop = torch.full((b, max(m, 1)), -2, dtype=torch.long, device=device)
        for i, s in enumerate(stop_sets):
            if s:
                self.stop[i, : len(s)] = torch.tensor(sorted(s), device=device)
        self.stopped = torch.zeros(b, dtype=torch.bool, device=device)
        self.rounds = torch.zeros(b, dtype=torch.long, device=device)
        self.drafted = torch.zeros(b, dtype=torch.long, device=device)
        self.accepted = torch.zeros(b, dtype=torch.long, device=device)
        # acceptance evidence for the speculation policy: [accepted drafts, rounds short of the drafts offered]
        self.evidence = torch.zeros(b, 2, dtype=torch.float64, device=device)
        self.temperature = torch.tensor([float(r.temperature) for r in requests], dtype=torch.float64, device=device)
        self.top_k = torch.tensor([r.top_k for r in requests], dtype=torch.long, device=device)
        self.top_p = torch.tensor([float(r.top_p) for r in requests], device=device)
        self.seed = torch.tensor([r.seed for r in requests], dtype=torch.long, device=device)
        self.top_logprobs = [getattr(r, "logprobs", None) for r in requests]  # host, per row, like request_ids
        self.matchers = [getattr(r, "matcher", None) for r in requests]  # host, per row: grammar state (or None)
        for name, table in processors.tables(requests, device).items():
            setattr(self, name, table)
        self._flags(requests)
        self._logprob_rows()

    def _flags(self, requests):
        """Host-side switches, set when rows join: does any row sample, filter (top-k / top-p), decode greedily."""
        self.sampling = any(r.temperature > 0 for r in requests)
        self.filtering = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in requests)
        self.greedy_rows = any(r.temperature == 0 for r in requests)
        self.processors = set().union(*map(processors.kinds, requests))  # those some row uses
        self.min_p_rows = any(r.temperature > 0 and getattr(r, "min_p", 0.0) > 0 for r in requests)

    def _logprob_rows(self) -> None:
        """The rows that asked for log-probabilities, as a device index (None: no row did), and those with a grammar,
        rebuilt when rows join or leave, never per round."""
        asked = [i for i, t in enumerate(self.top_logprobs) if t is not None]
        self.lp_rows = torch.tensor(asked, dtype=torch.long, device=self.length.device) if asked else None
        self.lp_index, self.lp_tops = asked, [self.top_logprobs[i] for i in asked]
        self.grammar_rows = [i for i, m in enumerate(self.matchers) if m is not None]  # rows with structured output

    def logprobs(self, out, block: torch.Tensor) -> RoundLogprobs | None:
        """The target's log-softmax of its raw logits (``out.logits`` ``[B, W, V]``, before any warping) at each
        token of ``block`` ``[B, W]`` and the most likely tokens at each position, for the rows that asked only, on
        the device (the engine reads them with the round's one host read). None, touching nothing, when no row
        asked. ``out.logits[:, j]`` is the distribution ``block[:, j]`` came from, draft or bonus alike, so the
        values are the same with and without speculation."""
        if self.lp_rows is None:
            return None
        x = out.logits[self.lp_rows]
        x = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        lsm = x.log_softmax(-1)
        tokens = block[self.lp_rows].clamp(0, lsm.shape[-1] - 1)  # entries past a row's emitted ones are arbitrary
        chosen = lsm.gather(-1, tokens[..., None]).squeeze(-1)
        top = lsm.topk(min(max(self.lp_tops), lsm.shape[-1]), -1)
        return RoundLogprobs(self.lp_index, self.lp_tops, chosen, top.indices, top.values)

    def process(self, logits: torch.Tensor, drafts: torch.Tensor, start: int = 0) -> torch.Tensor:
        """The round's ``logits`` [B, W, V] (positions ``start``.., after the pending token and the drafts before
        each) through each row's logits processors, as batch-1 decoding would process them (``processors.process``;
        call it only when ``processors``, the kinds some row uses, is not empty)."""
        return processors.process(self, logits, drafts, start)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's sampling distribution from ``logits`` [B, Q, V] (one-hot argmax for greedy rows)."""
        return warp(logits, self.temperature, self.top_k, self.top_p, self.filtering, self.greedy_rows,
                    self.min_p if self.min_p_rows else None)

    def uniforms(self, q: int, stream: int) -> torch.Tensor:
        """[B, q] uniforms for the next ``q`` tokens of each row (keyed by seed and generated-token index)."""
        index = self.generated()[:, None] + torch.arange(q, device=self.seed.device)[None, :]
        return uniforms(self.seed, index, stream)

    def __len__(self):
        return len(self.request_ids)

    def pending(self) -> torch.Tensor:
        return self.history.gather(1, (self.length - 1)[:, None]).squeeze(1)

    def generated(self) -> torch.Tensor:
        return self.length - self.prompt_len

    def extend(self, block: torch.Tensor, n_emit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the first ``n_emit[b]`` tokens of ``block`` [B, W] to each row, cut after a stop token and at the
        row's limit. Returns (finished [B], emitted count [B], verified tokens dropped after a stop token [B])."""
        w = block.shape[1]
        j = torch.arange(w, device=block.device)[None, :]
        is_stop = (block[:, :, None] == self.stop[:, None, :]).any(-1) & (j < n_emit[:, None])
        hit, first = is_stop.any(1), is_stop.int().argmax(1)
        n = torch.minimum(torch.where(hit, first + 1, n_emit), self.limit - self.generated())
        dump = self.history.shape[1] - 1
        pos = torch.where(j < n[:, None], self.length[:, None] + j, dump)
        self.history.scatter_(1, pos, block)
        self.length += n
        self.stopped |= hit & (first < n)
        finished = self.stopped | (self.generated() >= self.limit)
        return finished, n, torch.where(hit, n_emit - n, 0)

    def select_rows(self, rows: torch.Tensor) -> None:
        keep = rows.tolist()  # at row removal only
        self.request_ids = [self.request_ids[i] for i in keep]
        self.top_logprobs = [self.top_logprobs[i] for i in keep]
        self.matchers = [self.matchers[i] for i in keep]
        for name in FIELDS:
            setattr(self, name, getattr(self, name)[rows])
        self._logprob_rows()

    def take(self, rows: torch.Tensor) -> "Sequences":
        """A copy of ``rows`` (a batch drawn from a larger window)."""
        part = object.__new__(Sequences)
        for name in FIELDS:
            setattr(part, name, getattr(self, name)[rows])
        taken = rows.tolist()
        part.request_ids = [self.request_ids[i] for i in taken]
        part.top_logprobs = [self.top_logprobs[i] for i in taken]
        part.matchers = [self.matchers[i] for i in taken]
        part.sampling, part.filtering, part.greedy_rows = self.sampling, self.filtering, self.greedy_rows
        part.processors, part.min_p_rows = self.processors, self.min_p_rows
        part._logprob_rows()
        return part

    def put(self, rows: torch.Tensor, part: "Sequences") -> None:
        for name in FIELDS:
            getattr(self, name)[rows] = getattr(part, name)

    def merge(self, other: "Sequences") -> "Sequences":
        """This batch's rows followed by ``other``'s (requests joining a running batch)."""
        for name in FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if a.shape[1:] != b.shape[1:]:  # history / stop / processor tables of different widths
                fill = -1 if name == "history" else -2
                size = [max(x, y) for x, y in zip(a.shape[1:], b.shape[1:])]
                a, b = _widen(a, size, fill), _widen(b, size, fill)
            setattr(self, name, torch.cat([a, b]))
        self.request_ids = self.request_ids + other.request_ids
        self.top_logprobs = self.top_logprobs + other.top_logprobs
        self.matchers = self.matchers + other.matchers
        self._logprob_rows()
        self.sampling |= other.sampling
        self.filtering |= other.filtering
        self.greedy_rows |= other.greedy_rows
        self.processors = self.processors | other.processors
        self.min_p_rows |= other.min_p_rows
        return self


def _widen(t: torch.Tensor, size: list[int], fill: int) -> torch.Tensor:
    """``t`` padded with ``fill`` after its entries to ``[len(t), *size]``."""
    pad = [p for have, want in zip(reversed(t.shape[1:]), reversed(size)) for p in (0, want - have)]
    return torch.nn.functional.pad(t, pad, value=fill)
