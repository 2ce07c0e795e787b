"""The only module that touches Hugging Face cache and attention-mask internals (with ``runner.py``'s attention
function, which follows HF's attention-function signature).

A transformers upgrade should only ever need changes here. The engine sees:
- ``SlotCache``: a KV cache whose per-layer buffers are preallocated (grown geometrically, rarely) and written in
  place; ``SlotLayer.reserve`` / ``advance`` are the public way for a kernel to write slots itself;
- ``attention_mask``: a ready 4D mask built from a per-slot visibility mask (HF's mask builders are bypassed);
- ``gather_slots`` / ``select_rows`` / ``stack_rows`` / ``join_rows`` / ``take_rows`` / ``put_rows`` /
  ``place_rows``: one gather per cache for realignment, row removal, splicing, rows joining a running batch, moving
  rows between a window and a batch, and assembling a prefill;
- ``windows``: each attention layer type's sliding window, which ``attention_mask`` applies over visible tokens;
- ``check_supported``: refuses models whose attention this engine cannot address by slot;
- ``rebuild_buffers``: the buffers of a model built on the meta device (its rotary tables), computed by
  transformers' own initialiser (a packed model loaded from the cache, ``loading.py``).
"""

from __future__ import annotations

import threading

import torch
from transformers.cache_utils import Cache, DynamicLayer

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def row_capacity(rows: int) -> int:
    """Rows a cache buffer is allocated with: the next bucket (``graphs.py`` runs a bucket's rows as one static
    shape; the batch uses the first ``rows``); beyond the largest bucket, exactly ``rows``."""
    return next((b for b in ROW_BUCKETS if b >= rows), rows)


def slot_capacity(slots: int, device: torch.device) -> int:
    """Slots a cache buffer is allocated with: on a GPU the next power of two (at least 256), so that batches of
    similar prompts get buffers of the same shape, which the allocator hands back at the same address and the static
    steps' graphs fit again; elsewhere ``slots``."""
    return max(256, 1 << (slots - 1).bit_length()) if device.type == "cuda" else slots


def whole_buffer(t: torch.Tensor) -> torch.Tensor:
    """The whole buffer behind a layer's ``[:rows]`` view (all ``row_capacity(rows)`` rows)."""
    rows = t.untyped_storage().nbytes() // (t.stride(0) * t.element_size())
    if t.storage_offset() or not t.is_contiguous() or rows <= t.shape[0]:
        return t
    return t.as_strided((rows, *t.shape[1:]), t.stride())


POOL_DEVICES = {"cuda"}  # where released buffers are kept for the next batch
_pool: dict[tuple, list[torch.Tensor]] = {}
_pool_lock = threading.Lock()
POOL_LIMIT = 256  # buffers kept at most (beyond, those of other shapes are dropped)


def _rows_buffer(like: torch.Tensor, rows: int, slots: int, dim: int, written: int = 0) -> torch.Tensor:
    """Zeroed ``[rows, heads, slots, dim]``: the first ``rows`` of a buffer of ``row_capacity(rows)`` rows, taken from
    the buffers of released caches when one has this shape (on ``POOL_DEVICES``: the static steps' CUDA graphs are
    bound to buffer addresses, so a batch that reuses its predecessor's buffers reuses its graphs too). Elsewhere the
    first ``written`` slots of every row are left as they are: the caller writes them (zeros where it has nothing),
    so their pages are touched once."""
    shape = (row_capacity(rows), like.shape[1], slot_capacity(slots, like.device), dim)
    with _pool_lock:
        free = _pool.get((shape, like.dtype, like.device))
        buf = free.pop() if free else None
    if buf is not None:
        return buf.zero_()[:rows]
    if not written or like.device.type in POOL_DEVICES:
        return like.new_zeros(shape)[:rows]
    buf = _unwritten(like, shape)
    buf[:, :, written:].zero_()
    return buf[:rows]


