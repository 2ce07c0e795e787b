"""Hand-written CPU kernels for the few-token forwards (decode, verification, draft steps, short prefills).

- ``skinny.c``: linear layers over a few rows. For a handful of rows MKL's fp32 products stream a large weight at
  ~6 GB/s on this project's reference CPU (AVX2); reading each weight row once for all rows, with the weights
  prefetched ahead, streams it at ~13-14 GB/s. Rows go in register blocks (AVX2, or two rows a register with
  AVX-512), each row summed in one order whatever its block, so a token's outputs have the same bits in a
  verification block as in a decode step.
- ``layer.c``: one Llama decoder layer per call (driven by ``llama.py``), attention over visible slots only.
- ``match.c``: prompt lookup's matching, a row at a time (``lookup_match``).
- ``causal.c``: causal attention of a prompt over its own keys, for the whole prefill (``model/prefill.py``):
  flash-style, each key/value read once per 6 queries of a head, nothing right of the diagonal computed.
- ``packed.c``: linear layers over weights kept in a narrower exact format (``model/weights.py``), each weight
  expanded in a register to its fp32 value as it is read (AVX2, or two weight rows a register with AVX-512 for
  blocks of 1 and 4 rows) and summed in ``skinny.c``'s order: the same bits, fewer bytes read.
- ``argmax.c``: the greedy tokens of a q8_0 output head without every logit: 8-bit integer scores within a proven
  bound of the exact outputs, and only the outputs the bound cannot rule out computed (``packed.c``'s bits).

They are compiled on first use with the system C compiler into ``$BATCHSPEC_CACHE/kernels`` (default
``~/.cache/batchspec/kernels``); without a compiler or AVX2, for other dtypes or devices, or with
``BATCHSPEC_KERNELS=0``, the entry points return None and callers use torch. Their sums run in another order than
MKL's, like any change of batch size.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

MAX_ROWS = 64  # measured no slower than torch up to 48 rows; beyond this torch is used
_SOURCES = [Path(__file__).with_name(name)
            for name in ("skinny.c", "layer.c", "match.c", "packed.c", "causal.c", "argmax.c")]
_HEADERS = [Path(__file__).with_name(name) for name in ("vexp.h", "packed.h")]  # included by the sources (a build depends on them too)
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def cache_dir() -> Path:
    from ..cache import cache_base

    return cache_base() / "kernels"


def source_digest() -> str:
    """A digest of the kernels' sources (what a build, and the layout of packed codes, depend on)."""
    return hashlib.sha256(b"".join(src.read_bytes() for src in _SOURCES + _HEADERS)).hexdigest()[:16]


def _build() -> Path | None:
    """Compile the kernels once per source version; None when that is not possible here."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc or not sys.platform.startswith("linux") or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    digest = source_digest()
    out = cache_dir() / f"cpu-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    # no contraction of a * b + c into one rounding: elementwise steps round like torch's
    cmd = [cc, "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", *map(str, _SOURCES),
           "-o", str(tmp), "-lm"]
    if subprocess.run(cmd, capture_output=True).returncode:
        tmp.unlink(missing_ok=True)
        return None
    os.replace(tmp, out)
    return out


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if os.environ.get("BATCHSPEC_KERNELS", "1") == "0":
        return None
    if _tried:  # the hot path: no lock once the first call has built (or given up on) the kernel
        return _lib
    with _lock:
        if not _tried:
            _tried = True
            try:
                path = _build()
                if path is not None:
                    lib = ctypes.CDLL(str(path))
                    lib.skinny_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
                    lib.skinny_linear.restype = None
                    lib.skinny_avx512.argtypes = [ctypes.c_int]
                    lib.skinny_avx512.restype = ctypes.c_int
                    lib.llama_layers.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_float] * 2 + [ctypes.c_void_p] * 2 + [
                        ctypes.c_long]
                    lib.llama_layers.restype = ctypes.c_int
                    lib.lookup_match.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2
                    lib.lookup_match.restype = None
                    lib.packed_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
                    lib.packed_linear.restype = ctypes.c_int
                    lib.packed_expand.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 2 + [ctypes.c_void_p]
                    lib.packed_expand.restype = None
                    lib.packed_gather.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                                  ctypes.c_void_p]
                    lib.packed_gather.restype = None
                    lib.packed_find.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [
                        ctypes.c_void_p] * 3
                    lib.packed_find.restype = ctypes.c_int
                    lib.causal_attention.argtypes = [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 2 + [
                        ctypes.c_long, ctypes.c_void_p] + [ctypes.c_long] * 6 + [ctypes.c_float]
                    lib.causal_attention.restype = ctypes.c_int
                    lib.q8_argmax_supported.argtypes = []
                    lib.q8_argmax_supported.restype = ctypes.c_int
                    lib.q8_row_sums.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long] + [ctypes.c_void_p] * 2
                    lib.q8_row_sums.restype = None
                    lib.q8_argmax.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2
                    lib.q8_argmax.restype = ctypes.c_int
                    _lib = lib
            except OSError:
                _lib = None
    return _lib


def skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """``x @ weight.T`` for ``x`` ``[M, K]`` with few rows, or None where the kernel does not apply."""
    m, k = x.shape
    if (m > MAX_ROWS or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.device.type != "cpu" or weight.device.type != "cpu" or not weight.is_contiguous()):
        return None
    lib = _load()
    if lib is None:
        return None
    x = x.contiguous()
    y = torch.empty((m, weight.shape[0]), dtype=torch.float32)
    lib.skinny_linear(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, weight.shape[0], k)
    return y


class Packed(ctypes.Structure):
    """``packed_t`` of ``packed.c``: a weight's format code and the addresses of its codes, scales and offsets."""

    _fields_ = [("kind", ctypes.c_long), ("q", ctypes.c_void_p), ("d", ctypes.c_void_p), ("m", ctypes.c_void_p)]


