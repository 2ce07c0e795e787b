"""``batchspec audit``: run engines against the batch-size-1 oracle and write audit.json, audit.md and audit.png."""

from __future__ import annotations

from pathlib import Path

from batchspec.cli import COMMANDS


def add_arguments(parser, model_args) -> None:
    model_args(parser)
    parser.description = (
        "Compare engines with HF greedy decoding at batch size 1 (exact match, partial match, ROUGE-L, repetition), "
        "attribute each divergence to numerical noise or a synchronization error, and name each failure signature. "
        "Exits with status 1 when an engine other than an injected fault is not clean."
    )
    parser.add_argument(
        "--engines", default="slotmask,eqspec",
        help="comma list of slotmask, eqspec, plain, fault:<name>, or 'faults' for every injected fault "
             "(default slotmask,eqspec)",
    )
    parser.add_argument("--batch-sizes", default="1,4,8", help="comma list of batch sizes (default 1,4,8)")
    parser.add_argument("--out", default="out/audit", help="folder for audit.json, audit.md, audit.png (default out/audit)")
    parser.add_argument(
        "--tolerance", type=float, default=None,
        help="relative logit-margin tolerance for calling a divergence numerical (default per dtype: float64 1e-6, "
             "float32 1e-3, float16 2e-2, bfloat16 5e-2; times max(1, max |logit|))",
    )
    parser.add_argument("--limit", type=int, default=None, help="audit only the first N prompts")
    parser.set_defaults(func=run)


def _ints(text: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of integers, got {text!r}") from None
    if not out:
        raise ValueError(f"{what} is empty")
    return out


def run(args) -> int:
    import torch
    from rich.console import Console

    from batchspec.cli import load_prompts, resolve_draft
    from batchspec.models import load_model, load_tokenizer

    from .core import audit

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    batch_sizes = _ints(args.batch_sizes, "--batch-sizes")
    dtype = getattr(torch, args.dtype) if args.dtype else None
    model = load_model(args.target, dtype, args.device, "target")
    tokenizer = load_tokenizer(args.target)
    _, _, prompts = load_prompts(args.prompts, tokenizer, args.chat_template)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    report = audit(
        model, resolve_draft(args.target, args.draft), prompts, engines=engines, batch_sizes=batch_sizes,
        max_tokens=args.max_tokens, num_draft_tokens=args.num_draft_tokens, tokenizer=tokenizer,
        tolerance=args.tolerance, progress=True,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report.to_json(out / "audit.json")
    (out / "audit.md").write_text(report.to_markdown())
    report.plot(out / "audit.png")
    console = Console()
    if not console.is_terminal:  # a log file: keep every column readable instead of wrapping at 80
        console.width = max(console.width, 170)
    console.print(report.rich_table())
    console.print(f"wrote {out / 'audit.json'}, {out / 'audit.md'}, {out / 'audit.png'}")
    broken = [f"{r.engine} B={r.batch_size}" for r in report.rows if not r.clean and not r.engine.startswith("fault:")]
    if broken:
        console.print(f"[red]not clean: {', '.join(broken)}[/red]")
        return 1
    return 0


COMMANDS["audit"] = (add_arguments, run)
