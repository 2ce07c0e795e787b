"""Weights kept in the narrowest format that holds their fp32 values exactly: lossless, not quantisation.

A batch-1 decode step on a CPU waits on memory: it reads every weight once. Many fp32 weights carry fewer bits than
they take: a model dequantised from a GGUF file holds, per block of 32 weights of a row, only values ``d * q + m``
(Q4_1: ``q`` a 4-bit code, ``d`` and ``m`` fp16) or ``d * q`` (Q8_0, Q4_0), and a checkpoint published in bf16 holds
only bf16 values. ``pack`` finds, for one fp32 weight, the narrowest of these formats whose expansion gives back every
value *bit for bit* (it checks all of them), and ``packed.c`` expands a chunk of rows at a time to those very fp32
values before the usual fp32 kernel runs over them: every logit keeps its bits, a step reads 2-7x fewer bytes.

Formats (bits per weight, resident: the block scales are fp16 values kept as fp32): q4_0 5, q4_1 6, q8_0 9, bf16 16,
f16 16 (fp32 32). A tensor no format holds exactly stays fp32. Activations stay fp32 throughout; nothing is approximated.

The K-quants of GGUF files (q4_k 4.5, q5_k 5.5, q6_k 6.5625: super-blocks of 256 weights whose sub-blocks' scales are
products ``d * sc`` that no fp16 holds, so no format above does) are not found from the values: a weight loaded from
such a file keeps the file's own blocks (``pack``'s ``given``, ``loading.gguf_blocks``), checked like the others.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from . import kernels

BLOCK = 32  # weights of a row sharing one scale (and offset) in the block formats, as in GGUF
KINDS = {"f32": 0, "bf16": 1, "f16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5, "q4_k": 6, "q5_k": 7, "q6_k": 8}  # packed.c's
BITS = {"q4_0": 5.0, "q4_1": 6.0, "q8_0": 9.0, "bf16": 16.0, "f16": 16.0, "f32": 32.0,  # resident, fp32 scales
        "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625}
SUPER = 256  # weights of a row in one K-quant super-block
KQUANTS = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # bytes of a super-block, as ggml lays it out
ORDER = ("q4_0", "q4_1", "q8_0", "bf16", "f16")  # tried narrowest first
GREEDY_MOST = 8  # the most rows ``PackedLinear.greedy`` takes (argmax.c's MAX_ROWS)
# the rows of x at which it runs, by whether packed.c's 16-lane blocks run at full width (``packed_full_width``).
# Half width (Zen 4): 1-4 rows, 1.5x as fast as every logit at one row. Full width (Zen 5, 2 threads, decode with it
# against without, tokens/s): at 1-6 rows every logit reads a q8_0 head as fast (the default model 0.92-0.99x, Gemma
# 3 270M 0.87-1.05x, outputs identical), at 7-8 rows those logits are bound by arithmetic and its 8-bit scores take
# less (Gemma 1.11x / 1.11-1.23x, the default model 1.04x / 0.99-1.06x)
GREEDY_ROWS = {"half": (1, 4), "full": (7, 8)}
# per thread (engines may share a model across threads): the fast argmax's scores, one buffer reused (fresh pages
# would cost their faults every step)
_scores = threading.local()


@dataclass
class PackedWeight:
    """One weight ``[N, K]`` in ``kind``: ``q`` the codes (int16 ``[N, K]`` bits for bf16 and f16; int32 words for
    the block formats, laid out for eight 32-bit lanes as ``packed.c`` says: ``[N, K/64, 8]``, word j of group g
    holding the 4-bit codes of weights 64g + 8p + j, p = 0..7, in bits 4p..4p+3; ``[N, K/32, 8]`` for q8_0, the 8-bit
    codes of weights 32b + 8p + j, p = 0..3, in bits 8p..8p+7; for the K-quants, uint8 ``[N, K/256 * bytes]``: each
    row's super-blocks as a GGUF file stores them), ``d`` and ``m`` ``[N, K/32]`` the blocks' scales and offsets
    (None where the format has none, or keeps them in its blocks): fp16 values, kept in fp32 so that the kernel
    broadcasts them from memory as they are."""

    kind: str
    shape: tuple[int, int]
    q: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {k: t for k, t in (("q", self.q), ("d", self.d), ("m", self.m)) if t is not None}

    def c_struct(self) -> kernels.Packed:
        ptr = (lambda t: t.data_ptr() if t is not None else None)
        return kernels.Packed(KINDS[self.kind], ptr(self.q), ptr(self.d), ptr(self.m))

    def expand(self, scratch: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` (the kernel where built, else torch; the same bits either way); written into
        the start of ``scratch`` (fp32, contiguous, at least N * K elements) when given, so that a caller expanding
        many weights in turn reuses one buffer."""
        lib = kernels.library()
        if lib is None:
            return expand_torch(self)
        n = self.shape[0] * self.shape[1]
        out = torch.empty(self.shape, dtype=torch.float32) if scratch is None else scratch.view(-1)[:n].view(self.shape)
        lib.packed_expand(ctypes.byref(self.c_struct()), self.shape[0], self.shape[1], out.data_ptr())
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of the fp32 weight: ``[*ids.shape, K]``."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        lib = kernels.library()
        if lib is None:
            out = expand_torch(self, flat)
        else:
            if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.shape[0]):
                raise IndexError(f"index out of range for {self.shape[0]} rows")
            out = torch.empty((flat.numel(), self.shape[1]), dtype=torch.float32)
            lib.packed_gather(ctypes.byref(self.c_struct()), self.shape[1], flat.data_ptr(), flat.numel(),
                              out.data_ptr())
        return out.view(*ids.shape, self.shape[1])


