"""Train the feature-reading draft head (``batchspec.drafters.eagle``) for the ``smollm2-135m`` target, on CPU.

Stages (each reads the previous one's output from ``--work``):

1. ``gen``: the target answers training prompts (``scripts/draft_prompts.py``: written for this, disjoint from the
   built-in evaluation prompts) greedily through its chat template with batchspec's plain engine, in chunks; each
   chunk then gets the target's final hidden states (the features the head reads) at every position from one
   teacher-forced forward, stored in float16. Chunks already on disk are kept, so the stage resumes.
2. ``train``: the head (``fc`` over [token embedding, feature], one Llama decoder layer, the target's own norm and a
   vocabulary-restricted copy of its output head) learns to predict the next feature and the target's next-token
   distribution, with the target's embedding and head frozen.
3. ``export``: the head's weights, config and card into ``src/batchspec/data/<name>``.
4. ``eval``: mean accepted length at K draft tokens on the built-in prompts and the 8 Spec-Bench prompts, and the
   head's cost per drafted token relative to a target decode step.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draft_prompts import HeldOut, training_prompts  # noqa: E402

TARGET = "smollm2-135m"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def held_out_texts() -> list[str]:
    from batchspec.data import builtin_prompts

    return [t for _, t in builtin_prompts()]


# --------------------------------------------------------------------------------------------------------- gen


@torch.no_grad()
def features(model, seqs: list[list[int]], max_tokens: int = 8192) -> list[torch.Tensor]:
    """The target's final (normalised) hidden states at every position of each sequence, float16, in groups of
    similar length padded on the right (causal attention: right padding changes nothing before it)."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    i = 0
    while i < len(order):
        width = len(seqs[order[i]])
        j = i
        while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= max_tokens:
            j += 1
        j = max(j, i + 1)
        rows = order[i:j]
        width = max(len(seqs[r]) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for n, r in enumerate(rows):
            ids[n, :len(seqs[r])] = torch.tensor(seqs[r])
            mask[n, :len(seqs[r])] = 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        for n, r in enumerate(rows):
            out[r] = hidden[n, :len(seqs[r])].to(torch.float16).clone()
        i = j
    return out


def cmd_gen(args) -> None:
    import batchspec
    from batchspec.prompts import encode

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    held = held_out_texts()
    pairs = training_prompts(args.num_prompts, args.seed, held)
    guard = HeldOut(held)
    assert not any(guard.overlaps(t) for _, t in pairs), "training prompts overlap the built-in prompts"
    random.Random(args.seed).shuffle(pairs)  # every chunk mixes the categories
    llm = batchspec.LLM(TARGET, batch_size=args.batch, scheduler="continuous")
    ids = encode(llm.tokenizer, [t for _, t in pairs], True)
    params = batchspec.SamplingParams(max_tokens=args.max_new_tokens)
    t0 = time.perf_counter()
    total = 0
    for c in range(0, len(pairs), args.chunk):
        path = work / f"chunk{c // args.chunk:03d}.pt"
        if path.exists():
            continue
        outs = llm.generate(ids[c:c + args.chunk], params)
        seqs = [o.prompt_token_ids + o.token_ids for o in outs]
        feats = features(llm.target, seqs)
        torch.save({"categories": [k for k, _ in pairs[c:c + args.chunk]], "prompt_len": [len(o.prompt_token_ids)
                    for o in outs], "ids": seqs, "hidden": feats}, path)
        total += sum(len(o.token_ids) for o in outs)
        log(f"gen: chunk {c // args.chunk} ({min(c + args.chunk, len(pairs))}/{len(pairs)} prompts), "
            f"{total} answer tokens this run, {time.perf_counter() - t0:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["gen"])
    p.add_argument("--work", default=str(ROOT / "build" / "eagle"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    g = p.add_argument_group("gen")
    g.add_argument("--num-prompts", type=int, default=4000)
    g.add_argument("--chunk", type=int, default=250)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--batch", type=int, default=64)
    args = p.parse_args(argv)
    {"gen": cmd_gen}[args.stage](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
