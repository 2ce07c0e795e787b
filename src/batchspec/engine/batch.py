"""The ragged batch as one rectangle of cache slots, and the two invariants it must keep.

Each model (target, and a draft model if any) has a ``SlotState``: its KV cache plus, per slot, whether the slot is
``valid`` (visible to attention), the ``token`` it holds and the ``position`` it was written with. Rows are left-padded;
rejected draft tokens become holes (invalid slots) until a layout realigns the rectangle.
"""

from __future__ import annotations

import copy

import torch

from ..model import kv
from ..model.prefixes import Prefix
from ..model.runner import Runner


class InvariantError(AssertionError):
    """A synchronisation invariant was violated.

    ``invariant``: "I1" or "I2". ``kind``: "shape" (I1), or for I2 "padding" (a padding slot is visible), "count"
    (valid KV entries differ from tokens processed), "content" (a visible slot holds a token the row did not accept)
    or "positions" (valid slots do not carry positions 0..n-1). ``row``, ``round`` and ``cache`` locate it.
    """

    def __init__(self, invariant, kind, message, row=None, round=None, cache=""):
        self.invariant, self.kind, self.row, self.round, self.cache = invariant, kind, row, round, cache
        super().__init__(f"{invariant} ({kind}) violated in the {cache} cache, row {row}, round {round}: {message}")


def _grow(t: torch.Tensor, capacity: int, fill) -> torch.Tensor:
    """``t`` ``[B, W]`` copied into a ``[B, capacity]`` buffer (the rest ``fill``)."""
    out = t.new_full((t.shape[0], capacity), fill)
    out[:, : t.shape[1]] = t
    return out


