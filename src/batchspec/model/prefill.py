"""A Llama prefill of many prompts with their tokens end to end: no padding, one forward, causal attention per row.

The grouped prefill (``batch/prefilling.py``) runs one left-padded forward per group of similar lengths: it computes the
padding's tokens, expands every packed weight once per forward, and, when the prompts share a prefix (a chat
template's), attends over a masked rectangle (twice the work of causal attention). Here every token is computed
once: the rows' tokens (and the shared prefix, once) are laid end to end as one sequence of ``T`` tokens, so each
linear layer is one product over ``[T, H]``; attention runs per row, causally, over the row's own slots (prefix
first); keys and values go straight to the row's right-aligned slots of the final cache. A kept prefix
(``prefixes.py``) is copied into every row's first slots instead, and the sequence starts after it.

Each step is the model's own arithmetic in its order of operations (norms, projections, MLP, rotary tables; the
attention's softmax), written into buffers made once per forward; attention runs in ``kernels/causal.c`` where it
applies (fp32, heads of 64, AVX-512: flash-style, 1.5-2x torch's attention on this project's CPU), else in torch's
``scaled_dot_product_attention`` over blocks of positions aligned to 0 (``ALIGN``). The products see more rows at once, so sums may run in another order, like any
change of batch size.

Used for ``LlamaForCausalLM`` models with sdpa attention on CPU (the per-row attention calls cost launches a GPU
would not want), and for the families the C layer covers beside it (``kernels.llama.FAMILIES``: Qwen2's q/k/v biases
are added after the products, Qwen3's RMS norms of each query and key head run before the rotary embedding; Gemma 3's
norms of the attention's and the MLP's outputs run before their residual adds, its rotary tables are one per layer
type, and its local layers' queries see the window's last keys: a prompt's tokens are consecutive, so a window of
visible tokens is one of positions); anything else returns None and the caller runs the grouped prefill.
"""

from __future__ import annotations

import functools
import threading
import weakref

import torch
from transformers.activations import ACT2FN

from . import kernels, kv
from . import weights as packed
from .prefixes import available_bytes
from .kernels import llama as fused

# ``hidden`` asking for what a feature-reading head starts from, not the final hidden states: at prompt positions
# the last layer's *input*, normed by the final norm. The last layer then computes only its keys and values (its
# queries, attention and MLP are ~3% of a prefill), and a head's drafts barely read a prompt's features: with the
# default head drafting every round (K=5), 562 of 2,120 drafts accepted against 568 of 2,090 with the final states
# (12 Spec-Bench prompts, 128 tokens), 669 against 671 on 24 built-in ones (docs/benchmarks.md)
FEATURES = "features"
MAX_TOKENS = 1 << 14  # tokens per forward at most (bounds the activations: ~28 KB a token for a 576-wide model);
# rows longer than that run alone. At 16k tokens a forward's fixed costs (expanding packed weights) are < 1%


def supported(model) -> bool:
    """Whether this path covers ``model`` (a query: module types, device and attention implementation)."""
    return model.device.type == "cpu" and model.config._attn_implementation == "sdpa" and fused.covered(model)


