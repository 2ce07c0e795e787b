"""What the commands share: the model flags, argument types, prompt files, output paths, and the errors that are the
user's (one line on stderr, exit status 2)."""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path

from ..files import write_atomic  # noqa: F401  (the commands write their files through it)

DEFAULT_TARGET = "smollm2-135m"
DEFAULT_DRAFT = "smollm2-135m-draft"
TARGET_HELP = f"target model: path, model id or built-in name ({DEFAULT_TARGET}, the default, or gemma3-270m)"


def model_args(p: argparse.ArgumentParser, target_default: str | None = DEFAULT_TARGET, target_help: str = "") -> None:
    """The model flags; ``target_default`` None and a ``target_help`` for a command whose default depends on others."""
    p.add_argument("--target", default=target_default,
                   help=target_help or TARGET_HELP)
    p.add_argument("--draft", default=None, help=f"draft: a model or draft-head path, a built-in name ({DEFAULT_DRAFT}: the "
                   f"feature-reading head; {DEFAULT_DRAFT}-model), 'prompt-lookup' or 'none' (default {DEFAULT_DRAFT} with "
                   "the default target, else none)")
    p.add_argument("--prompts", default=None, help='JSONL, one object per line with "turns" (Spec-Bench: turns[0] is '
                   'the prompt) or "prompt", or plain text, one prompt per line; every line is checked before any '
                   "model loads (default: the built-in prompt set)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=5)
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=True, help="apply the tokenizer's chat template")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--device", default=None)
    weights_arg(p)
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"],
                   help="speculation length: chosen each round from measured cost and acceptance (adaptive, default) "
                        "or always --num-draft-tokens (fixed)")


def weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", default="auto", choices=["auto", "fp32"],
                   help="auto (default): keep each weight in the narrowest format that holds its values exactly "
                        "(same outputs bit for bit, fewer bytes read per step); fp32: as loaded")


def prefix_cache_arg(p: argparse.ArgumentParser) -> None:
    from ..model.prefixes import DEFAULT_CAP_MIB, DEFAULT_FRACTION

    p.add_argument("--prefix-cache", type=non_negative_int, default=None, metavar="MIB",
                   help="MiB of prompt blocks kept between prefills, so that a prompt computes only the tokens after "
                        "its longest cached start; 0 turns it off (default: "
                        f"{DEFAULT_FRACTION:.0%}% of the available memory, at most {DEFAULT_CAP_MIB})")


def kv_memory_arg(p: argparse.ArgumentParser) -> None:
    from ..engine.memory import DEFAULT_FRACTION

    p.add_argument("--kv-memory", type=positive_int, default=None, metavar="MIB",
                   help="MiB the running rows' keys and values may take at their widest: a request waits until it "
                        "fits, one that never could is refused (default: "
                        f"{DEFAULT_FRACTION:.0%}% of the available memory)")


def resolve_draft(target: str, draft: str | None):
    """The ``draft`` argument of ``LLM`` for --target and --draft; a misspelt name (``prompt_lookup``) is refused
    here, with the name meant, before any model loads."""
    from ..model.loading import BUILTIN_MODELS

    _near_name("--target", target, BUILTIN_MODELS)
    if draft is None:
        return DEFAULT_DRAFT if target == DEFAULT_TARGET else None
    _near_name("--draft", draft, ("prompt-lookup", "none", *BUILTIN_MODELS))
    return None if draft == "none" else draft


def _near_name(flag: str, value, names) -> None:
    """Refuse ``value`` when it is no path but close to one of the built-in ``names``: a typo, not a model."""
    if not isinstance(value, str) or value in names or "/" in value or os.path.exists(os.path.expanduser(value)):
        return
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.8)
    if close:
        raise ValueError(f"{flag} {value!r} is no model path or name: did you mean {close[0]!r}?")


def dtype(name):
    import torch

    return getattr(torch, name) if name else None


def engine_config(args, **given):
    """The ``EngineConfig`` of a command's flags: every flag named as an ``LLM`` argument (--target, --draft,
    --num-draft-tokens, --batch-size, --weights, --prefix-cache, --kv-memory...) taken as it is, but for the draft
    (resolved: the default target's built-in draft, 'none') and the dtype (a name made a torch dtype); ``given`` sets
    the others or overrides a flag (the server's continuous scheduler)."""
    from dataclasses import fields

    from ..config import EngineConfig

    flags = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    flags.update(draft=resolve_draft(args.target, args.draft), dtype=dtype(args.dtype))
    return EngineConfig(**{**flags, **given})


