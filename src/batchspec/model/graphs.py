"""Static-shape steps: decode, verification and draft forwards that CUDA graphs can replay.

On a GPU a small model's step is set by kernel launches and Python, not arithmetic (SmolLM2-135M: ~30 ms a step
through the model's modules, whatever the batch). A CUDA graph replays a whole step's kernels in one launch, but only
over fixed shapes and fixed memory. So a step here is written with static shapes:

- rows: the slot cache's buffers hold a *bucket* of rows (1, 2, 4, ..., 256; ``kv.row_capacity``), of which the
  batch uses the first ``n``; the step runs every row of the buffer, the others as padding (token 0, a mask that
  shows each padding query only its own new slot, so nothing of them reaches a real row, whose mask never shows a
  padding row's slots: rows do not attend across rows at all);
- keys: attention runs over the buffer's first slots up to a multiple of ``SPAN`` past the rectangle's width, with a
  mask (slots beyond the width are hidden); grouped-query heads are folded into the query length, so each key and
  value head is read once (``grouped_attention``);
- the new slots are written with ``index_copy_`` at slot indices held in a device tensor.

Inputs (token ids, positions, mask, slot indices) are copied into static tensors before each replay. One graph is
captured per (rows, capacity, span, new tokens, kept logits) the second time that shape is met over the same
buffers (a shape met once, such as an exspec window's fresh copy, runs eagerly). Graphs are bound to the buffers
they were captured over; a runner keeps those of its last ``BUFFER_SETS`` sets of buffers, and a finished batch
gives its buffers back to ``kv`` for the next batch of the same shape (``SlotCache.release``), which so replays the
same graphs (on a GPU ``kv`` rounds the slot capacity to a power of two, so that batches share shapes). Wider
forwards (more than ``MAX_NEW`` new tokens per row: prefill) run through the model's modules as before.

The step calls the model's own modules (embedding, rotary tables, norms, projections, MLP) and only reads them;
covered: ``LlamaForCausalLM`` with sdpa attention. ``Runner(model, graphs="static")`` runs the same static-shape step
without capturing (any device): that is how the CPU tests check it.
"""

from __future__ import annotations

import warnings
from collections import Counter, OrderedDict

import torch
from transformers.models.llama import modeling_llama as hf

from . import kv

MAX_NEW = 16  # widest block (new tokens per row) a static step takes; wider forwards run eagerly
BUFFER_SETS = 4  # graphs are kept for this many sets of cache buffers (successive batches reuse freed buffers)


def supported(model) -> bool:
    """Whether the static step covers ``model`` (a Llama with sdpa attention and the standard decoder layers)."""
    if type(model) is not hf.LlamaForCausalLM or model.config._attn_implementation != "sdpa":
        return False
    layers = model.model.layers
    return len(layers) > 0 and type(model.lm_head) is torch.nn.Linear and all(
        type(layer) is hf.LlamaDecoderLayer and type(layer.self_attn) is hf.LlamaAttention
        and type(layer.self_attn.q_proj) is torch.nn.Linear for layer in layers)  # packed weights: CPU paths only


SPAN = 256  # attention reads the cache's first slots rounded up to a multiple of this (one graph per span)


