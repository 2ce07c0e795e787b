"""Audit any OpenAI-compatible endpoint against the local batch-size-1 oracle of the same model, at several levels of
concurrency: ``audit_endpoint(url, target, prompts, concurrency=(1, 8, 32))`` or ``batchspec audit --endpoint URL``.

At each level ``c`` every prompt is sent with at most ``c`` requests under way at once (a new one starts as soon as
one ends, so requests keep joining a running batch), greedy (``temperature: 0``), and the generated token ids are read
back. How they are read decides how far the audit can be trusted, and the report says which was used per level
(``token_source``):

- ``token_ids``: the server returns them (``return_token_ids``, as vLLM and ``batchspec serve`` do): exact;
- ``retokenized text``: it returns only text, which is encoded again with the local tokenizer: a last resort, since
  decoding and encoding need not round-trip (a divergence may then be an artefact of the text, not of the server).

``api="completions"`` (default) sends the prompts as token ids, so the server sees exactly the oracle's prompt;
``api="chat"`` sends each prompt as one user message and lets the server apply its chat template (the oracle applies
the local tokenizer's; when the server returns ``prompt_token_ids`` that differ, the request is counted in
``prompt_mismatches``). ``stream=True`` reads the answers as Server-Sent Events.

Each level is one run of the existing audit (``batchspec.audit.core.audit``) with a black-box engine
(``CallableEngine``), so the metrics, the divergence attribution and the black-box signature are the audit's own;
the rows' ``batch_size`` is the concurrency. A request that fails (an HTTP error, a broken stream) yields an empty
output, which diverges from the oracle, so such a level is never clean.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..serve.protocol import DONE, sse_data

TOKEN_IDS = "token_ids"
RETOKENIZED = "retokenized text"


@dataclass
class Answer:
    ids: list[int]
    source: str | None  # TOKEN_IDS | RETOKENIZED | None (failed)
    prompt_ids: list[int] | None = None
    error: str | None = None
    finish_reason: str | None = None


@dataclass
class EndpointClient:
    """Sends one prompt at a time (``one``) to an OpenAI-compatible server and returns the generated token ids."""

    url: str
    model: str
    tokenizer: object = None
    max_tokens: int = 64
    api: str = "completions"
    stream: bool = False
    api_key: str | None = None
    timeout: float = 600.0
    stop_token_ids: list[int] = field(default_factory=list)
    texts: dict = field(default_factory=dict)  # tuple(prompt ids) -> text (chat)

    def __post_init__(self):
        import httpx

        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        self.client = httpx.Client(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        self.base = self.url.rstrip("/") if self.url.rstrip("/").endswith("/v1") else self.url.rstrip("/") + "/v1"

    def close(self):
        self.client.close()

    def _headers(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _body(self, ids: list[int]) -> dict:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "return_token_ids": True,
                "stream": self.stream}
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.api == "chat":
            text = self.texts.get(tuple(ids))
            if text is None:
                raise ValueError("chat prompts must be given as text")
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = list(ids)
        return body

    def one(self, ids: list[int]) -> Answer:
        path = "/chat/completions" if self.api == "chat" else "/completions"
        try:
            if self.stream:
                return self._streamed(path, ids)
            r = self.client.post(self.base + path, json=self._body(ids), headers=self._headers())
            if r.status_code != 200:
                return Answer([], None, error=f"HTTP {r.status_code}: {r.text[:300]}")
            choice = r.json()["choices"][0]
            text = choice.get("text") if self.api == "completions" else (choice.get("message") or {}).get("content")
            return self._answer(choice.get("token_ids"), text or "", choice.get("prompt_token_ids"),
                                choice.get("finish_reason"))
        except Exception as e:
            return Answer([], None, error=f"{type(e).__name__}: {e}"[:300])

    def _streamed(self, path: str, ids: list[int]) -> Answer:
        got_ids, texts, prompt_ids, reason, done = [], [], None, None, False
        has_ids = False
        with self.client.stream("POST", self.base + path, json=self._body(ids), headers=self._headers()) as r:
            if r.status_code != 200:
                return Answer([], None, error=f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
            for line in r.iter_lines():
                msg = sse_data(line)
                if msg is None:
                    continue
                if msg == DONE:
                    done = True
                    break
                if "error" in msg:
                    return Answer([], None, error=f"error event: {json.dumps(msg['error'])[:300]}")
                for ch in msg.get("choices") or []:
                    if "token_ids" in ch:
                        has_ids = True
                        got_ids += ch.get("token_ids") or []
                    if ch.get("prompt_token_ids") is not None:
                        prompt_ids = ch["prompt_token_ids"]
                    text = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    texts.append(text or "")
                    reason = ch.get("finish_reason") or reason
        if not done:
            return Answer([], None, error="the stream ended without [DONE]")
        return self._answer(got_ids if has_ids else None, "".join(texts), prompt_ids, reason)

    def _answer(self, token_ids, text: str, prompt_ids, reason) -> Answer:
        if token_ids is not None:
            return Answer([int(t) for t in token_ids], TOKEN_IDS, prompt_ids, finish_reason=reason)
        if self.tokenizer is None:
            return Answer([], None, error="the server returned no token ids and there is no tokenizer to re-encode "
                                          "its text")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        return Answer(list(ids), RETOKENIZED, prompt_ids, finish_reason=reason)


class ConcurrentRun:
    """The black-box engine of one concurrency level: a callable ``list[prompt ids] -> list[output ids]``.

    The audit hands an engine its prompts in batches of ``batch_size`` (here the concurrency) one after another;
    this engine serves them all at the first call instead, with ``concurrency`` requests under way at any time, so
    new requests keep joining a running batch, and answers later calls from that run. A call that is not part of
    the expected sequence (the audit re-running one prompt alone to test the padding rule) is sent live."""

    def __init__(self, client: EndpointClient, prompts: list[list[int]], concurrency: int):
        self.client, self.prompts, self.concurrency = client, [list(p) for p in prompts], concurrency
        n = len(self.prompts)
        self.expected = [self.prompts[s : s + concurrency] for s in range(0, n, concurrency)]
        self.answers: list[Answer] | None = None
        self.offset = 0  # answers handed out from the run
        self.live: list[Answer] = []
        self.seconds = 0.0
        self._lock = threading.Lock()

    def _run_all(self) -> None:
        t = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            self.answers = list(pool.map(self.client.one, self.prompts))
        self.seconds = time.perf_counter() - t

    def __call__(self, batch: list[list[int]]) -> list[list[int]]:
        batch = [list(p) for p in batch]
        with self._lock:
            if self.expected and batch == self.expected[0]:
                if self.answers is None:
                    self._run_all()
                self.expected.pop(0)
                start, self.offset = self.offset, self.offset + len(batch)
                return [a.ids for a in self.answers[start : self.offset]]
        answers = [self.client.one(p) for p in batch]
        self.live += answers
        return [a.ids for a in answers]

    def summary(self) -> dict:
        answers = (self.answers or []) + self.live
        sources = sorted({a.source for a in answers if a.source})
        return {
            "concurrency": self.concurrency, "requests": len(answers),
            "failed": sum(a.source is None for a in answers),
            "token_source": ", ".join(sources) if sources else None,
            "prompt_mismatches": sum(a.prompt_ids is not None and list(a.prompt_ids) != p
                                     for a, p in zip(self.answers or [], self.prompts)),
            "errors_sample": [a.error for a in answers if a.error][:5],
            "seconds": self.seconds,
        }


def served_models(url: str, api_key: str | None = None, timeout: float = 30.0) -> list[str]:
    import httpx

    base = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
    r = httpx.get(base + "/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                  timeout=timeout)
    r.raise_for_status()
    return [m["id"] for m in r.json().get("data") or []]


def audit_endpoint(url: str, target, prompts, concurrency=(1, 8, 32), model: str | None = None, *,
                   tokenizer=None, max_tokens: int = 64, api: str = "completions", stream: bool = False,
                   chat_template: bool = True, api_key: str | None = None, stop_token_ids=(), tolerance=None,
                   dtype=None, device=None, cache_dir=None, timeout: float = 600.0, progress: bool = False):
    """Audit the endpoint at ``url`` at each level of ``concurrency``; returns an ``AuditReport`` with one row per
    level (``batch_size`` = concurrency, engine ``endpoint:<model>``) and ``meta["endpoint"]`` (url, model, api,
    stream, and per level: requests, failed, token_source, prompt_mismatches, seconds).

    ``target``/``tokenizer``: the same model as the server's, loaded locally for the oracle (a model or a path or a
    built-in name, as for ``audit``). ``prompts``: strings or token-id lists; with ``api="completions"`` strings are
    encoded locally (through the chat template when ``chat_template`` and the tokenizer has one) and sent as token
    ids; ``api="chat"`` needs strings. ``model``: the server's model id (default: the first of ``/v1/models``).
    ``cache_dir``: the oracle cache, as for ``audit`` (the oracle runs once and is read back for the other levels;
    with False it runs at every level)."""
    from batchspec.model.loading import load_model, load_tokenizer

    from .core import audit
    from .report import AuditReport

    levels = [int(c) for c in concurrency]
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be integers >= 1, got {list(concurrency)}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to audit")
    model_obj = load_model(target, dtype, device, "target")
    tok = load_tokenizer(tokenizer if tokenizer is not None else target if isinstance(target, str) else None)
    texts = {}
    if api == "chat":
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("api='chat' needs text prompts")
        if tok is None:
            raise ValueError("api='chat' needs the tokenizer (with its chat template) to build the oracle's prompts")
    ids = []
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                raise ValueError("text prompts need a tokenizer; pass tokenizer= or token-id prompts")
            from batchspec.prompts import encode

            enc = encode(tok, [p], chat_template)[0]
            texts[tuple(enc)] = p
            ids.append(list(enc))
        else:
            ids.append([int(t) for t in p])
    if model is None:
        names = served_models(url, api_key)
        if not names:
            raise ValueError(f"{url} serves no model; give the model name")
        model = names[0]
    client = EndpointClient(url, model, tok, max_tokens, api, stream, api_key, timeout, list(stop_token_ids), texts)
    name = f"endpoint:{model}"
    rows, meta, oracle, levels_meta = [], None, None, []
    try:
        for c in levels:
            run = ConcurrentRun(client, ids, c)
            report = audit(model_obj, None, ids, engines=[(name, run)], batch_sizes=[c], max_tokens=max_tokens,
                           tokenizer=tok, stop_token_ids=stop_token_ids, tolerance=tolerance, cache_dir=cache_dir,
                           progress=progress)
            row = report.rows[0]
            if run.seconds > 0:  # the level's wall time, without the live re-runs of single prompts
                row.tokens_per_second = sum(len(o) for o in row.outputs) / run.seconds
            rows.append(row)
            meta = meta or report.meta
            oracle = oracle or report.oracle
            levels_meta.append(run.summary())
    finally:
        client.close()
    meta = dict(meta)
    meta["batch_sizes"] = levels
    meta["engines"] = [name]
    meta["num_draft_tokens"] = "-"  # the server's own
    sources = {lv["token_source"] for lv in levels_meta}
    meta["endpoint"] = {"url": url, "model": model, "api": api, "stream": stream, "levels": levels_meta,
                        "retokenized": any(s and RETOKENIZED in s for s in sources)}
    return AuditReport(rows, meta, oracle)


def endpoint_markdown(report) -> str:
    """The audit's Markdown plus a table of what each level of concurrency sent and how its tokens were read."""
    ep = report.meta["endpoint"]
    path = "/v1/chat/completions" if ep["api"] == "chat" else "/v1/completions"
    lines = [report.to_markdown().replace("| batch |", "| concurrency |", 1), "",
             f"Endpoint {ep['url']} (model {ep['model']}, {path}{', streamed' if ep['stream'] else ''}); "
             "concurrency: the number of requests under way at once.",
             "", "| concurrency | requests | failed | token source | prompt mismatches | seconds |",
             "|---|---|---|---|---|---|"]
    for lv in ep["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['failed']} | {lv['token_source'] or '-'} | "
                     f"{lv['prompt_mismatches']} | {lv['seconds']:.1f} |")
    if ep["retokenized"]:
        lines += ["", "**Warning:** the server returned no token ids; its text was re-tokenized locally, so a "
                      "divergence may come from the text round trip rather than from the server."]
    return "\n".join(lines) + "\n"
