"""Determinism run: does a server give one greedy output per prompt, whatever else it is running?
``determinism_run(url, prompts, repeat=100, concurrency=(1, 8, 32))`` or ``batchspec audit --endpoint URL --repeat N``.

Each prompt is sent ``repeat`` times, greedy (``temperature: 0``), in ``repeat`` rounds: round ``r`` sends every prompt
once, in an order shuffled per round (``seed``), with ``concurrency[r % len(concurrency)]`` requests under way at once,
so each prompt's copies meet different neighbours in different batch sizes. No reference and no model is needed
(only a tokenizer to send text prompts as token ids; without one they go as text). Token ids are read back as in the
endpoint audit (``batchspec.audit.endpoint``), and each prompt's answers are compared whole, token id for token id:

- ``unique``: the number of distinct outputs among its answers (1: deterministic);
- ``first_divergence``: the first token index at which two of them differ (None when there is one);
- per distinct output: how many answers gave it, at which concurrency, its length and its ids.

A request that fails or whose ids are not token ids (a protocol error) is counted and not compared; a finish_reason
is not checked here. Verdict (``DeterminismReport.verdict``): exit status 1 when some prompt has more than one unique
output (``not deterministic``) or some requests failed (``incomplete``), 2 when every request failed (``could not
audit``) or the outputs are too short to exercise batching (median under ``MIN_MEDIAN_TOKENS``: ``proved little``),
else 0 (``deterministic``). As in the endpoint audit, a level above the number of prompts is capped at that number.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from .endpoint import (ConcurrentRun, EndpointClient, check_levels, check_request, model_name, prompt_items,
                       reference_tokenizer)
from .endpoint.flows import cap_levels, capped_note
from .endpoint.markdown import MIN_MEDIAN_TOKENS
from ..serve.client import display
from .report import save_png

DETERMINISTIC = "deterministic"
NOT_DETERMINISTIC = "not deterministic"


def first_divergence(outputs) -> int | None:
    """The first index at which two of ``outputs`` differ (a length difference counts); None when they are equal."""
    outputs = [list(o) for o in outputs]
    if len({tuple(o) for o in outputs}) <= 1:
        return None
    k = 0
    while all(k < len(o) for o in outputs) and len({o[k] for o in outputs}) == 1:
        k += 1
    return k


@dataclass
class DeterminismReport:
    """``prompts``: one summary per prompt (see the module); ``meta``: url, model, api, stream, repeat, levels,
    rounds (the concurrency of each), requests, seconds, max_tokens, token_source, capped (None, or which levels
    were capped at the number of prompts)."""

    prompts: list[dict]
    meta: dict

    def verdict(self) -> tuple[int, str]:
        """The exit status and the verdict in a line."""
        answered = sum(p["answered"] for p in self.prompts)
        requests = sum(p["requests"] for p in self.prompts)
        if not answered:
            return 2, "could not audit: every request failed"
        spread = [p for p in self.prompts if p["unique"] > 1]
        if spread:
            most = max(p["unique"] for p in spread)
            return 1, (f"{NOT_DETERMINISTIC}: {len(spread)} of {len(self.prompts)} prompts gave more than one greedy "
                       f"output (up to {most} unique)")
        if answered < requests:
            return 1, (f"incomplete: {requests - answered} of {requests} requests failed; the answered ones give one "
                       "output per prompt")
        median = statistics.median(p["outputs"][0]["length"] for p in self.prompts if p["outputs"])
        if median < MIN_MEDIAN_TOKENS:
            return 2, (f"proved little: the median output is {median:g} tokens (under {MIN_MEDIAN_TOKENS}), too short "
                       "to exercise batching, so one output per prompt shows little (give prompts that ask for longer "
                       "answers, or --api chat)")
        levels = ", ".join(map(str, self.meta["levels"]))
        return 0, (f"{DETERMINISTIC}: one output per prompt over {self.meta['repeat']} requests each "
                   f"(concurrency {levels})")

    def as_dict(self) -> dict:
        return {"meta": self.meta, "verdict": self.verdict()[1], "prompts": self.prompts}

    def to_json(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=1))
        return path

    def to_markdown(self) -> str:
        m = self.meta
        lines = [f"**Verdict: {self.verdict()[1]}**", "",
                 f"Determinism run of {m['url']} (model {m['model']}): {m['n_prompts']} prompts, each sent "
                 f"{m['repeat']} times (greedy, max_tokens {m['max_tokens']}) in {m['repeat']} rounds at concurrency "
                 f"{', '.join(map(str, m['levels']))} in turn; {m['requests']} requests in {m['seconds']:.1f} s; "
                 f"tokens from {m['token_source'] or '-'}" + (f" ({m['capped']})." if m.get("capped") else "."), "",
                 "| prompt | requests | answered | unique outputs | first divergence | most common output |",
                 "|---|---|---|---|---|---|"]
        for p in self.prompts:
            top = p["outputs"][0] if p["outputs"] else None
            common = f"{top['count']} answers, {top['length']} tokens" if top else "-"
            fd = "-" if p["first_divergence"] is None else str(p["first_divergence"])
            lines.append(f"| {p['name']} | {p['requests']} | {p['answered']} | {p['unique']} | {fd} | {common} |")
        problems = [(p["name"], q) for p in self.prompts for q in p["problems"]]
        if problems:
            lines += ["", "First problems:", ""] + [f"- prompt {name}: {q}" for name, q in problems[:10]]
        return "\n".join(lines) + "\n"

    def figure(self):
        """Unique outputs per prompt (a matplotlib ``Figure``): one bar a prompt, red above 1."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        n = len(self.prompts)
        fig = Figure(figsize=(min(16.0, max(6.0, 0.25 * n + 2)), 4.2), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        unique = [p["unique"] for p in self.prompts]
        ax.bar(range(n), unique, color=["#c53030" if u > 1 else "#2f855a" for u in unique], width=0.8)
        ax.axhline(1, color="#555555", lw=0.8, ls=":")
        ax.set_xlim(-0.6, n - 0.4)
        ax.set_ylim(0, max([2, *unique]) + 0.5)
        ax.set_xlabel("prompt")
        ax.set_ylabel("unique greedy outputs")
        if n <= 40:
            ax.set_xticks(range(n), [display(p["name"]) for p in self.prompts], rotation=45, ha="right", fontsize=7,
                          parse_math=False, usetex=False)
        m = self.meta
        ax.set_title(f"determinism: {m['repeat']} requests per prompt at concurrency "
                     f"{', '.join(map(str, m['levels']))}\n(1 unique output = deterministic)", fontsize=9)
        return fig

    def plot(self, path) -> Path:
        return save_png(self.figure(), path)


@dataclass
class DeterminismRun:
    """A determinism run's settings (see ``determinism_run``); ``run()`` checks them and returns the
    ``DeterminismReport``."""

    url: str
    prompts: Sequence = ()
    repeat: int = 100
    concurrency: Sequence[int] = (1, 8, 32)
    model: str | None = None
    names: Sequence | None = None
    tokenizer: object = None
    max_tokens: int = 64
    api: str = "completions"
    stream: bool = False
    chat_template: bool = True
    api_key: str | None = None
    stop_token_ids: Sequence[int] = ()
    timeout: float = 600.0
    seed: int = 0
    progress: bool = False
    capped: Sequence[int] = ()

    def checked(self) -> DeterminismRun:
        """These settings with the levels as integers and the prompts and names as lists; ``ValueError`` for ones
        that cannot run."""
        levels = check_levels(self.concurrency)
        prompts, repeat = list(self.prompts), self.repeat
        if not prompts:
            raise ValueError("no prompts to send")
        if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 2:
            raise ValueError(f"repeat must be an integer >= 2 (each prompt is sent that many times), got {repeat!r}")
        check_request(self.api, self.timeout)
        names = list(self.names) if self.names is not None else list(range(len(prompts)))
        if len(names) != len(prompts):
            raise ValueError(f"{len(names)} names for {len(prompts)} prompts")
        levels, capped = cap_levels(levels, len(prompts))
        return replace(self, concurrency=levels, prompts=prompts, names=names, capped=capped)

    def run(self) -> DeterminismReport:
        """Send the rounds (see ``determinism_run``)."""
        run = self.checked()
        model = model_name(run.url, run.model, run.api_key, run.timeout)
        tok = reference_tokenizer(None, run.tokenizer)
        items, texts = prompt_items(run.prompts, tok, run.api, run.chat_template)
        stops = {int(s) for s in run.stop_token_ids}
        if getattr(tok, "eos_token_id", None) is not None:
            stops.add(int(tok.eos_token_id))
        client = EndpointClient(run.url, model, tok, run.max_tokens, run.api, run.stream, run.api_key, run.timeout,
                                [int(s) for s in run.stop_token_ids], texts, sorted(stops),
                                vocab_size=len(tok) if tok is not None else None)
        t = time.perf_counter()
        try:
            got, rounds = run._rounds(client, items)
        finally:
            client.close()
        seconds = time.perf_counter() - t
        summaries = [_summary(name, answers) for name, answers in zip(run.names, got)]
        sources = sorted({a.source for answers in got for _, a in answers if a.source})
        meta = {"url": run.url, "model": display(model), "api": run.api, "stream": run.stream, "repeat": run.repeat,
                "levels": run.concurrency, "rounds": rounds, "seed": run.seed, "n_prompts": len(items),
                "requests": run.repeat * len(items), "seconds": seconds, "max_tokens": run.max_tokens,
                "token_source": ", ".join(sources) or None,
                "capped": capped_note(run.capped, len(items))}
        return DeterminismReport(summaries, meta)

    def _rounds(self, client: EndpointClient, items: list) -> tuple[list[list[tuple[int, object]]], list[int]]:
        """Every round in turn; per prompt: (concurrency, answer) of each of its requests, and each round's
        concurrency."""
        from ..progress import Progress

        levels, repeat = self.concurrency, self.repeat
        rng = random.Random(self.seed)
        got: list[list[tuple[int, object]]] = [[] for _ in items]
        rounds = []
        with Progress(self.progress, repeat, "determinism run") as bar:
            for r in range(repeat):
                c = levels[r % len(levels)]
                bar.describe(f"round {r + 1} of {repeat}, concurrency {c}")
                order = rng.sample(range(len(items)), len(items))
                answers = ConcurrentRun(client, [items[k] for k in order], c).run()
                for k, a in zip(order, answers):
                    got[k].append((c, a))
                rounds.append(c)
                bar.advance()
        return got, rounds


def determinism_run(url: str, prompts, repeat: int = 100, concurrency=(1, 8, 32), model: str | None = None,
                    **settings) -> DeterminismReport:
    """Send each prompt ``repeat`` times at the ``concurrency`` levels in turn and count its distinct outputs (see the
    module). ``settings``: the other fields of ``DeterminismRun``, by name: ``names``: what to call each prompt in the
    report (default its index); ``tokenizer``: an object, path or name, to send text prompts as token ids (through
    the chat template when ``chat_template``); ``seed``: of the order of each round; the others (``max_tokens``,
    ``api``, ``stream``, ``api_key``, ``stop_token_ids``, ``timeout``, ``progress``) as for ``audit_endpoint``.
    Raises ``ConnectionError`` when the server cannot be reached."""
    return DeterminismRun(url, prompts, repeat, concurrency, model, **settings).run()


def _summary(name, answers) -> dict:
    outs = [(c, tuple(a.ids)) for c, a in answers if a.source is not None]
    counts = Counter(o for _, o in outs)
    by_c: dict = {}
    for c, o in outs:
        by_c.setdefault(o, Counter())[c] += 1
    problems = [f"{kind}: {why}" for _, a in answers for kind, why in a.problems() if kind != "finish_reason"]
    return {
        "name": name, "requests": len(answers), "answered": len(outs),
        "failed": sum(a.error is not None for _, a in answers),
        "protocol_errors": sum(a.protocol_error is not None for _, a in answers),
        "unique": len(counts), "first_divergence": first_divergence(counts),
        "outputs": [{"count": n, "by_concurrency": {str(c): k for c, k in sorted(by_c[o].items())}, "length": len(o),
                     "token_ids": list(o)} for o, n in counts.most_common()],
        "problems": problems[:5],
    }
