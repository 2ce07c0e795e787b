"""Command line: ``batchspec generate | audit | bench | serve | loadtest``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"target model: path, model id or built-in name (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None, help=f"draft: a model or draft-head path, a built-in name ({DEFAULT_DRAFT}: the "
                   f"feature-reading head; {DEFAULT_DRAFT}-model), 'prompt-lookup' or 'none' (default {DEFAULT_DRAFT} with "
                   "the default target, else none)")
    p.add_argument("--prompts", default=None, help="Spec-Bench style JSONL (turns[0]) or plain text, one prompt per line (default: the built-in prompt set)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=5)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True, help="apply the tokenizer's chat template")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--device", default=None)
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"],
                   help="speculation length: chosen each round from measured cost and acceptance (adaptive, default) "
                        "or always --num-draft-tokens (fixed)")


def resolve_draft(target: str, draft: str | None):
    if draft is None:
        return DEFAULT_DRAFT if target == DEFAULT_TARGET else None
    return None if draft == "none" else draft


def _dtype(name):
    import torch

    return getattr(torch, name) if name else None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def int_list(text: str, what: str) -> list[int]:
    """A comma list of integers >= 1 (``--batch-sizes``)."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = [0]
    if not out or min(out) < 1:
        raise ValueError(f"{what} must be a comma list of integers >= 1, got {text!r}")
    return out


def sampling_flags(args, **kwargs):
    """``SamplingParams`` from --temperature, --top-k and --top-p (plus ``kwargs``), checked by its own rules first;
    --top-k and --top-p without --temperature > 0 would do nothing, so they are refused."""
    from .params import SamplingParams

    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, **kwargs)
    if sp.temperature == 0 and (sp.top_k or sp.top_p != 1.0):
        raise ValueError("--top-k and --top-p apply to sampling: give --temperature > 0 as well")
    return sp


def prepare_out(path, folder: bool) -> Path:
    """Check an output location and create its folder before any model loads, so a bad ``--out`` costs nothing.
    ``folder``: ``path`` is a folder to write into; else a file to write."""
    out = Path(path).expanduser()
    where = out if folder else out.parent
    if not folder and out.is_dir():
        raise ValueError(f"--out {path} is a folder; give a file path, e.g. {out / 'out.jsonl'}")
    blocker = next((p for p in (where, *where.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"--out {path}: {blocker} is a file, not a folder; give another path")
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {path}: cannot create the folder {where} ({e.strerror}); give another path") from None
    if not os.access(where, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"--out {path}: {out if out.exists() else where} is not writable; give another path")
    return out


def read_prompt_set(path) -> list[tuple[str, str]]:
    """``(prompt id, text)`` pairs from a prompt file, or the built-in set when ``path`` is None; never empty."""
    from .prompts import read_prompts

    if path is None:
        try:
            from .data import builtin_prompts
        except ImportError:
            raise ValueError("no --prompts file given and this install has no built-in prompt set") from None
        pairs = builtin_prompts()
    else:
        pairs = read_prompts(path)
    if not pairs:
        raise ValueError(f"no prompts in {path if path is not None else 'the built-in prompt set'}")
    return pairs


def encode_prompts(pairs, tokenizer, chat_template: bool):
    """(ids, texts, token-id prompts) for ``read_prompt_set``'s pairs."""
    from .prompts import encode

    if tokenizer is None:
        raise ValueError("the target has no tokenizer to encode text prompts; pass a model directory with one")
    return [i for i, _ in pairs], [t for _, t in pairs], encode(tokenizer, [t for _, t in pairs], chat_template)


def cmd_generate(args) -> int:
    import batchspec

    if args.ray:  # the same generation on Ray Data workers (batchspec.ray)
        from .ray import cmd_generate as generate_on_ray

        return generate_on_ray(args)
    sp = sampling_flags(args, max_tokens=args.max_tokens, seed=args.seed)
    pairs = read_prompt_set(args.prompts)
    out = prepare_out(args.out, folder=False) if args.out else None
    llm = batchspec.LLM(
        args.target, draft=resolve_draft(args.target, args.draft), num_draft_tokens=args.num_draft_tokens,
        layout=args.layout, scheduler=args.scheduler, batch_size=args.batch_size, dtype=_dtype(args.dtype),
        device=args.device, speculation=args.speculation,
    )
    ids, texts, prompts = encode_prompts(pairs, llm.tokenizer, args.chat_template)
    if args.seed is not None:  # one seed for the run: prompt i gets seed + i
        sp = [dataclasses.replace(sp, seed=args.seed + i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, progress=True)
    wall = time.perf_counter() - t0
    if out:
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

# What bad input raises (a flag, a prompt file, an --out path, a model path): one line on stderr, exit status 2.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
               NotImplementedError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchspec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate for a prompt file")
    _model_args(g)
    g.add_argument("--batch-size", type=positive_int, default=8)
    g.add_argument("--layout", default="slotmask", choices=["slotmask", "eqspec"])
    g.add_argument("--scheduler", default="static", choices=["static", "continuous", "exspec"])
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy decoding")
    g.add_argument("--top-k", type=int, default=0, help="0: off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    g.add_argument("--seed", type=int, default=None, help="prompt i is sampled with seed + i")
    g.add_argument("--out", default=None, help="write one JSON line per prompt here (with --ray: a folder of files)")
    g.add_argument("--ray", action="store_true", help="run on Ray Data workers, each holding the models (needs the "
                   "ray extra); prompts from --prompts (JSONL / Parquet read by Ray), files written into --out")
    g.add_argument("--ray-address", default=None, help="with --ray: an existing cluster (auto or HOST:PORT); "
                   "default: start a local Ray")
    g.add_argument("--workers", type=positive_int, default=1, help="with --ray: model replicas (Ray actors)")
    g.add_argument("--cpus-per-worker", type=positive_int, default=1,
                   help="with --ray: CPU slots each worker takes, and its torch threads")
    g.add_argument("--block-size", type=positive_int, default=None,
                   help="with --ray: rows per worker call (default: the rows split evenly over the workers, <= 256)")
    g.add_argument("--out-format", default="jsonl", choices=["jsonl", "parquet"], help="with --ray: output files")
    g.set_defaults(func=cmd_generate)
    for name, (add, _) in COMMANDS.items():
        add(sub.add_parser(name), _model_args)
    return parser


def main(argv=None) -> int:
    _register_optional()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"batchspec {args.command}: error: {e}", file=sys.stderr)
        return 2


def _register_optional() -> None:
    """Subcommands living in other modules register themselves as ``COMMANDS[name] = (add_arguments, run)``."""
    for mod in ("batchspec.audit.cli", "batchspec.bench", "batchspec.serve.cli"):
        try:
            __import__(mod)
        except ImportError as e:
            if not (e.name and mod.startswith(e.name)):
                raise


if __name__ == "__main__":  # ``python -m batchspec.cli``: run the imported module, where subcommands register
    from batchspec.cli import main as _main

    sys.exit(_main())
