"""A whole Llama forward for few new tokens per row, its decoder layers in one C call (``layer.c``).

Hugging Face's Llama runs a decode step as ~40 small torch operations per layer plus attention over a masked
rectangle; on a 2-core CPU that overhead and the padded attention cost as much as the weight reads themselves. Here
a layer is one pass in C: norms, the projections (``skinny.c``), rotary embedding, the cache write, attention over
the visible slots only (each key/value head read once for its query heads) and the MLP; all layers of a forward are
one call, over the cache buffers' pointers kept from one forward to the next. The embedding, the rotary tables, the
final norm and the output head stay the model's own modules.

Used for ``LlamaForCausalLM`` models in fp32 on CPU (SiLU MLP without biases, attention without biases, one
projection per weight) when the kernels are built, and for the families whose layer is Llama's up to ``layer.c``'s
hooks (``FAMILIES``): Qwen2 (q/k/v biases), Qwen3 (RMS norms of each query and key head), Gemma 3 (head norms,
norms of the attention's and the MLP's outputs, norm weights as offsets from 1, a GELU MLP, a rotary table and a
window per layer type: a local layer's queries see the row's last ``window`` visible tokens, as ``kv.attention_mask``
counts them) and Mistral (Llama's layer with one window on every layer); anything else returns None and the caller
runs the model.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3 import modeling_gemma3 as gemma3
from transformers.models.llama import modeling_llama as hf
from transformers.models.mistral import modeling_mistral as mistral
from transformers.models.qwen2 import modeling_qwen2 as qwen2
from transformers.models.qwen3 import modeling_qwen3 as qwen3

from .. import kv
from .. import weights as packed
from . import MAX_ROWS, Packed, _load, skinny_linear


# The families the C layer and the whole prefill (``model/prefill.py``) cover: model class -> its (decoder layer,
# attention, MLP, RMS norm) classes. Each is Llama's layer up to the steps ``layer.c``'s hooks add.
FAMILIES = {
    hf.LlamaForCausalLM: (hf.LlamaDecoderLayer, hf.LlamaAttention, hf.LlamaMLP, hf.LlamaRMSNorm),
    qwen2.Qwen2ForCausalLM: (qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention, qwen2.Qwen2MLP, qwen2.Qwen2RMSNorm),
    qwen3.Qwen3ForCausalLM: (qwen3.Qwen3DecoderLayer, qwen3.Qwen3Attention, qwen3.Qwen3MLP, qwen3.Qwen3RMSNorm),
    gemma3.Gemma3ForCausalLM: (gemma3.Gemma3DecoderLayer, gemma3.Gemma3Attention, gemma3.Gemma3MLP,
                               gemma3.Gemma3RMSNorm),
    mistral.MistralForCausalLM: (mistral.MistralDecoderLayer, mistral.MistralAttention, mistral.MistralMLP,
                                 mistral.MistralRMSNorm),
}
# the families whose windows (``kv.windows``) the kernels apply: Gemma 3's per layer type, Mistral's on every layer
WINDOWED = (gemma3.Gemma3ForCausalLM, mistral.MistralForCausalLM)
UNIT_NORMS = (gemma3.Gemma3RMSNorm,)  # RMS norms whose weights are offsets from 1: x / rms(x) * (1 + w), in fp32
ACTIVATIONS = {type(ACT2FN["silu"]): 0, torch.nn.SiLU: 0, type(ACT2FN["gelu_pytorch_tanh"]): 1}  # ``layer.c``'s codes
WEIGHTS = 16  # a layer's weights as ``llama_layer`` takes them: the 9 of a Llama layer, the 5 of the hooks, the 2
# norms of the attention's and the MLP's outputs


def covered(model) -> bool:
    """Whether ``model`` is of one of ``FAMILIES`` with its own classes in every layer, causal attention without
    capped logits, and windows only where the family's are applied (a query: module types and config only)."""
    classes = FAMILIES.get(type(model))
    cfg = model.config
    if classes is None or not len(model.model.layers) or getattr(cfg, "use_bidirectional_attention", False):
        return False
    if getattr(cfg, "attn_logit_softcapping", None) or getattr(cfg, "final_logit_softcapping", None):
        return False
    if kv.windows(model) and not isinstance(model, WINDOWED):
        return False
    layer, attention, mlp, _ = classes
    windowed = isinstance(model, WINDOWED)
    return all(type(x) is layer and type(x.self_attn) is attention and type(x.mlp) is mlp
               and (windowed or getattr(x.self_attn, "sliding_window", None) is None) for x in model.model.layers)


