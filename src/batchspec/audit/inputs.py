"""What every audit starts from: the target, the draft and the tokenizer resolved as ``batchspec.LLM`` resolves them,
the prompts as token ids, and the ``Context`` the engines are built from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Context:
    target: object
    draft: object
    tokenizer: object
    num_draft_tokens: int
    max_tokens: int
    extra_stops: list[int]



def load_inputs(target, draft, tokenizer, prompts, dtype, device):
    """(target model, draft model or drafter name, tokenizer, token-id prompts) as ``batchspec.LLM`` resolves them."""
    from batchspec.api import shared_draft
    from batchspec.model.loading import load_model, load_tokenizer

    model = load_model(target, dtype, device, "target")
    tok = load_tokenizer(tokenizer if tokenizer is not None else target if isinstance(target, str) else None)
    draft = shared_draft(draft, model)
    return model, draft, tok, _encode(list(prompts), tok)


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
