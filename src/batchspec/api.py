"""``LLM``: resolve models and components, run the scheduler's batches through the engine, return outputs in order."""

from __future__ import annotations

import dataclasses
import numbers
import os
import time

import torch

from .batch.grammar import Grammars
from .config import EngineConfig
from .drafters import EagleDrafter, ModelDrafter, NoDrafter, PromptLookup
from .drafters.eagle import is_checkpoint as is_eagle
from .engine.engine import Engine, Parts, Request
from .engine.faults import apply_fault
from .engine import memory
from .engine.layouts import get_layout
from .engine.schedulers import get_scheduler
from .model import kv
from .model.loading import context_length, eos_ids, load_model, load_tokenizer, resolve, vocab_size
from .model.runner import Runner
from .params import PROCESSORS, RequestOutput, SamplingParams, Stats
from .progress import Progress
from .text import TextStream
from .speculation import get_policy


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
        profile: bool = False,
        speculation: str = "adaptive",
        graphs: str = "auto",
        weights: str = "auto",
        prefix_cache: int | None = None,
        kv_memory: int | None = None,
    ):
        """``weights``: "auto" keeps each weight of a model this LLM loads (fp32 on CPU) in the narrowest format that
        holds its values exactly (GGUF-style blocks, bf16, fp16; see ``batchspec.model.weights``): outputs keep
        every bit, a decode step reads far fewer bytes; "fp32" keeps them as loaded. A model object passed in is
        never changed. ``llm.weights`` reports what they take. ``prefix_cache``: MiB of prompt blocks whose keys and
        values the target keeps between prefills, so a prompt computes only the tokens after its longest cached start
        (``batchspec.model.prefixes``); 0 turns it off; None sizes it from the machine (``prefixes.default_mib``).
        ``kv_memory``: MiB the running rows' keys and values may take at their widest; a request waits until it
        fits, one that never could is refused (``batchspec.engine.memory``); None sizes it from the machine
        (``memory.default_mib``). ``llm.memory`` holds the measure (``per_token`` bytes, ``budget``) its engines take.

        The arguments are kept as ``llm.config`` (an ``EngineConfig``, which checks what it can before any model
        loads); ``LLM.from_config`` builds an ``LLM`` from one."""
        self.config = EngineConfig(**{name: value for name, value in locals().items() if name != "self"})
        self.layout = get_layout(layout)
        policy = get_policy(speculation) if isinstance(speculation, str) else speculation  # or a policy object
        self.scheduler = scheduler if hasattr(scheduler, "select") else get_scheduler(scheduler)
        self.target = load_model(target, dtype, device, "target", weights)
        self.weights_mode = weights
        kv.check_supported(self.target, "target")
        self.tokenizer = load_tokenizer(tokenizer if tokenizer is not None else target if isinstance(target, str) else None)
        self.batch_size, self.check_invariants = batch_size, check_invariants
        self.graphs = graphs
        self.drafter = self._drafter(draft, dtype)
        self.k = 0 if isinstance(self.drafter, NoDrafter) else num_draft_tokens
        ctx, draft_ctx = self._contexts()
        if draft_ctx is not None:  # a draft model drafts one position less than the block it fills
            ctx = draft_ctx + 1 if ctx is None else min(ctx, draft_ctx + 1)
        grammars = Grammars(self.tokenizer, vocab_size(self.target), eos_ids(self.target)) if self.tokenizer else None
        parts = Parts(Runner(self.target, graphs, prefix_cache), self.drafter, self.layout, self.k, policy=policy,
                      context=ctx, grammars=grammars)
        self.parts = apply_fault(parts, fault)
        if self.k:  # the adaptive policy prices rounds from a profile of this machine (measured once, cached)
            self.parts.policy.bind(self.parts.target, self.drafter, batch_size)
        self.fault, self.profile = fault, profile
        mib = kv_memory if kv_memory is not None else memory.default_mib(self.target.device)
        self.memory = memory.KVMemory.of(self.parts, memory.budget_bytes(mib))
        self.stats = Stats()

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An ``LLM`` built from ``config``'s arguments."""
        return cls(**config.kwargs())

    def _drafter(self, draft, dtype):
        if draft is None:
            return NoDrafter()
        if isinstance(draft, str) and draft == "prompt-lookup":
            return PromptLookup()
        if hasattr(draft, "propose"):  # an already-built drafter
            return draft
        if isinstance(draft, (str, os.PathLike)) and is_eagle(path := resolve(draft, "draft")):
            return EagleDrafter.load(path, self.target, dtype, self.graphs, weights=self.weights_mode)
        model = load_model(draft, dtype if dtype is not None else self.target.dtype, self.target.device, "draft",
                           self.weights_mode)
        kv.check_supported(model, "draft")
        if vocab_size(model) != vocab_size(self.target):
            raise ValueError(
                f"draft vocabulary ({vocab_size(model)} tokens) differs from the target's ({vocab_size(self.target)})"
            )
        return ModelDrafter(model, self.graphs)

    @property
    def weights(self):
        """What the target's linear and embedding weights take: formats and resident bytes (``PackReport``)."""
        from .model.weights import report

        return report(self.target)

    @property
    def draft(self):
        """The draft model, the drafter for model-free drafting, or None."""
        if isinstance(self.drafter, NoDrafter):
            return None
        return getattr(self.drafter, "model", self.drafter)

    def reset_stats(self) -> None:
        self.stats = Stats()

    def clear_prefixes(self) -> None:
        """Drop the target's kept prompt prefixes (``prefix_cache``): needed after editing its weights in place, since
        what was kept was computed with the old ones."""
        if self.parts.target.prefixes is not None:
            self.parts.target.prefixes.clear()

    def _encode(self, prompts) -> list[list[int]]:
        vocab = vocab_size(self.target)
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer; pass tokenizer= or token-id prompts")
                ids = self.tokenizer(p)["input_ids"]
            elif isinstance(p, (list, tuple)) or (hasattr(p, "tolist") and getattr(p, "ndim", None) == 1):
                ids = [_token_id(t, i) for t in (p if isinstance(p, (list, tuple)) else p.tolist())]
            else:
                raise ValueError(f"prompt {i} is a {type(p).__name__}; give a string or a list (or 1-D array) of "
                                 "token ids")
            if not ids:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary (0..{vocab - 1})")
            out.append(ids)
        return out

    def _check(self, ids: list[list[int]], params: list[SamplingParams]) -> None:
        """Every limit that could fail mid-run, checked before any work: the target's and the draft's context
        (speculative blocks are clipped near the end of the target's context, so whatever fits there is served),
        the KV memory budget (a request that alone would not fit it could never join), and sampling values the
        model's dtype cannot compute."""
        ctx, draft_ctx = self._contexts()
        dtype = self.target.dtype
        smallest = torch.finfo(torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype).tiny
        for i, (p, sp) in enumerate(zip(ids, params)):
            need = len(p) + sp.max_tokens
            if ctx is not None and need > ctx:
                raise ValueError(
                    f"prompt {i}: {len(p)} prompt tokens + max_tokens {sp.max_tokens} = {need} "
                    f"exceeds the model's context of {ctx} positions"
                )
            if draft_ctx is not None and need > draft_ctx:
                raise ValueError(
                    f"prompt {i}: {len(p)} prompt tokens + max_tokens {sp.max_tokens} = {need} exceeds the draft "
                    f"model's context of {draft_ctx} positions; use a draft with a longer context, or prompt-lookup"
                )
            refusal = self.memory.refusal(len(p), sp.max_tokens)
            if refusal is not None:
                raise ValueError(f"prompt {i}: {refusal}; ask for fewer tokens or raise kv_memory")
            if 0 < sp.temperature < smallest:
                raise ValueError(
                    f"prompt {i}: temperature {sp.temperature} cannot be represented in {dtype}'s sampling arithmetic; "
                    f"use at least {smallest:.3g}, or 0 for greedy decoding"
                )

    def _contexts(self) -> tuple[int | None, int | None]:
        """The target's and the draft model's context lengths (None: unlimited, or no draft model)."""
        draft = context_length(self.draft) if isinstance(self.drafter, ModelDrafter) else None
        return context_length(self.target), draft

    def _params(self, prompts, sampling_params) -> list[SamplingParams]:
        """One validated copy of the sampling params per prompt."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(sp).__name__}")
            if sp.stop and self.tokenizer is None:
                raise ValueError("stop strings need a tokenizer; pass tokenizer= or use stop_token_ids")
            if sp.structured() is not None and self.tokenizer is None:
                raise ValueError("structured output needs a tokenizer; pass tokenizer=")
        return [dataclasses.replace(sp) for sp in params]  # validated again: fields may have changed since

    def requests(self, prompts, sampling_params=None) -> tuple[list[list[int]], list[Request]]:
        """Validate ``prompts`` and their params; returns (token ids, engine requests numbered 0..n-1)."""
        params = self._params(prompts, sampling_params)
        ids = self._encode(prompts)
        self._check(ids, params)
        eos = eos_ids(self.target)
        stops = [set(sp.stop_token_ids) | (set() if sp.ignore_eos else eos) for sp in params]
        seeds = [sp.seed if sp.seed is not None else int(torch.randint(2**62, ())) for sp in params]
        return ids, [
            Request(p, sp.max_tokens, stop, sp.temperature, sp.top_k, sp.top_p, seed, id=i, logprobs=sp.logprobs,
                    cache_salt=sp.cache_salt, prompt_logprobs=sp.prompt_logprobs, grammar=sp.structured(),
                    **{name: getattr(sp, name) for name in PROCESSORS})
            for i, (p, sp, stop, seed) in enumerate(zip(ids, params, stops, seeds))
        ]

    def engine(self, prefill_tokens: int | None = None, prefill_chunk: int | None = None) -> Engine:
        """A step-able engine over this LLM's models and components (``add_request`` / ``step`` / ``abort``);
        ``prefill_tokens``, ``prefill_chunk``: see ``Engine``."""
        return Engine(self.parts, self.scheduler, self.batch_size, self.stats, self.check_invariants, self.profile,
                      prefill_tokens, self.memory.budget, prefill_chunk)

    def output(self, prompt_ids: list[int], f, stream: TextStream | None = None) -> RequestOutput:
        """A ``RequestOutput`` from an engine's ``Finished``; cut before its stop string when ``stream`` (its text
        with the request's stop strings) met one."""
        ids, text, reason, lps = f.token_ids, None, f.reason, f.logprobs
        if stream is not None and stream.stopped is not None:
            n = len(stream.ids)
            ids, text, reason, lps = ids[:n], stream.text, "stop", None if lps is None else lps[:n]
        elif self.tokenizer:
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return RequestOutput(
            prompt_token_ids=prompt_ids,
            token_ids=ids,
            text=text,
            finish_reason=reason,
            num_rounds=f.rounds,
            num_drafted=f.drafted,
            num_accepted=f.accepted,
            logprobs=lps,
            prompt_logprobs=f.prompt_logprobs,
        )

    def generate(self, prompts, sampling_params=None, progress: bool = False, on_tokens=None) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. ``on_tokens(index, new_token_ids, finished)`` (optional) is called
        after every engine step for each prompt that gained tokens, to stream them.

        If anything raises mid-run, the exception propagates with ``exc.outputs``: a list in prompt order holding
        the ``RequestOutput`` of every prompt that had finished and None for the others; the ``LLM`` stays usable.

        ``prompts``: a list of prompts, each a string or a list (or 1-D array) of token ids; a string, or one list of
        token ids, alone is one prompt (as in vLLM), not a prompt per character or per token."""
        prompts = _prompt_list(prompts)
        if not prompts:
            return []
        params = self._params(prompts, sampling_params)
        ids, requests = self.requests(prompts, params)
        # stop strings: the output's text as the server streams it; a request whose text met one is aborted
        streams = {i: TextStream(self.tokenizer, sp.stop) for i, sp in enumerate(params) if sp.stop}
        results: list[RequestOutput | None] = [None] * len(ids)
        engine = self.engine()
        for r in requests:
            engine.add_request(r)
        t0 = time.perf_counter()
        try:
            with Progress(progress, len(ids), "generating") as bar:
                while engine.has_work():
                    for o in engine.step():
                        new, stream = o.new_token_ids, streams.get(o.request_id)
                        if stream is not None:
                            new = stream.add(new)[0]
                            if stream.stopped is not None and o.finished is None:
                                engine.abort(o.request_id)
                        if on_tokens is not None and (new or o.finished):
                            on_tokens(o.request_id, new, o.finished is not None)
                        if o.finished is not None:
                            results[o.request_id] = self.output(ids[o.request_id], o.finished, stream)
                            bar.advance()
        except BaseException as exc:
            engine.reset()
            try:
                exc.outputs = list(results)
            except AttributeError:  # an exception type that takes no attributes
                pass
            raise
        finally:
            self.stats.total += time.perf_counter() - t0
        return results

    def chat(self, messages, sampling_params=None, progress: bool = False, add_generation_prompt: bool = True,
             chat_template: str | None = None) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: generate for one conversation (a list of ``{"role": ..., "content": ...}`` messages)
        or a list of them, each rendered by the tokenizer's chat template (``chat_template``: a Jinja template to
        use instead), as ``generate`` does; one ``RequestOutput`` per conversation, in order."""
        from .prompts import chat_ids

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; pass tokenizer=")
        if not (chat_template or getattr(self.tokenizer, "chat_template", None)):
            raise ValueError("the tokenizer has no chat template; pass chat_template= (a Jinja template), or give "
                             "generate() the prompt text")
        one = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else list(messages)
        for i, conversation in enumerate(conversations):
            ok = isinstance(conversation, (list, tuple)) and conversation and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in conversation)
            if not ok:
                raise ValueError(f"conversation {i} must be a non-empty list of {{'role': str, 'content': str}} "
                                 "messages")
        ids = [chat_ids(self.tokenizer, list(c), add_generation_prompt, chat_template) for c in conversations]
        return self.generate(ids, sampling_params, progress=progress)


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list: a string, or one list / 1-D array of token ids, is a single prompt."""
    if isinstance(prompts, str) or getattr(prompts, "ndim", None) == 1:
        return [prompts]
    prompts = list(prompts)
    one = all(getattr(t, "ndim", None) == 0 or isinstance(t, numbers.Integral) and not isinstance(t, bool)
              for t in prompts)
    return [prompts] if prompts and one else prompts


def shared_draft(draft, target, weights: str = "fp32"):
    """``draft`` loaded once, to share between several ``LLM`` over ``target`` (a draft model's weights), or as it
    is where each ``LLM`` builds its own drafter (prompt lookup, a feature-reading head: small, and tied to one
    runner)."""
    if not isinstance(draft, (str, os.PathLike)) or draft == "prompt-lookup" or is_eagle(resolve(draft, "draft")):
        return draft
    return load_model(draft, target.dtype, target.device, "draft", weights)


def _token_id(t, prompt: int) -> int:
    """An integer token id (bool, float, str and other types are refused, numpy / torch integers accepted)."""
    if isinstance(t, bool) or not isinstance(t, numbers.Integral):
        if isinstance(t, torch.Tensor) and t.dim() == 0 and not t.is_floating_point() and t.dtype != torch.bool:
            return int(t)
        raise ValueError(f"prompt {prompt} has token {t!r} of type {type(t).__name__}; token ids are integers")
    return int(t)
