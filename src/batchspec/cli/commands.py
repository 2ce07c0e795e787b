"""The ``batchspec`` command: one table of subcommands, each a module of this package with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> exit status``. Commands import their heavy dependencies (torch, the web
stack, Ray) only when they run."""

from __future__ import annotations

import argparse
import sys

from . import audit, bench, generate, loadtest, profile, serve, train_draft
from .common import USER_ERRORS

COMMANDS = {
    "generate": generate,
    "audit": audit,
    "bench": bench,
    "serve": serve,
    "loadtest": loadtest,
    "train-draft": train_draft,
    "profile": profile,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchspec", description="Batched speculative decoding whose greedy output "
                                     "equals batch-size-1 decoding, and an audit that checks any engine or server.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP)
        module.add_arguments(p)
        p.set_defaults(func=module.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as e:
        print(f"batchspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