def layer_types(model) -> list:
    """Each layer's type (its rotary table and window), None for every layer where the model has one kind."""
    types = getattr(model.model.rotary_emb, "layer_types", None) and model.config.layer_types
    return list(types) if types else [None] * len(model.model.layers)


def rotary(model, x, positions, kinds=None) -> dict:
    """``{layer type: (cos, sin)}`` for ``layer_types`` (or its distinct ``kinds``, where known): Gemma 3's rotary
    embedding has a base per layer type."""
    emb = model.model.rotary_emb
    kinds = dict.fromkeys(layer_types(model)) if kinds is None else kinds
    return {t: emb(x, positions) if t is None else emb(x, positions, t) for t in kinds}


def layer_windows(model) -> list[int]:
    """Each layer's window of visible tokens (``kv.windows``), 0 where it attends to its whole history; a model with
    one kind of layer and a window (Mistral's) has it on every layer."""
    windows, types = kv.windows(model), getattr(model.config.get_text_config(), "layer_types", None)
    if not types:
        return [windows.get("sliding_attention") or 0] * len(model.model.layers)
    return [windows.get(t) or 0 for t in types]


def norm_eps(norm) -> float:
    """An RMS norm's epsilon (Gemma's norms call it ``eps``)."""
    return norm.eps if isinstance(norm, UNIT_NORMS) else norm.variance_epsilon


class _Plan:
    """Per model: the weights of each layer as a C array of pointers, and the shapes and constants."""

    def __init__(self, model, layers):
        self.tensors = layers  # keeps the pointed-to memory alive
        self.pointers = [(Packed * WEIGHTS)(*(_descriptor(w) for w in ws)) for ws in layers]
        self.table = (ctypes.c_void_p * len(layers))(*map(ctypes.addressof, self.pointers))  # all layers' arrays
        self.key = _fingerprint(model)
        a = model.model.layers[0].self_attn
        self.heads, self.kv_heads = a.q_proj.out_features // a.head_dim, a.k_proj.out_features // a.head_dim
        self.head_dim, self.hidden = a.head_dim, model.config.hidden_size
        self.inter = model.model.layers[0].mlp.gate_proj.out_features
        self.eps, self.scale = norm_eps(model.model.layers[0].input_layernorm), a.scaling
        self.act = ACTIVATIONS[type(model.model.layers[0].mlp.act_fn)]
        self.unit = int(isinstance(model.model.layers[0].input_layernorm, UNIT_NORMS))
        types = layer_types(model)
        self.kinds = list(dict.fromkeys(types))  # the rotary tables, in ``rotary``'s order
        self.rope = (ctypes.c_long * len(layers))(*(self.kinds.index(t) for t in types))  # each layer's table
        self.tables = ctypes.c_void_p * len(self.kinds)
        self.windows = (ctypes.c_long * len(layers))(*layer_windows(model))


def _descriptor(w) -> Packed:
    """``packed_t`` of an fp32 tensor or a ``PackedWeight``; of None, an absent one (a NULL ``q``)."""
    if w is None:
        return Packed(0, None, None, None)
    return w.c_struct() if isinstance(w, packed.PackedWeight) else Packed(0, w.data_ptr(), None, None)


def _storage(module) -> torch.Tensor:
    """The tensor holding a linear's weight: its fp32 parameter, or a packed module's codes."""
    return module.weight if isinstance(module, torch.nn.Linear) else module.q


def _fingerprint(model):
    """Changes when the model's parameters are replaced (``model.to(...)``, reloading): the plan is then rebuilt."""
    w = _storage(model.model.layers[0].self_attn.q_proj if len(model.model.layers) else model.lm_head)
    return w.data_ptr(), w.dtype, w.device, _storage(model.lm_head).data_ptr()


