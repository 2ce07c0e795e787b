"""``batchspec serve``: the OpenAI-compatible server. The web stack is imported only when the command runs, so the rest
of the command line works without the ``serve`` extra."""

from __future__ import annotations

import argparse
import math
import os

from ..params import MAX_TEMPERATURE
from ..serve.protocol import DEFAULT_MAX_BODY_BYTES, PREFILL_CHUNK, PREFILL_TOKENS
from .common import (DEFAULT_TARGET, TARGET_HELP, engine_config, kv_memory_arg, need, non_negative_int,
                     port_number, positive_int, prefix_cache_arg, weights_arg)

HELP = "serve the target over an OpenAI-compatible HTTP API"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serve the target (with its draft) over an OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions (streaming with Server-Sent Events), /v1/models, /health, /metrics. Requests are "
        "batched continuously in one engine thread; greedy outputs (temperature 0) are token-for-token those of "
        "batch-size-1 decoding whatever the load."
    )
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=TARGET_HELP)
    p.add_argument("--draft", default=None,
                   help="draft: a model or draft-head path, a built-in name (smollm2-135m-draft: the feature-reading "
                        "head; smollm2-135m-draft-model), 'prompt-lookup' or 'none' (default smollm2-135m-draft with "
                        "the default target, else none)")
    p.add_argument("--tokenizer", default=None, help="tokenizer path (default: the target's)")
    p.add_argument("--num-draft-tokens", type=positive_int, default=5)
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"])
    p.add_argument("--layout", default="slotmask", choices=["slotmask", "eqspec"])
    p.add_argument("--batch-size", type=positive_int, default=32, help="most rows in the running batch (default 32)")
    p.add_argument("--max-queue", type=non_negative_int, default=64,
                   help="requests that may wait beyond the batch; more get 429 (default 64)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "float64"])
    p.add_argument("--device", default=None)
    weights_arg(p)
    prefix_cache_arg(p)
    kv_memory_arg(p)
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=8000,
                   help="port to listen on; checked free before the model loads")
    p.add_argument("--api-key", default=os.environ.get("BATCHSPEC_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* and /metrics (default: $BATCHSPEC_API_KEY; "
                        "none: open; an empty key is refused). Prefer the environment variable: a key on the command "
                        "line is visible to every user in ps")
    p.add_argument("--max-prefill-tokens", type=non_negative_int, default=PREFILL_TOKENS,
                   help="while rows are running, the prompt tokens one step prefills at most (at least one request "
                        "joins): a burst of arrivals joins a group at a time, each group streaming before the next "
                        f"one's prefill (default {PREFILL_TOKENS}; 0: every request that fits the batch joins at once)")
    p.add_argument("--prefill-chunk", type=non_negative_int, default=PREFILL_CHUNK,
                   help="while rows are running, a prompt with more tokens than this not cached yet is prefilled this "
                        "many a step (into the prefix cache) and joins when the rest fits, so running streams wait a "
                        f"chunk at a time (default {PREFILL_CHUNK}; 0: whole)")
    p.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest request body in bytes; larger ones get 413 before they are read (default "
                        f"{DEFAULT_MAX_BODY_BYTES}, 4 MiB: a 128k-token context as ids or text takes about 1 MB)")
    p.add_argument("--allowed-hosts", type=_names, action="extend", default=[], metavar="NAMES",
                   help="Host names (comma list, any port) accepted besides localhost, 127.0.0.1 and [::1]; '*': any. "
                        "The Host header is checked on loopback connections (against DNS rebinding) and, once this is "
                        "given, on every connection; others get 400")
    p.add_argument("--allowed-origins", type=_names, action="extend", default=[], metavar="ORIGINS",
                   help="web origins (comma list of scheme://host[:port]; '*': any) whose pages may call the server "
                        "from a browser (CORS headers included); requests with another site's Origin header get 403 "
                        "(default: none, only the server's own origin)")
    p.add_argument("--docs", action="store_true",
                   help="serve the OpenAPI pages /docs, /redoc and /openapi.json (off by default; when on, they are "
                        "open even with --api-key: they describe the routes, nothing else)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send (default: the last part of --target)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256,
                   help="chat's max_tokens when a request gives none (completions: 16, as OpenAI)")
    p.add_argument("--default-temperature", type=float, default=1.0,
                   help="temperature when a request gives none (default 1.0, as OpenAI; 0: greedy)")
    p.add_argument("--shutdown-grace", type=_seconds, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or SIGINT, new requests get 503 and those in flight get this long to finish; the "
                        "rest then end with an error (a stream: an error event, then [DONE]) (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def build_app(args):
    """The app for parsed ``serve`` arguments (loads the models)."""
    import batchspec

    from ..serve.app import create_app

    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("the API key (--api-key or BATCHSPEC_API_KEY) is empty: set a key, or unset it to serve open")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if not (math.isfinite(args.default_temperature) and 0 <= args.default_temperature <= MAX_TEMPERATURE):
        raise ValueError(f"--default-temperature must be in [0, {MAX_TEMPERATURE:g}], got {args.default_temperature}")
    llm = batchspec.LLM.from_config(engine_config(args, scheduler="continuous"))
    name = args.served_model_name or os.path.basename(os.path.normpath(args.target))
    return create_app(llm, model_name=name, api_key=args.api_key, max_queue=args.max_queue,
                      default_max_tokens=args.default_max_tokens, default_temperature=args.default_temperature,
                      max_body_bytes=args.max_body_bytes, allowed_hosts=args.allowed_hosts or None,
                      allowed_origins=args.allowed_origins, docs=args.docs,
                      prefill_tokens=args.max_prefill_tokens or None, prefill_chunk=args.prefill_chunk or None)


def _seconds(text: str) -> float:
    """argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    """argparse type: a comma list of names (``--allowed-hosts a,b --allowed-hosts c``)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def check_listen(host: str, port: int) -> None:
    """Bind ``host``:``port`` once (as the server will, reusing a closing connection's address) and let it go: a port
    in use or an address not of this machine is one line before the model loads, not a failure after it."""
    import errno
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host}: no such address ({e.strerror}); give 127.0.0.1 (this machine only) or "
                         "0.0.0.0 (every interface)") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            hints = {errno.EADDRINUSE: "stop what listens there, or give another --port",
                     errno.EACCES: "ports below 1024 need privileges: give another --port, like 8000",
                     errno.EADDRNOTAVAIL: "give --host 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)"}
            hint = hints.get(e.errno, "give another --host or --port")
            raise ValueError(f"cannot listen on {host} port {port} ({e.strerror}); {hint}") from None


def run(args) -> int:
    need("fastapi", "uvicorn", "prometheus_client")
    from ..serve.server import serve_forever

    check_listen(args.host, args.port)
    app = build_app(args)
    serve_forever(app, args.host, args.port, args.log_level, args.shutdown_grace)
    return 0
