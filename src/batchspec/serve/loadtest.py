"""A load generator for any OpenAI-compatible server: ``run_load(LoadConfig(...))`` or ``batchspec loadtest``.

Arrivals are a Poisson process at ``rate`` requests/s (exponential gaps, seeded), or ``concurrency`` clients that each
send their next request when the last one ends. Both stop after ``requests`` requests or ``duration`` seconds of
sending, whichever comes first; requests under way then run to their end (at most ``timeout`` seconds each).
Every request streams (``stream: true`` with ``stream_options.include_usage``), so that the client sees each token:

- TTFT: from sending the request to the first chunk that carries output (text or token ids);
- TPOT (time per output token): ``(end - first token) / (output tokens - 1)``, per request with >= 2 tokens;
- end-to-end latency: from sending to the ``[DONE]`` event;
- output tokens: the usage the server reports, else the token ids it streams, else one per chunk with text.

With ``multi_turn`` (chat only) each prompt is a conversation, a list of user turns: ``requests`` and the arrivals
count conversations, and each turn is sent once the answer to the turn before has come, with every earlier turn and
the server's own answers as history (user, assistant, user, ...), as a chat client does; the prefix cache of a server
meets its traffic there. A conversation stops at a turn that fails, and starts no turn after ``duration``. TTFT, TPOT,
latency and throughput are also reported per turn.

A request counts as ``ok`` when its stream ends with ``[DONE]`` after a chunk with a ``finish_reason``; 429 and 503
answers are counted apart (load shed by the server); anything else (another status, a broken stream, an error event,
a timeout) is an error. Throughput is over the wall time from the first request to the last answer.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..progress import Progress
from .client import (AnswerError, StreamError, StreamedAnswer, aread_body, api_base, api_path, asse_lines, auth_headers,
                     display, prompt_field)

PERCENTILES = (50, 90, 99)


@dataclass
class LoadConfig:
    url: str
    model: str | None = None  # None: the first model of /v1/models
    prompts: list = field(default_factory=list)  # texts; with multi_turn, lists of turns
    rate: float | None = None  # requests/s (Poisson); None with concurrency
    concurrency: int | None = None
    requests: int = 100
    duration: float = 600.0  # seconds of sending at most
    max_tokens: int = 64
    api: str = "chat"  # "chat" | "completions"
    temperature: float = 0.0
    api_key: str | None = None
    timeout: float = 600.0
    seed: int = 0
    ignore_eos: bool = False  # vLLM/batchspec extension: every request generates max_tokens tokens
    multi_turn: bool = False


@dataclass
class Record:
    index: int
    start: float  # seconds since the test began
    status: str  # "ok" | "429" | "503" | "error"
    http_status: int | None = None
    ttft: float | None = None
    tpot: float | None = None
    gap: float | None = None  # the longest wait between two streamed outputs after the first
    e2e: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    turn: int | None = None  # with multi_turn: 1 for a conversation's first turn, 2 for its second, ...
    prompt_tokens: int | None = None  # as the server's usage reports them


async def first_model(client, url: str, api_key: str | None, timeout: float) -> str:
    """The first model of ``url``'s ``/v1/models``, read whole within ``timeout`` seconds and at most
    ``MAX_ANSWER_BYTES``: a server that trickles its answer or sends one without end does not hold the load test."""
    async def get():
        async with client.stream("GET", api_base(url) + "/models", headers=auth_headers(api_key)) as r:
            r.raise_for_status()
            return json.loads(await aread_body(r, time.monotonic() + timeout))

    try:
        found = await asyncio.wait_for(get(), timeout)
    except asyncio.TimeoutError:
        raise TimeoutError(f"{url} sent no whole /v1/models within {timeout:g} s") from None
    except (AnswerError, ValueError) as e:  # too large, not JSON
        raise ValueError(f"{url} sent no usable /v1/models: {e}") from None
    data = (found.get("data") if isinstance(found, dict) else None) or []
    if not data:
        raise ValueError(f"{url} serves no model (/v1/models is empty); give --model")
    return data[0]["id"]


def _body(cfg: LoadConfig, model: str, prompt) -> dict:
    """The request for ``prompt``: a text, or a list of chat messages (a conversation so far)."""
    body = {"model": model, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update({"messages": prompt} if isinstance(prompt, list) else prompt_field(cfg.api, prompt))
    return body


async def _one(client, cfg: LoadConfig, model: str, index: int, prompt, t0: float) -> tuple[Record, str]:
    """Send ``prompt`` (``_body``); returns its record and the text of its answer."""
    start = time.perf_counter()
    rec = Record(index, start - t0, "error")
    answer = StreamedAnswer(strict=False)
    try:
        await asyncio.wait_for(_stream(client, cfg, model, prompt, rec, answer), cfg.timeout)
    except asyncio.TimeoutError:  # httpx's timeout bounds each read: a trickled answer never trips it
        rec.error = f"TimeoutError: no whole answer within {cfg.timeout:g} s"
    except StreamError as e:
        rec.error = f"error event: {json.dumps(e.error)[:300]}"
    except Exception as e:  # connection refused or reset, timeout, bad JSON
        rec.error = f"{type(e).__name__}: {e}"[:300]
    end = time.perf_counter()
    rec.finish_reason = answer.finish_reason
    text = "".join(answer.texts)
    if rec.error is not None:
        return rec, text
    if not answer.done or rec.finish_reason is None:
        rec.error = "the stream ended without [DONE] and a finish_reason"
        return rec, text
    rec.status = "ok"
    rec.e2e = end - start
    streamed_ids = sum(len(ids) for ids in answer.token_chunks if ids)
    usage = answer.usage or {}
    rec.prompt_tokens = usage.get("prompt_tokens")
    usage_tokens = usage.get("completion_tokens")
    rec.output_tokens = usage_tokens if usage_tokens is not None else streamed_ids or answer.text_chunks
    if answer.first is not None:
        rec.ttft, rec.gap = answer.first - start, answer.gap
        if rec.output_tokens > 1:
            rec.tpot = (end - answer.first) / (rec.output_tokens - 1)
    return rec, text


async def _conversation(client, cfg: LoadConfig, model: str, index: int, turns, t0: float, deadline: float):
    """The records of one conversation: each turn sent once the answer to the turn before has come, with every
    earlier turn and the server's answers as history; it stops at a turn that fails and sends none after
    ``deadline``."""
    turns = [turns] if isinstance(turns, str) else turns
    messages, records = [], []
    for n, turn in enumerate(turns, 1):
        if n > 1 and time.perf_counter() >= deadline:
            break
        messages.append({"role": "user", "content": turn})
        rec, text = await _one(client, cfg, model, index, list(messages), t0)
        rec.turn = n
        records.append(rec)
        if rec.status != "ok":
            break
        messages.append({"role": "assistant", "content": text})
    return records


async def _stream(client, cfg: LoadConfig, model: str, prompt, rec: Record, answer: StreamedAnswer):
    """Send one request and fold its stream into ``answer``; an answer other than 200 sets ``rec``'s status and
    error. At most ``MAX_ANSWER_BYTES`` are read, by ``cfg.timeout`` seconds from now."""
    deadline = time.monotonic() + cfg.timeout
    async with client.stream("POST", api_base(cfg.url) + api_path(cfg.api), json=_body(cfg, model, prompt),
                             headers=auth_headers(cfg.api_key), timeout=cfg.timeout) as r:
        rec.http_status = r.status_code
        if r.status_code != 200:
            text = (await aread_body(r, deadline)).decode(errors="replace")
            rec.status = str(r.status_code) if r.status_code in (429, 503) else "error"
            rec.error = f"HTTP {r.status_code}: {text[:300]}"
            return
        async for line in asse_lines(r, deadline):
            if answer.feed(line):
                break


def percentiles(values) -> dict:
    """P50/P90/P99 (linear interpolation), mean, max and count of ``values`` (None when empty)."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}

    def q(p):
        pos = (len(xs) - 1) * p / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"n": len(xs), "mean": sum(xs) / len(xs), **{f"p{p}": q(p) for p in PERCENTILES}, "max": xs[-1]}


