"""The model runner: owns every forward batchspec runs, and changes nothing anyone else can see.

A ``Runner`` wraps one model. Its forwards go, in order of preference, through
- the C layer (``kernels/llama.py``): fp32 Llama, Qwen2, Qwen3 and Gemma 3 models on CPU, at most
  ``kernels.MAX_ROWS`` rows (batch x new tokens): one call per decoder layer, between the model's own embedding,
  rotary tables, final norm and head (Gemma 3's windows applied inside it);
- the runner's *private copy* of the model's module tree, which shares every parameter and buffer with the user's
  model (no memory cost) but has its own config and its own modules. Only that copy is changed: its linear layers
  run few rows as ``W @ x^T`` (or the skinny kernel), and its attention is ``slot_sdpa`` (grouped-query attention
  without copying key/value heads, and rows of very different lengths attended over their own slots only).

The user's model object, its config, its classes and the process environment are never written, so HF ``generate``
(or another engine) may use the same model from another thread at the same time. The copy is rebuilt when the
model's parameters are replaced (``model.to(...)``); in-place edits of the weights are shared and seen at once.

A forward returns ``TargetOutput(logits, hidden)``; ``hidden`` (the final hidden states the head reads) only when
asked for, so plain decoding pays nothing for it.
"""

from __future__ import annotations

import copy
import threading
from itertools import chain

import torch
from transformers.modeling_utils import AttentionInterface

from ..sampling import greedy
from . import graphs, kernels, kv
from . import prefill as whole_prefill
from .kernels import linear as fp32_linear
from .kernels import llama as fused_llama
from .prefixes import PrefixCache, budget_bytes, default_mib
SLOT_SDPA = "batchspec_slot_sdpa"
# a prompt of at most this many cached tokens is prefilled by the C layer's few-row forwards, a longer one whole: alone,
# the whole prefill measured slower only below ~32 tokens on an EPYC (its weights then expanded at each forward: ~55
# ms for SmolLM2-135M at 2 threads); on a Xeon, its weights kept, 1.3-1.6x slower at 32 tokens, 1.1-1.3x at 48
FEW_TOKENS = 32


class TargetOutput:
    """A forward's result: ``logits`` ``[B, n, V]`` and, when asked for, ``hidden`` ``[B, n, H]``; ``tokens()`` the
    greedy token of each position ``[B, n]``.

    ``logits`` may come as a function that computes them: then they are computed when first read, and ``tokens()``
    asks ``fast_tokens()`` first (the same tokens without every logit, or None: ``PackedLinear.greedy``), so a greedy
    round that reads only tokens never computes the vocabulary's logits.

    A packed forward (``counts``) computed only its real positions: ``packing`` ``(real, b, n)`` says where its
    logits' rows go (``real``: their flat positions in ``[b, n]``). The ``[B, n, V]`` logits (padding 0) are laid
    out only when read; ``tokens()`` takes the argmax of the real rows alone (padding's token 0)."""

    def __init__(self, logits, hidden: torch.Tensor | None = None, packing: tuple | None = None, fast_tokens=None):
        self._logits, self.hidden, self._packing, self._tokens = logits, hidden, packing, None
        self._fast = fast_tokens

    def _computed(self) -> torch.Tensor:
        if callable(self._logits):
            self._logits = self._logits()
        return self._logits

    @property
    def logits(self) -> torch.Tensor:
        self._computed()
        if self._packing is not None:
            self._logits, self._packing = fused_llama.unpack(self._logits, *self._packing), None
        return self._logits

    def tokens(self) -> torch.Tensor:
        if self._tokens is None:
            best = self._fast() if callable(self._logits) and self._fast is not None else None
            if best is None:
                best = greedy(self._computed())
            self._tokens = best if self._packing is None else fused_llama.unpack(best, *self._packing)
        return self._tokens


