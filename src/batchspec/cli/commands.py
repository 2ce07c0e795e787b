"""The ``batchspec`` command: one table of subcommands, each a module of this package with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> exit status``. Commands import their heavy dependencies (torch, the web
stack, Ray) only when they run."""

from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
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


class HelpFormatter(argparse.HelpFormatter):
    """``--help`` shows each option's default, unless its help already names it or there is none to show."""

    def _format_action(self, action):
        if not action.help and _shows_default(action):  # argparse shows nothing for an option without help
            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)

    def _get_help_string(self, action):
        text = action.help or ""
        return text + " (default: %(default)s)" if _shows_default(action) and "default" not in text else text


def _shows_default(action) -> bool:
    return bool(action.option_strings) and action.default not in (None, False, argparse.SUPPRESS, [])


class Parser(argparse.ArgumentParser):
    """A bad flag is one line on stderr, naming the flag and what it takes (with the closest choice when a value is
    not one of them), and exit status 2: the usage block is for ``--help``."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            names = [str(c) for c in action.choices]
            close = difflib.get_close_matches(str(value), names, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise argparse.ArgumentError(action, f"invalid choice {value!r}: {hint}(choose from {', '.join(names)})")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="batchspec", formatter_class=HelpFormatter, description="Batched speculative decoding whose "
                    "greedy output equals batch-size-1 decoding, and an audit that checks any engine or server.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module in COMMANDS.items():
        p = sub.add_parser(name, help=module.HELP, formatter_class=HelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.run, parser=p)
    return parser


@contextlib.contextmanager
def quiet_libraries():
    """No progress bars from the libraries models load through (transformers' "Loading weights", the hub's
    downloads) while a command runs: its own progress (rich) is what it shows."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # the hub's bars too
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


def main(argv=None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    parser = args.__dict__.pop("parser")  # not a setting: commands keep their arguments (a checkpoint pickles them)
    if unknown:  # named by the command's parser, with the closest of its flags
        flags = [s for a in parser._actions for s in a.option_strings]
        close = difflib.get_close_matches(unknown[0].split("=")[0].replace("_", "-"), flags, n=1, cutoff=0.75)
        parser.error(f"unrecognized arguments: {' '.join(unknown)}" + (f" (did you mean {close[0]}?)" if close else ""))
    try:
        with quiet_libraries():
            return args.func(args)
    except USER_ERRORS as e:
        print(f"batchspec {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