async def run_load_async(cfg: LoadConfig, progress: bool = False) -> dict:
    import httpx

    if (cfg.rate is None) == (cfg.concurrency is None):
        raise ValueError("give exactly one of rate and concurrency")
    if not cfg.prompts:
        raise ValueError("no prompts")
    if cfg.api not in ("chat", "completions"):
        raise ValueError(f"api must be 'chat' or 'completions', got {cfg.api!r}")
    if cfg.multi_turn and cfg.api != "chat":
        raise ValueError("multi_turn sends chat messages: it needs api 'chat'")
    rng = random.Random(cfg.seed)
    records: list[Record] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    bar = Progress(progress, cfg.requests, "loadtest")
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout) as client:
        model = cfg.model or await first_model(client, cfg.url, cfg.api_key, cfg.timeout)
        t0 = time.perf_counter()
        deadline = t0 + cfg.duration

        done = 0

        async def send(i: int):
            nonlocal done
            prompt = cfg.prompts[i % len(cfg.prompts)]
            if cfg.multi_turn:
                records.extend(await _conversation(client, cfg, model, i, prompt, t0, deadline))
            else:
                records.append((await _one(client, cfg, model, i, prompt, t0))[0])
            done += 1
            ok = sum(r.status == "ok" for r in records)
            shed = sum(r.status in ("429", "503") for r in records)
            bar.update(done, f"ok {ok} shed {shed} errors {len(records) - ok - shed}")

        with bar:
            if cfg.rate is not None:
                tasks, at = [], t0
                for i in range(cfg.requests):
                    if i:
                        at += rng.expovariate(cfg.rate)
                    if at >= deadline:
                        break
                    await asyncio.sleep(max(0.0, at - time.perf_counter()))
                    tasks.append(asyncio.create_task(send(i)))
                await asyncio.gather(*tasks)
            else:
                counter = iter(range(cfg.requests))

                async def client_loop():
                    for i in counter:
                        if time.perf_counter() >= deadline:
                            return
                        await send(i)

                await asyncio.gather(*(client_loop() for _ in range(cfg.concurrency)))
        wall = time.perf_counter() - t0
    records.sort(key=lambda r: (r.index, r.turn or 0))
    return summarize(cfg, model, records, len(records), wall)


