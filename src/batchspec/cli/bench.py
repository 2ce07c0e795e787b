"""``batchspec bench``: throughput of engines against HF ``generate`` (and each other), with exact match against the
batch-size-1 oracle; writes bench.json, bench.md and plots."""

from __future__ import annotations

import json
from dataclasses import asdict

from .common import (
    dtype,
    encode_prompts,
    int_list,
    model_args,
    positive_int,
    prepare_out,
    read_prompt_set,
    resolve_draft,
    rich_console,
    show_markdown_table,
    write_atomic,
)

HELP = "benchmark engines against HF generate"


def add_arguments(parser) -> None:
    model_args(parser)
    parser.add_argument("--engines", default="plain,slotmask,eqspec,slotmask-lookup",
                        help="comma list of engine names: plain, slotmask, eqspec, slotmask-lookup, fault:<name>, each "
                             "with an optional :fixed / :adaptive and @static / @continuous / @exspec "
                             "(default plain,slotmask,eqspec,slotmask-lookup)")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--no-hf", action="store_true", help="skip HF generate at batch sizes above 1")
    parser.add_argument("--limit", type=positive_int, default=None, help="benchmark only the first N prompts")
    parser.add_argument("--truncate", type=positive_int, default=None, metavar="N",
                        help="an identical-length set: keep prompts of at least N tokens, cut to their first N")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs per engine and batch size, interleaved after a warm-up run (default 3)")
    parser.add_argument("--out", default="out/bench")
    parser.set_defaults(max_tokens=128)


def run(args) -> int:
    from ..bench import bench, parse_engine, plot, to_markdown
    from ..model.loading import load_tokenizer

    draft = resolve_draft(args.target, args.draft)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:  # unknown engine names fail here, before any model loads
        parse_engine(e, draft, args.speculation)
    sizes = int_list(args.batch_sizes, "--batch-sizes")
    pairs = read_prompt_set(args.prompts)
    out = prepare_out(args.out, folder=True)
    tokenizer = load_tokenizer(args.target)
    _, _, prompts = encode_prompts(pairs, tokenizer, args.chat_template)
    if args.truncate:
        prompts = [p[: args.truncate] for p in prompts if len(p) >= args.truncate]
        if not prompts:
            raise ValueError(f"no prompt has {args.truncate} tokens or more to truncate to")
    prompts = prompts[: args.limit]
    rows = bench(args.target, draft, prompts, engines, sizes, args.max_tokens, args.num_draft_tokens,
                 tokenizer, hf=not args.no_hf, progress=True, speculation=args.speculation,
                 repeats=args.repeats, weights=args.weights, dtype=dtype(args.dtype), device=args.device)
    write_atomic(out / "bench.json", lambda f: f.write(json.dumps([asdict(r) for r in rows], indent=1)))
    md = to_markdown(rows)
    write_atomic(out / "bench.md", lambda f: f.write(md))
    pngs = plot(rows, out)
    console = rich_console()
    show_markdown_table(console, md)
    console.print(f"wrote {out}/bench.json, bench.md, " + ", ".join(p.name for p in pngs))
    return 0