def grouped_attention(q, k, v, mask, scale):
    """Attention of ``q`` ``[R, H, n, D]`` over ``k``/``v`` ``[R, Hkv, C, D]`` with ``mask`` ``[R, 1, n, C]``, each
    key/value head read once: the query heads sharing it are folded into the query length (``[R, Hkv, G*n, D]``)
    rather than the keys expanded to every query head (what ``enable_gqa`` does outside flash attention, which
    copies the whole cache ``G`` times per layer)."""
    r, h, n, d = q.shape
    g = h // k.shape[1]
    if g > 1:
        q = q.reshape(r, k.shape[1], g * n, d)
        mask = mask.expand(r, 1, n, mask.shape[-1]).repeat(1, 1, g, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return o.reshape(r, h, n, d)


def static_step(model, keys, values, ids, pos, mask, slots, keep: int):
    """One forward of ``ids`` ``[R, q]`` over cache buffers ``keys``/``values`` (per layer ``[R, H, C, D]``): writes
    the new keys and values at ``slots`` ``[q]``, attends over the first ``S`` slots with ``mask`` ``[R, 1, q, S]``;
    returns the logits and the final (normed) hidden states of the last ``keep`` positions (all when 0). Launches
    kernels only: no host read, so it can be captured."""
    inner = model.model
    span = mask.shape[-1]
    x = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(x, pos)
    for layer, k_buf, v_buf in zip(inner.layers, keys, values):
        a = layer.self_attn
        h = layer.input_layernorm(x)
        shape = (*ids.shape, -1, a.head_dim)
        q = a.q_proj(h).view(shape).transpose(1, 2)
        k = a.k_proj(h).view(shape).transpose(1, 2)
        v = a.v_proj(h).view(shape).transpose(1, 2)
        q, k = hf.apply_rotary_pos_emb(q, k, cos, sin)
        k_buf.index_copy_(2, slots, k)
        v_buf.index_copy_(2, slots, v)
        o = grouped_attention(q, k_buf[:, :, :span], v_buf[:, :, :span], mask, a.scaling)
        x = x + a.o_proj(o.transpose(1, 2).reshape(*ids.shape, -1).contiguous())
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = inner.norm(x)
    if keep:
        x = x[:, -keep:]
    return model.lm_head(x), x


class _Shape:
    """Static inputs of one shape, and its graph and outputs once captured."""

    def __init__(self, rows, span, q, device):
        self.ids = torch.zeros((rows, q), dtype=torch.long, device=device)
        self.pos = torch.zeros((rows, q), dtype=torch.long, device=device)
        self.mask = torch.zeros((rows, 1, q, span), dtype=torch.bool, device=device)
        self.slots = torch.zeros(q, dtype=torch.long, device=device)
        self.cols = torch.arange(span, device=device)
        self.graph = self.out = None


class StaticRunner:
    """Static-shape steps of one model over its slot caches; ``capture`` replays them as CUDA graphs."""

    def __init__(self, model, capture: bool):
        self.model, self.capture = model, capture
        self._sets: OrderedDict[tuple, tuple[dict, Counter]] = OrderedDict()  # buffers -> (shapes, times seen)
        self._pool = None
        self.steps = self.captured = 0  # static steps run, graphs captured (for tests and benchmarks)
        self.failed = False

    def forward(self, cache: kv.SlotCache, input_ids, position_ids, visible, keep: int, hidden: bool):
        """``(logits, hidden or None)`` for ``Runner.forward``'s arguments, or None where this path does not apply
        (a fresh cache without mask, too many new tokens, more rows than the largest bucket, a shape met once)."""
        n, q = input_ids.shape
        if self.failed or visible is None or q > MAX_NEW or n > kv.ROW_BUCKETS[-1]:
            return None
        cfg, layers = self.model.config, cache.layers
        start = layers[0].length
        a = self.model.model.layers[0].self_attn
        like = torch.empty((n, cfg.num_key_value_heads, q, a.head_dim), dtype=self.model.dtype, device=input_ids.device)
        for layer in layers:
            layer.reserve(like, like, start + q)
        keys = [kv.whole_buffer(layer._k) for layer in layers]
        values = [kv.whole_buffer(layer._v) for layer in layers]
        rows, capacity = keys[0].shape[0], keys[0].shape[2]
        span = min(capacity, -(-(start + q) // SPAN) * SPAN)
        weights = (self.model.lm_head.weight, self.model.model.layers[0].self_attn.q_proj.weight)
        buffers = tuple(t.data_ptr() for t in (*keys, *values, *weights))
        if buffers not in self._sets:  # graphs are bound to the buffers (and weights) they were captured over
            self._sets[buffers] = ({}, Counter())
            if len(self._sets) > BUFFER_SETS:
                self._sets.popitem(last=False)
        self._sets.move_to_end(buffers)
        shapes, seen = self._sets[buffers]
        key = (rows, capacity, span, q, keep)
        seen[key] += 1
        if self.capture and key not in shapes and seen[key] < 2:
            return None
        s = shapes.get(key)
        if s is None:
            s = shapes[key] = _Shape(rows, span, q, input_ids.device)
        self._fill(s, input_ids, position_ids, visible, start)

        def step():
            return static_step(self.model, keys, values, s.ids, s.pos, s.mask, s.slots, keep)

        if not self.capture:
            logits, states = step()
            self.steps += 1
        else:
            if s.graph is None:
                try:
                    s.graph, s.out = self._capture(step)
                except RuntimeError as e:  # a capture this torch build cannot take: run the model's modules instead
                    warnings.warn(f"CUDA graph capture failed ({e}); running steps without graphs", stacklevel=2)
                    self.failed = True
                    shapes.pop(key)
                    return None
                self.captured += 1
            s.graph.replay()
            logits, states = s.out
            self.steps += 1
        for layer in layers:
            layer.advance(start + q)
        return logits[:n].clone(), (states[:n].clone() if hidden else None)

    @staticmethod
    def _fill(s: _Shape, input_ids, position_ids, visible, start: int) -> None:
        n, q = input_ids.shape
        s.ids[:n] = input_ids
        s.pos[:n] = position_ids
        s.slots.copy_(s.cols[start : start + q])
        seen = torch.zeros_like(s.mask[:, 0, 0])  # [rows, span]: padding rows see nothing but themselves
        seen[:n, : start + q] = visible
        new = s.slots[:, None]
        s.mask[:, 0] = (seen[:, None, :] & (s.cols[None, :] <= new)) | (s.cols[None, :] == new)

    def _capture(self, step):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up (library handles, kernel choice); writes the same slots the replays write
        torch.cuda.current_stream().wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        return graph, out
