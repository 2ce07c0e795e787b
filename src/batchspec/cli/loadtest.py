"""``batchspec loadtest``: a load generator for any OpenAI-compatible server (streamed requests at a Poisson rate or
from a fixed number of clients); writes loadtest.json and loadtest.png."""

from __future__ import annotations

import argparse
import os

from pathlib import Path

from .common import (need, non_negative_int, positive_float, positive_int, prepare_out, read_prompt_set,
                     rich_console, show_table, write_atomic)

HELP = "send a load to an OpenAI-compatible server and report throughput and latency"



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Send streamed requests to an OpenAI-compatible server at a Poisson rate (--rate) or with a fixed number of "
        "clients (--concurrency); report throughput, TTFT, time per output token and end-to-end latency (P50/P90/"
        "P99) and the requests shed (429/503) or failed; write loadtest.json and loadtest.png to --out."
    )
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=positive_float, help="requests per second, Poisson arrivals")
    load.add_argument("--concurrency", type=positive_int, help="clients sending one request after another")
    p.add_argument("--requests", type=positive_int, default=100, help="requests to send at most (default 100)")
    p.add_argument("--duration", type=positive_float, default=600.0,
                   help="seconds of sending at most (default 600); requests under way then finish")
    p.add_argument("--prompts", default=None, help="prompt file, JSONL or one prompt per line (default: built-in set)")
    p.add_argument("--categories", default="", metavar="A,B",
                   help="comma-separated categories of the prompt records to send (default: all)")
    p.add_argument("--skip", type=non_negative_int, default=0, metavar="N",
                   help="leave out the first N prompt records of each category, in file order (default 0)")
    p.add_argument("--multi-turn", action="store_true",
                   help="replay each record's turns as a conversation (chat): turn 2 goes with turn 1 and the "
                        "server's answer as history; --requests counts conversations; stats per turn")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--api", default="chat", choices=["chat", "completions"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens (vLLM extension)")
    p.add_argument("--api-key", default=os.environ.get("BATCHSPEC_API_KEY"))
    p.add_argument("--timeout", type=positive_float, default=600.0, help="seconds per request at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--out", default="out/loadtest", help="folder for loadtest.json and loadtest.png")

BASE_URL_HINT = "give the server's base URL, like http://127.0.0.1:8000"


