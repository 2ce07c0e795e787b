"""Automatic prefix caching: the keys and values of every prompt prefilled, kept in blocks for later prompts.

A server meets the same leading tokens again and again (a chat template's system prompt, a conversation's earlier
turns, a prompt sent again), one request at a time, where a prefill of many prompts at once computes their shared
prefix once (``batch/prefilling.py``) but a prefill of one prompt cannot. A ``PrefixCache`` keeps the keys and values
(and, where the prefill computed them, the final hidden states a feature-reading head starts from) of every prompt
prefilled, in blocks of ``BLOCK`` tokens and a tail (the tokens past the last whole block); a later prompt starts
from its longest run of cached blocks, whenever the first was seen, and computes only the tokens after it, and a
prompt sent again, found whole with its tail, computes none.

A block is found by a hash of every token up to its end (chained: a block's key covers its whole prefix) and of the
request's isolation salt (``cache_salt``), so two prompts share a block only when they agree on everything before
it, and one client's prompts never start another's. Blocks are dropped least recently used first beyond the byte
budget; a prompt's use marks its blocks last to first, so a block is always more recent than its descendants and
none is dropped before them (the one dropped is always a leaf).

The kept values are the ones the prefill that stored them computed, and a later prompt reuses them as they are: like
any change of batch composition, a prefix computed with other rows around it may differ from a fresh prefill's in
the last bits (log-probabilities; never tokens at these margins), never in what the tokens attend to.
"""

from __future__ import annotations

import hashlib
import os
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

# tokens per block (vLLM's default): a hit is rounded down to whole blocks, so smaller blocks reuse more of a prompt
# but cost a key, a lookup and a copy each; 16 is also where reusing a prefix starts to save more than its bookkeeping
# costs (``batch/prefilling.SHARED_PREFIX_MIN``, the same measurement)
BLOCK = 16
MIN_TOKENS = BLOCK  # the shortest prefix reused: one block
# default budget: a tenth of the memory available on the model's device when the runner is built (the running
# batch's own caches, activations and the rest of the process need the remainder), at most 4 GiB (hundreds of
# thousands of a 1.7B model's tokens, far more conversations than a server holds in flight)
DEFAULT_FRACTION = 0.1
DEFAULT_CAP_MIB = 4096
FALLBACK_MIB = 256  # where the available memory cannot be read


def budget_bytes(mib) -> int:
    """A budget of ``mib`` MiB in bytes; ValueError unless ``mib`` is a whole number >= 0 or None (the default, sized
    by ``default_mib`` once the device is known: returns -1) (``LLM(prefix_cache=)``)."""
    if mib is None:
        return -1
    if not isinstance(mib, int) or isinstance(mib, bool) or mib < 0:
        raise ValueError(f"prefix_cache must be a whole number of MiB >= 0, or None for the default, got {mib!r}")
    return mib << 20


