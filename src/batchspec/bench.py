"""``batchspec bench``: throughput of each engine next to HF ``generate`` on the same prompts in the same process,
with the stage split, alignment overhead, engine efficiency and exact match against the batch-size-1 oracle.

Engines: ``plain`` (no drafter), ``slotmask`` / ``eqspec`` (the given draft), ``slotmask-lookup`` /
``eqspec-lookup`` (prompt lookup), ``fault:<name>`` (eqspec with an injected fault, to show the check at work), each
optionally suffixed ``:fixed`` / ``:adaptive`` (the speculation length policy; default ``--speculation``, fixed for
faults) and ``@<scheduler>`` (e.g. ``slotmask:fixed@continuous``). Rows that are not exact get the audit's signature.
Definitions:
- tokens/s: generated tokens / wall seconds of ``generate`` (prefill included); per batch size each engine is
  warmed up on the prompts, then all run ``--repeats`` times interleaved, and a row is the median run.
- x plain: the median (and range) over those repetitions of the engine's tokens/s over ``plain``'s in the same
  repetition: the speed claim to read (the machine drifts; side by side, the drift falls on both).
- alignment overhead: align seconds / decode seconds (draft + verify + align + schedule), as the paper defines it;
  for ``@exspec`` engines the copies between the window and the batch (schedule) count as alignment work too.
- efficiency: achieved decode speedup over ``plain`` at the same batch size (generated tokens per decode second,
  prefill excluded, as it is the same for both) / the ideal speedup
  ``mean accepted length x (plain's forward seconds per row-round) / (verify + draft seconds per row-round)``
  (a row-round is one row in one round; rows leave the batch as they finish, so per round would mislead):
  what the engine's own bookkeeping leaves of what speculation could give.
- exact match: fraction of outputs equal to HF ``generate(do_sample=False)`` at batch size 1 (the HF batch-1 run).
- grouping rate (``@exspec`` engines): share of rounds whose batch had rows of one length (no realignment needed).
  ``--truncate N`` makes the paper's identical-length set (every prompt cut to N tokens) to compare with.
"""

from __future__ import annotations

import copy
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .audit.oracle import greedy_generate
from .engine.names import parse_engines
from .model.loading import eos_ids
from .progress import Progress


@dataclass
class BenchRow:
    engine: str
    batch_size: int
    tokens: int
    seconds: float
    tokens_per_second: float
    speedup_vs_hf_bs1: float | None = None
    speedup_vs_hf_same_bs: float | None = None
    mean_accepted_length: float | None = None
    exact_match: float | None = None
    stages: dict = field(default_factory=dict)
    alignment_overhead: float | None = None
    efficiency: float | None = None
    grouping_rate: float | None = None
    signature: str | None = None  # "clean" when exact; else the audit's signature for this engine and batch size
    repeats: int = 1  # timed runs (the row's figures are the median run's)
    vs_plain: float | None = None  # median over repetitions of tokens/s over plain's in the same repetition
    vs_plain_range: list | None = None  # [min, max] of those ratios


def parse_engine(name: str, draft, speculation: str = "adaptive") -> dict:
    """The ``LLM`` arguments of the engine ``name`` (grammar: ``engine.names``), given the run's ``draft``."""
    specs = parse_engines([name])
    if len(specs) != 1:
        raise ValueError(f"engine {name!r} names several engines; list them one by one")
    spec = specs[0]
    if spec.drafter == "draft" and draft is None:
        raise ValueError(f"engine {name!r} needs a draft model (--draft)")
    return dict(draft=spec.draft(draft), layout=spec.layout, scheduler=spec.scheduler, fault=spec.fault,
                speculation=spec.policy(speculation))


def hf_generate(model, prompts, max_tokens, stops, batch_size):
    """HF greedy ``generate`` over left-padded batches; returns (outputs cut after the first stop token, seconds)."""
    pad = min(stops) if stops else 0
    outs, t0 = [], time.perf_counter()
    for s in range(0, len(prompts), batch_size):
        chunk = prompts[s : s + batch_size]
        if batch_size == 1:
            outs.append(greedy_generate(model, chunk[0], max_tokens, stops))
            continue
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=0, eos_token_id=sorted(stops) or None, pad_token_id=pad)
        for row in out[:, width:].tolist():
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            outs.append(row[:cut])
    return outs, time.perf_counter() - t0


