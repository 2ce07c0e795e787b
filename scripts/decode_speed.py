"""Plain batched decoding on llama-batched-bench's shape: B rows of NPP prompt tokens, NTG new tokens each, prefill
and decode speed, for each ``--weights`` mode, the modes interleaved in one process (this machine's speed drifts).

    .venv/bin/python scripts/decode_speed.py [--npp 400] [--ntg 64] [--batch-sizes 1,8] [--weights fp32,auto]
        [--fast-greedy default] [--repeats 3] [--threads 2]

Prompts are random token ids (a forward's cost does not depend on them), generation ignores EOS. Prints, per mode
and batch size, the medians over repeats of prefill tokens/s (B x NPP over the prefill seconds: llama-batched-bench's
S_PP) and decode tokens/s (B x NTG over the rest: its S_TG), and the modes' outputs compared token for token.
``--fast-greedy on,off`` runs each weights mode twice, with and without a q8_0 head's fast greedy tokens
(``PackedLinear.greedy``, on at every row count it takes; off: every logit computed); ``default`` (the
default): as the library chooses.
"""

from __future__ import annotations

import argparse
import statistics

import torch

import batchspec
from batchspec.model import weights as packed_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--npp", type=int, default=400)
    ap.add_argument("--ntg", type=int, default=64)
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--weights", default="fp32,auto")
    ap.add_argument("--fast-greedy", default="default", help="default, on, off or a list of them (on,off)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = [m.strip() for m in args.weights.split(",") if m.strip()]
    fast = [f.strip() for f in args.fast_greedy.split(",") if f.strip()]
    if not set(fast) <= {"default", "on", "off"}:
        ap.error("--fast-greedy takes default, on, off or a list of them")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    # no kept prefixes: the repeats prefill the same prompts, each as llama-batched-bench does, from scratch
    llms = {m: {b: batchspec.LLM(args.target, draft=None, batch_size=b, weights=m, prefix_cache=0) for b in sizes}
            for m in weights}
    for m in weights:
        print(f"{m}: {llms[m][sizes[0]].weights.line()}")
    modes = [m if f == "default" else f"{m}/{f}" for m in weights for f in fast]  # "auto/off": without it
    rows = packed_weights.GREEDY_ROWS
    every = {kind: (1, packed_weights.GREEDY_MOST) for kind in rows}
    g = torch.Generator().manual_seed(0)
    params = batchspec.SamplingParams(max_tokens=args.ntg, ignore_eos=True)
    for b in sizes:
        prompts = torch.randint(100, 40000, (b, args.npp), generator=g).tolist()
        runs = {m: [] for m in modes}
        outs = {}
        for rep in range(args.repeats + 1):  # the first round warms up
            for m in modes:
                llm = llms[m.split("/")[0]][b]
                packed_weights.GREEDY_ROWS = ({kind: (1, 0) for kind in rows} if m.endswith("/off")
                                              else every if m.endswith("/on") else rows)
                llm.reset_stats()
                got = llm.generate(prompts, params)
                s = llm.stats
                if rep:
                    runs[m].append((b * args.npp / s.prefill, s.generated / (s.total - s.prefill)))
                outs[m] = [o.token_ids for o in got]
        same = all(outs[m] == outs[modes[0]] for m in modes)
        for m in modes:
            pp = statistics.median(r[0] for r in runs[m])
            tg = statistics.median(r[1] for r in runs[m])
            tgs = ", ".join(f"{r[1]:.1f}" for r in runs[m])
            print(f"B={b} {m:8s}: prefill {pp:6.1f} tok/s, decode {tg:6.1f} tok/s (runs {tgs})"
                  + ("" if m == modes[0] else f", outputs {'identical' if same else 'DIFFER'}"))


if __name__ == "__main__":
    main()
