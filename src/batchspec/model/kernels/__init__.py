"""Hand-written CPU kernels for the few-token forwards (decode, verification, draft steps, short prefills).

- ``skinny.c``: linear layers over a few rows. For a handful of rows MKL's fp32 products stream a large weight at
  ~6 GB/s on this project's reference CPU (AVX2); reading each weight row once for all rows, with the weights
  prefetched ahead, streams it at ~13-14 GB/s. Rows go in register blocks (AVX2, or two rows a register with
  AVX-512), each row summed in one order whatever its block, so a token's outputs have the same bits in a
  verification block as in a decode step.
- ``layer.c``: one Llama decoder layer per call (driven by ``llama.py``), attention over visible slots only; Qwen2's
  and Qwen3's layers are the same layer with small hooks (q/k/v biases, RMS norms of each query and key head);
  Gemma 3's adds the norms of the attention's and the MLP's outputs, a GELU MLP and a window on its local layers.
- ``match.c``: prompt lookup's matching, a row at a time (``lookup_match``).
- ``causal.c``: causal attention of a prompt over its own keys, for the whole prefill (``model/prefill.py``):
  flash-style, each step of 32 keys and values read from the first-level cache by a tile of 24 queries of every head
  that shares them, nothing right of the diagonal computed.
- ``packed.c``: linear layers over weights kept in a narrower exact format (``model/weights.py``), each weight
  expanded in a register to its fp32 value as it is read (AVX2, or two weight rows a register with AVX-512 for
  blocks of 1 and 4 rows) and summed in ``skinny.c``'s order: the same bits, fewer bytes read.
- ``argmax.c``: the greedy tokens of a q8_0 output head without every logit: 8-bit integer scores within a proven
  bound of the exact outputs, and only the outputs the bound cannot rule out computed (``packed.c``'s bits).

Shared by several: ``reduce.h`` (the horizontal sum whose order the bits rest on), ``packed.h`` (a weight as the
kernels see it, and the entry points they call across files), ``vexp.h`` (e^x of the softmaxes).

They are compiled on first use with the system C compiler into ``$BATCHSPEC_CACHE/kernels`` (default
``~/.cache/batchspec/kernels``), the compiler's output into a log beside them; without a compiler or AVX2, for other
dtypes or devices, or with ``BATCHSPEC_KERNELS=0``, the entry points return None and callers use torch (a build
that fails is logged once, with where its log is). Their sums run in another order than MKL's, like any change of
batch size.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

MAX_ROWS = 64  # measured no slower than torch up to 48 rows; beyond this torch is used
_DIR = Path(__file__).parent
_SOURCES = [_DIR / name for name in ("skinny.c", "layer.c", "match.c", "packed.c", "causal.c", "argmax.c")]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_off: str | None = None  # why the kernels are off here, once a build was tried
_told = False  # whether that was logged (once per process)
_log = logging.getLogger("batchspec.kernels")

# Every entry point Python calls, as its .c file defines it ("ptr": any pointer, a packed_t's by reference too).
SIGNATURES = {
    "skinny_linear": "void (ptr x, ptr w, ptr y, long M, long N, long K)",
    "skinny_avx512": "int (int on)",
    "packed_full_width": "int (int on)",
    "llama_layers": "int (ptr x, ptr w, ptr cos, ptr sin, ptr kc, ptr vc, ptr vis, ptr dims, float eps, float scale, "
                    "ptr first, ptr caps, long layers, ptr rope, ptr windows)",
    "lookup_match": "void (ptr hist, ptr length, long rows, long width, long n_max, ptr match, ptr end)",
    "packed_linear": "int (ptr x, ptr w, ptr y, long M, long N, long K)",
    "packed_expand": "void (ptr w, long N, long K, ptr out)",
    "packed_gather": "void (ptr w, long K, ptr ids, long n, ptr out)",
    "packed_find": "int (long kind, ptr w, long N, long K, ptr codes_out, ptr d, ptr m)",
    "causal_attention": "int (ptr q, long qs, ptr k, ptr v, long hs, ptr out, long os, long first, long n, long nh, "
                        "long nkv, long dim, float scale)",
    "q8_argmax_supported": "int ()",
    "q8_row_sums": "void (ptr w, long N, long K, ptr T, ptr R)",
    "q8_argmax": "int (ptr x, ptr w, ptr T, ptr R, long M, long N, long K, ptr A, ptr tokens)",
}
_C_TYPES = {"void": None, "ptr": ctypes.c_void_p, "long": ctypes.c_long, "int": ctypes.c_int, "float": ctypes.c_float}


def signature(name: str) -> tuple[type | None, list[tuple[str, type]]]:
    """``SIGNATURES[name]`` as ctypes sees it: the return type and the ``(name, type)`` of each argument."""
    ret, _, args = SIGNATURES[name].partition(" ")
    params = [a.split() for a in args.strip("()").split(",") if a.strip()]
    return _C_TYPES[ret], [(arg, _C_TYPES[kind]) for kind, arg in params]


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    for name in SIGNATURES:
        fn = getattr(lib, name)
        fn.restype, args = signature(name)
        fn.argtypes = [kind for _, kind in args]
    return lib


def cache_dir() -> Path:
    from ..cache import cache_base

    return cache_base() / "kernels"


def source_digest() -> str:
    """A digest of the kernels' sources and every header beside them (what a build, and the layout of packed codes,
    depend on)."""
    files = _SOURCES + sorted(_DIR.glob("*.h"))
    return hashlib.sha256(b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)).hexdigest()[:16]


def _off_because(reason: str, warn: bool) -> None:
    """Record why the kernels are off here; a fault the user can fix (``warn``) is logged at once."""
    global _off
    _off = reason
    if warn:
        _tell(logging.WARNING)


def _tell(level: int) -> None:
    global _told
    if not _told:
        _told = True
        _log.log(level, "packed weights and fused kernels off: %s", _off)


def tell_off() -> None:
    """Log, once per process, that packed weights and the fused kernels are off here and why (for a caller that
    would use them: ``weights="auto"``); nothing where they are built, or where the build already said so."""
    global _off
    if os.environ.get("BATCHSPEC_KERNELS", "1") == "0":
        _off = "BATCHSPEC_KERNELS=0"
    elif _load() is not None:
        return
    _tell(logging.INFO)


def _build() -> Path | None:
    """Compile the kernels once per source version; None when that is not possible here (``_off`` says why). The
    compiler's output goes to a log beside the library, never to the terminal."""
    capability = torch.backends.cpu.get_cpu_capability()
    if not sys.platform.startswith("linux"):
        return _off_because("the C kernels are built on Linux only", warn=False)
    if capability not in ("AVX2", "AVX512"):
        return _off_because(f"this CPU has no AVX2 (torch reports {capability})", warn=False)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return _off_because("no C compiler found (install gcc, or name one in CC)", warn=True)
    digest = source_digest()
    out = cache_dir() / f"cpu-{digest}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, log = out.with_name(f"{out.name}.{os.getpid()}.tmp"), out.with_suffix(".log")
    # no contraction of a * b + c into one rounding: elementwise steps round like torch's
    cmd = [cc, "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", *map(str, _SOURCES),
           "-o", str(tmp), "-lm"]
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        try:
            failed = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT).returncode
        except OSError as e:
            f.write(f"{e}\n")
            failed = True
    if failed:
        tmp.unlink(missing_ok=True)
        return _off_because(f"the C kernels did not build (install a C compiler, or see the log at {log})", warn=True)
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
            try:
                path = _build()
                _lib = None if path is None else _declare(ctypes.CDLL(str(path)))
            except OSError as e:  # an unwritable cache folder, a library that does not load
                _lib = None
                _off_because(f"the C kernels did not build or load ({e})", warn=True)
            _tried = True
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
    """``packed_t`` of ``packed.h``: a weight's format code and the addresses of its codes, scales and offsets."""

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
    if x2.shape[0] == 1 and x2.device.type == "cpu":  # one row takes MKL's matrix-vector path, which sums in another
        # order than its product of 2+ rows (seen on an Intel Xeon): as two rows, a row's bits never depend on how many
        # rows are beside it
        return (weight @ torch.cat([x2, torch.zeros_like(x2)]).T)[:, :1].T.contiguous()
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
