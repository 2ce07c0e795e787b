"""KV memory: what the running rows' caches hold, what their tokens need, and the budget admission keeps them in.

Every row of the slot rectangle is as wide as the longest (``batch/slots.py``), so the running rows' keys and values
take rows x width x ``per_token`` bytes (every layer's K and V, of the target's cache and the drafter's). A waiting
request joins only while the rectangle with it still fits the budget at the widest it may grow to: its longest row's
prompt + max_tokens, the holes the layout lets stand (its ``max_waste`` of the width), one verification block and,
where rounds are drawn from a window of rows, the round's copy of a batch. A request that could not fit alone is
refused when it is added. The measure is read from shapes after each round: no host sync.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

import torch

from ..batch import grammar
from ..model.kv import per_token_bytes
from ..model.prefixes import available_bytes

# default budget: a quarter of the memory available on the target's device when the engine is built. The budget
# bounds the slots the rectangle uses; its buffers are grown geometrically (up to about twice the slots in use),
# merging joining rows briefly holds the old rectangle beside the new, and the prefill's activations, the prefix
# cache and the rest of the process need the remainder.
DEFAULT_FRACTION = 0.25
FALLBACK_MIB = 1024  # where the available memory cannot be read


def budget_bytes(mib) -> int | None:
    """A budget of ``mib`` MiB in bytes (None: sized by ``default_mib`` once the device is known); ValueError unless
    ``mib`` is a whole number >= 1 or None (``LLM(kv_memory=)``)."""
    if mib is None:
        return None
    if not isinstance(mib, int) or isinstance(mib, bool) or mib < 1:
        raise ValueError(f"kv_memory must be a whole number of MiB >= 1, or None for the default, got {mib!r}")
    return mib << 20


def default_mib(device: torch.device) -> int:
    """The default budget on ``device``: ``DEFAULT_FRACTION`` of its available memory (``FALLBACK_MIB`` where that
    cannot be read)."""
    free = available_bytes(device)
    return FALLBACK_MIB if free is None else max(1, int(free * DEFAULT_FRACTION) >> 20)


def _mib(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)"


class KVMemory:
    """The KV bytes of one engine's running rows. ``per_token``: bytes a slot takes across the target's and the
    drafter's caches; ``budget``: bytes the rectangle may take (None: no bound, measured only); ``waste``: the share
    of the width the layout may leave as holes; ``block``: slots a round appends (K + 1); ``part``: rows a round
    draws from a larger window (None: rounds run on every row)."""

    def __init__(self, per_token: int, budget: int | None, waste: float = 0.0, block: int = 1,
                 part: int | None = None):
        self.per_token, self.budget, self.waste, self.block, self.part = per_token, budget, waste, block, part
        self.ceilings: dict[int, int] = {}  # running request id -> prompt + max_tokens

    @classmethod
    def of(cls, parts, budget: int | None, part: int | None = None, part_waste: float = 0.0) -> "KVMemory":
        """The measure of ``parts``' caches (the target's and a drafter model's), with ``parts.layout``'s holes;
        ``part``: rows a round draws from a window, whose holes may reach ``part_waste`` of its width."""
        per_token = per_token_bytes(parts.target.model)
        draft = getattr(parts.drafter, "model", None)
        if draft is not None:
            per_token += per_token_bytes(draft)
        waste = getattr(parts.layout, "max_waste", 0.0)
        if part is not None:
            waste = max(waste, part_waste)
        forced = grammar.FORCED_MOST if parts.grammars is not None else 0  # a block without a drafter widens for them
        return cls(per_token, budget, waste, (parts.k or forced) + 1, part)

    def need(self, rows: int, ceiling: int) -> int:
        """Bytes of a rectangle of ``rows`` whose longest row ends at ``ceiling`` tokens, at its widest."""
        width = math.ceil(ceiling / (1 - self.waste)) + self.block
        if self.part is not None and rows > self.part:
            rows += self.part
        return rows * width * self.per_token

    def refusal(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request of ``prompt_tokens`` + ``max_tokens`` could never join (alone it would not fit the budget),
        or None."""
        need = self.need(1, prompt_tokens + max_tokens)
        if self.budget is None or need <= self.budget:
            return None
        return (f"{prompt_tokens} prompt tokens + max_tokens {max_tokens} need up to {_mib(need)} of KV cache alone "
                f"({self.per_token} bytes a slot), over the KV memory budget of {_mib(self.budget)}")

    def admits(self, running: list[int], waiting: Sequence) -> Callable[[int], bool] | None:
        """``fits(n)``: whether the first ``n`` of the ``waiting`` requests may join the ``running`` rows (their
        request ids) inside the budget (None: no budget, or no request waits)."""
        if self.budget is None or not waiting:
            return None
        self.ceilings = {rid: self.ceilings[rid] for rid in running if rid in self.ceilings}
        top = max(self.ceilings.values(), default=0)

        def fits(n: int) -> bool:
            ceiling = max([top] + [len(r.prompt) + r.max_tokens for r in itertools.islice(waiting, n)])
            return self.need(len(running) + n, ceiling) <= self.budget

        return fits

    def joined(self, requests) -> None:
        """``requests`` joined the running rows."""
        if self.budget is not None:
            self.ceilings.update((r.id, len(r.prompt) + r.max_tokens) for r in requests)

    def measure(self, batch, drafter, stats) -> None:
        """Set ``stats``' KV gauges from ``batch``'s caches (None: no rows): bytes the rectangle's slots take
        (``kv_bytes_used``, and its most so far ``kv_bytes_peak``), bytes the buffers hold (``kv_bytes_held``, spare
        room included), bytes the rows' cached tokens need (``kv_bytes_visible``) and the budget (0: none)."""
        used = held = visible = 0
        if batch is not None:
            for state in (batch.target, *drafter.states(batch.draft)):
                u, h = state.cache.nbytes()
                used, held = used + u, held + h
            visible = sum(max(0, n - 1) for n in batch.lengths) * self.per_token
        stats.kv_bytes_used, stats.kv_bytes_held, stats.kv_bytes_visible = used, held, visible
        stats.kv_bytes_peak = max(stats.kv_bytes_peak, used)
        stats.kv_bytes_budget = self.budget or 0