def expand_torch(p: PackedWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values of ``p`` (its ``rows`` only, when given) computed with torch: the reference the kernel's
    expansion is tested against, and the fallback where the kernels are not built."""
    pick = (lambda t: t if rows is None or t is None else t[rows])
    q, d, m = pick(p.q), pick(p.d), pick(p.m)
    n, k = q.shape[0], p.shape[1]
    if p.kind == "f32":
        return q.clone()
    if p.kind == "bf16":
        return (q.to(torch.int32) << 16).view(torch.float32)
    if p.kind == "f16":
        return q.view(torch.float16).float()
    if p.kind in KQUANTS:  # gguf's dequantiser: the arithmetic packed.c's expansion reproduces
        from gguf import GGMLQuantizationType, quants

        kind = GGMLQuantizationType[p.kind.upper()]
        return torch.from_numpy(quants.dequantize(q.numpy(), kind)).view(n, k)
    if p.kind == "q8_0":
        codes = q
    else:  # nibble p of word j: weight 8p + j of the group of 64
        codes = torch.stack([(q >> (4 * i)) & 0x0F for i in range(8)], -2)
    codes = codes.reshape(n, k).float() - (8.0 if p.kind == "q4_0" else 0.0)
    codes = codes.view(n, k // BLOCK, BLOCK)
    w = codes * d.float()[..., None]  # exact: 11 significant bits times at most 8
    if p.kind == "q4_1":
        w = w + m.float()[..., None]  # the one rounding, as gguf's dequantiser (d * q, then + m)
    return w.view(n, k)


def pack(weight: torch.Tensor, kinds=ORDER, given: PackedWeight | None = None) -> PackedWeight | None:
    """The narrowest format in ``kinds`` that holds every value of the fp32 ``weight`` ``[N, K]`` bit for bit (its
    expansion is checked against it), or None: also where the kernels, which find the block formats' codes and
    would run the packed weight, are not built here, and for rows whose length is not a multiple of ``BLOCK`` (the
    kernel reads every format ``BLOCK`` weights of a row at a time, so such a row stays fp32). ``given``, a packed
    form the weight was made from (a GGUF file's K-quant blocks), comes first where its expansion is the weight."""
    lib = kernels.library()
    if (lib is None or weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu"
            or weight.shape[1] % BLOCK):
        return None
    w = weight.detach().contiguous()
    n, k = w.shape
    bits = w.view(torch.int32)
    if (given is not None and given.shape == (n, k) and (given.kind not in KQUANTS or k % SUPER == 0)
            and torch.equal(given.expand().view(torch.int32), bits)):
        return given
    for kind in kinds:
        p = None
        if kind == "bf16" and not (bits & 0xFFFF).any():
            p = PackedWeight(kind, (n, k), (bits >> 16).to(torch.int16))
        elif kind == "f16" and torch.equal(w.half().float().view(torch.int32), bits):
            p = PackedWeight(kind, (n, k), w.half().view(torch.int16))
        elif kind in ("q4_0", "q4_1", "q8_0") and k % (BLOCK if kind == "q8_0" else 2 * BLOCK) == 0:
            q = (torch.empty((n, k), dtype=torch.int8) if kind == "q8_0"
                 else torch.empty((n, k // (2 * BLOCK), 8), dtype=torch.int32))
            d = torch.empty((n, k // BLOCK), dtype=torch.float32)
            m = torch.empty_like(d) if kind == "q4_1" else None
            found = lib.packed_find(KINDS[kind], w.data_ptr(), n, k, q.data_ptr(), d.data_ptr(),
                                    None if m is None else m.data_ptr())
            p = PackedWeight(kind, (n, k), q, d, m) if found == 0 else None
        if p is not None and torch.equal(p.expand().view(torch.int32), bits):
            return p
    return None


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` over a ``PackedWeight``, computed as the runner computes an fp32 linear (``kernels.linear``):
    few rows through ``packed.c`` (the skinny kernel's bits), more with the expanded weight (its very fp32 values) in
    the same orientation: the fp32 path's bits at every row count. A ``bias`` is added after the product (torch adds
    it within its own, so a biased ``nn.Linear`` gives other bits: ``pack_model`` leaves those alone; a drafter,
    whose outputs only propose, packs its own)."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        self.packed = packed
        self.out_features, self.in_features = packed.shape
        for name, t in packed.tensors().items():  # buffers: moved, shared and counted like the model's own
            self.register_buffer(name, t, persistent=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(), requires_grad=False)

    def _weight(self) -> PackedWeight:
        """The packed weight over this module's own buffers (a deep copy of the module shares them)."""
        p = self.packed
        if p.q is not self.q:
            p = self.packed = PackedWeight(p.kind, p.shape, self.q, getattr(self, "d", None), getattr(self, "m", None))
        return p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        lib = kernels.library()
        p = self._weight()
        x2 = x.reshape(rows, self.in_features)
        if lib is None or rows > kernels.MAX_ROWS or x.dtype != torch.float32:
            y = kernels.linear(x2, p.expand().to(x.dtype))
        else:
            x2 = x2.contiguous()
            y = torch.empty((rows, self.out_features), dtype=torch.float32)
            if lib.packed_linear(x2.data_ptr(), ctypes.byref(p.c_struct()), y.data_ptr(), rows, *p.shape):
                raise MemoryError("batchspec's packed linear kernel could not allocate its scratch memory")
        if self.bias is not None:
            y += self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def greedy(self, x: torch.Tensor) -> torch.Tensor | None:
        """The index of the largest output of each row of ``x`` ``[M, K]`` (the first on ties): the tokens
        ``sampling.greedy(self(x))`` gives, bit for bit, without computing every output (``kernels/argmax.c``: q8_0
        weights, AVX-512 VNNI; an output head). None where that does not apply or does not pay (``GREEDY_ROWS``): the
        caller computes the outputs."""
        lib = kernels.library()
        p = self._weight()
        rows = x.numel() // self.in_features
        if (lib is None or p.kind != "q8_0" or x.dtype != torch.float32 or x.device.type != "cpu"
                or not lib.q8_argmax_supported()):
            return None
        lo, hi = GREEDY_ROWS["full" if lib.skinny_avx512(-1) and lib.packed_full_width(-1) else "half"]
        if not lo <= rows <= min(hi, GREEDY_MOST):
            return None
        sums = getattr(self, "_sums", None)
        if sums is None or sums[0] is not p.q:  # per row: the sum of the weights and of their magnitudes, once
            t, r = torch.empty(self.out_features), torch.empty(self.out_features)
            lib.q8_row_sums(ctypes.byref(p.c_struct()), *p.shape, t.data_ptr(), r.data_ptr())
            sums = self._sums = (p.q, t, r)
        scratch = getattr(_scores, "buffer", None)
        if scratch is None or scratch.numel() < rows * self.out_features:
            scratch = _scores.buffer = torch.empty(rows * self.out_features)
        x2 = x.reshape(rows, self.in_features).contiguous()
        tokens = torch.empty(rows, dtype=torch.long)
        if lib.q8_argmax(x2.data_ptr(), ctypes.byref(p.c_struct()), sums[1].data_ptr(), sums[2].data_ptr(), rows,
                         *p.shape, scratch.data_ptr(), tokens.data_ptr()):
            return None
        return tokens.view(x.shape[:-1])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.packed.kind}"


class PackedEmbedding(torch.nn.Module):
    """``nn.Embedding`` over a ``PackedWeight`` (a tied output head shares it): rows expanded as they are looked up.
    ``scale``: a scaled embedding's factor (Gemma's ``embed_scale``), each row multiplied by it in fp32 as the
    module it replaces does."""

    def __init__(self, packed: PackedWeight, padding_idx: int | None = None, scale: float | None = None):
        super().__init__()
        self.packed = packed
        self.num_embeddings, self.embedding_dim = packed.shape
        self.padding_idx, self.scale = padding_idx, scale
        self._factor = None if scale is None else torch.tensor(scale, dtype=torch.float32)  # fp32 rows only
        for name, t in packed.tensors().items():
            self.register_buffer(name, t, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.packed
        if p.q is not self.q:
            p = self.packed = PackedWeight(p.kind, p.shape, self.q, getattr(self, "d", None), getattr(self, "m", None))
        rows = p.rows(ids)
        return rows if self._factor is None else rows * self._factor

    def extra_repr(self) -> str:
        scale = "" if self.scale is None else f", scale={self.scale}"
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.packed.kind}{scale}"


def embedding_scale(module) -> float | None:
    """The factor a scaled word embedding (transformers' ``*ScaledWordEmbedding``: ``nn.Embedding`` rows times its
    ``embed_scale``, Gemma's) multiplies its rows by; None for any other module (a query)."""
    if not isinstance(module, torch.nn.Embedding) or not type(module).__name__.endswith("ScaledWordEmbedding"):
        return None
    scale = getattr(module, "embed_scale", None)
    if isinstance(scale, torch.Tensor):
        return float(scale) if scale.numel() == 1 and not scale.is_meta else None
    return float(scale) if isinstance(scale, (int, float)) else None


def _packable(module) -> bool:
    """A bias-free ``nn.Linear``, an ``nn.Embedding`` or a scaled word embedding (a query)."""
    if type(module) is torch.nn.Linear:
        return module.bias is None
    return type(module) is torch.nn.Embedding or embedding_scale(module) is not None


def packed_weight(module) -> PackedWeight | None:
    """The packed weight of a ``PackedLinear`` / ``PackedEmbedding`` (None for any other module)."""
    if isinstance(module, PackedLinear):
        return module._weight()
    return module.packed if isinstance(module, PackedEmbedding) else None


@dataclass
class PackReport:
    """What ``pack_model`` did: tensors per format, fp32 bytes before and resident weight bytes after."""

    formats: dict[str, int]
    fp32_bytes: int
    bytes: int
    unpacked: list[str]  # linear / embedding weights kept in fp32 (no format holds them exactly)

    def line(self) -> str:
        counts = ", ".join(f"{n} {k}" for k, n in sorted(self.formats.items()))
        return (f"weights: {self.bytes / 2**20:.0f} MiB resident for {self.fp32_bytes / 2**20:.0f} MiB in fp32 "
                f"({counts})")


def report(model) -> PackReport:
    """What ``model``'s linear and embedding weights take now: tensors per format and resident bytes (a query)."""
    formats: dict[str, int] = {}
    unpacked: list[str] = []
    fp32 = total = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        p = packed_weight(module)
        if p is not None:
            key, n, size, kind = id(p.q), p.shape[0] * p.shape[1], p.nbytes, p.kind
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            w = module.weight
            key, n, size, kind = id(w), w.numel(), w.numel() * w.element_size(), None
        else:
            continue
        if key in seen:
            continue
        seen.add(key)
        fp32, total = fp32 + 4 * n, total + size
        if kind is None:
            unpacked.append(name)
        else:
            formats[kind] = formats.get(kind, 0) + 1
    return PackReport(formats, fp32, total, unpacked)


def pack_model(model, given: dict[str, PackedWeight] | None = None) -> PackReport:
    """Replace, in place, every bias-free ``nn.Linear`` and ``nn.Embedding`` (or scaled word embedding: Gemma's) of an
    fp32 CPU ``model`` whose weight a narrower format holds exactly by its packed module (a tied output head and input
    embedding share one packed weight); other parameters (norms, biases) stay. Outputs keep their bits. ``given``:
    packed forms the weights were made from, by parameter name (``pack``'s). Returns ``report(model)``."""
    given = {id(p): given[name] for name, p in model.named_parameters(remove_duplicate=False) if name in given} \
        if given else {}
    done: dict[int, tuple] = {}  # id(weight) -> (weight, its packed form): tied weights are packed once (the weight
    # is kept so that its id is not reused while the loop runs)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not _packable(child):
                continue
            w = child.weight
            if w.dtype != torch.float32 or w.device.type != "cpu":
                continue
            if kernels.library() is None:  # nothing can be packed here: said once per process, and why
                kernels.tell_off()
                return report(model)
            if id(w) not in done:
                done[id(w)] = (w, pack(w, given=given.get(id(w))))
            p = done[id(w)][1]
            if p is not None:
                setattr(parent, name, PackedLinear(p) if type(child) is torch.nn.Linear
                        else PackedEmbedding(p, child.padding_idx, embedding_scale(child)))
    return report(model)


# ------------------------------------------------------------------------------------------------- the cache

CACHE_VERSION = 2  # of the file below: a change of its layout or of a format's codes makes older files unread


def state(model) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor a packed model needs, by name (a packed module's codes as ``name.q`` / ``.d`` / ``.m``, every
    other parameter as it is), and what says how to rebuild it: each packed module's format, shape and class, and
    the modules that share another's packed weight (a tied head)."""
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict] = {}
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        p = packed_weight(module)
        if p is None:
            continue
        cls = "linear" if isinstance(module, PackedLinear) else "embedding"
        spec = {"padding_idx": module.padding_idx, "scale": module.scale} if cls == "embedding" else {}
        if id(p.q) in owner:
            modules[name] = {"class": cls, "same_as": owner[id(p.q)], **spec}
            continue
        owner[id(p.q)] = name
        modules[name] = {"class": cls, "kind": p.kind, "shape": list(p.shape), **spec}
        tensors.update({f"{name}.{k}": t.contiguous() for k, t in p.tensors().items()})
    for name, param in model.named_parameters():
        tensors[name] = param.detach().contiguous()
    return tensors, {"version": CACHE_VERSION, "modules": modules}


def _module(p: PackedWeight, spec: dict) -> torch.nn.Module:
    if spec["class"] == "linear":
        return PackedLinear(p)
    return PackedEmbedding(p, spec.get("padding_idx"), spec.get("scale"))


def modules_from(tensors: dict[str, torch.Tensor], layout: dict) -> dict[str, torch.nn.Module]:
    """The packed modules ``state`` described, by name, over ``tensors``."""
    if layout.get("version") != CACHE_VERSION:
        raise ValueError(f"packed weights of version {layout.get('version')}, this batchspec reads {CACHE_VERSION}")
    built: dict[str, torch.nn.Module] = {}
    for name, spec in layout["modules"].items():
        if "same_as" in spec:
            continue
        parts = {k: tensors.get(f"{name}.{k}") for k in ("q", "d", "m")}
        p = PackedWeight(spec["kind"], tuple(spec["shape"]), parts["q"], parts["d"], parts["m"])
        built[name] = _module(p, spec)
    for name, spec in layout["modules"].items():
        if "same_as" in spec:
            built[name] = _module(packed_weight(built[spec["same_as"]]), spec)
    return built