def available_bytes(device: torch.device) -> int | None:
    """The memory ``device`` has free now (a GPU's, or the machine's for the CPU); None where it cannot be read."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[0]
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def default_mib(device: torch.device) -> int:
    """The default budget on ``device``: ``DEFAULT_FRACTION`` of its available memory, capped at
    ``DEFAULT_CAP_MIB`` (``FALLBACK_MIB`` where the available memory cannot be read)."""
    free = available_bytes(device)
    return FALLBACK_MIB if free is None else max(1, min(DEFAULT_CAP_MIB, int(free * DEFAULT_FRACTION) >> 20))


def block_keys(tokens, salt: str | None = None, tail: bool = False) -> list[bytes]:
    """The keys of ``tokens``' whole blocks: block i's is a hash of block i-1's key and its own tokens, the first's
    of the salt (no salt and an empty one are the same). ``tail``: one more key after them for the tokens past the
    last whole block (where there are any), kept apart from any whole block's: a prompt sent again finds all of
    its tokens (``PrefixCache.find``'s ``whole``)."""
    key = hashlib.sha256(b"salt:" + salt.encode()).digest() if salt else bytes(32)
    keys = []
    for end in range(BLOCK, len(tokens) + 1, BLOCK):
        key = hashlib.sha256(key + array("q", tokens[end - BLOCK : end]).tobytes()).digest()
        keys.append(key)
    rest = len(tokens) % BLOCK
    if tail and rest:
        keys.append(hashlib.sha256(b"tail:" + key + array("q", tokens[len(tokens) - rest :]).tobytes()).digest())
    return keys


@dataclass
class Block:
    """``BLOCK`` tokens' ``keys`` / ``values`` ``[layers, kv heads, BLOCK, D]`` and ``hidden`` ``[BLOCK, H]`` (None
    when the prefill that stored it did not compute them)."""

    keys: torch.Tensor
    values: torch.Tensor
    hidden: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        parts = (self.keys, self.values) + ((self.hidden,) if self.hidden is not None else ())
        return sum(t.numel() * t.element_size() for t in parts)


@dataclass
class Prefix:
    """A prompt start to prefill from: its ``tokens`` and, per layer, its ``keys`` / ``values`` ``[1, kv heads, P,
    D]``; ``hidden`` ``[1, P, H]`` the model's final (normed) hidden states at its tokens, or None; ``chain`` the keys
    of the blocks it was made of."""

    tokens: tuple
    keys: list
    values: list
    hidden: torch.Tensor | None
    chain: tuple = ()

    def __len__(self) -> int:
        return len(self.tokens)


class PrefixCache:
    """Cached blocks of one model's prompts, within ``budget`` bytes. Counters: ``hits`` (prompts prefilled from
    cached blocks), ``reused`` (their tokens not computed again), ``evictions`` (blocks dropped for room).
    Thread-safe."""

    def __init__(self, budget: int):
        self.budget, self.nbytes = budget, 0
        self._blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self.hits = self.reused = self.evictions = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def held(self, chain: list[bytes], hidden: bool) -> int:
        """How many leading blocks of ``chain`` are cached (with hidden states when ``hidden``). A query."""
        with self._lock:
            n = 0
            for key in chain:
                b = self._blocks.get(key)
                if b is None or (hidden and b.hidden is None):
                    break
                n += 1
            return n

    def find(self, tokens, chain: list[bytes], hidden: bool, whole: bool = False) -> Prefix | None:
        """The longest run of cached blocks ``tokens`` (keys ``chain``) starts with and goes past (a token of its own
        is left), as a ``Prefix``; with hidden states when ``hidden``; None when not one block is. ``whole``: only
        every one of ``tokens`` (``chain`` with its tail's key, ``block_keys``), else None. A query."""
        if whole:
            n = len(chain) if tokens and self.held(chain, hidden) == len(chain) else 0
        else:
            n = min(self.held(chain, hidden), max(len(tokens) - 1, 0) // BLOCK)
        with self._lock:
            blocks = [self._blocks.get(key) for key in chain[:n]]
        if not n or any(b is None for b in blocks):  # dropped meanwhile (another thread): computed instead
            return None
        keys, values = torch.cat([b.keys for b in blocks], 2), torch.cat([b.values for b in blocks], 2)
        states = torch.cat([b.hidden for b in blocks])[None] if hidden else None
        return Prefix(tuple(tokens[: keys.shape[2]]), list(keys[:, None].unbind()), list(values[:, None].unbind()),
                      states, tuple(chain[:n]))

    def used(self, entry: Prefix, rows: int) -> None:
        """Count ``rows`` prompts prefilled from ``entry`` and mark its blocks recently used."""
        with self._lock:
            self.hits += rows
            self.reused += rows * len(entry)
            self._touch(entry.chain)

    def put(self, chain: list[bytes], first: int, keys: torch.Tensor, values: torch.Tensor,
            hidden: torch.Tensor | None) -> None:
        """Keep blocks ``first..`` of ``chain``, given as ``keys`` / ``values`` ``[layers, kv heads, n x BLOCK, D]``
        and ``hidden`` ``[n x BLOCK, H]`` (or None; a tail's block holds fewer tokens), as copies (replacing a cached
        block only to add hidden states);
        mark the whole chain recently used and drop the least recently used blocks beyond the budget."""
        parts = zip(keys.split(BLOCK, 2), values.split(BLOCK, 2),
                    hidden.split(BLOCK) if hidden is not None else [None] * len(chain))
        with self._lock:
            for key, (k, v, h) in zip(chain[first:], parts):
                old = self._blocks.get(key)
                if old is not None and (h is None or old.hidden is not None):
                    continue
                new = Block(k.clone(), v.clone(), None if h is None else h.clone())
                self.nbytes += new.nbytes - (old.nbytes if old is not None else 0)
                self._blocks[key] = new
            self._touch(chain)
            while self.nbytes > self.budget and self._blocks:
                _, gone = self._blocks.popitem(last=False)
                self.nbytes -= gone.nbytes
                self.evictions += 1

    def touch(self, chain) -> None:
        """Mark the cached blocks of ``chain`` recently used."""
        with self._lock:
            self._touch(chain)

    def _touch(self, chain) -> None:
        """Most recently used: the chain's blocks, last to first (a block before its descendants)."""
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def clear(self) -> None:
        """Drop every cached block (the counters stay)."""
        with self._lock:
            self._blocks.clear()
            self.nbytes = 0