def bench(target, draft, prompts, engines=("plain", "slotmask", "eqspec"), batch_sizes=(1, 8), max_tokens=128,
          num_draft_tokens=5, tokenizer=None, hf=True, progress=False, speculation="adaptive",
          repeats=3, weights="auto", dtype=None, device=None) -> list[BenchRow]:
    """One row per (engine, batch size). Per batch size every engine is built afresh and warmed up on the prompts
    (kernels, buffers, and the adaptive policy's first costs), then the engines run ``repeats`` times, interleaved
    (engine 1, 2, ..., 1, 2, ...), so the machine's drift falls on all alike: a row reports the median run
    (tokens/s, stages, accepted length), the worst exact match, and, with ``plain`` among the engines, the median and
    range over repetitions of its tokens/s over plain's in the same repetition (``vs_plain``). HF runs once, always
    on the fp32 weights (it is the reference); ``weights`` is what batchspec's engines run on (see ``LLM``)."""
    import batchspec
    from batchspec.api import shared_draft

    if not prompts:
        raise ValueError("no prompts to benchmark")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    from batchspec.model.loading import load_model

    llm0 = batchspec.LLM(target, tokenizer=tokenizer, weights="fp32", dtype=dtype, device=device)
    model = llm0.target
    engine_model = model if weights == "fp32" or not isinstance(target, (str, os.PathLike)) else load_model(
        target, model.dtype, model.device, "target", weights)
    ids = llm0._encode(prompts)
    stops = eos_ids(model)
    specs = {e: parse_engine(e, draft, speculation) for e in engines}
    if isinstance(draft, str) and any(s["draft"] is draft for s in specs.values()):
        draft = shared_draft(draft, model, weights)  # load once, share between engines
        specs = {e: parse_engine(e, draft, speculation) for e in engines}
    total = 1 + (sum(b != 1 for b in batch_sizes) if hf else 0) + repeats * len(batch_sizes)
    with Progress(progress, total, "benchmarking") as bar:
        params = batchspec.SamplingParams(max_tokens=max_tokens)
        rows, hf_tps, plain = [], {}, {}
        oracle, secs = hf_generate(model, ids, max_tokens, stops, 1)
        n_oracle = sum(map(len, oracle))
        hf_tps[1] = n_oracle / secs
        rows.append(BenchRow("hf", 1, n_oracle, secs, hf_tps[1], 1.0, 1.0, exact_match=1.0))
        bar.advance()
        if hf:
            for bs in batch_sizes:
                if bs == 1:
                    continue
                outs, secs = hf_generate(model, ids, max_tokens, stops, bs)
                n = sum(map(len, outs))
                hf_tps[bs] = n / secs
                exact = sum(o == r for o, r in zip(outs, oracle)) / len(ids)
                rows.append(BenchRow("hf", bs, n, secs, hf_tps[bs], hf_tps[bs] / hf_tps[1], 1.0, exact_match=exact))
                bar.advance()
        for bs in batch_sizes:
            llms = {name: batchspec.LLM(engine_model, draft=spec["draft"], tokenizer=tokenizer, weights=weights,
                                        num_draft_tokens=num_draft_tokens, layout=spec["layout"], scheduler=spec["scheduler"], batch_size=bs,
                                        fault=spec.get("fault"), speculation=spec["speculation"],
                                        profile=True,  # exact stage seconds on CUDA too
                                        prefix_cache=0)  # each repeat computes its prompts, as HF does
                    for name, spec in specs.items()}
            for llm in llms.values():  # warm-up: kernels, buffers, and the adaptive policy's first costs
                llm.generate(ids, params)
            runs = {name: [] for name in llms}
            for _ in range(repeats):  # interleaved: the machine's drift falls on every engine alike
                for name, llm in llms.items():
                    llm.reset_stats()
                    t0 = time.perf_counter()
                    outs = llm.generate(ids, params)
                    secs = time.perf_counter() - t0
                    exact = sum(o.token_ids == r for o, r in zip(outs, oracle)) / len(ids)
                    runs[name].append((secs, copy.deepcopy(llm.stats), exact))
                bar.advance()
            for name, spec in specs.items():
                rs = runs[name]
                secs, s, _ = sorted(rs, key=lambda r: r[0])[len(rs) // 2]  # the median run (stages, accepted length)
                decode = s.draft + s.verify + s.align + s.schedule
                row = BenchRow(
                    name, bs, s.generated, secs, s.generated / secs,
                    speedup_vs_hf_bs1=s.generated / secs / hf_tps[1],
                    speedup_vs_hf_same_bs=(s.generated / secs / hf_tps[bs]) if bs in hf_tps else None,
                    mean_accepted_length=s.mean_accepted_length,
                    exact_match=min(r[2] for r in rs),
                    stages={k: round(getattr(s, k), 4) for k in ("prefill", "draft", "verify", "align", "schedule")
                            if hasattr(s, k)},
                    alignment_overhead=(s.align + s.schedule) / decode if decode else None,
                    grouping_rate=getattr(s, "grouping_rate", None),
                    repeats=repeats,
                )
                if "plain" in runs:  # per repetition: this engine's tokens/s over plain's in the same repetition
                    ratios = [p[0] / r[0] * r[1].generated / p[1].generated for p, r in zip(runs["plain"], rs)]
                    row.vs_plain, row.vs_plain_range = statistics.median(ratios), [min(ratios), max(ratios)]
                if row.exact_match < 1.0:
                    row.signature = _signature(model, spec, ids, bs, max_tokens, num_draft_tokens)
                else:
                    row.signature = "clean"
                if name == "plain":
                    plain[bs] = (s.generated / decode, s.verify / max(s.row_rounds, 1))
                elif bs in plain and s.row_rounds and decode:
                    ideal = s.mean_accepted_length * plain[bs][1] / ((s.verify + s.draft) / s.row_rounds)
                    row.efficiency = (s.generated / decode / plain[bs][0]) / ideal
                rows.append(row)
    return rows


def _signature(model, spec, ids, bs, max_tokens, k) -> str:
    """The audit's verdict for an engine that was not exact (numerical near-ties still come out ``clean``)."""
    from .audit import audit

    engine = f"fault:{spec['fault']}" if spec.get("fault") else spec["layout"] if spec["draft"] is not None else "plain"
    engine = f"{engine}:{spec['speculation']}"
    rep = audit(model, spec["draft"], ids, engines=[engine], batch_sizes=[bs], max_tokens=max_tokens,
                num_draft_tokens=k)
    return rep.rows[0].signature


def to_markdown(rows: list[BenchRow]) -> str:
    head = ("| engine | batch | tok/s | x plain (range) | x HF bs1 | x HF same bs | mean acc. len | exact match | "
            "signature | align overhead | efficiency | grouping rate |")
    lines = [head, "|" + "---|" * 12]
    f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    for r in rows:
        lines.append(
            f"| {r.engine} | {r.batch_size} | {r.tokens_per_second:.1f} | {_ratio(r)} | {f(r.speedup_vs_hf_bs1, '.2f')} | "
            f"{f(r.speedup_vs_hf_same_bs, '.2f')} | {f(r.mean_accepted_length, '.2f')} | {f(r.exact_match, '.0%')} | "
            f"{r.signature or '-'} | "
            f"{f(r.alignment_overhead, '.1%')} | {f(r.efficiency, '.0%')} | {f(r.grouping_rate, '.0%')} |"
        )
    return "\n".join(lines) + "\n"


def _ratio(r: BenchRow) -> str:
    if r.vs_plain is None:
        return "-"
    lo, hi = r.vs_plain_range
    return f"{r.vs_plain:.2f}" if r.repeats < 2 else f"{r.vs_plain:.2f} ({lo:.2f}–{hi:.2f})"


def plot(rows: list[BenchRow], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for key, label, fname in (("alignment_overhead", "alignment overhead (align / decode)", "alignment_overhead.png"),
                              ("tokens_per_second", "tokens / s", "throughput.png"),
                              ("grouping_rate", "grouping rate (exspec)", "grouping_rate.png")):
        if not any(getattr(r, key) is not None for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for eng in dict.fromkeys(r.engine for r in rows):
            pts = [(r.batch_size, getattr(r, key)) for r in rows if r.engine == eng and getattr(r, key) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=eng)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(label)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
