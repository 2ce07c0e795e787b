"""Plain decoding of random-weight Llama, Qwen2 and Qwen3 models of one shape (SmolLM2-135M's by default), each
Qwen with its C layer and whole prefill and without them (``before``: the families the fast paths cover cut back to
Llama's, as the code was before it took Qwen2 and Qwen3), the runs interleaved in one process.

    .venv/bin/python scripts/family_speed.py [--batch-sizes 1,8] [--npp 200] [--ntg 48] [--repeats 3] [--threads 2]

Models are built from configs with random weights (fp32, tied embeddings as SmolLM2's; Qwen2's q/k/v biases random),
nothing downloaded; prompts are random token ids, generation ignores EOS. Prints per batch size and model the median
decode tokens/s (B x NTG over the seconds after the prefill) over the repeats, each run's figure, and whether the
Qwen models' outputs are identical with and without the fast paths.
"""

from __future__ import annotations

import argparse
import statistics
from contextlib import contextmanager

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

import batchspec
from batchspec.model.kernels import llama as fused

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
             num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
BUILDERS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE)),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=64)),
}


def build(arch: str):
    torch.manual_seed(0)
    model = BUILDERS[arch]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):  # zeros from the init: random, as a trained model's
                p.normal_(0.0, 0.1)
    model.config._attn_implementation = "sdpa"
    return model.float().eval()


@contextmanager
def fast_paths(on: bool):
    """The C layer and whole prefill for every family (``on``), or for Llama alone (as before Qwen2 and Qwen3)."""
    saved = dict(fused.FAMILIES)
    if not on:
        for cls in list(fused.FAMILIES):
            if cls is not LlamaForCausalLM:
                del fused.FAMILIES[cls]
    fused._PLANS.clear()
    try:
        yield
    finally:
        fused.FAMILIES.clear()
        fused.FAMILIES.update(saved)
        fused._PLANS.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--archs", default="llama,qwen2,qwen3")
    ap.add_argument("--npp", type=int, default=200)
    ap.add_argument("--ntg", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    models = {a: build(a) for a in archs}
    # Llama runs the same code either way: once a round, as the reference
    modes = [(a, True) for a in archs] + [(a, False) for a in archs if a != "llama"]
    params = batchspec.SamplingParams(max_tokens=args.ntg, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    for b in [int(x) for x in args.batch_sizes.split(",")]:
        prompts = torch.randint(100, 40000, (b, args.npp), generator=g).tolist()
        llms = {a: batchspec.LLM(m, draft=None, batch_size=b, prefix_cache=0) for a, m in models.items()}
        runs = {m: [] for m in modes}
        outs = {}
        for rep in range(args.repeats + 1):  # the first round warms up
            for arch, on in modes:
                llm = llms[arch]
                with fast_paths(on):
                    llm.reset_stats()
                    got = llm.generate(prompts, params)
                s = llm.stats
                if rep:
                    runs[arch, on].append(s.generated / (s.total - s.prefill))
                outs[arch, on] = [o.token_ids for o in got]
        llama = statistics.median(runs["llama", True]) if "llama" in archs else None
        for arch, on in modes:
            tg = statistics.median(runs[arch, on])
            each = ", ".join(f"{r:.1f}" for r in runs[arch, on])
            ratio = f", {tg / llama:.2f}x llama" if llama else ""
            same = "" if arch == "llama" or on else (
                f", outputs {'identical' if outs[arch, False] == outs[arch, True] else 'DIFFER'} to after")
            print(f"B={b} {arch:6s} {'after ' if on else 'before'}: decode {tg:6.1f} tok/s{ratio} (runs {each}){same}")


if __name__ == "__main__":
    main()
