"""``batchspec serve`` (the OpenAI-compatible server) and ``batchspec loadtest`` (a load generator for any
OpenAI-compatible server). The web stack is imported only when a command runs, so the rest of the command line works
without the ``serve`` extra."""

from __future__ import annotations

import argparse
import os

from batchspec.cli import COMMANDS, DEFAULT_TARGET, positive_int

EXTRA_HINT = "install the serve extra: pip install 'batchspec[serve]'"


def _need(*modules: str) -> None:
    missing = []
    for m in modules:
        try:
            __import__(m)
        except ImportError:
            missing.append(m)
    if missing:
        raise ValueError(f"this command needs {', '.join(missing)}: {EXTRA_HINT}")


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


# ------------------------------------------------------------------------------------------------ serve


def add_serve_arguments(p: argparse.ArgumentParser, model_args=None) -> None:
    p.description = (
        "Serve the target (with its draft) over an OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions (streaming with Server-Sent Events), /v1/models, /health, /metrics. Requests are "
        "batched continuously in one engine thread; greedy outputs (temperature 0) are token-for-token those of "
        "batch-size-1 decoding whatever the load."
    )
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"target model: path, model id or built-in name (default {DEFAULT_TARGET})")
    p.add_argument("--draft", default=None,
                   help="draft: a model or draft-head path, a built-in name (smollm2-135m-draft: the feature-reading "
                        "head; smollm2-135m-draft-model), 'prompt-lookup' or 'none' (default smollm2-135m-draft with "
                        "the default target, else none)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=5)
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"])
    p.add_argument("--layout", default="slotmask", choices=["slotmask", "eqspec"])
    p.add_argument("--batch-size", type=positive_int, default=32, help="most rows in the running batch (default 32)")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests that may wait beyond the batch; more get 429 (default 64)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--device", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("BATCHSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $BATCHSPEC_API_KEY; none: open)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the last part of --target)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="chat's max_tokens when a request gives none (completions: 16, as OpenAI)")
    p.add_argument("--default-temperature", type=float, default=1.0,
                   help="temperature when a request gives none (default 1.0, as OpenAI; 0: greedy)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def build_app(args):
    """The app for parsed ``serve`` arguments (loads the models)."""
    import torch

    import batchspec
    from batchspec.cli import resolve_draft

    from .app import create_app

    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.default_temperature < 0:
        raise ValueError(f"--default-temperature must be >= 0, got {args.default_temperature}")
    llm = batchspec.LLM(
        args.target, draft=resolve_draft(args.target, args.draft), tokenizer=args.tokenizer,
        num_draft_tokens=args.num_draft_tokens, layout=args.layout, scheduler="continuous",
        batch_size=args.batch_size, dtype=getattr(torch, args.dtype) if args.dtype else None, device=args.device,
        speculation=args.speculation,
    )
    name = args.served_model_name or os.path.basename(os.path.normpath(args.target))
    return create_app(llm, model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                      default_max_tokens=args.default_max_tokens, default_temperature=args.default_temperature)


def run_serve(args) -> int:
    _need("fastapi", "uvicorn", "prometheus_client")
    from .server import serve_forever

    app = build_app(args)
    serve_forever(app, args.host, args.port, args.log_level)
    return 0


# ------------------------------------------------------------------------------------------------ loadtest


def add_loadtest_arguments(p: argparse.ArgumentParser, model_args=None) -> None:
    p.description = (
        "Send streamed requests to an OpenAI-compatible server at a Poisson rate (--rate) or with a fixed number of "
        "clients (--concurrency); report throughput, TTFT, time per output token and end-to-end latency (P50/P90/"
        "P99) and the requests shed (429/503) or failed; write loadtest.json and loadtest.png to --out."
    )
    p.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--model", default=None, help="model id (default: the first of /v1/models)")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=_positive_float, help="requests per second, Poisson arrivals")
    load.add_argument("--concurrency", type=positive_int, help="clients sending one request after another")
    p.add_argument("--requests", type=positive_int, default=100, help="requests to send at most (default 100)")
    p.add_argument("--duration", type=_positive_float, default=600.0,
                   help="seconds of sending at most (default 600); requests under way then finish")
    p.add_argument("--prompts", default=None, help="prompt file, JSONL or one prompt per line (default: built-in set)")
    p.add_argument("--max-tokens", type=positive_int, default=64)
    p.add_argument("--api", default="chat", choices=["chat", "completions"])
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask for exactly --max-tokens tokens (vLLM extension)")
    p.add_argument("--api-key", default=os.environ.get("BATCHSPEC_API_KEY"))
    p.add_argument("--timeout", type=_positive_float, default=600.0, help="seconds per request at most")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--out", default="out/loadtest", help="folder for loadtest.json and loadtest.png")
    p.set_defaults(func=run_loadtest)


def run_loadtest(args) -> int:
    _need("httpx")
    from rich.console import Console

    from batchspec.cli import prepare_out, read_prompt_set

    from .loadtest import LoadConfig, rich_table, run_load, write_report

    out = prepare_out(args.out, folder=True)
    prompts = [t for _, t in read_prompt_set(args.prompts)]
    cfg = LoadConfig(url=args.url, model=args.model, prompts=prompts, rate=args.rate, concurrency=args.concurrency,
                     requests=args.requests, duration=args.duration, max_tokens=args.max_tokens, api=args.api,
                     temperature=args.temperature, api_key=args.api_key, timeout=args.timeout, seed=args.seed,
                     ignore_eos=args.ignore_eos)
    try:
        summary = run_load(cfg, progress=True)
    except OSError as e:
        raise ValueError(f"cannot reach {args.url}: {e}") from None
    js, png = write_report(summary, out)
    console = Console()
    console.print(rich_table(summary))
    c, t = summary["requests"], summary["throughput"]
    console.print(
        f"{c['sent']} sent in {summary['wall_s']:.1f} s: {c['ok']} ok, {c['rejected_429']} x 429, "
        f"{c['rejected_503']} x 503, {c['errors']} errors; {t['requests_per_s']:.2f} req/s, "
        f"{t['output_tokens_per_s']:.1f} output tok/s; wrote {js}, {png}"
    )
    if c["errors"]:
        console.print(f"[red]{c['errors']} requests failed, e.g. {summary['errors_sample'][0]}[/red]")
        return 1
    return 0


COMMANDS["serve"] = (add_serve_arguments, run_serve)
COMMANDS["loadtest"] = (add_loadtest_arguments, run_loadtest)
