"""A Llama prefill of many prompts with their tokens end to end: no padding, one forward, causal attention per row.

The grouped prefill (``engine/batch.py``) runs one left-padded forward per group of similar lengths: it computes the
padding's tokens, expands every packed weight once per forward, and, when the prompts share a prefix (a chat
template's), attends over a masked rectangle (twice the work of causal attention). Here every token is computed
once: the rows' tokens (and the shared prefix, once) are laid end to end as one sequence of ``T`` tokens, so each
linear layer is one product over ``[T, H]``; attention runs per row, causally, over the row's own slots (prefix
first); keys and values go straight to the row's right-aligned slots of the final cache.

The arithmetic of each step is the model's own modules' (norms, projections, MLP, rotary tables) and torch's
``scaled_dot_product_attention``, as in the model's forward; the products see more rows at once, so their sums may
run in another order, like any change of batch size.

Used for ``LlamaForCausalLM`` models with sdpa attention on CPU (the per-row attention calls cost launches a GPU
would not want); anything else returns None and the caller runs the grouped prefill.
"""

from __future__ import annotations

import torch
from transformers.models.llama import modeling_llama as hf

from . import kv

MAX_TOKENS = 1 << 14  # tokens per forward at most (bounds the activations: ~24 KB a token for a 576-wide model);
# rows longer than that run alone. At 16k tokens a forward's fixed costs (expanding packed weights) are < 1%


def supported(model) -> bool:
    """Whether this path covers ``model`` (a query: module types, device and attention implementation)."""
    if type(model) is not hf.LlamaForCausalLM or model.device.type != "cpu":
        return False
    if model.config._attn_implementation != "sdpa" or not len(model.model.layers):
        return False
    return all(type(layer) is hf.LlamaDecoderLayer and type(layer.self_attn) is hf.LlamaAttention
               and type(layer.mlp) is hf.LlamaMLP for layer in model.model.layers)


def prefill(model, prompts: list[list[int]], shared: int, width: int, hidden: bool):
    """Cache ``prompts`` (token ids, each at least ``shared`` long; ``shared`` leading tokens common to all, computed
    once) right-aligned in ``width`` slots of a new ``SlotCache`` of ``len(prompts)`` rows (padding zeros). Returns
    ``(cache, states)``: ``states`` ``[B, width, H]`` the final (normed) hidden states laid out like the slots (zeros
    on padding) when ``hidden``, else None. None where ``supported`` says no."""
    if not supported(model):
        return None
    cache = kv.new_cache(model)
    states = None
    rows = [r for r, p in enumerate(prompts) if len(p)]
    for chunk in _chunks([len(prompts[r]) - shared for r in rows], shared):
        chunk = [rows[i] for i in chunk]
        h = _forward(model, cache, [prompts[r] for r in chunk], chunk, shared, width, len(prompts), hidden)
        if hidden:
            if states is None:
                states = h.new_zeros((len(prompts), width, h.shape[-1]))
            src, dr, ds = _where(chunk, [len(prompts[r]) for r in chunk], shared, width)
            states[dr, ds] = h[src]
    return cache, states


def _chunks(own: list[int], shared: int) -> list[list[int]]:
    """Consecutive runs of rows whose tokens (the shared prefix once, then each row's own) fit ``MAX_TOKENS``."""
    out, total = [], 0
    for i, n in enumerate(own):
        if not out or total + n > MAX_TOKENS:
            out.append([])
            total = shared
        out[-1].append(i)
        total += n
    return out


def _where(rows: list[int], lengths: list[int], shared: int, width: int):
    """``(tokens, dest_rows, dest_slots)``, ``[N]`` each: the forward's token ``tokens[i]`` (the prefix, then the
    rows' own tokens in order) goes to slot ``dest_slots[i]`` of row ``dest_rows[i]``; the prefix to every row."""
    src, dr, ds, at = [], [], [], shared
    for r, n in zip(rows, lengths):
        own = n - shared
        src += list(range(shared)) + list(range(at, at + own))
        dr += [r] * n
        ds += list(range(width - n, width))
        at += own
    return torch.tensor(src), torch.tensor(dr), torch.tensor(ds)


def _forward(model, cache, prompts, rows, shared, width, batch, hidden):
    """One forward over ``prompts`` (the prefix once, then each row's own tokens) writing rows ``rows`` of the
    ``batch``-row cache; returns the normed hidden states ``[T, H]`` when ``hidden``."""
    inner = model.model
    lengths = [len(p) for p in prompts]
    ids = torch.tensor(prompts[0][:shared] + [t for p in prompts for t in p[shared:]])
    positions = torch.cat([torch.arange(shared)] + [torch.arange(shared, n) for n in lengths])[None, :]
    x = inner.embed_tokens(ids[None, :])  # [1, T, H]
    cos, sin = inner.rotary_emb(x, positions)
    # [first, last) of each row's own tokens in the sequence, after the prefix
    ends = torch.tensor(lengths).sub(shared).cumsum(0).add(shared).tolist()
    spans = list(zip([shared] + ends[:-1], ends))
    src, dr, ds = _where(rows, lengths, shared, width)
    for layer, slots in zip(inner.layers, cache.layers):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (1, x.shape[1], -1, a.head_dim)
        q = a.q_proj(h).view(shape).transpose(1, 2)  # [1, heads, T, D]
        k = a.k_proj(h).view(shape).transpose(1, 2)  # [1, kv heads, T, D]
        v = a.v_proj(h).view(shape).transpose(1, 2)
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        if not slots.length:
            slots.lazy_initialization(k, v)
            slots.fresh(k, v, batch, width)
        slots.keys.transpose(1, 2)[dr, ds] = k[0].transpose(0, 1)[src]  # [N, kv heads, D] into [B, S, kv heads, D]
        slots.values.transpose(1, 2)[dr, ds] = v[0].transpose(0, 1)[src]
        out = torch.empty_like(q)
        starts = [width - n for n in lengths]  # each row's first slot
        if shared:  # the prefix attends to itself once
            out[:, :, :shared] = _attend(q[:, :, :shared], slots, rows[0], starts[0], a.scaling)
        for r, start, (first, last) in zip(rows, starts, spans):
            # the row's queries after the prefix's (their outputs dropped): square and causal, so each query sees
            # the prefix and its row's tokens up to itself
            mine = q[:, :, first:last] if not shared else torch.cat([q[:, :, :shared], q[:, :, first:last]], 2)
            out[:, :, first:last] = _attend(mine, slots, r, start, a.scaling)[:, :, shared:]
        x = x + a.o_proj(out.transpose(1, 2).reshape(1, x.shape[1], -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return inner.norm(x)[0] if hidden else None


def _attend(queries, slots, row, start, scale):
    """Causal attention of ``queries`` ``[1, heads, n, D]`` over the n slots of ``row`` from ``start`` on."""
    n = queries.shape[2]
    keys, values = slots.keys[row : row + 1, :, start : start + n], slots.values[row : row + 1, :, start : start + n]
    return torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                                            enable_gqa=queries.shape[1] != keys.shape[1])
