"""Measure a draft (a feature-reading head or a draft model, e.g. one ``batchspec train-draft`` wrote) against its
target: mean accepted length at K draft tokens on the built-in prompts (and the 8 Spec-Bench prompts), the draft's
multiply-accumulates per token and the cost of a drafting step relative to a target decode step.

    python scripts/eval_draft.py --draft DIR [--target smollm2-135m] [--spec-bench question.jsonl] [--check-hf 3]
    python scripts/eval_draft.py --draft smollm2-135m-draft-model --decode-steps --repeats 3 --check-hf 6

``--decode-steps`` also times a whole-model decode step of a draft model against the target's through HF (the draft
model card's figures).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from batchspec.training.data import log


def macs_per_token(modules) -> int:
    """Weight multiply-accumulates of one token through ``modules`` (every linear layer incl. the output heads; no
    attention scores)."""
    from batchspec.model.weights import PackedLinear

    return sum(m.in_features * m.out_features for mod in modules for m in mod.modules()
               if isinstance(m, (torch.nn.Linear, PackedLinear)))  # packed weights (``weights="auto"``) count alike


@torch.no_grad()
def step_costs(llm, batch_sizes=(1, 8), context: int = 256, repeats: int = 40) -> dict:
    """Measured time of one drafting step (a draft model's decode step; a head's ``fc`` and layer over one pair per
    row, with its restricted output head) against one target decode step (one token per row), both through their
    runners over caches of ``context`` positions, interleaved; medians of ``repeats`` pairs."""
    from batchspec.model.kv import new_cache
    from batchspec.model.runner import Runner

    d, target = llm.drafter, llm.target
    runner, eagle = Runner(target), d.name == "eagle"
    out = {}
    for b in batch_sizes:
        ids = torch.randint(3, 1000, (b, context + 1))
        pos = torch.arange(context)[None].expand(b, -1)
        tc, dc = new_cache(target), new_cache(d.model)
        feats = runner.forward(tc, ids[:, :context], pos, None, 1, "all").hidden
        extra = dict(hidden=True, embeds=d._inputs(ids[:, 1:], feats)) if eagle else {}
        d.runner.forward(dc, ids[:, :context], pos, None, 1, **extra)
        times = {"target": [], "draft": []}
        for r in range(repeats + 3):
            n = context + r
            p1, seen = torch.full((b, 1), n), torch.ones((b, n + 1), dtype=torch.bool)
            t0 = time.perf_counter()
            runner.forward(tc, ids[:, -1:], p1, seen, 1)
            t1 = time.perf_counter()
            extra = dict(hidden=True, embeds=d._inputs(ids[:, -1:], feats[:, -1:])) if eagle else {}
            d.runner.forward(dc, ids[:, -1:], p1, seen, 1, **extra)
            t2 = time.perf_counter()
            if r >= 3:  # warm-up
                times["target"].append(t1 - t0)
                times["draft"].append(t2 - t1)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        out[f"batch_{b}"] = {"target_step_ms": round(med["target"] * 1e3, 3), "draft_step_ms": round(
            med["draft"] * 1e3, 3), "ratio": round(med["draft"] / med["target"], 4)}
        log(f"batch {b}: target decode step {med['target'] * 1e3:.2f} ms, drafting step {med['draft'] * 1e3:.2f} ms, "
            f"ratio {med['draft'] / med['target']:.3f}")
    return out


@torch.no_grad()
def step_seconds(model, batch: int, context: int, steps: int, repeats: int) -> float:
    """Best-of-``repeats`` mean wall time of one single-token HF decode step over a ``context``-token cache."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, context + steps), generator=g)
    best = float("inf")
    for _ in range(repeats):
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        for i in range(steps):
            model(input_ids=ids[:, context + i: context + i + 1], past_key_values=cache, use_cache=True,
                  logits_to_keep=1)
        best = min(best, (time.perf_counter() - t) / steps)
    return best


def specbench_prompts(path: str) -> list[str]:
    """The 8-prompt Spec-Bench set: the first two of summarization, rag, qa and translation."""
    recs = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return [r["turns"][0] for c in ("summarization", "rag", "qa", "translation")
            for r in [r for r in recs if r.get("category") == c][:2]]