def check_url(url: str) -> None:
    """Refuse a --url that is no server's base URL (no http://, an endpoint's path, a bad port) before any request."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        meant = f"did you mean http://{url}? " if "://" not in url else ""
        raise ValueError(f"--url {url!r} is no http:// or https:// URL; {meant}{BASE_URL_HINT}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"--url {url!r} has no valid port (1-65535); {BASE_URL_HINT}") from None
    path = parts.path.rstrip("/")
    if path.endswith(("/completions", "/models")) or parts.query:
        raise ValueError(f"--url {url!r} names an endpoint; {BASE_URL_HINT} (with or without /v1)")


def reach(url: str, api_key: str | None, timeout: float) -> None:
    """One request to ``/v1/models`` before the load: a server that is not there, or that refuses the key, is one
    line naming the fix instead of a failed run. Only its status is read, within ``timeout`` seconds in all."""
    import httpx

    from ..serve.client import api_base, auth_headers, run_within

    def status() -> int:
        with httpx.stream("GET", api_base(url) + "/models", timeout=timeout, headers=auth_headers(api_key)) as r:
            return r.status_code

    try:
        code = run_within(timeout, status)
    except (httpx.HTTPError, TimeoutError) as e:
        raise ValueError(f"cannot reach {url} ({e or type(e).__name__}); is the server running? "
                         f"Start one with batchspec serve, or {BASE_URL_HINT}") from None
    if code in (401, 403):
        raise ValueError(f"{url} refused the request ({code}); give its key with --api-key or $BATCHSPEC_API_KEY")
    if code == 404:
        raise ValueError(f"{url} has no /v1/models (404); {BASE_URL_HINT} (with or without /v1)")


def run(args) -> int:
    need("httpx")
    import httpx
    from rich.markup import escape

    from ..serve.loadtest import LoadConfig, rich_table, run_load, write_report

    check_url(args.url)
    if args.multi_turn and args.api != "chat":
        raise ValueError("--multi-turn sends conversations as chat messages; leave out --api completions")
    out = prepare_out(args.out, folder=True)
    prompts = pick_prompts(args.prompts, [c for c in args.categories.split(",") if c], args.skip, args.multi_turn)
    reach(args.url, args.api_key, min(args.timeout, 10.0))
    cfg = LoadConfig(url=args.url, model=args.model, prompts=prompts, rate=args.rate, concurrency=args.concurrency,
                     requests=args.requests, duration=args.duration, max_tokens=args.max_tokens, api=args.api,
                     temperature=args.temperature, api_key=args.api_key, timeout=args.timeout, seed=args.seed,
                     ignore_eos=args.ignore_eos, multi_turn=args.multi_turn)
    try:
        summary = run_load(cfg, progress=True)
    except (OSError, httpx.HTTPError) as e:
        raise ValueError(f"cannot reach {args.url}: {e or type(e).__name__}") from None
    js, png = write_report(summary, out, write_atomic)
    console = rich_console()
    show_table(console, rich_table(summary))
    c, t = summary["requests"], summary["throughput"]
    console.print(
        f"{c['sent']} sent in {summary['wall_s']:.1f} s: {c['ok']} ok, {c['rejected_429']} x 429, "
        f"{c['rejected_503']} x 503, {c['errors']} errors; {t['requests_per_s']:.2f} req/s, "
        f"{t['output_tokens_per_s']:.1f} output tok/s{_per_turn(summary)}; wrote {js}, {png}"
    )
    if c["errors"]:
        console.print(f"[red]{c['errors']} requests failed, e.g. {escape(str(summary['errors_sample'][0]))}[/red]")
        return 1
    return 0


def _per_turn(summary: dict) -> str:
    return "".join(f", turn {n} {t['throughput']['output_tokens_per_s']:.1f}"
                   for n, t in summary.get("turns", {}).items())


def pick_prompts(path, categories: list[str], skip: int, multi_turn: bool) -> list:
    """The prompts to send: the records of ``path`` (the built-in set when None; a text file's lines are records of
    one turn and no category) of ``categories`` (all when empty), less the first ``skip`` of each category, in file
    order; each its first turn, or with ``multi_turn`` its list of turns (records of one turn left out)."""
    texts = [text for _, text in read_prompt_set(path)]  # each record's first turn, checked
    records = _records(path) or [{"turns": [text]} for text in texts]
    unknown = sorted(set(categories) - {r.get("category") for r in records})
    if unknown:
        raise ValueError(f"no prompt record of category {', '.join(unknown)} in {path or 'the built-in prompt set'}")
    seen: dict = {}
    picked = []
    for rec, text in zip(records, texts):
        cat = rec.get("category")
        seen[cat] = seen.get(cat, 0) + 1
        if (not categories or cat in categories) and seen[cat] > skip:
            picked.append((rec.get("turns"), text))
    if not multi_turn:
        prompts = [text for _, text in picked]
    else:
        prompts = [turns for turns, _ in picked if isinstance(turns, list) and len(turns) > 1]
        bad = next((t for p in prompts for t in p if not isinstance(t, str) or not t.strip()), None)
        if bad is not None:
            raise ValueError(f"a turn of a prompt record is not a non-empty string: {bad!r:.40}")
    if not prompts:
        raise ValueError(f"no prompt {'record with two turns or more ' if multi_turn else ''}left among the "
                         f"{len(records)} records after --categories and --skip")
    return prompts


def _records(path) -> list[dict]:
    """The JSON records of a prompt file (the built-in set when None); [] for a text file."""
    from ..prompts import JSON_SUFFIXES, json_records, read_text

    if path is None:
        from ..data import builtin_records

        return builtin_records()
    text = read_text(Path(path))
    first = next((line for line in text.splitlines() if line.strip()), "")
    if Path(path).suffix.lower() in JSON_SUFFIXES or first.lstrip().startswith("{"):
        return [rec for _, rec in json_records(path, text)]
    return []
