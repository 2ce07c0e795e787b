"""The compass workload: Spec-Bench prompts (chat template), greedy, one batch, end to end, in batchspec or in a peer.

    .venv/bin/python scripts/compass.py --prompts question.jsonl [--categories summarization,rag,qa,translation]
        [--take 2] [--max-tokens 64] [--batch-size 8] [--repeats 3] [--engine batchspec|vllm] [--out FILE]

``--engine vllm`` runs the same prompts through vLLM's offline ``LLM.generate`` (run it with the Python of an
environment where vLLM is installed; batchspec is not imported then; ``--model`` names the same model's Hugging Face
directory, in fp32; prefix caching off, so that every repeat prefills as batchspec's do). ``--engine batchspec`` runs ``batchspec.LLM`` (plain decoding unless ``--draft``; ``--weights``).
Prints tokens/s of every repeat after a warm-up and their median; ``--out`` writes the token ids, so two engines'
outputs can be compared (``--compare A.json B.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def pick(path, categories, take) -> list[str]:
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    groups = [[r for r in records if r.get("category") == c] for c in categories] if categories else [records]
    return [r["turns"][0] for g in groups for r in g[:take or None]]


def run_vllm(args, texts):
    from vllm import LLM, SamplingParams

    # prefix caching off: every repeat prefills its prompts, as a batchspec run does (with it on, repeats 2.. of the
    # same prompts reuse the first run's cache and measure decoding alone)
    llm = LLM(args.model, dtype="float32", max_num_seqs=args.batch_size, max_model_len=2048, seed=0,
              enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
               for t in texts]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # a BatchEncoding or ids
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def once():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return prompts, once


def run_batchspec(args, texts):
    import batchspec
    from batchspec.prompts import encode

    # no kept prefixes: every repeat computes its prompts, as vLLM here does with prefix caching off
    llm = batchspec.LLM(args.model or "smollm2-135m", draft=args.draft, batch_size=args.batch_size,
                        weights=args.weights, prefix_cache=0)
    prompts = encode(llm.tokenizer, texts, True)
    sp = batchspec.SamplingParams(max_tokens=args.max_tokens)

    def once():
        return [o.token_ids for o in llm.generate(prompts, sp)]

    return prompts, once


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts")
    ap.add_argument("--categories", default="summarization,rag,qa,translation")
    ap.add_argument("--take", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", default="batchspec", choices=["batchspec", "vllm"])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--compare", nargs=2, default=None)
    args = ap.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text())["outputs"] for p in args.compare)
        same = sum(x == y for x, y in zip(a, b))
        print(f"{same} of {len(a)} outputs identical")
        return
    if not args.prompts:
        ap.error("--prompts is required")
    texts = pick(args.prompts, [c for c in args.categories.split(",") if c], args.take)
    prompts, once = (run_vllm if args.engine == "vllm" else run_batchspec)(args, texts)
    outs = once()  # warm-up
    rates = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        outs = once()
        rates.append(sum(map(len, outs)) / (time.perf_counter() - t))
    print(f"{args.engine}: {len(prompts)} prompts ({sum(map(len, prompts))} prompt tokens), "
          f"{sum(map(len, outs))} tokens: {statistics.median(rates):.1f} tok/s "
          f"(runs {', '.join(f'{r:.1f}' for r in rates)})", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps({"engine": args.engine, "prompts": prompts, "outputs": outs}))


if __name__ == "__main__":
    main()