class FewRowLinear(torch.nn.Linear):
    """``nn.Linear`` as the runner computes it (``kernels.linear``: the skinny kernel, ``W @ x^T`` for few rows,
    torch's product for many). The products are the same; only their summation order may differ, like any change of
    batch size."""

    @classmethod
    def sharing(cls, linear: torch.nn.Linear) -> "FewRowLinear":
        """A module of this class over the same parameters as ``linear`` (which is left as it is)."""
        new = cls.__new__(cls)
        new.__dict__.update(linear.__dict__)
        new._parameters = dict(linear._parameters)
        return new

    def forward(self, x):
        rows = x.numel() // x.shape[-1]
        if rows > kernels.FEW_ROWS:
            return super().forward(x)
        y = fp32_linear(x.reshape(rows, x.shape[-1]), self.weight)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], y.shape[-1])


def row_segments(visible: torch.Tensor, q: int) -> list[tuple[int, int, int]] | None:
    """Split a ragged rectangle's rows into two runs ``(row_from, row_to, first_slot)`` so that each run's attention
    skips the slots left of its rows' first visible one; ``None`` when that saves less than a quarter of the work.

    Rows of very different lengths share one rectangle (the short ones left-padded), so attention over the whole
    width spends most of a short row's time on padding. One host read of the first visible slot per row; only used
    on CPU, where reading it costs nothing. The ``q`` new slots are always kept (each query sees itself)."""
    b, width = visible.shape
    if b < 2 or visible.device.type != "cpu":
        return None
    first = visible.to(torch.uint8).argmax(1).clamp(max=width - q)
    head = first.cummin(0).values  # the earliest first slot of rows [0, i]
    tail = first.flip(0).cummin(0).values.flip(0)  # ... of rows [i, b)
    split = torch.arange(1, b)
    cost = split * (width - head[:-1]) + (b - split) * (width - tail[1:])
    i = int(cost.argmin())  # the first cheapest split
    c, h, t, earliest = torch.stack([cost[i], head[i], tail[i + 1], head[-1]]).tolist()
    if c > 0.75 * b * (width - earliest):
        return None
    return [(0, i + 1, h), (i + 1, b, t)]


def slot_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, segments=None, starts=None,
              **kwargs):
    """Scaled dot-product attention for the runner's private model copy (HF's attention-function signature).

    Key/value heads are shared by their query heads without being copied (torch's ``enable_gqa``); with
    ``segments`` (see ``row_segments``) each run of rows attends over its own slots only. Without a mask (a fresh,
    unpadded prefill) attention is causal. ``starts`` (a fresh, left-padded prefill): each row attends causally over
    its own tokens, from its first one on, as it would alone (the masked rectangle would compute every padded query
    against every key, twice the work of causal attention); the padding's outputs are 0."""

    def attend(q, k, v, mask):
        causal = mask is None and q.shape[2] > 1
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])

    if starts is not None:
        out = query.new_zeros(query.shape)
        for b, s in enumerate(starts):
            out[b : b + 1, :, s:] = attend(query[b : b + 1, :, s:], key[b : b + 1, :, s:], value[b : b + 1, :, s:], None)
        return out.transpose(1, 2).contiguous(), None
    if segments and attention_mask is not None:
        out = torch.cat([attend(query[a:b], key[a:b, :, s:], value[a:b, :, s:], attention_mask[a:b, ..., s:])
                         for a, b, s in segments])
    else:
        out = attend(query, key, value, attention_mask)
    return out.transpose(1, 2).contiguous(), None


_registered = threading.Lock()


def _register_slot_sdpa() -> None:
    """Make ``slot_sdpa`` known to transformers under its own name (done once, when the first runner needs it; only
    the runners' private model copies select it)."""
    with _registered:
        if SLOT_SDPA not in AttentionInterface._global_mapping:
            AttentionInterface.register(SLOT_SDPA, slot_sdpa)


