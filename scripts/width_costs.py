"""What a verification block costs: one target forward of 1..W new tokens per row over a cache of C tokens, as a
multiple of a one-token forward (a decode step).

    .venv/bin/python scripts/width_costs.py [--batch-size 1] [--context 700] [--max-width 8] [--reps 14] [--threads 2]

Random prompt tokens (the cost does not depend on them); each repetition prefills afresh and runs every width once,
the new slots hidden again after each forward so every width sees the same context. Prints the median seconds of
width 1 and each wider block's median as a multiple of it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import batchspec
from batchspec.batch import prefill
from batchspec.model.runner import Runner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--context", type=int, default=700)
    ap.add_argument("--max-width", type=int, default=8)
    ap.add_argument("--reps", type=int, default=14)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if min(args.batch_size, args.context, args.max_width, args.reps) < 1:
        ap.error("--batch-size, --context, --max-width and --reps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    runner = Runner(batchspec.LLM("smollm2-135m").target)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, 40000, (args.batch_size, args.context), generator=g).tolist()
    widths = range(1, args.max_width + 1)
    seconds = {w: [] for w in widths}
    no_slot = torch.zeros(args.batch_size, dtype=torch.long)
    with torch.inference_mode():
        for _ in range(args.reps + 1):  # the first repetition warms up
            state = prefill(runner, prompts)
            for w in widths:
                ids = torch.randint(100, 40000, (args.batch_size, w), generator=g)
                t = time.perf_counter()
                state.append(ids)
                seconds[w].append(time.perf_counter() - t)
                state.hide_tail(w, no_slot)
    base = statistics.median(seconds[1][1:])
    costs = " ".join(f"{w}: {statistics.median(seconds[w][1:]) / base:.2f}" for w in widths if w > 1)
    print(f"batch {args.batch_size}, context {args.context}: width 1 {base * 1e3:.2f} ms; x that: {costs}")


if __name__ == "__main__":
    main()
