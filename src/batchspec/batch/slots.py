"""The ragged batch as one rectangle of cache slots, and the two invariants it must keep.

Each model (target, and a draft model if any) has a ``SlotState``: its KV cache plus, per slot, whether the slot is
``valid`` (visible to attention), the ``token`` it holds and the ``position`` it was written with. Rows are left-padded;
rejected draft tokens become holes (invalid slots) until a layout realigns the rectangle.
"""

from __future__ import annotations

import copy

import torch

from ..model import kv


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
        """Rows of this state then rows of ``other`` in one left-padded state (the narrower is padded on the left); this
        state's cache is taken over (``kv.join_rows``): use the result, not this state."""
        width = max(self.width, other.width)
        cache = kv.join_rows(self.cache, len(self), other.cache, len(other), width)

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
