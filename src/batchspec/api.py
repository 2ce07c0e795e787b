"""``LLM``: resolve models and components, run the scheduler's batches through the engine, return outputs in order."""

from __future__ import annotations

import time

import torch

from . import kv
from .drafters import ModelDrafter, NoDrafter, PromptLookup
from .engine import Parts, Request, run
from .faults import apply_fault
from .layouts import get_layout
from .models import context_length, eos_ids, load_model, load_tokenizer, vocab_size
from .params import RequestOutput, SamplingParams, Stats
from .schedulers import get_scheduler


class LLM:
    def __init__(
        self,
        target,
        draft=None,
        tokenizer=None,
        num_draft_tokens: int = 5,
        layout: str = "slotmask",
        scheduler="static",
        batch_size: int = 8,
        dtype=None,
        device=None,
        check_invariants: bool = False,
        fault: str | None = None,
    ):
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        self.layout = get_layout(layout)
        self.scheduler = scheduler if hasattr(scheduler, "select") else get_scheduler(scheduler)
        self.target = load_model(target, dtype, device, "target")
        kv.check_supported(self.target, "target")
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else target if isinstance(target, str) else None)
        self.batch_size, self.check_invariants = batch_size, check_invariants
        self.drafter = self._drafter(draft, dtype)
        self.k = 0 if isinstance(self.drafter, NoDrafter) else num_draft_tokens
        self.parts = apply_fault(Parts(self.target, self.drafter, self.layout, self.k), fault)
        self.fault = fault
        self.stats = Stats()

    def _drafter(self, draft, dtype):
        if draft is None:
            return NoDrafter()
        if isinstance(draft, str) and draft == "prompt-lookup":
            return PromptLookup()
        if hasattr(draft, "propose"):  # an already-built drafter
            return draft
        model = load_model(draft, dtype if dtype is not None else self.target.dtype, self.target.device, "draft")
        kv.check_supported(model, "draft")
        if vocab_size(model) != vocab_size(self.target):
            raise ValueError(
                f"draft vocabulary ({vocab_size(model)} tokens) differs from the target's ({vocab_size(self.target)})"
            )
        return ModelDrafter(model)

    @property
    def draft(self):
        """The draft model, the drafter for model-free drafting, or None."""
        if isinstance(self.drafter, NoDrafter):
            return None
        return getattr(self.drafter, "model", self.drafter)

    def reset_stats(self) -> None:
        self.stats = Stats()

    def _encode(self, prompts) -> list[list[int]]:
        vocab = vocab_size(self.target)
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer; pass tokenizer= or token-id prompts")
                ids = self.tokenizer(p)["input_ids"]
            else:
                ids = [int(t) for t in p]
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (0..{vocab - 1})")
            out.append(ids)
        return out

    def generate(self, prompts, sampling_params=None, progress: bool = False) -> list[RequestOutput]:
        prompts = list(prompts)
        if not prompts:
            return []
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        ids = self._encode(prompts)
        ctx = context_length(self.target)
        for i, (p, sp) in enumerate(zip(ids, params)):
            if ctx is not None and len(p) + sp.max_tokens > ctx:
                raise ValueError(
                    f"prompt {i}: {len(p)} prompt tokens + max_tokens {sp.max_tokens} = {len(p) + sp.max_tokens} "
                    f"exceeds the model's context of {ctx} positions"
                )
        eos = eos_ids(self.target)
        stops = [set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos) for sp in params]
        seeds = [sp.seed if sp.seed is not None else int(torch.randint(2**62, ())) for sp in params]
        requests = [
            Request(i, p, sp.max_tokens, stop, sp.temperature, sp.top_k, sp.top_p, seed)
            for i, (p, sp, stop, seed) in enumerate(zip(ids, params, stops, seeds))
        ]
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = _progress(progress, len(ids))

        def finish(rows):
            for f in rows:
                results[f.request_id] = RequestOutput(
                    prompt_token_ids=ids[f.request_id],
                    token_ids=f.token_ids,
                    text=self.tokenizer.decode(f.token_ids, skip_special_tokens=True) if self.tokenizer else None,
                    finish_reason="stop" if f.stopped else "length",
                    num_rounds=f.rounds,
                    num_drafted=f.drafted,
                    num_accepted=f.accepted,
                )
                if bar:
                    bar.advance()

        t0 = time.perf_counter()
        try:
            run(self.parts, requests, self.scheduler, self.batch_size, self.stats, self.check_invariants, finish)
        finally:
            self.stats.total += time.perf_counter() - t0
            if bar:
                bar.close()
        return results


class _progress:
    """A rich progress bar over requests (a no-op object when disabled)."""

    def __new__(cls, enabled: bool, total: int):
        if not enabled:
            return None
        return super().__new__(cls)

    def __init__(self, enabled, total):
        from rich.progress import Progress

        self.p = Progress(transient=True)
        self.p.start()
        self.task = self.p.add_task("generating", total=total)

    def advance(self):
        self.p.advance(self.task)

    def close(self):
        self.p.stop()
