"""What the audit can run: batchspec's own engines by name, or any callable ``list[list[int]] -> list[list[int]]``.

Names follow ``batchspec.engine.names`` (the grammar ``bench`` uses too): ``plain``, ``slotmask``, ``eqspec``,
``slotmask-lookup``, ``fault:<name>``, ``faults``, each with an optional ``:fixed`` / ``:adaptive`` and ``@<scheduler>``;
the layouts draft with the audit's draft. A third-party engine is given as ``(name, fn)``, ``(name, fn, dtype)``, an object
with ``.name`` that is callable, or a named function; it receives one batch of prompt ids per call and returns the
generated ids of each (the audit cuts them at the first stop token and at ``max_tokens``). An optional ``dtype``
(attribute or third tuple item) says which precision it computes in, for the margin tolerance.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from ..engine.names import EngineSpec, parse_engines


@dataclass
class BatchspecEngine:
    """A batchspec engine named in the grammar of ``batchspec.engine.names``."""

    spec: EngineSpec
    white_box = True

    @property
    def name(self) -> str:
        return self.spec.name

    def llm(self, ctx, batch_size: int, check: bool = False):
        from ..api import LLM

        s = self.spec
        return LLM(
            ctx.engine_target, draft=s.draft(ctx.draft), tokenizer=ctx.tokenizer, num_draft_tokens=ctx.num_draft_tokens,
            layout=s.layout, scheduler=s.scheduler, batch_size=batch_size, check_invariants=check, fault=s.fault,
            speculation=s.policy(),
        )

    def dtype(self, ctx):
        return ctx.target.dtype

    def run(self, ctx, prompts, batch_size: int) -> tuple[list[list[int]], float]:
        from ..params import SamplingParams

        llm = self.llm(ctx, batch_size)
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=ctx.max_tokens, stop_token_ids=ctx.extra_stops))
        return [o.token_ids for o in outs], time.perf_counter() - t

    def batches(self, n: int, batch_size: int) -> list[list[int]]:
        return [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]  # static batches

    def first_violation(self, ctx, prompts, batch: list[int]):
        """Rerun one batch with the invariant checker on; the ``InvariantError`` raised, or None."""
        from ..batch import InvariantError
        from ..params import SamplingParams

        llm = self.llm(ctx, len(batch), check=True)
        try:
            llm.generate([prompts[i] for i in batch],
                         SamplingParams(max_tokens=ctx.max_tokens, stop_token_ids=ctx.extra_stops))
        except InvariantError as e:
            return e
        return None


@dataclass
class CallableEngine:
    name: str
    fn: Callable
    declared_dtype: object = None
    white_box = False

    def dtype(self, ctx):
        return self.declared_dtype if self.declared_dtype is not None else ctx.target.dtype

    def batches(self, n: int, batch_size: int) -> list[list[int]]:
        return [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]

    def call(self, batch_prompts):
        outs = self.fn([list(p) for p in batch_prompts])
        outs = [list(map(int, o)) for o in outs]
        if len(outs) != len(batch_prompts):
            raise ValueError(f"engine {self.name!r} returned {len(outs)} outputs for {len(batch_prompts)} prompts")
        return outs

    def run(self, ctx, prompts, batch_size: int) -> tuple[list[list[int]], float]:
        out: list[list[int]] = []
        t = time.perf_counter()
        for batch in self.batches(len(prompts), batch_size):
            out += self.call([prompts[i] for i in batch])
        return out, time.perf_counter() - t


def resolve(specs, sampling: bool = False) -> list:
    """Engine objects for the ``engines=`` argument of ``audit``. ``"faults"`` expands to every injected fault that
    the audit can show: with ``sampling``, the rejection sampler's own faults too (they are invisible when greedy)."""
    if isinstance(specs, str):
        specs = [s.strip() for s in specs.split(",") if s.strip()]
    out = []
    for spec in specs:
        if isinstance(spec, str):
            out += [BatchspecEngine(e) for e in parse_engines([spec], sampling)]
        elif isinstance(spec, tuple) and len(spec) in (2, 3) and isinstance(spec[0], str) and callable(spec[1]):
            out.append(CallableEngine(spec[0], spec[1], spec[2] if len(spec) == 3 else None))
        elif callable(spec):
            name = getattr(spec, "name", None) or getattr(spec, "__name__", None)
            if not name or name == "<lambda>":
                raise ValueError("a callable engine needs a name: pass (name, fn) or an object with .name")
            out.append(CallableEngine(str(name), spec, getattr(spec, "dtype", None)))
        else:
            raise TypeError(f"an engine is a name or a callable, got {type(spec).__name__}")
    names = [e.name for e in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"engine names must be unique; repeated: {sorted(dup)}")
    return out
