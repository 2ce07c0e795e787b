"""Per-stage time split (prefill / draft / verify / align / schedule) of the layouts and schedulers on a small random
fp32 Llama, with the alignment-overhead and throughput figures (the paper's Figure 5 shape).

    .venv/bin/python scripts/stage_split.py [--batch-sizes 8,16,32] [--max-tokens 96] [--engines ...] [--out DIR]

A synthetic model (random weights, fixed seed) so the figure needs no download; the draft is a perturbed copy so
acceptance is ragged. Prints one row per (layout, batch size) and checks exact match against HF generate at batch 1.
"""

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from batchspec.bench import bench, plot


def model(seed_noise=None):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
            if seed_noise is not None:
                p.add_(torch.randn(p.shape, generator=seed_noise) * 0.02 * p.std())
    m.generation_config.eos_token_id = None
    m.config._attn_implementation = "sdpa"
    return m.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="8,16,32")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engines", default="plain,eqspec,slotmask,eqspec@exspec,slotmask@exspec")
    ap.add_argument("--out", default=None, help="write bench.json and the PNG figures here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = model(), model(torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 2048, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 200, (args.prompts,), generator=g)]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = bench(target, draft, prompts, args.engines.split(","), sizes, args.max_tokens, 5, hf=False)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
        plot(rows, out)
    print("| engine | batch | tok/s | mean acc. len | exact | prefill s | draft s | verify s | align s | schedule s | "
          "align/decode | grouping |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.engine == "hf":
            continue
        st = r.stages
        print(f"| {r.engine} | {r.batch_size} | {r.tokens_per_second:.1f} | {r.mean_accepted_length:.2f} | "
              f"{r.exact_match:.0%} | {st['prefill']:.2f} | {st['draft']:.2f} | {st['verify']:.2f} | {st['align']:.2f} | "
              f"{st['schedule']:.2f} | {r.alignment_overhead:.1%} | "
              f"{'-' if r.grouping_rate is None else format(r.grouping_rate, '.0%')} |")


if __name__ == "__main__":
    main()