def _int_at_least(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low or high is not None and value > high:
        span = f">= {low}" if high is None else f"in {low}..{high}"
        raise argparse.ArgumentTypeError(f"must be an integer {span}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1..65535."""
    return _int_at_least(text, 1, 65535)


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
    from ..params import SamplingParams

    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, **kwargs)
    if sp.temperature == 0 and (sp.top_k or sp.top_p != 1.0):
        raise ValueError("--top-k and --top-p apply to sampling: give --temperature > 0 as well")
    return sp


def prepare_out(path, folder: bool, flag: str = "--out") -> Path:
    """Check an output location and create its folder before any model loads, so a bad ``--out`` costs nothing.
    ``folder``: ``path`` is a folder to write into; else a file to write. ``flag``: the option named in errors."""
    out = Path(path).expanduser()
    where = out if folder else out.parent
    if not folder and out.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path, e.g. {out / 'out.jsonl'}")
    blocker = next((p for p in (where, *where.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise ValueError(f"{flag} {path}: {blocker} is a file, not a folder; give another path")
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create the folder {where} ({e.strerror}); give another path") from None
    if not os.access(where, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ValueError(f"{flag} {path}: {out if out.exists() else where} is not writable; give another path")
    return out


def read_prompt_set(path) -> list[tuple[str, str]]:
    """``(prompt id, text)`` pairs from a prompt file, or the built-in set when ``path`` is None; never empty."""
    from ..prompts import read_prompts

    if path is None:
        try:
            from ..data import builtin_prompts
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
    from ..prompts import encode

    if tokenizer is None:
        raise ValueError("the target has no tokenizer to encode text prompts; pass a model directory with one")
    return [i for i, _ in pairs], [t for _, t in pairs], encode(tokenizer, [t for _, t in pairs], chat_template)


def rich_console(stderr: bool = False):
    """stdout's (or stderr's) rich console. When it is no terminal (a pipe, a log file) there is no width to fit:
    lines are written whole, never wrapped at 80 columns."""
    from rich.console import Console

    out = Console(stderr=stderr)
    return out if out.is_terminal else Console(stderr=stderr, soft_wrap=True)


def show_table(out, table) -> None:
    """A rich table on ``out``: on a terminal fitted to its width (a cell too wide is wrapped, never cut short with an
    ellipsis); elsewhere as a plain Markdown table, each cell whole."""
    if out.is_terminal:
        for column in table.columns:
            column.overflow = "fold"
        out.print(table)
    else:
        print(markdown_table(table), file=out.file, flush=True)


def show_markdown_table(out, md: str) -> None:
    """A Markdown table (``| a | b |`` lines) on ``out``: as it is when stdout is no terminal, else as ``show_table``
    shows it."""
    if not out.is_terminal:
        print(md.rstrip("\n"), file=out.file, flush=True)
        return
    from rich.table import Table

    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines() if line.startswith("|")]
    table = Table()
    for heading, rule in zip(rows[0], rows[1]):
        table.add_column(heading, justify="right" if rule.endswith(":") else "left")
    for row in rows[2:]:
        table.add_row(*row)
    show_table(out, table)


def markdown_table(table) -> str:
    """A rich table as a Markdown table (its title in bold above it), cells as plain text."""
    from rich.text import Text

    def plain(cell) -> str:
        text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
        return text.replace("|", "\\|").replace("\n", " ")

    columns = table.columns
    lines = [f"**{plain(table.title)}**", ""] if table.title else []
    lines.append("| " + " | ".join(plain(c.header) for c in columns) + " |")
    lines.append("|" + "".join("---:|" if c.justify == "right" else "---|" for c in columns))
    for cells in zip(*(list(c.cells) for c in columns)):
        lines.append("| " + " | ".join(plain(cell) for cell in cells) + " |")
    return "\n".join(lines)


# What bad input raises (a flag, a prompt file, an --out path, a model path): one line on stderr, exit status 2.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError,
               NotImplementedError)

SERVE_HINT = "install the serve extra: pip install 'batchspec[serve]'"


def need(*modules: str) -> None:
    """Refuse a command whose optional dependencies (the serve extra) are not installed, naming them."""
    missing = []
    for m in modules:
        try:
            __import__(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise ValueError(f"this command needs {', '.join(missing)}: {SERVE_HINT}")


def positive_float(text: str) -> float:
    """argparse type: a number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value
