"""Whole-prefill speed at long prompts: the causal attention kernel of this tree against another revision's, the two
interleaved in one process (this machine's speed drifts).

    .venv/bin/python scripts/prefill_speed.py --texts QUESTIONS.jsonl [--lengths 400,1000,3000,6000]
        [--batch-sizes 1,4] [--repeats 3] [--baseline main] [--threads 2]

``--texts``: a JSON-lines file of questions (Spec-Bench's: each line's ``turns``), read where it lies; its turns are
concatenated and tokenised, and each row's prompt is a window of that text of the length asked for (rows start at
different places). ``--baseline``: a git revision whose ``causal.c`` is built beside this tree's kernels (same
compiler flags) and swapped in for the "old" runs. Each repeat prefills every prompt once with each kernel, through ``model/prefill.py`` without hidden states, as the engine does. Prints, per batch size and
length, the medians of prompt tokens per second (wall clock and process CPU time), the runs, old/new, and whether the
two kernels left the same bits in the cache; then each length's new throughput against the shortest length's.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

import batchspec
from batchspec.model import kernels
from batchspec.model import prefill as whole


def build_baseline(rev: str, into: Path):
    """``causal_attention`` of revision ``rev``'s ``causal.c`` (with that revision's headers), built into ``into``."""
    where = "src/batchspec/model/kernels"
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:{where}"], capture_output=True, text=True,
                           check=True).stdout.split()
    for name in names:
        if name == "causal.c" or name.endswith(".h"):
            blob = subprocess.run(["git", "show", f"{rev}:{where}/{name}"], capture_output=True, check=True).stdout
            (into / name).write_bytes(blob)
    out = into / "causal.so"
    subprocess.run(["cc", "-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC",
                    str(into / "causal.c"), "-o", str(out), "-lm"], check=True)
    fn = ctypes.CDLL(str(out)).causal_attention
    fn.restype, args = kernels.signature("causal_attention")
    fn.argtypes = [kind for _, kind in args]
    return fn


class _With:
    """The built kernels with ``causal_attention`` replaced (every other entry point the same)."""

    def __init__(self, lib, causal):
        self._lib, self.causal_attention = lib, causal

    def __getattr__(self, name):
        return getattr(self._lib, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", required=True, help="a JSON-lines file of questions (each line's 'turns')")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--lengths", default="400,1000,3000,6000")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default="main", help="the git revision whose causal.c the old runs use")
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = batchspec.LLM(args.target, draft=None, prefix_cache=0)
    lines = Path(args.texts).read_text().splitlines()
    text = "\n\n".join(t for line in lines if line.strip() for t in json.loads(line)["turns"])
    ids = llm.tokenizer(text)["input_ids"]
    lengths, sizes = [int(n) for n in args.lengths.split(",")], [int(b) for b in args.batch_sizes.split(",")]
    new = kernels.library()
    if new is None:
        raise SystemExit("the C kernels are off here")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"old": _With(new, build_baseline(args.baseline, Path(tmp))), "new": new}
    print(f"{args.target}: {llm.weights.line()}, {torch.get_num_threads()} threads, baseline {args.baseline}")
    for lib in libs.values():  # warm up: both kernels loaded, the buffers' sizes seen once
        kernels._lib = lib
        whole.prefill(llm.target, [ids[:64]], 0, 64, False)
    best = {}
    for b in sizes:
        for n in lengths:
            step = max(1, (len(ids) - n) // max(1, b))
            prompts = [ids[r * step : r * step + n] for r in range(b)]
            runs, last = {m: [] for m in libs}, {}
            for _ in range(args.repeats):
                for m, lib in libs.items():
                    kernels._lib = lib
                    wall, cpu = time.perf_counter(), time.process_time()
                    cache, _ = whole.prefill(llm.target, prompts, 0, n, False)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                    runs[m].append((b * n / wall, b * n / cpu))
                    last[m] = cache.layers[-1]
            kernels._lib = new
            same = all(torch.equal(getattr(last["old"], t), getattr(last["new"], t)) for t in ("keys", "values"))
            med = {m: (statistics.median(r[0] for r in runs[m]), statistics.median(r[1] for r in runs[m])) for m in libs}
            best[b, n] = med["new"][0]
            for m in libs:
                walls = ", ".join(f"{r[0]:.0f}" for r in runs[m])
                print(f"B={b} n={n:5d} {m}: {med[m][0]:6.1f} tok/s wall, {med[m][1]:6.1f} tok/s CPU (runs {walls})")
            print(f"B={b} n={n:5d} old/new: {med['new'][0] / med['old'][0]:.2f}x wall, "
                  f"{med['new'][1] / med['old'][1]:.2f}x CPU; cache bits {'identical' if same else 'DIFFER'}")
    for b in sizes:
        print(f"B={b} new, tok/s at {lengths[0]} over tok/s at each length: "
              + ", ".join(f"{n}: {best[b, lengths[0]] / best[b, n]:.2f}" for n in lengths))


if __name__ == "__main__":
    main()
