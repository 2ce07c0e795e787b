"""Prompt prefixes kept between prefills: a chat template's system prompt, a conversation's earlier turns.

A server meets the same leading tokens again and again, one request at a time, where a prefill of many prompts at
once computes their shared prefix once (``batch/prefilling.py``) but a prefill of one prompt cannot. A ``PrefixCache``
keeps the keys and values (and, once asked for, the final hidden states a feature-reading head starts from) of
prefixes that recurred, so that a later prefill whose prompts all start with one computes only the tokens after it.

What is kept: a prefix is worth keeping when it has recurred, i.e. the prompts of one prefill share it, or it is
the common start of a prompt and one of the last ``HISTORY`` prompts prefilled (``recurring``). A prefill that
computes such a prefix keeps it (``store``); one whose prompts start with a kept prefix starts from it (``find``).
Entries are dropped least recently used first beyond the byte budget the runner was given.

The kept values are the ones the prefill that stored them computed, and a later prompt reuses them as they are: like
any change of batch composition, a prefix computed with other tokens around it may differ from a fresh prefill's in
the last bits (the products see other row counts), never in what the tokens attend to.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

import torch

# leading tokens a prefix must have to be kept or reused: below it, the bookkeeping (one more forward in the grouped
# prefill, copies of the keys and values) costs about what it saves (``batch/prefilling.SHARED_PREFIX_MIN``, the same
# measurement)
MIN_TOKENS = 16
HISTORY = 32  # earlier prompts a new one is compared with for a recurring start (a server's recent requests)
HISTORY_TOKENS = 4096  # leading tokens of each remembered prompt compared (a long conversation's)
DEFAULT_MIB = 256  # default budget: a few system prompts and conversations of a 1.7B model, ~1% of a 24 GB machine


def budget_bytes(mib) -> int:
    """A budget of ``mib`` MiB in bytes; ValueError unless ``mib`` is a whole number >= 0 (``LLM(prefix_cache=)``)."""
    if not isinstance(mib, int) or isinstance(mib, bool) or mib < 0:
        raise ValueError(f"prefix_cache must be a whole number of MiB >= 0, got {mib!r}")
    return mib << 20


@dataclass
class Prefix:
    """A kept prefix: its ``tokens`` and, per layer, its ``keys`` / ``values`` ``[1, kv heads, P, D]``; ``hidden``
    ``[1, P, H]`` the model's final (normed) hidden states at its tokens, or None when its prefill did not ask."""

    tokens: tuple
    keys: list
    values: list
    hidden: torch.Tensor | None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        parts = [*self.keys, *self.values] + ([self.hidden] if self.hidden is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


def common_length(a, b) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class PrefixCache:
    """Kept prefixes of one model, within ``budget`` bytes, and the last prompts prefilled. Counters: ``hits``
    (prompts prefilled from a kept prefix), ``reused`` (their tokens not computed again). Thread-safe."""

    def __init__(self, budget: int):
        self.budget = budget
        self._entries: OrderedDict[tuple, Prefix] = OrderedDict()  # least recently used first
        self._recent: deque = deque(maxlen=HISTORY)
        self._lock = threading.Lock()
        self.hits = self.reused = 0

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, prompts: list[list[int]], hidden: bool) -> Prefix | None:
        """The longest kept prefix every prompt starts with and goes past (each keeps a token of its own), holding
        hidden states when ``hidden``; None when there is none. A query."""
        with self._lock:
            best = None
            for e in self._entries.values():
                n = len(e)
                if (best is None or n > len(best)) and (e.hidden is not None or not hidden) and all(
                        len(p) > n and tuple(p[:n]) == e.tokens for p in prompts):
                    best = e
            return best

    def recurring(self, prompts: list[list[int]]) -> int:
        """The length of the longest start of ``prompts`` that recurs: shared by all of them when they are several,
        or by the first and one of the last prompts prefilled; at most each prompt's length less one, and 0 below
        ``MIN_TOKENS``. A query."""
        first = prompts[0]
        common = min(len(p) for p in prompts) - 1
        for p in prompts[1:]:
            common = min(common, common_length(first, p))
        best = common if len(prompts) > 1 else 0
        with self._lock:
            for old in self._recent:
                if best >= common:
                    break
                best = max(best, min(common, common_length(first, old)))
        return best if best >= MIN_TOKENS else 0

    def remember(self, prompts: list[list[int]]) -> None:
        """Note ``prompts`` as prefilled (their first ``HISTORY_TOKENS`` tokens) for ``recurring``."""
        with self._lock:
            for p in prompts:
                self._recent.append(tuple(p[:HISTORY_TOKENS]))

    def used(self, entry: Prefix, rows: int) -> None:
        """Count ``rows`` prompts prefilled from ``entry`` and mark it recently used."""
        with self._lock:
            self.hits += rows
            self.reused += rows * len(entry)
            if entry.tokens in self._entries:
                self._entries.move_to_end(entry.tokens)

    def store(self, entry: Prefix) -> None:
        """Keep ``entry`` (replacing one of the same tokens), dropping the least recently used beyond the budget; an
        entry larger than the whole budget is not kept."""
        if entry.nbytes > self.budget:
            return
        with self._lock:
            self._entries.pop(entry.tokens, None)
            self._entries[entry.tokens] = entry
            total = sum(e.nbytes for e in self._entries.values())
            while total > self.budget:
                _, gone = self._entries.popitem(last=False)
                total -= gone.nbytes

    def clear(self) -> None:
        """Drop every kept prefix and the remembered prompts (the counters stay)."""
        with self._lock:
            self._entries.clear()
            self._recent.clear()
