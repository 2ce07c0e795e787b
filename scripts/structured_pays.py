"""What JSON-schema output costs and what its forced tokens save: 8 schemas over Spec-Bench qa questions, each asked
to answer in JSON. Validity at batch 8 (every question with every schema, checked with ``jsonschema``), then forced
tokens drafted (``batch/grammar.forced``: the keys and separators a schema leaves no choice in) against not, at
batch 1, alternated in pairs in one process (this machine's speed drifts).

    .venv/bin/python scripts/structured_pays.py --prompts QUESTIONS.jsonl [--draft smollm2-135m-draft|none]
        [--pairs 3] [--max-tokens 64] [--valid-tokens 160]

``--prompts``: a JSON-lines file of questions (Spec-Bench's), read where it lies; its qa rows from the ``--first``-th
on, 8 of them. A pair's decode speed is its generated tokens over its seconds outside prefill (the prompts are the
same either way); the outputs of a pair must be identical. Prints each pair and the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import batchspec
from batchspec import SamplingParams
from batchspec.engine import engine


def _object(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


TEXT, NUMBER, INTEGER = {"type": "string"}, {"type": "number"}, {"type": "integer"}
LIST = {"type": "array", "items": TEXT, "maxItems": 3}
SCHEMAS = [_object(answer=TEXT, confidence=NUMBER), _object(name=TEXT, age=INTEGER),
           _object(title=TEXT, author=TEXT, year=INTEGER), _object(city=TEXT, country=TEXT), _object(keywords=LIST),
           _object(product=TEXT, price=NUMBER, in_stock={"type": "boolean"}),
           _object(event=TEXT, date=TEXT, attendees=INTEGER), _object(topic=TEXT, points=LIST)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="a JSON-lines file of questions (each line's 'turns')")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft", help="the drafter at batch 1 ('none': plain decoding)")
    ap.add_argument("--first", type=int, default=20, help="the first qa row used")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64, help="a batch-1 answer's limit")
    ap.add_argument("--valid-tokens", type=int, default=160, help="an answer's limit in the validity run (0: none)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import jsonschema

    with open(args.prompts) as f:
        rows = [json.loads(line) for line in f]
    questions = [r["turns"][0] for r in rows if r.get("category") == "qa"][args.first:args.first + 8]
    chats = [[{"role": "user", "content": q + " Answer in JSON."}] for q in questions]

    if args.valid_tokens:
        llm = batchspec.LLM(args.target, batch_size=8)
        params = [SamplingParams(max_tokens=args.valid_tokens, json_schema=s) for s in SCHEMAS for _ in chats]
        outs, valid = llm.chat(chats * len(SCHEMAS), params), 0
        for out, p in zip(outs, params):
            try:
                jsonschema.validate(json.loads(out.text), p.json_schema)
                valid += 1
            except ValueError:  # (jsonschema's ValidationError too)
                print(f"  not valid ({out.finish_reason}, {len(out.token_ids)} tokens): ...{out.text[-50:]!r}")
        print(f"valid: {valid} of {len(outs)} at batch 8 ({args.valid_tokens} tokens at most)", flush=True)

    llm = batchspec.LLM(args.target, batch_size=1, draft=None if args.draft == "none" else args.draft)
    forced = engine.grammar.forced

    def run(params, drafting: bool):
        engine.grammar.forced = forced if drafting else (lambda *a, **k: None)
        try:
            llm.reset_stats()
            start = time.perf_counter()
            outs = llm.chat(chats, params)
            seconds = time.perf_counter() - start - llm.stats.prefill
        finally:
            engine.grammar.forced = forced
        s = llm.stats
        return [o.token_ids for o in outs], s.generated / seconds, s.rounds, s.forced_drafted

    run([SamplingParams(max_tokens=8, json_schema=SCHEMAS[0])] * len(chats), True)  # warm-up
    ratios = []
    for pair in range(args.pairs):
        params = [SamplingParams(max_tokens=args.max_tokens, json_schema=SCHEMAS[(pair + i) % 8])
                  for i in range(len(chats))]
        first = pair % 2 == 0  # which goes first alternates
        a, b = run(params, first), run(params, not first)
        on, off = (a, b) if first else (b, a)
        assert on[0] == off[0], "forced drafting changed an output"
        ratios.append(on[1] / off[1])
        print(f"pair {pair}: decode tok/s forced drafted {on[1]:.1f} ({on[2]} rounds, {on[3]} forced), "
              f"not {off[1]:.1f} "
              f"({off[2]} rounds): {ratios[-1]:.2f}x, outputs identical", flush=True)
    print(f"median: {statistics.median(ratios):.2f}x ({args.draft} at batch 1)")


if __name__ == "__main__":
    main()
