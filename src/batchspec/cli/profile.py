"""``batchspec profile``: the cost profile the adaptive speculation length prices rounds with: the target's forward
of 1..B rows x 1..6 new tokens per row and the draft's own forward, timed once per machine, models, dtype and thread
count, and cached (``batchspec.speculation.costs``). Shows it, measuring it first where there is none (or with
``--refresh``)."""

from __future__ import annotations

from .common import (DEFAULT_TARGET, TARGET_HELP, engine_config, positive_int, rich_console, show_table,
                     weights_arg)

HELP = "show (or measure again) the cost profile the speculation length is chosen from"


def add_arguments(p) -> None:
    p.description = __doc__
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=TARGET_HELP)
    p.add_argument("--draft", default=None, help="draft, as for generate (default: the target's built-in draft)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="the most rows priced (default 8)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=5)
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--device", default=None)
    weights_arg(p)
    p.add_argument("--refresh", action="store_true", help="measure again (e.g. after the machine changed load)")


def run(args) -> int:
    from rich.table import Table

    import batchspec

    from ..speculation.costs import CostModel, describe, load_or_measure, profile_path

    # a fixed length measures nothing: the profile is measured here
    llm = batchspec.LLM.from_config(engine_config(args, speculation="fixed"))
    drafter = llm.drafter if llm.k else None
    profile = load_or_measure(llm.parts.target, args.batch_size, drafter, bool(drafter and drafter.needs_hidden),
                              refresh=args.refresh, progress=True)
    k = llm.k or args.num_draft_tokens
    table = Table(title=f"cost profile: {args.target}" + (f" + {drafter.name}" if drafter else ""))
    for col in ["rows", "plain step (ms)", *(f"verify {j}" for j in range(1, k + 1)), "draft step"]:
        table.add_column(col, justify="right")
    for cells in describe(CostModel(profile), k):
        table.add_row(*cells)
    console = rich_console()
    show_table(console, table)
    console.print(f"verify j: a round verifying j drafts a row, in plain steps; draft step: one forward of the draft's "
                  f"own model and its bookkeeping, in plain steps. Cached in {profile_path(profile.key)}")
    return 0