def _fp32(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` detached where the kernel reads it as it is (fp32, CPU, contiguous), else None."""
    ok = t is not None and t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
    return t.detach() if ok else None


def _linear_weight(lin, biased: bool = False):
    """A linear's weight as the layer kernel takes it (fp32 tensor or ``PackedWeight``), or None; a linear with a
    bias only where ``biased`` (the hooks add it after the product)."""
    if getattr(lin, "bias", None) is not None and not biased:
        return None
    if type(lin) is torch.nn.Linear:
        return _fp32(lin.weight)
    return packed.packed_weight(lin) if isinstance(lin, packed.PackedLinear) else None


def _layer_weights(layer, norm) -> list | None:
    """A layer's ``WEIGHTS`` (absent hooks None), or None where the kernel does not compute it as the model does
    (``norm``: the family's RMS norm class)."""
    a, m = layer.self_attn, layer.mlp
    pre = getattr(layer, "pre_feedforward_layernorm", None)  # Gemma's: then the post-attention norm is of the output
    norms = [layer.input_layernorm, layer.post_attention_layernorm if pre is None else pre]
    after = [] if pre is None else [layer.post_attention_layernorm, layer.post_feedforward_layernorm]
    heads = [n for n in (getattr(a, "q_norm", None), getattr(a, "k_norm", None)) if n is not None]  # Qwen3's
    if len(heads) == 1 or any(type(n) is not norm for n in norms + heads + after):
        return None
    if len({norm_eps(n) for n in norms + heads + after}) != 1:  # the kernel takes one epsilon
        return None
    if type(m.act_fn) not in ACTIVATIONS:
        return None
    q, k, v = (_linear_weight(lin, biased=True) for lin in (a.q_proj, a.k_proj, a.v_proj))
    o, gate, up, down = (_linear_weight(lin) for lin in (a.o_proj, m.gate_proj, m.up_proj, m.down_proj))
    hooks = [lin.bias for lin in (a.q_proj, a.k_proj, a.v_proj)] + ([n.weight for n in heads] or [None, None])
    hooks += [n.weight for n in after] or [None, None]
    ws = [norms[0].weight, q, k, v, o, norms[1].weight, gate, up, down]
    if any(w is None for w in ws) or any(_fp32(t) is None for t in [ws[0], ws[5]] + hooks if t is not None):
        return None
    if a.head_dim % 8:  # attention works on 8 dimensions at a time
        return None
    return [_fp32(w) if isinstance(w, torch.Tensor) else w for w in ws + hooks]


def _make_plan(model) -> _Plan | None:
    cfg = model.config
    if not covered(model) or getattr(cfg, "pretraining_tp", 1) != 1 or _linear_weight(model.lm_head) is None:
        return None
    layers = [_layer_weights(layer, FAMILIES[type(model)][3]) for layer in model.model.layers]
    if any(ws is None for ws in layers):
        return None
    scales = {layer.self_attn.scaling for layer in model.model.layers}
    acts = {type(layer.mlp.act_fn) for layer in model.model.layers}
    return _Plan(model, layers) if len(scales) == len(acts) == 1 else None


_PLANS: "weakref.WeakKeyDictionary[torch.nn.Module, _Plan | None]" = weakref.WeakKeyDictionary()


def plan(model) -> _Plan | None:
    """The model's plan, or None when the fused path does not cover it (checked once per set of parameters)."""
    if _load() is None:
        return None
    p = _PLANS.get(model, False)
    if p is False or (p is not None and p.key != _fingerprint(model)):
        p = _PLANS[model] = _make_plan(model)
    return p


def forward(model, cache, input_ids, position_ids, visible, logits_to_keep=0, hidden=False, embeds=None, counts=None):
    """``(logits, hidden states or None, packing or None, fast tokens or None)`` of one forward over a slot cache
    (``TargetOutput``'s arguments; the logits a function computing them when read), or None where this path does not
    apply. Reads the model's modules and weights; writes only the cache. ``counts`` ``[B]``: only the first
    ``counts[b]`` new tokens of row b are computed (packed: the others are padding, their cache slots are not
    written, their hidden states are 0; the logits come back as the real rows alone, with ``packing`` ``(real, b,
    q)`` to lay them out); only for all-position logits of token ids."""
    b, q = input_ids.shape
    packed = counts is not None and logits_to_keep in (0, q) and embeds is None
    rows = int(counts.sum()) if packed else b * q
    if packed and rows == b * q:
        packed = False
    if rows > MAX_ROWS or input_ids.device.type != "cpu":
        return None
    p = plan(model)
    if p is None:
        return None
    lib, inner = _load(), model.model
    x = inner.embed_tokens(input_ids) if embeds is None else embeds
    tables = [t.reshape(b * q, -1).contiguous() for pair in rotary(model, x, position_ids, p.kinds).values()
              for t in pair]
    x = x.reshape(b * q, p.hidden).contiguous() if embeds is None else embeds.reshape(b * q, p.hidden).clone()
    first = ptr = None
    if packed:  # the real tokens, in row order: one gather
        mine = (torch.arange(q)[None, :] < counts[:, None]).flatten()
        real = mine.nonzero().squeeze(1)
        x, tables = x[real], [t[real] for t in tables]
        first = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).long().contiguous()
        ptr = first.data_ptr()
    cos = p.tables(*(t.data_ptr() for t in tables[0::2]))  # one a layer type
    sin = p.tables(*(t.data_ptr() for t in tables[1::2]))
    vis = visible.to(torch.uint8).contiguous()
    start = cache.layers[0].length
    like = x.new_empty((b, p.kv_heads, q, p.head_dim))
    dims = (ctypes.c_long * 12)(b, q, start, 0, p.hidden, p.heads, p.kv_heads, p.head_dim, p.inter, rows, p.act,
                                p.unit)
    slots = _slots(cache, like, start + q)
    if lib.llama_layers(x.data_ptr(), p.table, cos, sin, slots.keys, slots.values, vis.data_ptr(), dims, p.eps,
                        p.scale, ptr, slots.caps, len(p.pointers), p.rope, p.windows):
        raise MemoryError("batchspec's layer kernel could not allocate its scratch memory")
    for layer in cache.layers:
        layer.advance(start + q)
    if packed:  # every position's states are the normed ones here (what ``hidden="all"`` asks for)
        states = inner.norm(x)
        # the logits stay packed (the runner lays them out when read): the greedy tokens need only the real rows
        logits, tokens = _head(model, states, (len(real),))
        return logits, (unpack(states, real, b, q) if hidden else None), (real, b, q), tokens
    normed = inner.norm(x.view(b, q, p.hidden)) if hidden == "all" else None  # every position's states
    states = x.view(b, q, p.hidden) if normed is None else normed
    if logits_to_keep:
        states = states[:, -logits_to_keep:]
    if normed is None:
        states = inner.norm(states)
    n = states.shape[1]
    logits, tokens = _head(model, states.reshape(b * n, p.hidden), (b, n))
    if normed is not None:
        states = normed
    return logits, (states if hidden else None), None, tokens


class _Slots:
    """A cache's key and value buffers as the C layer takes them: ``keys`` / ``values`` arrays of pointers, one a
    layer, ``caps`` their capacities (slots), ``room`` the least of them; ``buffers`` the tensors pointed to."""

    def __init__(self, buffers: list):
        n = len(buffers)
        self.buffers = buffers
        self.keys = (ctypes.c_void_p * n)(*(k.data_ptr() for k, _ in buffers))
        self.values = (ctypes.c_void_p * n)(*(v.data_ptr() for _, v in buffers))
        self.caps = (ctypes.c_long * n)(*(k.shape[-2] for k, _ in buffers))
        self.room = min(self.caps)

    def current(self, layers, needed: int) -> bool:
        """Whether ``layers`` still hold these very buffers, with room for ``needed`` slots."""
        return self.room >= needed and all(layer._k is k and layer._v is v
                                           for layer, (k, v) in zip(layers, self.buffers))


_SLOTS: "weakref.WeakKeyDictionary[object, _Slots]" = weakref.WeakKeyDictionary()


def _slots(cache, like, needed: int) -> _Slots:
    """Every layer's contiguous key and value buffers with room for ``needed`` slots, as pointers; kept per cache
    while its layers hold the same buffers, so that a decode step reserves nothing (reserving, and a call a layer,
    cost ~8 us a layer at batch 1)."""
    memo = _SLOTS.get(cache)
    if memo is None or not memo.current(cache.layers, needed):
        memo = _SLOTS[cache] = _Slots([layer.reserve(like, like, needed) for layer in cache.layers])
    return memo


def unpack(flat: torch.Tensor, real: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """``[b, n, ...]`` from the packed rows ``flat`` (at flat positions ``real`` of ``[b, n]``), padding 0."""
    return flat.new_zeros((b * n, *flat.shape[1:])).index_copy_(0, real, flat).view(b, n, *flat.shape[1:])


def _head(model, flat, shape):
    """The output head over ``flat`` ``[rows, H]`` as ``(logits, tokens)``, two functions: the logits ``[*shape, V]``
    computed when called, and their greedy tokens ``[*shape]`` without them where the head can (a q8_0 head:
    ``PackedLinear.greedy``; else None), so that a round that reads only tokens skips the vocabulary's logits."""
    head = model.lm_head
    if isinstance(head, packed.PackedLinear):
        def fast():
            best = head.greedy(flat)
            return None if best is None else best.view(shape)

        return (lambda: head(flat).view(*shape, -1)), fast

    def logits():
        y = skinny_linear(flat, head.weight)
        return (head(flat) if y is None else y).view(*shape, -1)

    return logits, None
