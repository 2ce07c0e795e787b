"""GPU measurements for static-shape (CUDA-graph) steps: one process, tables written as they are measured.

    python scripts/gpu_bench.py --target MODEL --draft DRAFT --spec-bench question.jsonl --out DIR [--device cuda]

The prompt set: the first 6 Spec-Bench prompts of summarization, rag, qa, translation and math_reasoning, then the
first of each MT-bench category (38, first turns, chat template). Measured, in order (each section appends to
DIR/gpu.md and DIR/gpu.json):
1. the oracle: HF ``generate`` at batch 1 (its tokens/s is HF batch 1), then HF at the large batch;
2. plain decoding at the large batch with graphs off and on (tokens/s, decode step ms, exact match);
3. speculative engines (draft model, prompt lookup; adaptive and fixed) at the large batch;
4. batch 1 on the first ``--bs1`` prompts: plain with graphs off and on, the speculative engines;
5. bf16: the audit (plain and slotmask) at batch ``--bf16-batch`` on the first that many prompts.
``--quick`` shrinks everything for a CPU rehearsal.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import batchspec
from batchspec.bench import eos_ids, hf_generate
from batchspec.prompts import encode

SETS = [("summarization", 6), ("rag", 6), ("qa", 6), ("translation", 6), ("math_reasoning", 6)] + [
    (c, 1) for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")]


def spec_bench_38(path) -> list[str]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    out = []
    for category, n in SETS:
        out += [r["turns"][0] for r in rows if r["category"] == category][:n]
    return out


class Report:
    def __init__(self, out: Path):
        self.out, self.rows, self.t0 = out, [], time.perf_counter()
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu.md").write_text("| what | batch | tok/s | step ms | mean acc. len | exact | graphs | note |\n"
                                    "|---|---|---|---|---|---|---|---|\n")

    def add(self, what, bs, tps, step_ms=None, mal=None, exact=None, graphs=None, note=""):
        row = dict(what=what, batch=bs, tok_s=round(tps, 1), step_ms=step_ms and round(step_ms, 2),
                   mean_accepted_length=mal and round(mal, 3), exact=exact, graphs=graphs, note=note,
                   at_s=round(time.perf_counter() - self.t0, 1))
        self.rows.append(row)
        (self.out / "gpu.json").write_text(json.dumps(self.rows, indent=1))
        cells = [what, bs, row["tok_s"], row["step_ms"], row["mean_accepted_length"], exact, graphs, note]
        with open(self.out / "gpu.md", "a") as f:
            f.write("| " + " | ".join("" if c is None else str(c) for c in cells) + " |\n")
        print(row, flush=True)


def run_engine(model, draft, ids, oracle, bs, max_tokens, graphs, speculation="adaptive", k=5, reps=2):
    """Best of ``reps`` timed runs after a full warm-up run (graphs captured there); stats of the best."""
    llm = batchspec.LLM(model, draft=draft, batch_size=bs, graphs=graphs, speculation=speculation,
                        num_draft_tokens=k, profile=True)
    sp = batchspec.SamplingParams(max_tokens=max_tokens)
    llm.generate(ids, sp)
    best = None
    for _ in range(reps):
        llm.reset_stats()
        torch.cuda.synchronize() if model.device.type == "cuda" else None
        t0 = time.perf_counter()
        outs = llm.generate(ids, sp)
        secs = time.perf_counter() - t0
        if best is None or secs < best[0]:
            best = (secs, outs, llm.stats)
    secs, outs, s = best
    exact = sum(o.token_ids == r for o, r in zip(outs, oracle)) / len(oracle)  # the rows that have an oracle
    static = llm.parts.target.static
    info = f"captured {static.captured}" if static and static.capture else ""
    return s.generated / secs, 1000 * s.verify / max(s.verify_calls, 1), s.mean_accepted_length, exact, info, s


def profile_rounds(model, ids, max_tokens, path: Path) -> None:
    """Kernel and operator times of 10 plain rounds at batch ``len(ids)`` (after 6 warm-up rounds), and the replay
    time of the captured decode graph alone."""
    from torch.profiler import ProfilerActivity, profile

    llm = batchspec.LLM(model, batch_size=len(ids), graphs="auto")
    eng = llm.engine()
    for r in llm.requests(ids, batchspec.SamplingParams(max_tokens=max_tokens))[1]:
        eng.add_request(r)
    for _ in range(6):
        eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(10):
            eng.step()
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        eng.step()
    sync()
    lines = [f"10 plain rounds at batch {len(ids)}: {1000 * (time.perf_counter() - t0) / 10:.2f} ms a round"]
    static = llm.parts.target.static
    for shapes, _ in (static._sets.values() if static else ()):
        for key, shape in shapes.items():
            if shape.graph is not None:
                sync()
                t0 = time.perf_counter()
                for _ in range(20):
                    shape.graph.replay()
                sync()
                ms = 1000 * (time.perf_counter() - t0) / 20
                lines.append(f"graph {key} (rows, capacity, span, q, keep): {ms:.2f} ms a replay")
    by = "cuda_time_total" if model.device.type == "cuda" else "cpu_time_total"
    lines += [prof.key_averages().table(sort_by=by, row_limit=30),
              prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)]
    path.write_text("\n".join(lines))
    print(lines[0], *[x for x in lines if x.startswith("graph")], sep="\n", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--spec-bench", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--bs1", type=int, default=8)
    p.add_argument("--bf16-batch", type=int, default=12)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip-bf16", action="store_true")
    p.add_argument("--oracle-prompts", type=int, default=None, help="HF batch-1 oracle for the first N prompts only")
    p.add_argument("--profile", action="store_true", help="profile plain rounds at the large batch (profile.txt)")
    p.add_argument("--speculation", default="adaptive,fixed", help="policies measured for the speculative engines")
    p.add_argument("--bs1-graphs", default="off,auto", help="graph modes of plain decoding at batch 1")
    a = p.parse_args(argv)
    rep = Report(Path(a.out))
    llm0 = batchspec.LLM(a.target, dtype=torch.float32, device=a.device)
    model, tok = llm0.target, llm0.tokenizer
    texts = spec_bench_38(a.spec_bench)
    if a.quick:
        texts = texts[:4]
    ids = encode(tok, texts, True)
    draft = batchspec.api.shared_draft(a.draft, model)
    stops = eos_ids(model)
    big = len(ids)
    print(f"{big} prompts, {min(map(len, ids))}-{max(map(len, ids))} tokens", flush=True)

    oracle, secs = hf_generate(model, ids[: a.oracle_prompts], a.max_tokens, stops, 1)
    rep.add("HF generate", 1, sum(map(len, oracle)) / secs, note=f"the oracle ({len(oracle)} prompts)")
    outs, secs = hf_generate(model, ids, a.max_tokens, stops, big)
    rep.add("HF generate", big, sum(map(len, outs)) / secs,
            exact=sum(o == r for o, r in zip(outs, oracle)) / len(oracle))

    for graphs in ("off", "auto"):
        tps, step, mal, exact, info, _ = run_engine(model, None, ids, oracle, big, a.max_tokens, graphs)
        rep.add("plain", big, tps, step, mal, exact, graphs, info)
    if a.profile:
        profile_rounds(model, ids, a.max_tokens, Path(a.out) / "profile.txt")
    for name, d in (("slotmask + draft", draft), ("slotmask + lookup", "prompt-lookup")):
        for spec in a.speculation.split(","):
            tps, step, mal, exact, info, s = run_engine(model, d, ids, oracle, big, a.max_tokens, "auto", spec)
            rep.add(f"{name} ({spec})", big, tps, step, mal, exact, "auto",
                    f"{info}; lengths {dict(sorted(s.lengths.items()))}")

    few, few_oracle = ids[: a.bs1], oracle[: a.bs1]
    for graphs in a.bs1_graphs.split(","):
        tps, step, mal, exact, info, _ = run_engine(model, None, few, few_oracle, 1, a.max_tokens, graphs, reps=1)
        rep.add("plain", 1, tps, step, mal, exact, graphs, info)
    for name, d in (("slotmask + draft", draft), ("slotmask + lookup", "prompt-lookup")):
        for spec in a.speculation.split(","):
            tps, step, mal, exact, info, s = run_engine(model, d, few, few_oracle, 1, a.max_tokens, "auto", spec,
                                                        reps=1)
            rep.add(f"{name} ({spec})", 1, tps, step, mal, exact, "auto",
                    f"{info}; lengths {dict(sorted(s.lengths.items()))}")

    if a.skip_bf16:
        return 0
    from batchspec.audit import audit

    n16 = min(a.bf16_batch, big)
    report = audit(a.target, a.draft, prompts=ids[:n16], engines=("plain", "slotmask"), batch_sizes=(n16,),
                   max_tokens=a.max_tokens, dtype=torch.bfloat16, device=a.device)
    (Path(a.out) / "audit_bf16.md").write_text(report.to_markdown())
    report.to_json(Path(a.out) / "audit_bf16.json", outputs=False)
    print(report.to_markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