@torch.no_grad()
def evaluate(args) -> dict:
    import batchspec
    from batchspec.data import builtin_prompts
    from batchspec.prompts import encode

    torch.set_num_threads(args.threads)
    draft = args.draft
    if args.no_copy:  # the head alone, without prompt lookup's copies
        from batchspec.drafters import EagleDrafter
        from batchspec.model.loading import load_model, resolve

        draft = EagleDrafter.load(resolve(args.draft, "draft"), load_model(args.target, None, "cpu", "target"),
                                  copy=False)
    llm = batchspec.LLM(args.target, draft=draft, num_draft_tokens=args.k, batch_size=args.batch_size,
                        speculation=args.speculation, device="cpu")
    d = llm.drafter
    res = {"draft": args.draft, "kind": d.name, "copies": getattr(d, "copy", None) is not None, "k": args.k,
           "max_tokens": args.max_tokens}
    if d.name == "eagle":
        res["draft_macs_per_token"] = macs_per_token([d.model, d.fc])  # fc, the layer and the restricted head
        res["head_tokens"] = len(d.token_map)
    elif d.name == "model":
        res["draft_macs_per_token"] = macs_per_token([d.model])
    if "draft_macs_per_token" in res:  # a model-free drafter (prompt lookup) has none
        res["target_macs_per_token"] = macs_per_token([llm.target])
        res["macs_ratio"] = round(res["draft_macs_per_token"] / res["target_macs_per_token"], 4)
        log(f"multiply-accumulates per token: target {res['target_macs_per_token'] / 1e6:.1f} M, draft "
            f"{res['draft_macs_per_token'] / 1e6:.2f} M, ratio {res['macs_ratio']:.3f}")
    if d.name in ("eagle", "model"):
        res["step_costs"] = step_costs(llm)
    if args.decode_steps and d.name == "model":
        for b in (1, 8):
            tt = step_seconds(llm.target, b, 128, 16, args.repeats)
            dt = step_seconds(d.model, b, 128, 16, args.repeats)
            res[f"step_ms_batch{b}"] = {"target": round(tt * 1e3, 2), "draft": round(dt * 1e3, 2),
                                        "ratio": round(dt / tt, 4)}
            log(f"decode step at batch {b}: target {tt * 1e3:.2f} ms, draft {dt * 1e3:.2f} ms, ratio {dt / tt:.3f}")
    sets = [("builtin", encode(llm.tokenizer, [t for _, t in builtin_prompts()], True))]
    if args.spec_bench:
        sets.append(("spec_bench_8", encode(llm.tokenizer, specbench_prompts(args.spec_bench), True)))
    for name, prompts in sets:
        llm.reset_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=args.max_tokens))
        s = llm.stats
        res[name] = {"prompts": len(prompts), "generated": s.generated,
                     "mean_accepted_length": round(s.mean_accepted_length, 4),
                     "acceptance_rate": round(s.accepted / max(s.drafted, 1), 4),
                     "seconds": round(time.perf_counter() - t0, 1)}
        log(f"{name}: K={args.k} mean accepted length {s.mean_accepted_length:.3f} ({s.generated} tokens)")
        if args.check_hf:
            same = sum(llm.target.generate(torch.tensor([p]), max_new_tokens=args.max_tokens, do_sample=False)[
                0, len(p):].tolist() == o.token_ids for p, o in list(zip(prompts, outs))[: args.check_hf])
            res[name]["identical_to_hf_generate"] = f"{same}/{min(args.check_hf, len(prompts))}"
            log(f"{name}: identical to HF generate (batch size 1): {res[name]['identical_to_hf_generate']}")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default="smollm2-135m-draft")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--speculation", choices=["fixed", "adaptive"], default="fixed")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--spec-bench", default=None, help="Spec-Bench question.jsonl: also the 8-prompt set")
    p.add_argument("--check-hf", type=int, default=0, metavar="N")
    p.add_argument("--no-copy", action="store_true", help="a head drafts alone, without prompt lookup's copies")
    p.add_argument("--decode-steps", action="store_true", help="a draft model: also HF decode steps, draft vs target")
    p.add_argument("--repeats", type=int, default=5, help="--decode-steps: best of N timings")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = evaluate(args)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
