"""What every audit starts from: the target, the draft and the tokenizer resolved as ``batchspec.LLM`` resolves them,
the prompts as token ids, and the ``Context`` the engines are built from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Context:
    target: object  # the oracle's model (as loaded: fp32 weights)
    draft: object
    tokenizer: object
    num_draft_tokens: int
    max_tokens: int
    extra_stops: list[int]
    engine_target: object = None  # the model batchspec's engines run (packed weights by default), or None: target

    def __post_init__(self):
        if self.engine_target is None:
            self.engine_target = self.target


def load_inputs(target, draft, tokenizer, prompts, dtype, device, weights: str = "fp32"):
    """(target model, draft model or drafter name, tokenizer, token-id prompts, the engines' target model) as
    ``batchspec.LLM`` resolves them: the target as loaded (fp32) for the oracle; with ``weights="auto"`` and a target
    given by name or path, the engines run it with packed weights, as ``LLM`` does by default."""
    from batchspec.api import shared_draft
    from batchspec.model.loading import load_model, load_tokenizer

    model = load_model(target, dtype, device, "target")
    engine_model = model
    if weights != "fp32" and not hasattr(target, "config"):
        engine_model = load_model(target, model.dtype, model.device, "target", weights)
    tok = load_tokenizer(tokenizer if tokenizer is not None else target if isinstance(target, str) else None)
    draft = shared_draft(draft, engine_model, weights)
    return model, draft, tok, _encode(list(prompts), tok), engine_model


def _encode(prompts, tokenizer) -> list[list[int]]:
    if not prompts:
        raise ValueError("no prompts to audit")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer; pass tokenizer= or token-id prompts")
            p = tokenizer(p)["input_ids"]
        p = [int(t) for t in p]
        if not p:
            raise ValueError(f"prompt {i} is empty")
        out.append(p)
    return out