class SlotState:
    """One model's slot rectangle: its runner, its KV cache and, per slot, ``valid`` ``[B, S]`` (the slot holds a
    token that attention may see), ``tokens`` (the token id written there, -1 for padding) and ``positions`` (the
    position id it was written with). The three live in buffers of fixed capacity with a write cursor (``width``):
    a round writes its new slots in place, and the buffers grow geometrically, rarely, never per round."""

    _FILL = {"valid": False, "tokens": -1, "positions": 0}

    def __init__(self, runner, cache: kv.SlotCache, valid, tokens, positions, name: str = "target"):
        self.runner, self.cache, self.name = runner, cache, name
        self.width = 0
        self._buf = {}
        self.store(valid, tokens, positions)

    def store(self, valid, tokens, positions) -> None:
        """Replace the per-slot tensors (all ``[B, W]``); keeps the buffers when they are large enough."""
        w = valid.shape[1]
        fresh = not self._buf or self._buf["valid"].shape[0] != valid.shape[0] or self.capacity < w
        for name, t in (("valid", valid), ("tokens", tokens), ("positions", positions)):
            if fresh:
                self._buf[name] = _grow(t, max(w + 64, w * 3 // 2), self._FILL[name])
            else:
                self._buf[name][:, :w] = t
        self.width = w

    @property
    def capacity(self) -> int:
        return self._buf["valid"].shape[1]

    def _reserve(self, width: int) -> None:
        if width > self.capacity:
            cap = max(width, 2 * self.capacity)
            self._buf = {n: _grow(t, cap, self._FILL[n]) for n, t in self._buf.items()}

    valid = property(lambda self: self._buf["valid"][:, : self.width])
    tokens = property(lambda self: self._buf["tokens"][:, : self.width])
    positions = property(lambda self: self._buf["positions"][:, : self.width])

    @valid.setter
    def valid(self, t):
        self._buf["valid"][:, : self.width] = t

    @property
    def model(self):
        return self.runner.model

    def count(self) -> torch.Tensor:
        """Valid (cached) tokens per row ``[B]``."""
        return self.valid.sum(1)

    def new_positions(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Positions for new slots ``[B, q]``: the number of valid tokens before each one."""
        return self.count()[:, None] + torch.cumsum(new_valid, 1) - new_valid.long()

    def append(self, input_ids: torch.Tensor, new_valid: torch.Tensor | None = None, logits_to_keep: int = 0,
               hidden: bool = False, embeds: torch.Tensor | None = None, counts: torch.Tensor | None = None):
        """Run the model on ``input_ids`` ``[B, q]`` written into ``q`` new slots per row; returns a
        ``TargetOutput`` (logits, and the final hidden states when ``hidden``). ``embeds``: the input vectors, when
        they are not the ids' embeddings (``Runner.forward``). ``counts`` ``[B]``: only the first ``counts[b]`` new
        tokens of row b are real; the slots after them are padding, hidden at once, and their outputs unspecified
        (a runner that ``packs`` does not compute them)."""
        if new_valid is None:
            new_valid = torch.ones_like(input_ids, dtype=torch.bool)
        if counts is not None:
            new_valid = new_valid & (torch.arange(input_ids.shape[1], device=counts.device)[None, :] < counts[:, None])
        q, w = input_ids.shape[1], self.width
        pos = self.new_positions(new_valid)
        self._reserve(w + q)
        for name, t in (("valid", new_valid), ("tokens", input_ids), ("positions", pos)):
            self._buf[name][:, w : w + q] = t
        self.width = w + q
        return self.runner.forward(self.cache, input_ids, pos, self.valid, logits_to_keep, hidden, embeds, counts)

    def hide_tail(self, q: int, keep: torch.Tensor) -> None:
        """Of the last ``q`` slots, keep the first ``keep[b]`` of each row visible and hide the rest (rejected)."""
        tail = torch.arange(q, device=keep.device)[None, :] < keep[:, None]
        self.valid[:, -q:] &= tail

    def gather(self, index: torch.Tensor, pad: torch.Tensor) -> None:
        """Rearrange every per-slot tensor and the KV cache in place by one gather: ``new[b, j] = old[b, index[b,
        j]]`` (``index`` no wider than the state)."""
        kv.gather_slots(self.cache, index, pad)
        self.store(self.valid.gather(1, index) & ~pad, self.tokens.gather(1, index).masked_fill(pad, -1),
                   self.positions.gather(1, index).masked_fill(pad, 0))

    def select_rows(self, rows: torch.Tensor) -> None:
        kv.select_rows(self.cache, rows)
        self._buf = {n: t[rows] for n, t in self._buf.items()}

    def _like(self, cache, valid, tokens, positions) -> "SlotState":
        part = copy.copy(self)  # keeps the class (an injected fault's overrides travel with it)
        part.cache, part._buf, part.width = cache, {}, 0
        part.store(valid, tokens, positions)
        return part

    def take(self, rows: torch.Tensor) -> "SlotState":
        """A copy of ``rows`` as a state of its own (a batch drawn from a larger window)."""
        return self._like(kv.take_rows(self.cache, rows), self.valid[rows], self.tokens[rows], self.positions[rows])

    def put(self, rows: torch.Tensor, part: "SlotState") -> None:
        """Write ``part`` (taken from ``rows`` and advanced) back, right-aligned; widens this state if needed."""
        width = max(self.width, part.width)
        kv.put_rows(self.cache, rows, part.cache, width, len(self.valid))
        self._reserve(width)
        for name in self._FILL:
            buf = self._buf[name]
            buf[:, self.width : width] = self._FILL[name]  # new slots on the right: empty
            buf[rows, : width - part.width] = self._FILL[name]
            buf[rows, width - part.width : width] = getattr(part, name)
        self.width = width

    def merge(self, other: "SlotState") -> "SlotState":
        """Rows of this state then rows of ``other`` in one left-padded state (the narrower is padded on the left)."""
        width = max(self.width, other.width)
        cache = kv.stack_rows([(self.cache, len(self)), (other.cache, len(other))], width, len(self.cache.layers))

        def pad(name):
            fill = self._FILL[name]
            return torch.cat([torch.nn.functional.pad(getattr(s, name), (width - s.width, 0), value=fill)
                              for s in (self, other)])

        return self._like(cache, pad("valid"), pad("tokens"), pad("positions"))

    def __len__(self) -> int:
        return self._buf["valid"].shape[0]


def compact_index(valid: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Index that right-aligns each row's valid slots (in order) into ``width`` slots, left-padded, and the pad mask."""
    n = valid.sum(1, keepdim=True).clamp(max=width)
    # rank of each valid slot counted from the right: the last valid slot goes to width-1
    from_right = valid.flip(1).cumsum(1).flip(1)  # valid slots after-or-at j (inclusive)
    dest = width - from_right  # destination column of a valid slot j
    # invalid slots (and any beyond ``width`` on the left) go to a dump column
    dest = torch.where(valid & (dest >= 0), dest, torch.full_like(dest, width))
    src = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
    index = torch.zeros(valid.shape[0], width + 1, dtype=torch.long, device=valid.device)
    index.scatter_(1, dest, src)
    index = index[:, :width]
    pad = torch.arange(width, device=valid.device)[None, :] < (width - n)
    return index, pad


# a forward's fixed cost, in tokens' worth of work (other devices: 1). CPU: a 64-token prefill forward took ~30 tokens'
# time more than its share of a 1024-token one, and 16 built-in chat prompts (862 tokens) prefilled 1.35x as fast grouped
# with 16-128 as without (docs/benchmarks.md)
PREFILL_OVERHEAD = {"cuda": 4096, "cpu": 32}
PREFILL_MAX_TOKENS = 1 << 16  # padded tokens per prefill forward at most (bounds its activations)
# leading tokens the prompts of a prefill must share before that prefix is computed once for all of them (a chat
# template's system prompt: 24 tokens for SmolLM2's, 40% of the built-in chat prompts' tokens); below it, one more
# forward and the copies of its keys and values cost about what sharing saves
SHARED_PREFIX_MIN = 16


def prefill_groups(lengths: list[int], overhead: int, max_tokens: int = PREFILL_MAX_TOKENS) -> list[list[int]]:
    """Split rows into groups, one left-padded forward each, minimising the sum over groups of ``overhead + rows x
    longest``: with a small overhead (CPU) rows of equal length share a forward and nothing is padded; with a large
    one (a GPU, where a forward's launches cost more than thousands of tokens' arithmetic) few forwards take all."""
    order = sorted(range(len(lengths)), key=lambda r: lengths[r])
    best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):  # best[j]: the cheapest split of the j shortest rows
        longest = lengths[order[j - 1]]
        for i in range(j - 1, -1, -1):
            if i < j - 1 and (j - i) * longest > max_tokens:
                break
            cost = best[i] + overhead + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(order)
    while j:
        groups.append(order[cut[j] : j])
        j = cut[j]
    return groups[::-1]


def shared_prefix(prompts: list[list[int]]) -> int:
    """How many leading tokens all of ``prompts`` share."""
    first, n = prompts[0], min(len(p) for p in prompts)
    for p in prompts[1:]:
        n = next((i for i in range(n) if p[i] != first[i]), n)
    return n


def _prefix(runner, prefix: list[int], hidden: bool, base: Prefix | None = None):
    """The forward of a prefix shared by every prompt of a prefill, once: its one-row cache and, with ``hidden``, its
    final hidden states ``[1, P, H]``. ``base``: a kept prefix of its first tokens, copied; only the rest is
    computed."""
    dev = runner.device
    cache = kv.new_cache(runner.model)
    start = 0 if base is None else len(base)
    if base is not None:
        for layer, k, v in zip(cache.layers, base.keys, base.values):
            layer.lazy_initialization(k, v)
            layer.set(k, v)
        if start == len(prefix):
            return cache, base.hidden
    visible = None if base is None else torch.ones((1, len(prefix)), dtype=torch.bool, device=dev)
    out = runner.forward(cache, torch.tensor([prefix[start:]], device=dev),
                         torch.arange(start, len(prefix), device=dev)[None, :], visible, logits_to_keep=1,
                         hidden="all" if hidden else False)
    if not hidden or base is None:
        return cache, out.hidden
    return cache, torch.cat([base.hidden, out.hidden], 1)


def _prefill_group(runner, cached: list[list[int]], prefix, shared: int, hidden: bool, inputs=None):
    """One group's forward: its rows' tokens ``cached[r][shared:]``, left-padded, after the shared prefix when there
    is one (``prefix`` from ``_prefix``: its keys and values copied for each row, attended to by every row; each row's
    slots are then right-aligned, prefix first). Returns the group's cache and, with ``hidden``, its final hidden
    states ``[R, n, H]`` laid out like its slots (zeros on padding). ``inputs``: input vectors in place of the token
    embeddings (only without a prefix)."""
    dev, rows = runner.device, len(cached)
    m = max(len(c) for c in cached) - shared
    pad = torch.tensor([m - (len(c) - shared) for c in cached], device=dev)[:, None]
    col = torch.arange(m, device=dev)[None, :]
    ids = torch.tensor([[0] * (m - len(c) + shared) + c[shared:] for c in cached], device=dev)
    if prefix is None:
        part = kv.new_cache(runner.model)
        visible = None if not pad.any() else col >= pad  # one host read per group, at prefill only
    else:
        part = kv.take_rows(prefix[0], torch.zeros(rows, dtype=torch.long, device=dev))
        visible = torch.cat([torch.ones((rows, shared), dtype=torch.bool, device=dev), col >= pad], 1)
    out = runner.forward(part, ids, shared + (col - pad).clamp(min=0), visible, logits_to_keep=1,
                         hidden="all" if hidden else False, embeds=inputs)
    if prefix is None:
        h = out.hidden if visible is None or not hidden else out.hidden.masked_fill(~visible[..., None], 0)
        return part, h
    index, hole = compact_index(visible, shared + m)
    kv.gather_slots(part, index, hole)
    if not hidden:
        return part, None
    states = torch.cat([prefix[1].expand(rows, -1, -1), out.hidden], 1)
    return part, states.gather(1, index[..., None].expand(-1, -1, states.shape[-1])).masked_fill(hole[..., None], 0)


def _grouped(runner, prompts, lengths, shared, width, overhead, hidden, embeds, base=None):
    """The prefill as one left-padded forward per group of rows (``prefill_groups``), after the shared prefix's own
    forward (from ``base`` on, a kept prefix of its first tokens); returns ``(cache, states)`` like
    ``Runner.prefill``: the hidden states ``[B, width, H]`` or None."""
    dev, states = runner.device, None
    cache = kv.new_cache(runner.model)
    prefix = _prefix(runner, prompts[0][:shared], hidden, base) if shared else None
    for rows in prefill_groups([n - shared for n in lengths], overhead):
        rows = [r for r in rows if lengths[r]]
        if not rows:
            continue
        n = max(lengths[r] for r in rows)
        inputs = embeds(rows, n) if embeds is not None else None
        part, h = _prefill_group(runner, [prompts[r][: lengths[r]] for r in rows], prefix, shared, hidden, inputs)
        index = torch.tensor(rows, device=dev)
        kv.place_rows(cache, index, part, len(prompts), width)
        if hidden:
            if states is None:
                states = h.new_zeros((len(prompts), width, h.shape[-1]))
            states[index, width - n:] = h
        part.release()
    if prefix is not None:
        prefix[0].release()
    return cache, states


def prefill(runner, prompts: list[list[int]], name: str = "target", overhead: int | None = None,
            hidden: bool = False, embeds=None):
    """Cache every prompt but its last token as one left-padded ``SlotState``; with ``hidden``, returns
    ``(state, states)``, ``states`` ``[B, W, H]`` the model's final hidden states at those tokens, laid out like the
    state's slots (zeros on padding).

    Where the runner can (``Runner.prefill``: a Llama on CPU), every prompt's tokens go end to end through one forward
    (the shared prefix below once), with no padding. Elsewhere rows are grouped by ``prefill_groups`` (``overhead``
    defaults by device: ``PREFILL_OVERHEAD``): each group is one
    forward, left-padded to its longest row (padding slots hidden), and its keys and values are then copied once
    into its rows of the final rectangle. When every prompt starts with the same
    ``SHARED_PREFIX_MIN`` or more tokens (a chat template's) and sharing saves more than a forward's overhead, that
    prefix is computed once and the groups are formed and run over the tokens after it (``_prefix``,
    ``_prefill_group``). ``embeds(rows, n)``: a group's input vectors ``[len(rows), n, H]`` (its rows' last n,
    right-aligned) in place of the token embeddings (a head that reads the target's features); the end-to-end forward
    asks for each row's own n, rows of one length together (no prefix is shared then).
    """
    runner = runner if isinstance(runner, Runner) else Runner(runner)  # a model: a runner of its own
    dev = runner.device
    lengths = [len(p) - 1 for p in prompts]
    width = max(lengths, default=0)
    if overhead is None:
        overhead = PREFILL_OVERHEAD.get(dev.type, 1)
    cached = [p[:n] for p, n in zip(prompts, lengths)]
    # the prefix every prompt shares, up to each row's last cached token (every row keeps one of its own): computed
    # once where that saves more than a forward's overhead
    shared = 0
    if embeds is None and len(prompts) > 1 and min(lengths) > 0:
        shared = min(shared_prefix(cached), min(lengths) - 1)
        if shared < SHARED_PREFIX_MIN or (len(prompts) - 1) * shared <= overhead:
            shared = 0
    # the runner's kept prefixes: start from the longest one the prompts all go past; compute (and keep) a longer
    # prefix that recurs, once
    store = runner.prefixes if embeds is None and prompts and min(lengths) > 0 else None
    base = keep = None
    if store is not None:
        base = store.find(cached, hidden)
        if base is not None and (base.keys[0].device != dev or base.keys[0].dtype != runner.model.dtype):
            store.clear()  # the model was moved or cast since: what was kept no longer fits it
            base = None
        start, grow = (len(base) if base is not None else 0), store.recurring(cached)
        keep = grow >= start + SHARED_PREFIX_MIN
        shared = grow if keep else max(shared, start)

    def vectors():  # each row's input vectors [n, H] for the end-to-end forward, asked for once per row length
        out = [None] * len(prompts)
        for n in set(lengths) - {0}:
            rows = [r for r, m in enumerate(lengths) if m == n]
            for r, v in zip(rows, embeds(rows, n)):
                out[r] = v
        return out

    whole = runner.prefill(cached, shared, width, hidden, vectors if embeds is not None else None, base)
    cache, states = whole or _grouped(runner, prompts, lengths, shared, width, overhead, hidden, embeds, base)
    if store is not None:
        if base is not None:
            store.used(base, len(prompts))
        if keep:  # row 0's copy of the prefix (every row's is the same)
            at = width - lengths[0]
            store.store(Prefix(tuple(cached[0][:shared]),
                               [layer.keys[:1, :, at : at + shared].clone() for layer in cache.layers],
                               [layer.values[:1, :, at : at + shared].clone() for layer in cache.layers],
                               states[:1, at : at + shared].clone() if hidden else None))
        store.remember(cached)
    n = torch.tensor(lengths, device=dev, dtype=torch.long)
    col = torch.arange(width, device=dev)[None, :]
    valid = col >= (width - n[:, None])
    tokens = torch.full((len(prompts), width), -1, dtype=torch.long, device=dev)
    for r, length in enumerate(lengths):  # once per request at prefill, not per round
        if length:
            tokens[r, width - length :] = torch.tensor(prompts[r][:-1], device=dev)
    positions = (col - (width - n[:, None])).clamp(min=0)
    state = SlotState(runner, cache, valid, tokens, positions, name)
    if not hidden:
        return state
    if states is None:  # every prompt is one token long
        size = runner.model.config.get_text_config().hidden_size
        states = torch.zeros((len(prompts), width, size), dtype=runner.model.dtype, device=dev)
    return state, states


def check_invariants(state: SlotState, history: torch.Tensor, processed: torch.Tensor, round: int) -> None:
    """Assert I1 and I2 for ``state``; ``history[b, :processed[b]]`` are the tokens row ``b`` must have cached.

    I1: ids, mask, positions and every layer's keys and values agree on batch size and slot count.
    I2: the valid slots of each row hold exactly the processed tokens, in order, with positions 0..n-1; so the pending
    token is not cached and no rejected token is visible.
    """
    b, s = state.valid.shape
    for what, t in (("tokens", state.tokens), ("positions", state.positions)):
        if tuple(t.shape) != (b, s):
            raise InvariantError("I1", "shape", f"{what} has shape {tuple(t.shape)}, mask has {(b, s)}", None, round, state.name)
    if history.shape[0] != b:
        raise InvariantError("I1", "shape", f"batch has {history.shape[0]} rows, cache has {b}", None, round, state.name)
    for i, (k, v) in enumerate(state.cache.tensors()):
        for what, t in (("keys", k), ("values", v)):
            if t.shape[0] != b or t.shape[-2] != s:
                raise InvariantError(
                    "I1", "shape", f"layer {i} {what} have batch {t.shape[0]} and {t.shape[-2]} slots; mask has {b} x {s}",
                    None, round, state.name,
                )
    if s == 0:
        bad = (processed != 0).nonzero()
        if len(bad):
            raise InvariantError("I2", "count", "the cache is empty but tokens were processed", int(bad[0]), round, state.name)
        return
    n = state.count()
    # valid tokens right-aligned vs history right-aligned: compare with one gather
    index, pad = compact_index(state.valid, s)
    got_tokens = state.tokens.gather(1, index).masked_fill(pad, -1)
    got_pos = state.positions.gather(1, index).masked_fill(pad, -1)
    col = torch.arange(s, device=n.device)[None, :]
    start = s - processed[:, None]
    want_pos = torch.where(col >= start, col - start, -1)
    hist_idx = want_pos.clamp(min=0)
    if hist_idx.shape[1] > history.shape[1]:
        history = torch.nn.functional.pad(history, (0, hist_idx.shape[1] - history.shape[1]), value=-1)
    want_tokens = torch.where(col >= start, history.gather(1, hist_idx), -1)
    checks = (
        ("padding", (state.valid & (state.tokens < 0)).any(1), "a padding slot is visible to attention"),
        ("count", n != processed, "valid KV entries differ from the tokens processed"),
        ("content", (got_tokens != want_tokens).any(1), "a visible slot holds a token the row did not accept"),
        ("positions", (got_pos != want_pos).any(1), "valid slots do not carry positions 0..n-1 in order"),
    )
    failed = torch.stack([bad for _, bad, _ in checks])  # [4, B]
    if failed.any():  # checker mode only: one sync
        which, row = (int(x) for x in failed.nonzero()[0])
        kind, _, message = checks[which]
        if kind == "count":
            message += f" ({int(n[row])} valid, {int(processed[row])} processed)"
        raise InvariantError("I2", kind, message, row, round, state.name)


class Batch:
    """The running rows, in one place: their sequences (``Sequences``), the target's slots, the drafter's per-row
    state (None for drafters without one) and each row's current length (prompt + generated, on the host, read with
    the round's one host sync). Row operations are written once, here, for all of them."""

    def __init__(self, seqs, target: SlotState, draft, lengths: list[int]):
        self.seqs, self.target, self.draft, self.lengths = seqs, target, draft, lengths

    def _parts(self):
        return (self.seqs, self.target) if self.draft is None else (self.seqs, self.target, self.draft)

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def request_ids(self) -> list[int]:
        return self.seqs.request_ids

    def select_rows(self, keep: list[int]) -> None:
        """Keep rows ``keep`` (host indices, ``new[i] = old[keep[i]]``)."""
        idx = torch.tensor(keep, dtype=torch.long, device=self.seqs.length.device)
        for part in self._parts():
            part.select_rows(idx)
        self.lengths = [self.lengths[i] for i in keep]

    def take(self, rows: list[int]) -> "Batch":
        """A copy of ``rows`` (a batch drawn from a larger window)."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.seqs.length.device)
        return Batch(*(part.take(idx) for part in self._parts()), *(() if self.draft is not None else (None,)),
                     [self.lengths[i] for i in rows])

    def put(self, rows: list[int], part: "Batch") -> None:
        """Write back what ``take(rows)`` returned, after a round."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.seqs.length.device)
        for mine, theirs in zip(self._parts(), part._parts()):
            mine.put(idx, theirs)
        for r, length in zip(rows, part.lengths):
            self.lengths[r] = length

    def merge(self, other: "Batch") -> "Batch":
        """This batch's rows followed by ``other``'s (requests joining)."""
        merged = [mine.merge(theirs) for mine, theirs in zip(self._parts(), other._parts())]
        return Batch(*merged, *(() if self.draft is not None else (None,)), self.lengths + other.lengths)
