"""The ragged batch as one rectangle of cache slots, and the two invariants it must keep.

Each model (target, and a draft model if any) has a ``SlotState``: its KV cache plus, per slot, whether the slot is
``valid`` (visible to attention), the ``token`` it holds and the ``position`` it was written with. Rows are left-padded;
rejected draft tokens become holes (invalid slots) until a layout realigns the rectangle.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import kv


class InvariantError(AssertionError):
    """A synchronisation invariant was violated.

    ``invariant``: "I1" or "I2". ``kind``: "shape" (I1), or for I2 "padding" (a padding slot is visible), "count"
    (valid KV entries differ from tokens processed), "content" (a visible slot holds a token the row did not accept)
    or "positions" (valid slots do not carry positions 0..n-1). ``row``, ``round`` and ``cache`` locate it.
    """

    def __init__(self, invariant, kind, message, row=None, round=None, cache=""):
        self.invariant, self.kind, self.row, self.round, self.cache = invariant, kind, row, round, cache
        super().__init__(f"{invariant} ({kind}) violated in the {cache} cache, row {row}, round {round}: {message}")


@dataclass
class SlotState:
    model: torch.nn.Module
    cache: kv.SlotCache
    valid: torch.Tensor  # [B, S] bool: the slot holds a token that attention may see
    tokens: torch.Tensor  # [B, S] long: token id written at each slot (-1 for padding)
    positions: torch.Tensor  # [B, S] long: position id each slot was written with
    name: str = "target"

    @property
    def width(self) -> int:
        return self.valid.shape[1]

    def count(self) -> torch.Tensor:
        """Valid (cached) tokens per row ``[B]``."""
        return self.valid.sum(1)

    def new_positions(self, new_valid: torch.Tensor) -> torch.Tensor:
        """Positions for new slots ``[B, q]``: the number of valid tokens before each one."""
        before = self.count()[:, None] + torch.cumsum(new_valid, 1) - new_valid.long()
        return before

    def append(self, input_ids: torch.Tensor, new_valid: torch.Tensor | None = None, logits_to_keep: int = 0):
        """Run the model on ``input_ids`` ``[B, q]`` written into ``q`` new slots per row; returns logits."""
        if new_valid is None:
            new_valid = torch.ones_like(input_ids, dtype=torch.bool)
        pos = self.new_positions(new_valid)
        visible = torch.cat([self.valid, new_valid], 1)
        logits = kv.forward(self.model, self.cache, input_ids, pos, visible, logits_to_keep)
        self.valid, self.tokens = visible, torch.cat([self.tokens, input_ids], 1)
        self.positions = torch.cat([self.positions, pos], 1)
        return logits

    def hide_tail(self, q: int, keep: torch.Tensor) -> None:
        """Of the last ``q`` slots, keep the first ``keep[b]`` of each row visible and hide the rest (rejected)."""
        tail = torch.arange(q, device=keep.device)[None, :] < keep[:, None]
        self.valid[:, -q:] &= tail

    def gather(self, index: torch.Tensor, pad: torch.Tensor) -> None:
        """Rearrange every per-slot tensor and the KV cache by one gather: ``new[b, j] = old[b, index[b, j]]``."""
        kv.gather_slots(self.cache, index, pad)
        self.valid = self.valid.gather(1, index) & ~pad
        self.tokens = self.tokens.gather(1, index).masked_fill(pad, -1)
        self.positions = self.positions.gather(1, index).masked_fill(pad, 0)

    def select_rows(self, rows: torch.Tensor) -> None:
        kv.select_rows(self.cache, rows)
        self.valid, self.tokens, self.positions = self.valid[rows], self.tokens[rows], self.positions[rows]

    def take(self, rows: torch.Tensor) -> "SlotState":
        """A copy of ``rows`` as a state of its own (a batch drawn from a larger window)."""
        return dataclasses.replace(self, cache=kv.take_rows(self.cache, rows), valid=self.valid[rows],
                                   tokens=self.tokens[rows], positions=self.positions[rows])

    def put(self, rows: torch.Tensor, part: "SlotState") -> None:
        """Write ``part`` (taken from ``rows`` and advanced) back, right-aligned; widens this state if needed."""
        old, width = self.width, max(self.width, part.width)
        kv.put_rows(self.cache, rows, part.cache, width)
        pad = torch.nn.functional.pad
        for name, fill in (("valid", False), ("tokens", -1), ("positions", 0)):
            mine = pad(getattr(self, name), (0, width - old), value=fill)  # new slots on the right: empty
            mine[rows] = pad(getattr(part, name), (width - part.width, 0), value=fill)
            setattr(self, name, mine)


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


def prefill(model, prompts: list[list[int]], name: str = "target") -> SlotState:
    """Cache every prompt but its last token, without padding waste, as one left-padded ``SlotState``.

    Prompts of equal length share one forward; each group's keys and values are then copied once into its rows of
    the final rectangle (cost follows the sum of prompt lengths, not batch x longest).
    """
    dev = model.device
    lengths = [len(p) - 1 for p in prompts]
    width = max(lengths, default=0)
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    cache = kv.new_cache(model)
    for n, rows in sorted(groups.items()):
        if n:
            part = kv.new_cache(model)
            ids = torch.tensor([prompts[r][:n] for r in rows], device=dev)
            pos = torch.arange(n, device=dev).expand(len(rows), n)
            kv.forward(model, part, ids, pos, logits_to_keep=1)
            kv.place_rows(cache, torch.tensor(rows, device=dev), part, len(prompts), width)
    n = torch.tensor(lengths, device=dev, dtype=torch.long)
    col = torch.arange(width, device=dev)[None, :]
    valid = col >= (width - n[:, None])
    tokens = torch.full((len(prompts), width), -1, dtype=torch.long, device=dev)
    for r, length in enumerate(lengths):  # once per request at prefill, not per round
        if length:
            tokens[r, width - length :] = torch.tensor(prompts[r][:-1], device=dev)
    positions = (col - (width - n[:, None])).clamp(min=0)
    return SlotState(model, cache, valid, tokens, positions, name)


def merge(a: SlotState, b: SlotState) -> SlotState:
    """Rows of ``a`` then rows of ``b`` in one left-padded state (the narrower is padded on the left)."""
    width = max(a.width, b.width)
    cache = kv.stack_rows([(a.cache, a.valid.shape[0]), (b.cache, b.valid.shape[0])], width, kv.num_layers(a.model))

    def pad(t, value):
        return torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value)

    return dataclasses.replace(
        a, cache=cache,
        valid=torch.cat([pad(a.valid, False), pad(b.valid, False)]),
        tokens=torch.cat([pad(a.tokens, -1), pad(b.tokens, -1)]),
        positions=torch.cat([pad(a.positions, 0), pad(b.positions, 0)]),
    )


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