def run_load(cfg: LoadConfig, progress: bool = False) -> dict:
    """Run the load test; returns the summary (``summarize``)."""
    return asyncio.run(run_load_async(cfg, progress))


def in_flight_at_arrival(records) -> list[int]:
    """For each completed request (``status`` ok), how many completed requests were under way when it was sent, itself
    included: the concurrency the server actually saw (it grows without bound when the rate is beyond capacity)."""
    spans = sorted((r["start"], r["start"] + r["e2e"]) for r in records if r["status"] == "ok")
    starts = [s for s, _ in spans]
    ends = sorted(e for _, e in spans)
    return [bisect.bisect_right(starts, s) - bisect.bisect_right(ends, s) for s in starts]


def summarize(cfg: LoadConfig, model: str, records: list[Record], sent: int, wall: float) -> dict:
    ok = [r for r in records if r.status == "ok"]
    counts = {"sent": sent, "ok": len(ok), "rejected_429": sum(r.status == "429" for r in records),
              "rejected_503": sum(r.status == "503" for r in records),
              "errors": sum(r.status == "error" for r in records)}
    accepted = [r for r in records if r.http_status == 200]
    counts["accepted"] = len(accepted)
    counts["accepted_not_completed"] = sum(r.status != "ok" for r in accepted)
    cfg_d = asdict(cfg)
    cfg_d["prompts"] = len(cfg.prompts)
    cfg_d.pop("api_key", None)
    summary = {
        "config": cfg_d, "model": model, "wall_s": wall, "requests": counts,
        "offered_rate": cfg.rate, "achieved_rate": sent / wall if wall > 0 else 0.0, **_latencies(ok, wall),
        "in_flight_at_arrival": percentiles(in_flight_at_arrival([asdict(r) for r in records])),
        "errors_sample": [r.error for r in records if r.status == "error"][:10],
        "records": [asdict(r) for r in records],
    }
    if cfg.multi_turn:  # each turn's requests apart: a later turn's prompt starts with the turns before it
        turns = sorted({r.turn for r in records})
        summary["turns"] = {str(n): {"sent": sum(r.turn == n for r in records),
                                     **_latencies([r for r in ok if r.turn == n], wall)} for n in turns}
    return summary


