"""Does speculation pay in the server? ``batchspec serve`` with its default draft against ``batchspec serve --draft
none`` (and any OpenAI-compatible endpoint given), under the same load from ``batchspec loadtest``, one after the other.

    .venv/bin/python scripts/serve_pays.py [--prompts FILE] [--categories summarization,rag,qa,translation] [--take 2]
        [--concurrency 1,16] [--requests 12] [--max-tokens 48] [--ignore-eos] [--pairs 2]
        [--server-args "--batch-size 32"] [--endpoint URL --endpoint-model NAME] [--out out/serve_pays.json]

Each pair starts the default server, sends a warm-up and the load, stops it, then does the same with the plain one
(and the endpoint, if given: it is not started here); the printed figures are medians over pairs of output tokens per
second, TTFT P50 and TPOT P50, and their ratios to the plain server in the same pair. Without ``--prompts`` the
built-in prompt set is used (``--categories`` and ``--take`` pick prompts within each category, in file order). The
engine's counters (rounds, drafted and accepted tokens, the reasons rounds drafted nothing) are read from /metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from batchspec.serve.loadtest import LoadConfig, run_load

ROOT = Path(__file__).resolve().parents[1]


def _figures(r: dict) -> str:
    return f"{r['tok_s']:.1f} tok/s (TTFT {r['ttft_p50'] * 1e3:.0f} ms, TPOT {r['tpot_p50'] * 1e3:.0f} ms)"


def pick(path, categories, take) -> list[str]:
    if path is None:
        from batchspec.data import builtin_records

        records = builtin_records()
    else:
        records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    groups = [[r for r in records if r.get("category") == c] for c in categories] if categories else [records]
    return [r["turns"][0] for g in groups for r in g[: take or None]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``batchspec serve`` process on a free loopback port, stopped (by its PID) when the block ends."""

    def __init__(self, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "batchspec", "serve", "--port", str(self.port), "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def __enter__(self) -> "Server":
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("the server did not come up")

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def counters(self) -> dict:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("batchspec_") and not line.startswith("batchspec_http"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


def load(url, model, prompts, args, n) -> dict:
    cfg = LoadConfig(url=url, model=model, prompts=prompts, concurrency=args.level, requests=n,
                     max_tokens=args.max_tokens, api=args.api, temperature=0.0, ignore_eos=args.ignore_eos,
                     timeout=1800)
    s = run_load(cfg)
    c = s["requests"]
    if c["errors"]:
        raise RuntimeError(f"{c['errors']} requests failed, e.g. {s['errors_sample'][0]}")
    return {"tok_s": s["throughput"]["output_tokens_per_s"], "ttft_p50": s["ttft_s"]["p50"],
            "tpot_p50": s["tpot_s"]["p50"], "ok": c["ok"]}


def run_server(extra, prompts, args) -> dict:
    with Server(extra) as srv:
        load(srv.url, None, prompts[:2], argparse.Namespace(**{**vars(args), "level": 1}), 2)  # warm-up
        before = srv.counters()
        res = load(srv.url, None, prompts, args, args.requests)
        after = srv.counters()
    res["engine"] = {k: after[k] - before.get(k, 0.0) for k in after if k.endswith("_total")}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default=None)
    ap.add_argument("--categories", default="")
    ap.add_argument("--take", type=int, default=0)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=12, help="requests per run (per concurrency level)")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--api", default="chat", choices=["chat", "completions"])
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--server-args", default="", help="extra arguments for both batchspec servers")
    ap.add_argument("--endpoint", default=None, help="another OpenAI-compatible server to load the same way")
    ap.add_argument("--endpoint-model", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    prompts = pick(args.prompts, [c for c in args.categories.split(",") if c], args.take)
    extra = shlex.split(args.server_args)
    report = {"command": " ".join(sys.argv), "prompts": len(prompts), "levels": {}}
    for level in [int(x) for x in args.concurrency.split(",")]:
        args.level = level
        runs = {"default": [], "plain": [], "endpoint": []}
        for pair in range(args.pairs):
            runs["default"].append(run_server(extra, prompts, args))
            runs["plain"].append(run_server(extra + ["--draft", "none"], prompts, args))
            if args.endpoint:
                runs["endpoint"].append(load(args.endpoint, args.endpoint_model, prompts, args, args.requests))
            d, p = runs["default"][-1], runs["plain"][-1]
            e = f", endpoint {_figures(runs['endpoint'][-1])}" if args.endpoint else ""
            print(f"c={level} pair {pair + 1}: default {_figures(d)}, plain {_figures(p)}{e}: "
                  f"{d['tok_s'] / p['tok_s']:.2f}x; engine {d['engine']}", flush=True)
        ratios = [d["tok_s"] / p["tok_s"] for d, p in zip(runs["default"], runs["plain"])]
        tpot = [d["tpot_p50"] / p["tpot_p50"] for d, p in zip(runs["default"], runs["plain"])]
        summary = {"ratio_median": statistics.median(ratios), "ratios": ratios, "tpot_ratio_median":
                   statistics.median(tpot), "runs": runs}
        line = (f"c={level}: default / plain output tok/s median {summary['ratio_median']:.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f}), TPOT P50 ratio {summary['tpot_ratio_median']:.2f}")
        if args.endpoint:  # each server's throughput and TTFT P50 against the endpoint's in the same pair
            for name in ("default", "plain"):
                pairs = list(zip(runs[name], runs["endpoint"]))
                tok = summary[f"{name}_vs_endpoint"] = [a["tok_s"] / b["tok_s"] for a, b in pairs]
                ttft = summary[f"{name}_ttft_vs_endpoint"] = [a["ttft_p50"] / b["ttft_p50"] for a, b in pairs]
                line += (f"; {name} / endpoint {statistics.median(tok):.2f}x ({min(tok):.2f}-{max(tok):.2f}), "
                         f"TTFT P50 {statistics.median(ttft):.2f}x")
        report["levels"][level] = summary
        print(line)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
