"""Resolve a target or draft given as a loaded model or as a local path / model id (never downloaded here)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(spec, dtype=None, device=None, role: str = "target") -> PreTrainedModel:
    if isinstance(spec, PreTrainedModel):
        model = spec
    elif isinstance(spec, str):
        kwargs = {"attn_implementation": "sdpa"}
        if dtype is not None:
            kwargs["dtype"] = dtype
        try:
            model = AutoModelForCausalLM.from_pretrained(spec, **kwargs)
        except OSError as e:
            raise ValueError(f"cannot load the {role} model {spec!r}: {e}") from e
        device = device or default_device()
    else:
        raise TypeError(f"{role} must be a transformers PreTrainedModel or a path, got {type(spec).__name__}")
    if dtype is not None and model.dtype != dtype:
        model = model.to(dtype)
    if device is not None and model.device != torch.device(device):
        model = model.to(device)
    return model.eval()


def load_tokenizer(spec):
    if spec is None:
        return None
    if not isinstance(spec, str):
        return spec
    try:
        return AutoTokenizer.from_pretrained(spec)
    except (OSError, ValueError):
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