def library() -> ctypes.CDLL | None:
    """The built kernels, or None where they do not apply here."""
    return _load()


FEW_ROWS = 256  # up to this many rows (batch x new tokens), linear layers run as ``W @ x^T`` (see ``linear``)


def linear(x2: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x2 @ weight.T`` for ``x2`` ``[M, K]`` as the runner computes it: the skinny kernel where it applies, else for
    up to ``FEW_ROWS`` rows ``W @ x^T`` (on CPU, MKL streams a large weight ~1.3-2x faster in that orientation when the
    rows are few; the vocabulary projection of 8 rows 2.3x), else torch's ``linear``. Every path that stands for the
    fp32 weights (``FewRowLinear``, packed weights) goes through here, so they give the same bits."""
    y = skinny_linear(x2, weight)
    if y is not None:
        return y
    if x2.shape[0] <= FEW_ROWS:
        return (weight @ x2.T).T.contiguous()
    return torch.nn.functional.linear(x2, weight)


def causal_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor, first: int,
                     scale: float) -> bool:
    """``out`` ``[n - first, heads, D]`` = causal attention of the queries ``q`` (same shape) of positions
    ``first .. n-1`` over ``keys`` / ``values`` ``[kv heads, n, D]`` of positions ``0 .. n-1`` (``causal.c``); False
    (nothing written) where the kernel does not apply: then the caller uses torch's attention."""
    lib = _load()
    n, d = keys.shape[1], keys.shape[2]
    if (lib is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (q, keys, values, out))
            or q.stride()[1:] != (d, 1) or out.stride()[1:] != (d, 1) or keys.stride()[1:] != (d, 1)
            or values.stride() != keys.stride() or q.shape != out.shape or q.shape[0] != n - first):
        return False
    return lib.causal_attention(q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(), keys.stride(0),
                                out.data_ptr(), out.stride(0), first, n, q.shape[1], keys.shape[0], d, scale) == 0


def lookup_match(history: torch.Tensor, length: torch.Tensor, n_max: int):
    """``(match length [B], end of its latest occurrence [B])`` of each row's last tokens in ``history`` ``[B, T]``
    (int64, ``length[b]`` tokens each), as ``PromptLookup.candidates`` defines them (``match.c``), or None where the
    kernels do not apply (then the caller's tensor version runs)."""
    lib = _load()
    if lib is None or history.device.type != "cpu" or history.dtype != torch.long or length.dtype != torch.long:
        return None
    hist, length = history.contiguous(), length.contiguous()
    match, end = torch.empty_like(length), torch.empty_like(length)
    lib.lookup_match(hist.data_ptr(), length.data_ptr(), hist.shape[0], hist.shape[1], n_max, match.data_ptr(),
                     end.data_ptr())
    return match, end
