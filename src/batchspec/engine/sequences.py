"""Per-request state of the running batch: token history (prompt + generated), lengths, limits, stop sets, counters."""

from __future__ import annotations

import torch

from .sampling import uniforms, warp

FIELDS = ("prompt_len", "limit", "history", "length", "stop", "stopped", "rounds", "drafted", "accepted", "evidence",
          "temperature", "top_k", "top_p", "seed")


class Sequences:
    def __init__(self, requests, k, device):
        """``requests``: objects with ``id``, ``prompt`` (token ids), ``max_tokens``, ``stop_ids`` and the sampling
        parameters ``temperature``, ``top_k``, ``top_p``, ``seed``."""
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
        self._flags(requests)

    def _flags(self, requests):
        """Host-side switches, set when rows join: does any row sample, filter (top-k / top-p), decode greedily."""
        self.sampling = any(r.temperature > 0 for r in requests)
        self.filtering = any(r.temperature > 0 and (r.top_k > 0 or r.top_p < 1) for r in requests)
        self.greedy_rows = any(r.temperature == 0 for r in requests)

    def warp(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's sampling distribution from ``logits`` [B, Q, V] (one-hot argmax for greedy rows)."""
        return warp(logits, self.temperature, self.top_k, self.top_p, self.filtering, self.greedy_rows)

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
        hit = is_stop.any(1)
        n = torch.where(hit, is_stop.int().argmax(1) + 1, n_emit)
        n = torch.minimum(n, self.limit - self.generated())
        dump = self.history.shape[1] - 1
        pos = torch.where(j < n[:, None], self.length[:, None] + j, dump)
        self.history.scatter_(1, pos, block)
        self.length += n
        self.stopped |= hit & (is_stop.int().argmax(1) < n)
        finished = self.stopped | (self.generated() >= self.limit)
        return finished, n, torch.where(hit, n_emit - n, 0)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.request_ids = [self.request_ids[i] for i in rows.tolist()]  # at row removal only
        for name in FIELDS:
            setattr(self, name, getattr(self, name)[rows])

    def take(self, rows: torch.Tensor) -> "Sequences":
        """A copy of ``rows`` (a batch drawn from a larger window)."""
        part = object.__new__(Sequences)
        for name in FIELDS:
            setattr(part, name, getattr(self, name)[rows])
        part.request_ids = [self.request_ids[i] for i in rows.tolist()]
        part.sampling, part.filtering, part.greedy_rows = self.sampling, self.filtering, self.greedy_rows
        return part

    def put(self, rows: torch.Tensor, part: "Sequences") -> None:
        for name in FIELDS:
            getattr(self, name)[rows] = getattr(part, name)

    def merge(self, other: "Sequences") -> "Sequences":
        """This batch's rows followed by ``other``'s (requests joining a running batch)."""
        for name in FIELDS:
            a, b = getattr(self, name), getattr(other, name)
            if a.dim() == 2 and a.shape[1] != b.shape[1]:  # history / stop tables of different widths
                fill = -1 if name == "history" else -2
                w = max(a.shape[1], b.shape[1])
                a = torch.nn.functional.pad(a, (0, w - a.shape[1]), value=fill)
                b = torch.nn.functional.pad(b, (0, w - b.shape[1]), value=fill)
            setattr(self, name, torch.cat([a, b]))
        self.request_ids = self.request_ids + other.request_ids
        self.sampling |= other.sampling
        self.filtering |= other.filtering
        self.greedy_rows |= other.greedy_rows
        return self