def _latencies(ok: list[Record], wall: float) -> dict:
    """Throughput (over ``wall``) and the TTFT, TPOT, longest-gap and end-to-end percentiles of the completed
    requests ``ok``."""
    tokens = sum(r.output_tokens for r in ok)
    return {"throughput": {"requests_per_s": len(ok) / wall if wall > 0 else 0.0,
                           "output_tokens_per_s": tokens / wall if wall > 0 else 0.0, "output_tokens": tokens},
            "ttft_s": percentiles(r.ttft for r in ok), "tpot_s": percentiles(r.tpot for r in ok),
            "gap_s": percentiles(r.gap for r in ok), "e2e_s": percentiles(r.e2e for r in ok)}


def write_report(summary: dict, out, write=None) -> tuple[Path, Path]:
    """``loadtest.json`` and ``loadtest.png`` (CDFs of TTFT, TPOT and end-to-end latency) in ``out``; ``write(path,
    fill)`` writes the JSON file (default: plainly; the command writes it whole or not at all)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "loadtest.json"
    text = json.dumps(summary, indent=1)
    if write is None:
        js.write_text(text)
    else:
        write(js, lambda f: f.write(text))
    png = out / "loadtest.png"
    plot(summary, png)
    return js, png


def plot(summary: dict, path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    recs = [r for r in summary["records"] if r["status"] == "ok"]
    fig = Figure(figsize=(12, 4), layout="constrained")
    FigureCanvasAgg(fig)
    cfg = summary["config"]
    load = f"rate {cfg['rate']}/s" if cfg.get("rate") is not None else f"concurrency {cfg['concurrency']}"
    c = summary["requests"]
    shed = c["rejected_429"] + c["rejected_503"]
    fig.suptitle(f"loadtest {display(summary['model'])}: {load}, {c['ok']} ok, {shed} shed, "
                 f"{c['errors']} errors; {summary['throughput']['output_tokens_per_s']:.1f} output tok/s",
                 parse_math=False, usetex=False)  # a server's model id, as it is
    for ax, key, label in zip(fig.subplots(1, 3), ("ttft", "tpot", "e2e"),
                              ("time to first token (s)", "time per output token (s)", "end-to-end latency (s)")):
        xs = sorted(r[key] for r in recs if r[key] is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color="#2b6cb0")
            stats = summary[f"{key}_s"]
            for p, style in zip(PERCENTILES, (":", "--", "-.")):
                ax.axvline(stats[f"p{p}"], color="#c53030", ls=style, lw=0.8, label=f"P{p} {stats[f'p{p}']:.3g}")
            ax.legend(fontsize=8, loc="lower right")
        ax.set_xlabel(label)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    fig.axes[0].set_ylabel("fraction of requests")
    fig.savefig(path, dpi=110)
    return Path(path)



def rich_table(summary: dict):
    from rich.table import Table
    from rich.text import Text

    t = Table(title=Text(f"loadtest {display(summary['model'])}"))  # inert text: the model id is the server's
    for col in ("metric", "P50", "P90", "P99", "mean", "n"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    rows = [(summary, key, label, scale, unit) for key, label, scale, unit in (
        ("ttft_s", "TTFT", 1000, "ms"), ("tpot_s", "TPOT", 1000, "ms"), ("gap_s", "longest gap", 1000, "ms"),
        ("e2e_s", "end-to-end", 1, "s"),
        ("in_flight_at_arrival", "in flight", 1, "req"))]
    for n, turn in summary.get("turns", {}).items():
        rows += [(turn, "ttft_s", f"TTFT turn {n}", 1000, "ms"), (turn, "tpot_s", f"TPOT turn {n}", 1000, "ms")]
    for part, key, label, scale, unit in rows:
        s = part[key]
        cells = [f"{s[k] * scale:.1f}" if s[k] is not None else "-" for k in ("p50", "p90", "p99", "mean")]
        t.add_row(f"{label} ({unit})", *cells, str(s["n"]))
    for n, turn in summary.get("turns", {}).items():
        t.add_row(f"output tok/s turn {n}", "-", "-", "-", f"{turn['throughput']['output_tokens_per_s']:.1f}",
                  str(turn["ttft_s"]["n"]))
    return t
