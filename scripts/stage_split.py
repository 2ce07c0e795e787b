"""Per-stage time split (prefill / draft / verify / align) of eqspec vs slotmask on a small random fp32 Llama.

    .venv/bin/python scripts/stage_split.py [--batch-sizes 8,32] [--max-tokens 96]

A synthetic model (random weights, fixed seed) so the figure needs no download; the draft is a perturbed copy so
acceptance is ragged. Prints one row per (layout, batch size) and checks exact match against HF generate at batch 1.
"""

import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from batchspec.bench import bench


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
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, draft = model(), model(torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 2048, (int(n),), generator=g).tolist()
               for n in torch.randint(8, 200, (args.prompts,), generator=g)]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows = bench(target, draft, prompts, ["plain", "eqspec", "slotmask"], sizes, args.max_tokens, 5, hf=False)
    print("| engine | batch | tok/s | mean acc. len | exact | prefill s | draft s | verify s | align s | align/decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.engine == "hf":
            continue
        st = r.stages
        print(f"| {r.engine} | {r.batch_size} | {r.tokens_per_second:.1f} | {r.mean_accepted_length:.2f} | "
              f"{r.exact_match:.0%} | {st['prefill']:.2f} | {st['draft']:.2f} | {st['verify']:.2f} | {st['align']:.2f} | "
              f"{r.alignment_overhead:.1%} |")


if __name__ == "__main__":
    main()