def _unwritten(like: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A new buffer whose values are not set (a test fills it with NaN: every slot is written before it is read)."""
    return like.new_empty(shape)


def _release(t: torch.Tensor | None) -> None:
    if t is None or t.device.type not in POOL_DEVICES:
        return
    buf = whole_buffer(t)
    if buf.storage_offset() or not buf.is_contiguous():  # only whole buffers as ``_rows_buffer`` made them
        return
    key = (tuple(buf.shape), buf.dtype, buf.device)
    with _pool_lock:
        if sum(map(len, _pool.values())) >= POOL_LIMIT:
            for other in [k for k in _pool if k != key]:
                del _pool[other]
        free = _pool.setdefault(key, [])
        if len(free) < POOL_LIMIT and all(b.data_ptr() != buf.data_ptr() for b in free):
            free.append(buf)


class SlotLayer(DynamicLayer):
    """One layer's keys and values, ``[batch, heads, capacity, head_dim]``, of which the first ``length`` slots are used.

    ``update`` writes the new slots in place (no concatenation, so no copy of the whole cache per forward).
    """

    def __init__(self):
        self.length = 0
        self._k = self._v = None
        super().__init__()

    # The used slots, ``[batch, heads, length, head_dim]``: views of the buffers made when read. A decode step in the C
    # layer writes the buffers itself and advances every layer without reading them (two views a layer, made at
    # every advance, were ~3% of a batch-1 step).
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[..., : self.length, :]

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:  # (Hugging Face's layer code assigns whole tensors)
        self._k = t
        if t is not None:
            self.length = t.shape[-2]

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[..., : self.length, :]

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        self._v = t
        if t is not None:
            self.length = t.shape[-2]

    def lazy_initialization(self, key_states, value_states):
        self.device = key_states.device
        self.is_initialized = True

    def _ensure(self, key_states, value_states, needed):
        if self._k is not None and needed <= self._k.shape[-2]:
            return
        cap = max(needed, 2 * (0 if self._k is None else self._k.shape[-2]), 64)
        b, _, _, d = key_states.shape if self._k is None else self._k.shape
        k = _rows_buffer(self._k if self._k is not None else key_states, b, cap, d)
        v = _rows_buffer(self._v if self._v is not None else value_states, b, cap, value_states.shape[-1])
        if self.length:
            k[..., : self.length, :] = self._k[..., : self.length, :]
            v[..., : self.length, :] = self._v[..., : self.length, :]
        self._k, self._v = k, v

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        self._ensure(key_states, value_states, self.length + q)
        self._k[..., self.length : self.length + q, :] = key_states
        self._v[..., self.length : self.length + q, :] = value_states
        self.length += q
        return self.keys, self.values

    def get_seq_length(self):
        return self.length

    def reserve(self, like_k, like_v, needed: int):
        """Contiguous key and value buffers with room for ``needed`` slots (grown if need be), for a kernel that
        writes slots itself; call ``advance`` once they are written."""
        if not self.is_initialized:
            self.lazy_initialization(like_k, like_v)
        self._ensure(like_k, like_v, needed)
        if not (self._k.is_contiguous() and self._v.is_contiguous()):
            self._k, self._v = self._k.contiguous(), self._v.contiguous()
        return self._k, self._v

    def advance(self, length: int) -> None:
        """``length`` slots of the buffers are now in use."""
        self._adopt(self._k, self._v, length)

    def _adopt(self, k, v, length):
        """Make ``k``/``v`` (full buffers) the layer's storage with ``length`` slots in use."""
        self._k, self._v, self.length, self.is_initialized = k, v, length, True

    def fresh(self, like_k, like_v, batch: int, length: int):
        """Empty zeroed buffers for ``batch`` rows and ``length`` slots plus spare room (so appends don't regrow them
        at once); returns the ``[:length]`` views to fill."""
        cap = length + max(64, length // 2)
        k = _rows_buffer(like_k, batch, cap, like_k.shape[-1])
        v = _rows_buffer(like_v, batch, cap, like_v.shape[-1])
        self._adopt(k, v, length)
        return self.keys, self.values

    def set(self, keys, values):
        """Replace the content with ``keys``/``values`` (``[B, H, L, D]``), keeping spare capacity."""
        k, v = self.fresh(keys, values, keys.shape[0], keys.shape[-2])
        k.copy_(keys)
        v.copy_(values)


class SlotCache(Cache):
    """A cache of ``SlotLayer``s, created for a model before its first forward."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[SlotLayer() for _ in range(num_layers)])
        self._sizes = (0, 0, 0)  # ``nbytes``' (first buffer's identity, bytes of a slot of every row, bytes held)

    @property
    def length(self) -> int:
        return self.layers[0].length

    def release(self) -> None:
        """Give the buffers back for later caches of the same shape (see ``_rows_buffer``); the cache is empty
        afterwards and must hold no other reference to them."""
        for layer in self.layers:
            _release(layer._k)
            _release(layer._v)
            layer._k = layer._v = None
            layer.length, layer.is_initialized = 0, False

    def nbytes(self) -> tuple[int, int]:
        """(bytes the used slots of every layer's keys and values take, bytes their buffers hold), from shapes. The
        engine reads it twice a round: the layers' sizes are summed again only when the first layer's buffer changed
        (the layers' buffers are made, grown and released together), else it is one multiply (a round at batch 1
        spent ~3% of its time summing them)."""
        first = self.layers[0]._k if self.layers else None
        key = None if first is None else (first.data_ptr(), first.shape)
        if self._sizes[0] != key:
            slot = held = 0  # bytes of one slot of every row across the layers, bytes the buffers hold
            for layer in self.layers:
                for t in (layer._k, layer._v):
                    if t is not None:
                        slot += t.shape[0] * t.shape[1] * t.shape[3] * t.element_size()
                        held += t.untyped_storage().nbytes()
            self._sizes = (key, slot, held)
        _, slot, held = self._sizes
        return slot * self.length, held

    def tensors(self):
        """(keys, values) of every layer, for invariant checks."""
        return [(layer.keys, layer.values) for layer in self.layers if layer.length]


def per_token_bytes(model) -> int:
    """Bytes one cached token takes in ``model``'s cache: K and V of every layer."""
    cfg = model.config.get_text_config()
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * heads * dim * model.dtype.itemsize


def num_layers(model) -> int:
    return model.config.get_text_config().num_hidden_layers


def new_cache(model) -> SlotCache:
    return SlotCache(num_layers(model))


def gather_slots(cache: SlotCache, index: torch.Tensor, pad: torch.Tensor) -> None:
    """Rearrange every layer in place as ``new[b, :, j] = old[b, :, index[b, j]]`` (zeros where ``pad[b, j]``), one
    gather each; ``index`` is no wider than the cache, and the buffers are kept."""
    if cache.length == 0:
        return
    zero = pad[:, None, :, None]
    for layer in cache.layers:
        k, v = layer.keys, layer.values
        b, h, _, d = k.shape
        w = index.shape[1]
        idx = index[:, None, :, None].expand(b, h, w, d)
        moved_k = torch.gather(k, 2, idx).masked_fill_(zero, 0)
        moved_v = torch.gather(v, 2, idx).masked_fill_(zero, 0)
        layer._k[:, :, :w].copy_(moved_k)
        layer._v[:, :, :w].copy_(moved_v)
        layer.advance(w)


def move_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``t[rows]`` for a batch narrowing to ``len(rows)`` rows (dim 0): where no row is read after it was written (rows
    moving from the tail into the places of leaving ones), the moving rows are copied in place and the first rows of
    ``t`` come back (a view); else a gathered copy. One host read."""
    n = len(rows)
    dest, moves = _row_moves(rows)
    if moves is None:
        return t[rows]
    for d, s in moves:
        t[d].copy_(t[s])
    return t[:n]


def _row_moves(rows: torch.Tensor):
    """``(places that change, [(place, row read)] or None)`` for ``new[i] = old[rows[i]]``: None where a row would be
    read after it was written (then only a gathered copy will do). One host read."""
    dest = (rows != torch.arange(len(rows), device=rows.device)).nonzero().squeeze(1)
    moves = torch.stack([dest, rows[dest]], 1).tolist()
    return dest, None if {s for _, s in moves} & {d for d, _ in moves} else moves


def select_rows(cache: SlotCache, rows: torch.Tensor) -> None:
    """Make the batch ``new[i] = old[rows[i]]``. Only rows that change place are copied, and the batch then narrows
    to ``len(rows)`` in place: removing a few finished rows (refilling their places from the tail) copies a few rows,
    not the whole cache."""
    n = len(rows)
    # row by row, in place, where no row is read after it was written (rows moving from the tail into the places of
    # leaving ones): a gathered copy would first fill fresh memory, ~38 MB a row for a 30-layer cache of 800 slots
    dest, moves = _row_moves(rows)  # one host read, at row removal only
    for layer in cache.layers:
        if layer.length:
            used = layer.length
            for buf in (layer._k, layer._v):
                if moves is not None:
                    for d, s in moves:
                        buf[d, :, :used].copy_(buf[s, :, :used])
                else:
                    buf[:n, :, :used].index_copy_(0, dest, buf[:, :, :used].index_select(0, rows[dest]))
            layer._adopt(layer._k[:n], layer._v[:n], layer.length)


def take_rows(cache: SlotCache, rows: torch.Tensor) -> SlotCache:
    """A new cache holding a copy of ``rows`` of ``cache`` (one index-select per layer)."""
    out = SlotCache(len(cache.layers))
    for src, dst in zip(cache.layers, out.layers):
        if src.length:
            dst.set(src.keys.index_select(0, rows), src.values.index_select(0, rows))
    return out


def put_rows(cache: SlotCache, rows: torch.Tensor, part: SlotCache, width: int, batch: int) -> None:
    """Write ``part``'s rows back into ``rows`` of ``cache`` (``batch`` rows), right-aligned in ``width`` slots (the
    cache grows on the right to ``width`` if narrower; slots left of the written ones keep stale, finite values the
    mask must hide)."""
    for dst, src in zip(cache.layers, part.layers):
        if not src.length:
            continue
        if dst._k is None:  # nothing cached yet (a draft head that has not run): zeroed buffers for every row
            dst.lazy_initialization(src.keys, src.values)
            dst.fresh(src.keys, src.values, batch, 0)
        dst._ensure(src.keys, src.values, width)
        n = src.length
        dst._k[:, :, width - n : width].index_copy_(0, rows, src.keys)
        dst._v[:, :, width - n : width].index_copy_(0, rows, src.values)
        dst._adopt(dst._k, dst._v, max(dst.length, width))


def place_rows(cache: SlotCache, rows: torch.Tensor, part: SlotCache, batch: int, width: int) -> None:
    """Copy ``part``'s rows into ``rows`` of ``cache``, right-aligned in ``width`` slots; an empty ``cache`` first gets
    zeroed buffers of ``batch`` rows (so the left padding holds zeros)."""
    for dst, src in zip(cache.layers, part.layers):
        if not dst.length:
            dst.fresh(src.keys, src.values, batch, width)
        n = src.length
        dst.keys[:, :, width - n :].index_copy_(0, rows, src.keys)
        dst.values[:, :, width - n :].index_copy_(0, rows, src.values)


def stack_rows(parts: list[tuple[SlotCache | None, int]], width: int, num_layers: int) -> SlotCache:
    """Left-pad each cache to ``width`` slots and concatenate them along the batch, in the order given.

    ``parts`` holds ``(cache, rows)`` pairs; a cache may be None or empty (rows with nothing cached yet).
    """
    out = SlotCache(num_layers)
    filled = [c for c, _ in parts if c is not None and c.length]
    if width == 0 or not filled:
        return out
    ref = filled[0]
    for i, layer in enumerate(out.layers):
        rk, rv = ref.layers[i].keys, ref.layers[i].values
        parts_k, parts_v = [], []
        for c, rows in parts:
            if c is None or not c.length:
                parts_k.append(rk.new_zeros((rows, rk.shape[1], width, rk.shape[-1])))
                parts_v.append(rv.new_zeros((rows, rv.shape[1], width, rv.shape[-1])))
                continue
            k, v = c.layers[i].keys, c.layers[i].values
            parts_k.append(torch.nn.functional.pad(k, (0, 0, width - k.shape[-2], 0)))
            parts_v.append(torch.nn.functional.pad(v, (0, 0, width - v.shape[-2], 0)))
        layer.set(torch.cat(parts_k), torch.cat(parts_v))
    return out


def join_rows(cache: SlotCache, rows: int, other: SlotCache, more: int, width: int) -> SlotCache:
    """``cache``'s ``rows`` rows then ``other``'s ``more`` rows, each right-aligned in ``width`` slots: what
    ``stack_rows`` makes of the two, but written into ``cache``'s own buffers where they have room (rows joining a
    running batch that is at least as wide as they are: its rows stay where they are), else into new buffers with
    room to grow; either way every row is copied at most once (a 16-row batch of 1,000 slots is ~0.9 GB of keys and
    values, which padding and concatenating copied three times at every join). ``cache`` is taken over: use the
    result."""
    if not cache.length or not other.length or cache.length > width or other.length > width:
        return stack_rows([(cache, rows), (other, more)], width, len(cache.layers))
    first = cache.layers[0]._k
    whole = whole_buffer(first)
    fits = (cache.length == width and whole.shape[0] >= rows + more and whole.shape[2] >= width
            and whole.is_contiguous() and not whole.storage_offset())
    out = cache if fits else SlotCache(len(cache.layers))
    for mine, theirs, dst in zip(cache.layers, other.layers, out.layers):
        n, bufs = theirs.length, []
        for t, new in ((mine._k, theirs.keys), (mine._v, theirs.values)):
            if fits:
                buf = whole_buffer(t)[: rows + more]
            else:
                buf = _rows_buffer(t, rows + more, width + max(64, width // 2), t.shape[-1], written=width)
                buf[:rows, :, : width - mine.length] = 0
                buf[:rows, :, width - mine.length : width] = t[:rows, :, : mine.length]
            buf[rows:, :, : width - n] = 0  # the joining rows' left padding (their rows held other slots)
            buf[rows:, :, width - n : width] = new
            bufs.append(buf)
        dst._adopt(*bufs, width)
    return out


def windows(model) -> dict[str, int | None]:
    """Each attention layer type's window (``{layer type: window or None}``, None: full attention), ``{}`` for a
    model whose every layer attends to its whole history. A window of ``w`` lets a token see itself and the ``w - 1``
    tokens before it (HF's ``sliding_window``); ``layer_types`` in the config names each layer's type (Gemma 3's
    local and global layers), else ``sliding_window`` applies to every layer (Mistral's)."""
    cfg = model.config.get_text_config()
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    types = set(getattr(cfg, "layer_types", None) or [])
    if not types:
        return {"sliding_attention": window} if window else {}
    kinds = {t: window if t == "sliding_attention" else None for t in types}
    return kinds if any(kinds.values()) or types - {"full_attention", "sliding_attention"} else {}


def _allowed(visible: torch.Tensor, q: int, window: int | None) -> torch.Tensor:
    """``[B, 1, q, S+q]``: which slots each of the ``q`` new queries may attend to (see ``attention_mask``)."""
    total = visible.shape[1]
    kv = torch.arange(total, device=visible.device)
    qs = torch.arange(total - q, total, device=visible.device)
    causal = kv[None, :] <= qs[:, None]
    allowed = visible[:, None, :] & causal[None]
    if window is not None:  # a window counts a row's visible tokens (its positions), not its slots
        seen = visible.cumsum(1)
        allowed &= seen[:, qs, None] - seen[:, None, :] < window
    return (allowed | (kv[None, :] == qs[:, None])[None])[:, None]


def attention_mask(model, visible: torch.Tensor, q: int):
    """A 4D mask for a forward of ``q`` new slots over a cache whose slots (old and new) are ``visible`` ``[B, S+q]``.

    Query ``i`` (slot ``S+i``) sees visible slots ``<= S+i``; it always sees itself, so a query on a hidden slot (a
    hole) still has one key and never produces NaN. Additive float for eager attention, bool otherwise (sdpa).
    Layers with a window (``windows``) see only the visible slots within that many of the row's tokens (holes and
    padding not counted); where layer types differ (Gemma 3), a dict of masks keyed by layer type, as HF's models
    with mixed layers take it.
    """
    masks = {t: _allowed(visible, q, w) for t, w in (windows(model) or {"full_attention": None}).items()}
    if model.config._attn_implementation == "eager":
        dtype, zero = model.dtype, torch.zeros((), dtype=model.dtype, device=visible.device)
        masks = {t: zero.masked_fill(~m, torch.finfo(dtype).min) for t, m in masks.items()}
    return masks.popitem()[1] if len(masks) == 1 else masks


SUPPORTED_ATTENTION = ("sdpa", "eager")
# families whose models take a dict of masks keyed by layer type, tested against HF with mixed layers
MIXED_LAYERS = ("gemma3_text",)


def check_supported(model, role: str) -> None:
    """Raise ``ValueError`` for models whose attention cannot be addressed by slot and visibility mask (with a
    window per layer type, ``windows``)."""
    cfg = model.config.get_text_config()
    impl = model.config._attn_implementation
    if impl not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"{role} model uses attention implementation {impl!r}; batchspec needs one of {SUPPORTED_ATTENTION} "
            "(load it with attn_implementation='sdpa')"
        )
    kinds = windows(model)
    odd = sorted(set(kinds) - {"full_attention", "sliding_attention"})
    mixed = len(set(kinds.values())) > 1 and model.config.model_type not in MIXED_LAYERS
    if odd or mixed or getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(
            f"{role} model ({cfg.model_type}) uses attention layers {sorted(kinds)} that batchspec does not serve "
            "exactly (a window per layer type is served for uniform windows and for the families "
            f"{MIXED_LAYERS}); refused rather than silently diverging"
        )
    if getattr(cfg, "attn_logit_softcapping", None) is not None and impl != "eager":
        raise ValueError(f"{role} model ({cfg.model_type}) caps attention logits, which only eager attention "
                         "computes (load it with attn_implementation='eager')")


def rebuild_buffers(model) -> bool:
    """Compute, on the CPU, the buffers a model built on the meta device made there (its rotary tables), with
    transformers' own initialiser of that module; False when some tensor is still on meta after it."""
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            model._init_weights(module)
    return not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