def prefill(model, prompts: list[list[int]], shared: int, width: int, hidden: bool, embeds=None, base=None):
    """Cache ``prompts`` (token ids, each at least ``shared`` long; ``shared`` leading tokens common to all, computed
    once) right-aligned in ``width`` slots of a new ``SlotCache`` of ``len(prompts)`` rows (padding zeros). Returns
    ``(cache, states)``: ``states`` ``[B, width, H]`` the final (normed) hidden states laid out like the slots (zeros
    on padding) when ``hidden`` (``FEATURES``: the last layer's input, normed), else None. None where ``supported``
    says no. ``embeds()``: each row's input vectors ``[len(prompt), H]`` in place of its tokens' embeddings (a head that reads the target's features; no shared
    prefix), asked for only where this path runs. ``base``: a kept ``Prefix`` (``prefixes.py``) of the first
    ``len(base) <= shared`` tokens: its keys, values (and hidden states) are copied, not computed."""
    if not supported(model) or (embeds is not None and shared):
        return None
    vectors = embeds() if embeds is not None else None
    cache = kv.new_cache(model)
    a = model.model.layers[0].self_attn
    like = torch.empty((1, a.k_proj.out_features // a.head_dim, 0, a.head_dim), dtype=model.dtype)
    for slots in cache.layers:  # made outside no_grad: the cache's views are written in place later, in any mode
        slots.lazy_initialization(like, like)
        slots.fresh(like, like, len(prompts), width)
    states = None
    rows = [r for r, p in enumerate(prompts) if len(p)]
    given = len(base) if base is not None else 0  # the prefix's tokens copied, not computed
    for chunk in _chunks([len(prompts[r]) - shared for r in rows], shared - given):
        chunk = [rows[i] for i in chunk]
        lengths = [len(prompts[r]) for r in chunk]
        where = _where(chunk, lengths, shared, width, given)
        kept = _where(chunk, lengths, given, width, 0, own=False) if given else None
        with torch.no_grad():
            x = torch.cat([vectors[r] for r in chunk]) if vectors is not None else None
            h = _forward(model, cache, [prompts[r] for r in chunk], chunk, shared, width, hidden, where, x,
                         base, kept)
        if hidden:
            if states is None:
                states = h.new_zeros((len(prompts), width, h.shape[-1]))
            src, dr, ds = where
            states[dr, ds] = h[src]
            if kept is not None:
                src, dr, ds = kept
                states[dr, ds] = base.hidden[0, src]
    return cache, states


def _chunks(own: list[int], shared: int) -> list[list[int]]:
    """Consecutive runs of rows whose tokens (``shared`` prefix tokens once, then each row's own) fit
    ``MAX_TOKENS``."""
    out, total = [], 0
    for i, n in enumerate(own):
        if not out or total + n > MAX_TOKENS:
            out.append([])
            total = shared
        out[-1].append(i)
        total += n
    return out


def _where(rows: list[int], lengths: list[int], shared: int, width: int, start: int = 0, own: bool = True):
    """``(tokens, dest_rows, dest_slots)``, ``[N]`` each: the forward's token ``tokens[i]`` (prefix tokens ``start ..
    shared - 1``, then the rows' own tokens in order) goes to slot ``dest_slots[i]`` of row ``dest_rows[i]``; the
    prefix to every row. Without ``own``, only the prefix's."""
    src, dr, ds, at, lead = [], [], [], shared - start, shared - start
    for r, n in zip(rows, lengths):
        mine = n - shared if own else 0
        src += list(range(lead)) + list(range(at, at + mine))
        dr += [r] * (lead + mine)
        ds += list(range(width - n + start, width - n + shared + mine))
        at += mine
    return torch.tensor(src), torch.tensor(dr), torch.tensor(ds)


def _forward(model, cache, prompts, rows, shared, width, hidden, where, x=None, base=None, kept=None):
    """One forward over ``prompts`` (the prefix once, then each row's own tokens) writing rows ``rows`` of the cache
    (``where``: ``_where``'s slots of its tokens); returns the normed hidden states ``[T, H]`` when ``hidden``. ``x``:
    the input vectors ``[T, H]`` (a fresh tensor: it becomes the residual stream), else the tokens' embeddings.
    ``hidden=FEATURES``: the last layer's input, normed, in place of the final hidden states.
    ``base``: a kept prefix of the first tokens, copied into every row's slots (``kept``: ``_where``'s for it), not
    computed: the forward starts after it.

    Each step writes into buffers made once per forward (``_Buffers``): a fresh tensor of this size costs its page
    faults again each time it is allocated, as much as the elementwise step that fills it."""
    inner = model.model
    lengths = [len(p) for p in prompts]
    given = len(base) if base is not None else 0  # the prefix's tokens copied, not computed
    lead = shared - given  # and those this forward computes
    ids = torch.tensor(prompts[0][given:shared] + [t for p in prompts for t in p[shared:]])
    positions = torch.cat([torch.arange(given, shared)] + [torch.arange(shared, n) for n in lengths])[None, :]
    if x is None:
        x = inner.embed_tokens(ids[None, :])[0].contiguous()  # [T, H], the residual stream, updated in place
    tables = {t: [c[0, :, None, :] for c in pair] for t, pair in fused.rotary(model, x[None], positions).items()}
    # [first, last) of each row's own tokens in the sequence, after the prefix
    ends = torch.tensor(lengths).sub(shared).cumsum(0).add(lead).tolist()
    spans = list(zip([lead] + ends[:-1], ends))
    starts = [width - n for n in lengths]  # each row's first slot
    src, dr, ds = where
    b = _Buffers(model, x)
    kinds, windows = fused.layer_types(model), fused.layer_windows(model)
    for i, (layer, slots) in enumerate(zip(inner.layers, cache.layers)):
        a, m = layer.self_attn, layer.mlp
        cos, sin = tables[kinds[i]]  # [T, 1, D]
        pre = getattr(layer, "pre_feedforward_layernorm", None)  # Gemma's: the post-attention norm is the output's
        post = (None, None) if pre is None else (layer.post_attention_layernorm, layer.post_feedforward_layernorm)
        # the last layer's keys and values are all the cache needs of it: without the final hidden states, its
        # queries, attention and MLP would only feed a residual stream nobody reads
        cache_only = hidden is not True and i == len(inner.layers) - 1
        _rmsnorm(x, layer.input_layernorm, b.h)
        k, v = (_linear(lin, b.h, out, b.w).view(len(x), -1, a.head_dim)  # [T, heads, D]
                for lin, out in ((a.k_proj, b.k), (a.v_proj, b.v)))
        _head_norm(k, getattr(a, "k_norm", None), b.rot)
        _rope(k, cos, sin, b.rot)
        slots.keys.transpose(1, 2)[dr, ds] = k[src]  # [N, kv heads, D] into [B, S, kv heads, D]
        slots.values.transpose(1, 2)[dr, ds] = v[src]
        if base is not None:  # the kept prefix's [1, kv heads, P, D] into every row's first slots
            ks, kr, kd = kept
            slots.keys.transpose(1, 2)[kr, kd] = base.keys[i][0].transpose(0, 1)[ks]
            slots.values.transpose(1, 2)[kr, kd] = base.values[i][0].transpose(0, 1)[ks]
        if cache_only:
            break
        q = _linear(a.q_proj, b.h, b.q, b.w).view(len(x), -1, a.head_dim)
        _head_norm(q, getattr(a, "q_norm", None), b.rot)
        _rope(q, cos, sin, b.rot)
        if lead:  # the prefix's computed tokens attend (to the kept ones and) to themselves once
            _attend(q, b.att, 0, lead, slots, rows[0], starts[0], given, a.scaling, windows[i])
        for r, start, (first, last) in zip(rows, starts, spans):
            _attend(q, b.att, first, last, slots, r, start, shared, a.scaling, windows[i])
        x.add_(_after(_linear(a.o_proj, b.att.view(len(x), -1), b.o, b.w), post[0], b.h))
        _rmsnorm(x, pre or layer.post_attention_layernorm, b.h)
        g, u = _linear(m.gate_proj, b.h, b.g, b.w), _linear(m.up_proj, b.h, b.u, b.w)
        if type(m.act_fn) in _SILU:
            torch.nn.functional.silu(g, inplace=True)
        else:
            g.copy_(m.act_fn(g))
        x.add_(_after(_linear(m.down_proj, g.mul_(u), b.o, b.w), post[1], b.h))
    return inner.norm(x) if hidden else None


_SILU = (ACT2FN["silu"].__class__, torch.nn.SiLU)


class _Buffers:
    """A forward's work buffers for ``T`` tokens: ``h`` normed input ``[T, H]``, ``q``/``k``/``v`` projections,
    ``rot`` rotary scratch, ``att`` attention output ``[T, heads, D]``, ``o`` a linear's output ``[T, H]``, ``g``/``u``
    the MLP's ``[T, I]``, ``w`` a packed weight expanded (the largest's size)."""

    def __init__(self, model, x):
        a, m = model.model.layers[0].self_attn, model.model.layers[0].mlp
        t, new = len(x), (lambda *shape: x.new_empty(shape))
        self.h, self.o = new(t, x.shape[1]), new(t, x.shape[1])
        self.q, self.att = new(t, a.q_proj.out_features), new(t, a.q_proj.out_features // a.head_dim, a.head_dim)
        self.k, self.v = new(t, a.k_proj.out_features), new(t, a.v_proj.out_features)
        self.rot = new(t * a.q_proj.out_features)
        self.g, self.u = new(t, m.gate_proj.out_features), new(t, m.up_proj.out_features)
        sizes = [lin.in_features * lin.out_features for lin in model.model.layers.modules()
                 if isinstance(lin, packed.PackedLinear)]
        self.w = new(max(sizes)) if sizes else None


def least_rows() -> int:
    """The fewest rows a CPU product runs on here (``_product``). torch's (MKL) gives a row the same bits whatever the
    number of rows beside it only from a few rows up (measured: below 12 rows at 2 threads, 28 at 16, it takes other
    paths); so a forward of fewer tokens (a prompt's last few after its cached blocks) runs padded to this many: a
    prompt's values never depend on how much of it was cached, or by whom. oneDNN's products need 2 rows where
    ``_onednn_least`` finds it so."""
    return max(32, 4 * torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _onednn_least(k: int, n: int, threads: int) -> int:
    """The fewest rows oneDNN's fp32 product of width ``k`` into ``n`` runs on at ``threads`` threads: 2 where it
    gives every row of 2 .. ``least_rows()`` rows the bits it gives that row among 64 (checked once per shape here, on
    random values: its kernels for few rows sum in the same order on the CPUs measured), else ``least_rows()``. A
    prompt's last few tokens after its cached blocks then cost their own rows, not 32 (a kept prompt prefilled again
    in 0.72x the time)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g), torch.randn(64, k, generator=g)
    full = _onednn(x, w)
    ok = all(torch.equal(_onednn(x[:m], w), full[:m]) for m in range(2, least_rows() + 1))
    return 2 if ok else least_rows()


def _onednn(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def _onednn_runs(x) -> bool:
    """Whether ``x``'s products run through oneDNN (fp32 on a CPU that has it)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def _product(x, w, out):
    """``x @ w.T``, over at least as many rows as give a row the same bits however few are beside it (``least_rows``)
    on a CPU. In fp32 there through oneDNN (its AVX-512 kernels: 2.3x torch's MKL product on an EPYC, where MKL takes
    its AVX2 path), which makes its own output: that is returned as it is (copying it into ``out`` took 2% of a
    prompt's prefill); elsewhere torch's, into ``out``. Callers take the returned tensor."""
    cpu, onednn = x.device.type == "cpu", _onednn_runs(x)
    if onednn:
        least = _onednn_least(w.shape[1], w.shape[0], torch.get_num_threads())
    else:
        least = least_rows() if cpu else 0
    if len(x) < least:
        padded = x.new_zeros((least, x.shape[1]))
        padded[: len(x)] = x
        return _product(padded, w, padded.new_empty((least, w.shape[0])))[: len(x)]
    if onednn:
        return _onednn(x, w)
    return torch.mm(x, w.t(), out=out)


def _linear(module, x, out, scratch):
    """``module(x)`` (in ``out`` where the product writes there; a packed weight kept expanded (``_expanded``) or
    expanded into ``scratch``): the product as ``nn.Linear`` takes it (``_product``)."""
    p = packed.packed_weight(module)
    w = module.weight if p is None else _expanded(module, p, x)
    w = p.expand(scratch) if w is None else w
    y = _product(x, w, out)
    if getattr(module, "bias", None) is not None:
        y.add_(module.bias)
    return y


# Packed weights expanded once and kept in oneDNN's own layout for the prefill's products, while all kept fit in this
# fraction of the memory available when the first is kept: expanding each weight at every forward (and oneDNN
# reordering it there) is a fixed cost per forward; kept, the default model's prefill ran 1.03-1.56x as fast at 64
# tokens, 1.10-1.31x at 512 (one sitting of four 0.90x), 1.0-1.09x at 2,048, where the products dominate. The
# default model's take 411 MB
KEEP_FRACTION = 0.125
_kept: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> (its packed tensors' versions, weight)
_keeping = {"budget": None, "used": 0}
_keep_lock = threading.Lock()


def _expanded(module, p, x):
    """``module``'s packed weight ``p`` as fp32 in oneDNN's layout, kept from its first product (``KEEP_FRACTION``),
    for ``x``'s product; None where oneDNN does not run it, where it would not give the bits of the weight expanded
    at each call (``_layout_keeps_bits``), or where the budget is spent (then it is expanded at each call)."""
    if not _onednn_runs(x):
        return None
    version = tuple((t.data_ptr(), t._version) for t in p.tensors().values())  # codes, scales, offsets
    held = _kept.get(module)
    if held is not None and held[0] == version:
        return held[1]
    if not _layout_keeps_bits(p.shape[1], p.shape[0], torch.get_num_threads()):
        return None
    if held is None and not _keep(module, 4 * p.shape[0] * p.shape[1]):
        return None
    w = torch.ops.mkldnn._reorder_linear_weight(p.expand())
    _kept[module] = (version, w)
    return w


def _keep(module, size: int) -> bool:
    """Whether ``size`` more bytes of kept weights fit the budget (counted until ``module`` is collected)."""
    keeping = _keeping
    with _keep_lock:
        if keeping["budget"] is None:
            keeping["budget"] = int((available_bytes(torch.device("cpu")) or 0) * KEEP_FRACTION)
        if keeping["used"] + size > keeping["budget"]:
            return False
        keeping["used"] += size
    weakref.finalize(module, _unkeep, keeping, size)
    return True


def _unkeep(keeping: dict, size: int) -> None:
    with _keep_lock:
        keeping["used"] -= size


@functools.lru_cache(maxsize=None)
def _layout_keeps_bits(k: int, n: int, threads: int) -> bool:
    """Whether oneDNN's fp32 product of width ``k`` into ``n`` at ``threads`` threads gives the same bits with the
    weight in its own layout as with the plain weight, at 2 to 64 rows (checked once per shape here, on random
    values: the same kernels run on the CPUs measured, only the reordering is done once)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(n, k, generator=g), torch.randn(64, k, generator=g)
    kept = torch.ops.mkldnn._reorder_linear_weight(w)
    return all(torch.equal(_onednn(x[:m], w), _onednn(x[:m], kept)) for m in (2, 3, 17, 64))


def _rmsnorm(x, norm, out):
    """``norm(x)`` into ``out`` in the module's order of operations (``x * rsqrt(mean(x^2) + eps)``, then the weight,
    or Gemma's ``1 + weight``); the module computes in fp32 whatever the dtype: other dtypes call it."""
    if x.dtype != torch.float32:
        return out.copy_(norm(x))
    variance = torch.pow(x, 2, out=out).mean(-1, keepdim=True)
    torch.mul(x, torch.rsqrt(variance + fused.norm_eps(norm)), out=out)
    return out.mul_(_weight(norm))


def _weight(norm):
    """What an RMS norm multiplies by: its weight, or 1 + its weight (Gemma's, in fp32 as the module adds it)."""
    return 1.0 + norm.weight.float() if isinstance(norm, fused.UNIT_NORMS) else norm.weight


def _after(y, norm, out):
    """``y`` (an attention's or MLP's output), or its ``norm`` into ``out`` where the family has one (Gemma's)."""
    return y if norm is None else _rmsnorm(y, norm, out)


def _head_norm(t, norm, scratch):
    """``norm`` of each head of ``t`` ``[T, heads, D]`` in place (Qwen3's and Gemma's, before the rotary embedding),
    in ``_rmsnorm``'s order of operations; nothing where the family has none."""
    if norm is None:
        return t
    if t.dtype != torch.float32:
        return t.copy_(norm(t))
    variance = torch.pow(t, 2, out=scratch[: t.numel()].view(t.shape)).mean(-1, keepdim=True)
    return t.mul_(torch.rsqrt(variance + fused.norm_eps(norm))).mul_(_weight(norm))


def _rope(t, cos, sin, scratch):
    """``t * cos + rotate_half(t) * sin`` in place for ``t`` ``[T, heads, D]`` (the model's ``apply_rotary_pos_emb``)."""
    half = t.shape[-1] // 2
    rot = scratch[: t.numel()].view(t.shape)
    torch.neg(t[..., half:], out=rot[..., :half])
    rot[..., half:] = t[..., :half]
    return t.mul_(cos).add_(rot.mul_(sin))


def _attend(q, out, first, last, slots, row, start, before, scale, window=0):
    """``out[first:last]`` = causal attention of the queries ``q[first:last]`` (``[T, heads, D]`` buffers), positions
    ``before ..`` of ``row`` (its slots from ``start`` on; ``before``: the shared prefix's, ahead of them) over the
    row's keys up to each (the last ``window`` of them, where one is given). The kernel (``kernels/causal.c``) where
    it applies, else torch's attention in aligned blocks (``_blocks``)."""
    n = before + last - first
    keys, values = slots.keys[row, :, start : start + n], slots.values[row, :, start : start + n]  # [kv heads, n, D]
    if window or not kernels.causal_attention(q[first:last], keys, values, out[first:last], before, scale):
        _blocks(q[first:last], keys, values, out[first:last], before, scale, window)


# torch's CPU attention splits a call's queries into blocks (32 below 192 queries, more above) whose products take
# other paths at other row counts: a query's bits moved with the length of the call, i.e. with where a prefill cut the
# prompt (a start shared by the prompts of a prefill, a kept one). Queries go in blocks of this many positions
# aligned to position 0 (torch's blocks of 32 within), padded to the whole block, each block over the keys from the
# same first one to its end (zeros where the row has none yet, hidden): a query's bits follow its position alone.
# Gemma 3 270M's prefill (heads of 256) against one call a row, 400 / 3,000 tokens: 0.84-1.16x / 1.06-1.32x as fast
ALIGN = 128


def _blocks(q, keys, values, out, before, scale, window=0):
    """``out`` = attention of the queries ``q`` ``[n, heads, D]`` at positions ``before ..`` over ``keys`` /
    ``values`` ``[kv heads, before + n, D]``, the query at position p seeing keys p - window + 1 .. p (all up to p
    without a window): torch's attention over blocks of ``ALIGN`` positions, each over the keys its queries may see
    (a band where there is a window, not the whole square)."""
    n, heads, d = q.shape
    end, kv = before + n, keys.shape[0]
    for s in range(before - before % ALIGN, end, ALIGN):
        e = s + ALIGN
        lo = max(0, s - window + 1) if window else 0
        a, b = max(s, before), min(e, end)  # this block's own queries
        mine = q.new_zeros((1, heads, ALIGN, d))
        mine[0, :, a - s : b - s] = q[a - before : b - before].transpose(0, 1)
        k, v = keys[None, :, lo:e], values[None, :, lo:e]
        if end < e:  # the last block: its keys padded with zeros to its end
            k, v = (t.new_zeros((1, kv, e - lo, d)) for t in (k, v))
            k[0, :, : end - lo], v[0, :, : end - lo] = keys[:, lo:end], values[:, lo:end]
        pos, key = torch.arange(s, e)[:, None], torch.arange(lo, e)[None, :]
        mask = (key <= pos) & (key < end)
        if window:
            mask &= pos - key < window
        got = torch.nn.functional.scaled_dot_product_attention(mine, k, v, attn_mask=mask, scale=scale,
                                                               enable_gqa=heads != kv)
        out[a - before : b - before] = got[0, :, a - s : b - s].transpose(0, 1)
