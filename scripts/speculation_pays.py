"""Does speculation pay? Plain decoding against speculative engines in one process, in repeated rounds, same prompts.

    .venv/bin/python scripts/speculation_pays.py [--prompts FILE] [--categories summarization,rag] [--skip 2]
        [--take 4] [--batch-sizes 1,8] [--drafts smollm2-135m-draft,prompt-lookup] [--speculation adaptive,fixed]
        [--max-tokens 64] [--pairs 3] [--out out/speculation.json]

Each repetition runs plain decoding, then every (draft, speculation) engine, on the same prompts (chat template):
the printed ratios are medians over repetitions of engine ÷ plain tokens per second, end to end (prefill
included) and in decode time only. Without ``--prompts`` the built-in prompt set is used (``--categories`` and
``--skip`` / ``--take`` pick prompts within each category, in file order). Every output is checked equal to plain
decoding's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import batchspec
from batchspec.prompts import encode


def pick(path, categories, skip, take) -> list[str]:
    """Prompt texts: ``skip`` then ``take`` prompts of each category in file order (all prompts without categories)."""
    if path is None:
        from batchspec.data import builtin_records

        records = builtin_records()
    else:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    groups = [[r for r in records if r.get("category") == c] for c in categories] if categories else [records]
    return [r["turns"][0] for g in groups for r in g[skip : skip + take if take else None]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--categories", default="")
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--take", type=int, default=0)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--drafts", default="smollm2-135m-draft,prompt-lookup")
    ap.add_argument("--speculation", default="adaptive,fixed")
    ap.add_argument("--num-draft-tokens", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    texts = pick(args.prompts, [c for c in args.categories.split(",") if c], args.skip, args.take)
    plain = batchspec.LLM("smollm2-135m")
    prompts = encode(plain.tokenizer, texts, True)
    print(f"{len(prompts)} prompts, {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
    params = batchspec.SamplingParams(max_tokens=args.max_tokens)
    # no kept prefixes: the prompts repeat (warm-up, pairs), and each run is to compute them as the first did
    engines = {"plain": lambda bs: batchspec.LLM(plain.target, tokenizer=plain.tokenizer, batch_size=bs,
                                                 prefix_cache=0)}
    for d in [d for d in args.drafts.split(",") if d]:
        for s in [s for s in args.speculation.split(",") if s]:
            engines[f"{d}:{s}"] = (lambda d, s: lambda bs: batchspec.LLM(
                plain.target, draft=d, tokenizer=plain.tokenizer, batch_size=bs, speculation=s,
                num_draft_tokens=args.num_draft_tokens, prefix_cache=0))(d, s)
    results = {}
    for bs in [int(b) for b in args.batch_sizes.split(",")]:
        llms = {name: make(bs) for name, make in engines.items()}
        for llm in llms.values():  # warm-up: kernels, buffers, and the adaptive policy's first costs
            llm.generate(prompts, params)
        runs = {name: [] for name in llms}
        reference = None
        for rep in range(args.pairs):
            for name, llm in llms.items():
                llm.reset_stats()
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                wall = time.perf_counter() - t
                tokens = [o.token_ids for o in outs]
                reference = reference or tokens
                s = llm.stats
                runs[name].append(dict(wall=wall, decode=wall - s.prefill, generated=s.generated,
                                       mean_accepted_length=s.mean_accepted_length, lengths=dict(s.lengths),
                                       decisions=dict(s.decisions), exact=tokens == reference))
        for name, rs in runs.items():
            e2e = [runs["plain"][i]["wall"] / r["wall"] for i, r in enumerate(rs)]
            dec = [runs["plain"][i]["decode"] / r["decode"] for i, r in enumerate(rs)]
            results[f"{name}@{bs}"] = dict(
                batch_size=bs, end_to_end=statistics.median(e2e), end_to_end_range=[min(e2e), max(e2e)],
                decode=statistics.median(dec), decode_range=[min(dec), max(dec)],
                tok_s=statistics.median(r["generated"] / r["wall"] for r in rs),
                mean_accepted_length=statistics.median(r["mean_accepted_length"] for r in rs),
                lengths=rs[-1]["lengths"], decisions=rs[-1]["decisions"], exact=all(r["exact"] for r in rs))
            r = results[f"{name}@{bs}"]
            print(f"{name:34s} bs {bs:2d}  {r['tok_s']:6.1f} tok/s  x plain {r['end_to_end']:.2f} "
                  f"({r['end_to_end_range'][0]:.2f}-{r['end_to_end_range'][1]:.2f})  decode x {r['decode']:.2f} "
                  f"({r['decode_range'][0]:.2f}-{r['decode_range'][1]:.2f})  acc.len {r['mean_accepted_length']:.2f}"
                  f"  exact {r['exact']}  lengths {r['lengths']}  decisions {r['decisions']}", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
