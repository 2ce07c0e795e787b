"""Command line: ``batchspec generate | audit | bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: path, model id or built-in name (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None, help=f"draft model path/name, 'prompt-lookup' or 'none' (default {DEFAULT_DRAFT} with the default target, else none)")
    p.add_argument("--prompts", default=None, help="Spec-Bench style JSONL (turns[0]) or plain text, one prompt per line (default: the built-in prompt set)")
    p.add_argument("--num-draft-tokens", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True, help="apply the tokenizer's chat template")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--device", default=None)


def resolve_draft(target: str, draft: str | None):
    if draft is None:
        return DEFAULT_DRAFT if target == DEFAULT_TARGET else None
    return None if draft == "none" else draft


def _dtype(name):
    import torch

    return getattr(torch, name) if name else None


def load_prompts(path, tokenizer, chat_template: bool):
    """(ids, texts, token-id prompts) from a prompt file, or the built-in set when ``path`` is None."""
    from .prompts import encode, read_prompts

    if path is None:
        try:
            from .data import builtin_prompts
        except ImportError:
            raise SystemExit("no --prompts file given and this install has no built-in prompt set")
        pairs = builtin_prompts()
    else:
        pairs = read_prompts(path)
    if tokenizer is None:
        raise SystemExit("the target has no tokenizer to encode text prompts; pass a model directory with one")
    return [i for i, _ in pairs], [t for _, t in pairs], encode(tokenizer, [t for _, t in pairs], chat_template)


def cmd_generate(args) -> int:
    import batchspec

    llm = batchspec.LLM(
        args.target, draft=resolve_draft(args.target, args.draft), num_draft_tokens=args.num_draft_tokens,
        layout=args.layout, scheduler=args.scheduler, batch_size=args.batch_size, dtype=_dtype(args.dtype),
        device=args.device,
    )
    sp = batchspec.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
    ids, texts, prompts = load_prompts(args.prompts, llm.tokenizer, args.chat_template)
    if args.seed is not None:  # one seed for the run: prompt i gets seed + i
        sp = [dataclasses.replace(sp, seed=args.seed + i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, progress=True)
    wall = time.perf_counter() - t0
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w", encoding="utf-8") as f:
            for pid, o in zip(ids, outs):
                f.write(json.dumps({
                    "prompt_id": pid, "token_ids": o.token_ids, "text": o.text, "finish_reason": o.finish_reason,
                    "num_rounds": o.num_rounds, "num_drafted": o.num_drafted, "num_accepted": o.num_accepted,
                }) + "\n")
    s = llm.stats
    from rich.console import Console

    Console().print(
        f"{len(outs)} prompts, {s.generated} tokens in {wall:.1f} s: [bold]{s.generated / wall:.1f} tok/s[/bold], "
        f"mean accepted length {s.mean_accepted_length:.2f} (K={llm.k}, layout {args.layout}); "
        f"stage seconds prefill {s.prefill:.1f} draft {s.draft:.1f} verify {s.verify:.1f} align {s.align:.1f}"
        + (f"; wrote {out}" if out else "")
    )
    return 0


COMMANDS = {}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate for a prompt file")
    _model_args(g)
    g.add_argument("--batch-size", type=int, default=8)
    g.add_argument("--layout", default="slotmask", choices=["slotmask", "eqspec"])
    g.add_argument("--scheduler", default="static", choices=["static", "continuous", "exspec"])
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy decoding")
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    g.add_argument("--seed", type=int, default=None, help="prompt i is sampled with seed + i")
    g.add_argument("--out", default=None, help="write one JSON line per prompt here")
    g.set_defaults(func=cmd_generate)
    for name, (add, _) in COMMANDS.items():
        add(sub.add_parser(name), _model_args)
    return parser


def main(argv=None) -> int:
    _register_optional()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as e:
        print(f"batchspec {args.command}: error: {e}", file=sys.stderr)
        return 2


def _register_optional() -> None:
    """Subcommands living in other modules register themselves as ``COMMANDS[name] = (add_arguments, run)``."""
    for mod in ("batchspec.audit.cli", "batchspec.bench"):
        try:
            __import__(mod)
        except ImportError as e:
            if not (e.name and mod.startswith(e.name)):
                raise


if __name__ == "__main__":
    sys.exit(main())