def _fingerprint(params) -> tuple:
    """Changes when the parameters' storage is replaced (``model.to(...)``), not when it is edited in place."""
    return tuple((p.data_ptr(), p.dtype, p.device) for p in params)


def private_copy(model):
    """A copy of ``model``'s module tree (and config) that shares its parameters and buffers, in eval mode, with
    linears over few rows as ``FewRowLinear`` on CPU and ``slot_sdpa`` attention where the model uses sdpa."""
    shared = {id(t): t for t in chain(model.parameters(), model.buffers())}
    mine = copy.deepcopy(model, memo=shared)
    mine.eval()
    for module in list(mine.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and child.weight.device.type == "cpu":
                setattr(module, name, FewRowLinear.sharing(child))
    if mine.config._attn_implementation == "sdpa":
        _register_slot_sdpa()
        mine.config._attn_implementation = SLOT_SDPA  # the copy's own config object
    return mine


class Runner:
    """Runs forwards of one model over slot caches (see the module docstring)."""

    GRAPH_MODES = ("auto", "off", "static")

    def __init__(self, model, graphs: str = "auto", prefix_cache: int | None = 0):
        """``graphs``: "auto" replays static-shape steps as CUDA graphs on a GPU where ``graphs.supported(model)``;
        "off" never; "static" runs the static-shape steps without capture on any device (how they are tested on
        CPU). ``prefix_cache``: MiB of prompt blocks the prefills keep (``prefixes``; 0: none; None: sized from the
        model's device, ``prefixes.default_mib``)."""
        if graphs not in self.GRAPH_MODES:
            raise ValueError(f"graphs must be one of {self.GRAPH_MODES}, got {graphs!r}")
        budget = budget_bytes(prefix_cache)
        self.model, self.graphs = model, graphs
        self._first = next(model.parameters(), None)  # the device is read from it (it moves with ``model.to``)
        if budget < 0:
            budget = budget_bytes(default_mib(self.device))
        self.prefixes = PrefixCache(budget) if budget else None
        # sliding windows: masked forwards of the model's own modules, where the C layer does not apply them
        self.windowed = bool(kv.windows(model))
        self._static = None
        self._copy = self._key = None
        self._ends = ()
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        """The model's device, from its first parameter (``model.device`` walks the module tree: ~1% of a batch-1
        step, read every step)."""
        return self.model.device if self._first is None else self._first.device

    @property
    def modules(self):
        """The private copy (built on first use, rebuilt when the model's parameters were replaced)."""
        if self._copy is None or _fingerprint(self._ends) != self._key:
            with self._lock:
                params = list(self.model.parameters())
                self._ends = (params[0], params[-1]) if params else ()
                self._copy, self._key = private_copy(self.model), _fingerprint(self._ends)
        return self._copy

    @property
    def packed_rows(self) -> int:
        """How many rows (real new tokens) a forward with ``counts`` may have and still cost only those, as the C
        layer computes only them; 0 where forwards cost their whole rectangle."""
        fused = self.static is None and fused_llama.plan(self.model) is not None
        return fused_llama.MAX_ROWS if fused else 0

    @property
    def static(self) -> graphs.StaticRunner | None:
        """The static-shape step runner, where this runner's mode and model call for one."""
        if self.graphs == "off" or (self.graphs == "auto" and self.device.type != "cuda") or self.windowed:
            return None
        if self._static is None:
            self._static = graphs.supported(self.model) and graphs.StaticRunner(self.model, self.graphs == "auto")
        return self._static or None

    def whole(self, length: int) -> bool:
        """Whether a prompt of ``length`` cached tokens is computed by the whole prefill (``prefill``), else by the C
        layer's few-row forwards (``FEW_TOKENS``). A query of the prompt alone: each
        path gives a token the same bits however its forward is cut (the rows beside it, its cached start), so a
        prompt's keys, values and log-probabilities never depend on what else was prefilled or cached."""
        return (self.static is None and length > min(FEW_TOKENS, self.packed_rows)
                and whole_prefill.supported(self.model))

    def prefill(self, prompts: list[list[int]], shared: int, width: int, hidden: bool, embeds=None, base=None):
        """``(cache, states or None)`` of ``prompts`` cached right-aligned in ``width`` slots by one forward of their
        tokens end to end (``prefill.py``; ``shared`` leading tokens common to all computed once, or copied from
        ``base``, a kept prefix of the first of them; ``embeds()``: each row's input vectors in place of its tokens'
        embeddings), or None where that path does not apply: the caller then runs grouped forwards. The caller
        sends the prompts ``whole`` says this path is for."""
        if self.static is not None:
            return None
        return whole_prefill.prefill(self.model, prompts, shared, width, hidden, embeds, base)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits from its final hidden states ``[..., H]`` (a forward's ``hidden``): what its forward
        computes after them, the output head and, where the config has one, the final soft-capping."""
        out = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config.get_text_config(), "final_logit_softcapping", None)
        return out if not cap else torch.tanh(out / cap) * cap

    def forward(self, cache: kv.SlotCache, input_ids, position_ids, visible=None, logits_to_keep=0,
                hidden=False, embeds=None, counts=None) -> TargetOutput:
        """One forward of ``input_ids`` ``[B, q]`` appended to ``cache``.

        ``visible`` ``[B, S+q]`` says which slots attention may see; ``None`` means a fresh cache and unpadded rows
        (causal attention, which skips the masked half of the work). ``logits_to_keep`` > 0 keeps the last that
        many positions; ``hidden`` also returns the final hidden states at those positions (``"all"``: at every
        position). ``embeds`` ``[B, q, H]``, when given, are the input vectors in place of the token embeddings
        (``input_ids`` then only name the slots). ``counts`` ``[B]``: row b's new tokens past its first ``counts[b]``
        are padding (hidden from attention by ``visible``): their outputs are unspecified, and the C layer does not
        compute them (``packed_rows``)."""
        static = self.static
        if static is not None and embeds is None and hidden != "all":
            out = static.forward(cache, input_ids, position_ids, visible, logits_to_keep, hidden)
            if out is not None:
                return TargetOutput(*out)
        everything = visible if visible is not None else torch.ones_like(input_ids, dtype=torch.bool)
        out = fused_llama.forward(  # only where it applies the model's windows (``fused_llama.covered``)
            self.model, cache, input_ids, position_ids, everything, logits_to_keep, hidden, embeds, counts)
        if out is not None:  # the C layer only reads the model
            return TargetOutput(*out)
        model = self.modules
        mask = segments = None
        extra = {"input_ids": input_ids} if embeds is None else {"inputs_embeds": embeds}
        if visible is None and self.windowed:  # causal attention would not stop at the window: a mask that does
            visible = torch.ones((input_ids.shape[0], cache.length + input_ids.shape[1]), dtype=torch.bool,
                                 device=input_ids.device)
        if visible is not None:
            q = input_ids.shape[1]
            mask = kv.attention_mask(model, visible, q)
            own = model.config._attn_implementation == SLOT_SDPA
            fresh = cache.length == 0 and visible.shape[1] == q and not self.windowed  # per-row causal attention
            if own and fresh:  # a fresh, left-padded prefill: one host read
                extra["starts"] = visible.to(torch.uint8).argmax(1).tolist()
            else:
                segments = row_segments(visible, q) if own else None
                if segments:
                    extra["segments"] = segments
        res = model(position_ids=position_ids, attention_mask=mask, cache=cache, use_cache=True,
                    logits_to_keep=logits_to_keep, output_hidden_states=bool(hidden), **extra)
        states = None
        if hidden:
            states = res.hidden_states[-1]
            if logits_to_keep and hidden != "all":
                states = states[:, -logits_to_keep:]
        return TargetOutput(res.logits, states)
