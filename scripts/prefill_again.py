"""Prompts prefilled again from their kept blocks (a retry, a conversation's next turn): the target's prefill of each
prompt once its blocks are kept, with its last tokens at their own rows (``model/prefill._onednn_least``) against
padded to ``least_rows()`` (as before), the two interleaved in one process (this machine's speed drifts).

    .venv/bin/python scripts/prefill_again.py --prompts QUESTIONS.jsonl [--first 20] [--count 32] [--repeats 3]

``--prompts``: a JSON-lines file of questions (Spec-Bench's: each line's first turn), read where it lies; rows from the
``--first``-th of each category on, ``--count`` of them, each through the model's chat template. Each is prefilled
once (its blocks kept), then every repeat prefills them all again, one at a time as a server's arrivals come, padded
and at their own rows, and checks that both leave the bits a fresh prefill gives. Prints the seconds of each and their
ratio per repeat, then the median ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from itertools import zip_longest

import torch

import batchspec
from batchspec.batch.prefilling import prefill
from batchspec.model import prefill as whole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True, help="a JSON-lines file of questions (each line's 'turns')")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--first", type=int, default=20, help="the first row of each category used")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = batchspec.LLM(args.target, draft=None)
    by_category = defaultdict(list)
    with open(args.prompts) as f:
        for line in f:
            row = json.loads(line)
            by_category[row.get("category")].append(row["turns"][0])
    # the categories in turn, one row each (categories with fewer rows run out first)
    texts = [t for rows in zip_longest(*(rows[args.first:] for rows in by_category.values())) for t in rows
             if t is not None][: args.count]
    tok, runner = llm.tokenizer, llm.parts.target
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for t in texts]
    fresh = [prefill(runner, [p], hidden=True, fresh=True)[1] for p in prompts]
    for p in prompts:
        prefill(runner, [p], hidden=True)  # keeps its blocks
    own = whole._onednn_least

    def again(padded: bool) -> tuple[float, bool]:
        whole._onednn_least = (lambda k, n, threads: whole.least_rows()) if padded else own
        try:
            start, same = time.perf_counter(), True
            for p, want in zip(prompts, fresh):
                same &= torch.equal(prefill(runner, [p], hidden=True)[1], want)
            return time.perf_counter() - start, same
        finally:
            whole._onednn_least = own

    hits = runner.prefixes.hits
    ratios = []
    for r in range(args.repeats):
        (old, same_old), (new, same_new) = again(True), again(False)
        ratios.append(new / old)
        print(f"repeat {r}: padded {old:.2f} s, own rows {new:.2f} s ({new / old:.2f}x); bits as fresh: "
              f"{same_old} / {same_new}", flush=True)
    print(f"{len(prompts)} prompts ({sum(map(len, prompts))} tokens), {runner.prefixes.hits - hits} started from "
          f"kept blocks; median own rows / padded {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
