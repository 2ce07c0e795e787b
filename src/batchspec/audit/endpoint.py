"""Audit any OpenAI-compatible endpoint against the local batch-size-1 oracle of the same model, at several levels of
concurrency: ``audit_endpoint(url, target, prompts, concurrency=(1, 8, 32))`` or ``batchspec audit --endpoint URL``.

At each level ``c`` every prompt is sent with at most ``c`` requests under way at once (a new one starts as soon as
one ends, so requests keep joining a running batch), greedy (``temperature: 0``), and the generated token ids are read
back. How they are read decides how far the audit can be trusted, and the report says which was used per level
(``token_source``):

- ``token_ids``: the server returns them (``return_token_ids``, as vLLM and ``batchspec serve`` do): exact;
- ``retokenized text``: it returns only text, which is encoded again with the local tokenizer, and when its
  ``finish_reason`` is ``"stop"`` the EOS token that the text leaves out is put back at the end (the tokenizer's EOS
  if it is one of the stop ids, else the smallest stop id): a last resort, since decoding and encoding need not
  round-trip (a divergence may then be an artefact of the text, not of the server).

``api="completions"`` (default) sends the prompts as token ids, so the server sees exactly the oracle's prompt;
``api="chat"`` sends each prompt as one user message and lets the server apply its chat template (the oracle applies
the local tokenizer's). ``stream=True`` reads the answers as Server-Sent Events.

What is compared: the whole output the server returns, with the oracle's, which ends at the first stop token (the
target's EOS ids plus ``stop_token_ids``) or at ``max_tokens``. A divergence within that length is attributed by the
audit's margin rule (``batchspec.audit.attribution``); tokens after the first stop token or beyond ``max_tokens`` are a
divergence of class ``overrun`` at the first extra token. Every answer is checked too:

- token ids (``token_ids``, ``prompt_token_ids``) must be JSON integers in ``0..vocab-1``; anything else (``504.7``,
  ``"5"``, ``true``, ``-1``) is a *protocol error*, never converted, and that answer is not compared;
- ``prompt_token_ids``, when returned, must equal the ids sent (with ``api="chat"``: the local template's), else it is
  a *prompt mismatch*;
- ``finish_reason`` must agree with the tokens: ``"stop"`` with a stop token at the end, ``"length"`` with
  ``max_tokens`` tokens (either for ``max_tokens`` tokens ending with a stop token); anything else (none,
  ``"abort"``) disagrees. Without token ids only the value is checked;
- a request that fails (an HTTP error, an answer that is not JSON or has no choice, a closed connection, no answer
  within ``timeout``, an error event, a stream that ends without ``[DONE]``) is *failed* and not compared.

Each level is one row of an ``AuditReport`` (``batch_size`` = concurrency, ``n`` = answers compared) whose
``signature`` is the first that applies: ``could not audit`` (every request failed), ``stale or wrong reference``,
``prompt mismatch``, the audit's black-box signature of the synchronization divergences, ``overrun``, ``protocol
error`` (a protocol error or a finish_reason that disagrees), ``incomplete`` (some requests failed, the answers are
clean), ``clean``. Only ``clean`` is clean.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..serve.protocol import DONE, sse_data
from .attribution import OVERRUN, REFERENCE

TOKEN_IDS = "token_ids"
RETOKENIZED = "retokenized text"

COULD_NOT_AUDIT = "could not audit"
PROMPT_MISMATCH = "prompt mismatch"
PROTOCOL_ERROR = "protocol error"
INCOMPLETE = "incomplete"
# the signatures of a level beyond the audit's own (``batchspec.audit.attribution.SIGNATURES``)
ENDPOINT_SIGNATURES = (COULD_NOT_AUDIT, PROMPT_MISMATCH, OVERRUN, PROTOCOL_ERROR, INCOMPLETE)


@dataclass
class Answer:
    """One request's outcome. ``ids``: the generated token ids as returned, whole; ``source``: how they were read
    (None: there is nothing to compare). What is wrong beyond the tokens, each a one-line reason: ``error`` (the
    request failed), ``protocol_error`` (the answer's ids are not token ids), ``finish_problem`` (its finish_reason
    disagrees with its tokens), ``prompt_mismatch`` (its prompt_token_ids are not the ids sent)."""

    ids: list[int]
    source: str | None
    prompt_ids: list[int] | None = None
    error: str | None = None
    finish_reason: str | None = None
    protocol_error: str | None = None
    finish_problem: str | None = None
    prompt_mismatch: str | None = None

    def problems(self) -> list[tuple[str, str]]:
        """(kind, reason) of each thing wrong with the answer beyond its tokens."""
        kinds = (("failed", self.error), (PROTOCOL_ERROR, self.protocol_error), ("finish_reason", self.finish_problem),
                 (PROMPT_MISMATCH, self.prompt_mismatch))
        return [(kind, why) for kind, why in kinds if why]


class _Failed(Exception):
    """A request that failed for a reason already written out."""


def _one_line(text, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _bad_ids(value, vocab: int | None, what: str) -> str | None:
    """Why ``value`` is not a list of token ids of a ``vocab``-token vocabulary (None: it is one)."""
    if not isinstance(value, list):
        return f"{what} is {_short(value)}, not a list of token ids"
    for k, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab is not None and t >= vocab):
            return f"{what}[{k}] is {_short(t)}, not a token id (an integer {f'in 0..{vocab - 1}' if vocab else '>= 0'})"
    return None


def api_base(url: str) -> str:
    """``url`` with ``/v1`` at its end (given or not)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


@dataclass
class EndpointClient:
    """Sends one prompt at a time (``one``) to an OpenAI-compatible server and reads back its answer, checked.

    ``stop_token_ids`` are sent with each request; ``stops``: every id that ends an output (the target's EOS ids;
    ``stop_token_ids`` are added), for the finish_reason check and for the EOS that a text-only answer ends with;
    ``vocab_size``: token ids must be below it. ``timeout``: seconds to wait for the server at most, to connect and
    for each answer (a stream: for all of it)."""

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
    stops: list[int] = field(default_factory=list)
    vocab_size: int | None = None

    def __post_init__(self):
        import httpx

        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")
        self.stops = sorted({int(s) for s in self.stops} | {int(s) for s in self.stop_token_ids})
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos = eos if eos in self.stops else (self.stops[0] if self.stops else None)
        self.client = httpx.Client(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        self.base = api_base(self.url)

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
            token_ids, text, prompt_ids, reason = (self._streamed if self.stream else self._plain)(path, ids)
        except Exception as e:  # the request failed: the transport, the HTTP status, the answer's form
            return Answer([], None, error=self._why(e))
        return self._answer(ids, token_ids, text, prompt_ids, reason)

    def _why(self, e: Exception) -> str:
        import httpx

        if isinstance(e, _Failed):
            return str(e)
        if isinstance(e, (httpx.TimeoutException, TimeoutError)):
            return f"no answer within {self.timeout:g} s (the timeout)"
        if isinstance(e, json.JSONDecodeError):
            return _one_line(f"the answer is not JSON: {e.doc}")
        return _one_line(f"{type(e).__name__}: {e}")

    def _text(self, choice: dict):
        return choice.get("text") if "text" in choice else (choice.get("message") or choice.get("delta") or {}).get(
            "content")

    def _plain(self, path: str, ids: list[int]):
        r = self.client.post(self.base + path, json=self._body(ids), headers=self._headers())
        if r.status_code != 200:
            raise _Failed(_one_line(f"HTTP {r.status_code}: {r.text}"))
        choice = _choices(r.json())[0]
        return choice.get("token_ids"), self._text(choice), choice.get("prompt_token_ids"), choice.get("finish_reason")

    def _streamed(self, path: str, ids: list[int]):
        deadline = time.monotonic() + self.timeout
        chunks, texts, prompt_ids, reason, done = [], [], None, None, False
        with self.client.stream("POST", self.base + path, json=self._body(ids), headers=self._headers()) as r:
            if r.status_code != 200:
                raise _Failed(_one_line(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}"))
            for line in r.iter_lines():
                if time.monotonic() > deadline:
                    raise TimeoutError
                msg = sse_data(line)
                if msg is None:
                    continue
                if msg == DONE:
                    done = True
                    break
                if isinstance(msg, dict) and "error" in msg:
                    raise _Failed(_one_line(f"error event: {json.dumps(msg['error'])}"))
                for ch in _choices(msg, empty=True):
                    if ch.get("token_ids") is not None:
                        chunks.append(ch["token_ids"])
                    if ch.get("prompt_token_ids") is not None:
                        prompt_ids = ch["prompt_token_ids"]
                    text = self._text(ch)
                    texts.append(text if isinstance(text, str) else "")
                    reason = ch.get("finish_reason") or reason
        if not done:
            raise _Failed("the stream ended without [DONE]")
        bad = [c for c in chunks if not isinstance(c, list)]
        token_ids = (bad[0] if bad else [t for c in chunks for t in c]) if chunks else None
        return token_ids, "".join(texts), prompt_ids, reason

    def _answer(self, sent: list[int], token_ids, text, prompt_ids, reason) -> Answer:
        bad = _bad_ids(prompt_ids, self.vocab_size, "prompt_token_ids") if prompt_ids is not None else None
        if token_ids is not None:
            bad = bad or _bad_ids(token_ids, self.vocab_size, "token_ids")
        elif text is not None and not isinstance(text, str):
            bad = bad or f"the text is {_short(text)}, not a string"
        if bad:
            return Answer([], None, finish_reason=reason, protocol_error=bad)
        mismatch = None
        if prompt_ids is not None and prompt_ids != list(sent):
            k = next((k for k, (a, b) in enumerate(zip(prompt_ids, sent)) if a != b), min(len(prompt_ids), len(sent)))
            mismatch = (f"the server's prompt_token_ids ({len(prompt_ids)} ids) differ from the {len(sent)} ids sent "
                        f"at index {k}: {_short(prompt_ids[k:k + 8])} where {_short(list(sent[k:k + 8]))} were sent")
        if token_ids is not None:
            return Answer(list(token_ids), TOKEN_IDS, prompt_ids, finish_reason=reason, prompt_mismatch=mismatch,
                          finish_problem=self._finish_problem(token_ids, reason))
        if self.tokenizer is None:
            return Answer([], None, prompt_ids, error="the server returned no token ids and there is no tokenizer to "
                                                      "re-encode its text")
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []
        if reason == "stop" and self.eos is not None and not (ids and ids[-1] in self.stops):
            ids.append(self.eos)  # the text leaves the EOS token out; finish_reason says it was there
        return Answer(ids, RETOKENIZED, prompt_ids, finish_reason=reason, prompt_mismatch=mismatch,
                      finish_problem=self._finish_problem(None, reason))

    def _finish_problem(self, ids: list[int] | None, reason) -> str | None:
        """How ``reason`` disagrees with the output ``ids`` (None: it agrees; ids None: only the value is checked)."""
        if reason not in ("stop", "length"):
            return "no finish_reason" if reason is None else f"finish_reason {_short(reason)}: not 'stop' or 'length'"
        if ids is None:
            return None
        if reason == "stop" and not (ids and ids[-1] in self.stops):
            end = f"ends with {ids[-1]}" if ids else "is empty"
            return f"finish_reason 'stop' but the output {end}, not a stop token {self.stops}"
        if reason == "length" and len(ids) < self.max_tokens:
            return f"finish_reason 'length' after {len(ids)} tokens, fewer than max_tokens {self.max_tokens}"
        return None


def _choices(msg, empty: bool = False) -> list[dict]:
    """The choices of an answer (``empty``: a stream chunk may have none, as a usage chunk)."""
    choices = msg.get("choices") if isinstance(msg, dict) else None
    if isinstance(choices, list) and all(isinstance(c, dict) for c in choices) and (choices or empty):
        return choices
    raise _Failed(_one_line(f"no choice in the answer: {json.dumps(msg)}"))


class ConcurrentRun:
    """One level of concurrency: ``run()`` sends every prompt with ``concurrency`` requests under way at any time (a
    new one starts as soon as one ends, so requests keep joining a running batch); ``call(batch)`` sends prompts one
    at a time, for the audit's re-runs of a single prompt alone (the black-box padding rule)."""

    def __init__(self, client: EndpointClient, prompts: list[list[int]], concurrency: int):
        self.client, self.prompts, self.concurrency = client, [list(p) for p in prompts], concurrency
        self.answers: list[Answer] = []
        self.seconds = 0.0

    def run(self) -> list[Answer]:
        t = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            self.answers = list(pool.map(self.client.one, self.prompts))
        self.seconds = time.perf_counter() - t
        return self.answers

    def call(self, batch: list[list[int]]) -> list[list[int]]:
        return [self.client.one(list(p)).ids for p in batch]


def _get_models(url: str, api_key: str | None, timeout: float):
    """The answer to ``GET /v1/models``; ``ConnectionError`` when the server cannot be reached or does not answer
    within ``timeout`` seconds."""
    import httpx

    try:
        return httpx.get(api_base(url) + "/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                         timeout=timeout)
    except httpx.TimeoutException:
        raise ConnectionError(f"cannot reach {url}: no answer from /v1/models within {timeout:g} s") from None
    except httpx.TransportError as e:
        raise ConnectionError(f"cannot reach {url}: {_one_line(e) or type(e).__name__}") from None
    except httpx.InvalidURL as e:
        raise ValueError(f"{url!r} is not a URL: {e}") from None


def served_models(url: str, api_key: str | None = None, timeout: float = 30.0) -> list[str]:
    """The model ids that ``/v1/models`` lists; ``ConnectionError`` when the server cannot be reached in ``timeout``
    seconds, ``ValueError`` when it answers with an error or without a model list."""
    r = _get_models(url, api_key, timeout)
    if r.status_code != 200:
        fix = "check the API key (--api-key)" if r.status_code in (401, 403) else "give the model's name (--model)"
        raise ValueError(f"{api_base(url)}/models answered HTTP {r.status_code} ({_one_line(r.text, 120)}); {fix}")
    try:
        return [str(m["id"]) for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{api_base(url)}/models did not answer with a list of models ({_one_line(r.text, 120)}); "
                         "give the model's name (--model)") from None


def audit_endpoint(url: str, target, prompts, concurrency=(1, 8, 32), model: str | None = None, *,
                   tokenizer=None, max_tokens: int = 64, api: str = "completions", stream: bool = False,
                   chat_template: bool = True, api_key: str | None = None, stop_token_ids=(), tolerance=None,
                   dtype=None, device=None, cache_dir=None, timeout: float = 600.0, progress: bool = False):
    """Audit the endpoint at ``url`` at each level of ``concurrency``; returns an ``AuditReport`` with one row per
    level (``batch_size`` = concurrency, engine ``endpoint:<model>``, ``n`` = answers compared, ``outputs`` None for a
    request without one) and ``meta["endpoint"]``: url, model, api, stream, and per level: requests, compared, failed,
    protocol_errors, finish_mismatches, prompt_mismatches, overruns, token_source, seconds and ``problems`` (one
    ``{prompt, kind, detail}`` per thing wrong with a request: failed, protocol error, finish_reason, prompt mismatch,
    overrun).

    ``target``/``tokenizer``: the same model as the server's, loaded locally for the oracle (a model or a path or a
    built-in name, as for ``audit``). ``prompts``: strings or token-id lists; with ``api="completions"`` strings are
    encoded locally (through the chat template when ``chat_template`` and the tokenizer has one) and sent as token
    ids; ``api="chat"`` needs strings. ``model``: the server's model id (default: the first of ``/v1/models``).
    ``timeout``: seconds to wait for the server at most, for ``/v1/models`` and for each answer. ``cache_dir``: the
    oracle cache, as for ``audit`` (False: none). Raises ``ConnectionError`` when the server cannot be reached."""
    from batchspec.model.loading import eos_ids, load_model, load_tokenizer, vocab_size

    from ..progress import Progress
    from . import attribution as attr
    from .core import _tolerance_table
    from .inputs import Context
    from .metrics import repetition_rate
    from .oracle import Oracle
    from .report import AuditReport

    levels = [int(c) for c in concurrency]
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be integers >= 1, got {list(concurrency)}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to audit")
    if api not in ("completions", "chat"):
        raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
    if model is None:
        names = served_models(url, api_key, timeout)
        if not names:
            raise ValueError(f"{url} serves no model; give the model's name (--model)")
        model = names[0]
    else:
        _get_models(url, api_key, timeout)  # reachable? (any answer will do: a server need not list its models)
    model_obj = load_model(target, dtype, device, "target")
    tok = load_tokenizer(tokenizer if tokenizer is not None else target if isinstance(target, str) else None)
    ids, texts = _encode(prompts, tok, api, chat_template)
    stops = sorted(eos_ids(model_obj) | {int(s) for s in stop_token_ids})
    client = EndpointClient(url, model, tok, max_tokens, api, stream, api_key, timeout, list(stop_token_ids), texts,
                            stops, vocab_size(model_obj))
    ctx = Context(model_obj, None, tok, 0, max_tokens, [int(s) for s in stop_token_ids])
    name = f"endpoint:{model}"
    oracle = Oracle(model_obj, max_tokens, stops, cache_dir)
    probe = attr.MarginProbe(model_obj)
    rel_tol = attr.relative_tolerance(model_obj.dtype, tolerance)
    rows, levels_meta = [], []
    try:
        with Progress(progress, len(ids) + len(levels), "endpoint audit") as bar:
            bar.describe("oracle (HF greedy, batch size 1)")
            ref = oracle(ids, bar.advance)
            for c in levels:
                bar.describe(f"{name} concurrency {c}")
                run = ConcurrentRun(client, ids, c)
                row, level = _level(name, run, run.run(), ids, ref, stops, ctx, probe, rel_tol)
                rows.append(row)
                levels_meta.append(level)
                bar.advance()
    finally:
        client.close()
    meta = {
        "target_fingerprint": oracle.fingerprint, "target_dtype": str(model_obj.dtype).removeprefix("torch."),
        "device": str(model_obj.device), "n_prompts": len(ids), "max_tokens": max_tokens,
        "num_draft_tokens": "-", "stop_ids": stops, "batch_sizes": levels, "engines": [name],
        "tolerance": _tolerance_table(tolerance), "oracle_repetition_rate": repetition_rate(ref, stops),
        "oracle_cache": {"dir": str(oracle.dir) if oracle.dir else None, "hits": oracle.hits, "misses": oracle.misses},
        "endpoint": {"url": url, "model": model, "api": api, "stream": stream, "levels": levels_meta,
                     "retokenized": any(lv["token_source"] and RETOKENIZED in lv["token_source"]
                                        for lv in levels_meta)},
    }
    return AuditReport(rows, meta, ref)


def _encode(prompts, tok, api: str, chat_template: bool) -> tuple[list[list[int]], dict]:
    """The prompts as token ids, and (for ``api="chat"``) the text of each."""
    from batchspec.prompts import encode

    if api == "chat":
        if not all(isinstance(p, str) for p in prompts):
            raise ValueError("api='chat' needs text prompts")
        if tok is None:
            raise ValueError("api='chat' needs the tokenizer (with its chat template) to build the oracle's prompts")
    ids, texts = [], {}
    for p in prompts:
        if isinstance(p, str):
            if tok is None:
                raise ValueError("text prompts need a tokenizer; pass tokenizer= or token-id prompts")
            enc = list(encode(tok, [p], chat_template)[0])
            texts[tuple(enc)] = p
            ids.append(enc)
        else:
            ids.append([int(t) for t in p])
    return ids, texts


def _level(name, run: ConcurrentRun, answers: list[Answer], ids, ref, stops, ctx, probe, rel_tol):
    """The ``AuditRow`` of one level and its summary: whole outputs compared with the oracle's (see the module)."""
    from . import attribution as attr
    from . import metrics
    from .core import _black_box_records
    from .report import AuditRow

    n, c, max_tokens = len(ids), run.concurrency, ctx.max_tokens
    compared = [i for i, a in enumerate(answers) if a.source is not None]
    outs = [a.ids if a.source is not None else None for a in answers]
    cuts = [metrics.truncate(o, stops, max_tokens) if o is not None else [] for o in outs]
    divs, problems = [], []
    for i in compared:
        j = metrics.first_divergence(cuts[i], ref[i])
        if j is not None:
            divs.append(probe.divergence(i, ids[i], cuts[i], ref[i], j, rel_tol))
        k = len(cuts[i])
        if len(outs[i]) > k:  # tokens after the first stop token or beyond max_tokens
            divs.append(attr.Divergence(i, k, None, None, OVERRUN, ref[i][k] if k < len(ref[i]) else None,
                                        outs[i][k]))
            after = "max_tokens" if k == max_tokens and cuts[i][-1] not in stops else f"the stop token {cuts[i][-1]}"
            extra = len(outs[i]) - k
            problems.append({"prompt": i, "kind": OVERRUN,
                             "detail": f"{extra} extra token{'s' if extra > 1 else ''} after {after}, from index {k}: "
                                       f"{_short(outs[i][k:k + 8])}"})
    sync = [d for d in divs if d.cls == "synchronization"]
    n_ref = sum(d.cls == "reference" for d in divs)
    overruns = sum(d.cls == OVERRUN for d in divs)
    batches = [list(range(s, min(s + c, n))) for s in range(0, n, c)]
    records = _black_box_records(run, ctx, ids, cuts, ref, sync, batches, stops, probe, rel_tol)
    signature = _verdict(answers, attr.black_box_signature(c, records, n_reference=n_ref), overruns)
    problems += [{"prompt": i, "kind": kind, "detail": why} for i, a in enumerate(answers) for kind, why in a.problems()]
    problems.sort(key=lambda p: p["prompt"])
    m = len(compared)
    row = AuditRow(
        engine=name, batch_size=c, n=m,
        exact_match=sum(metrics.exact_match(outs[i], ref[i]) for i in compared) / m if m else 0.0,
        partial_match=sum(metrics.partial_match(outs[i], ref[i]) for i in compared) / m if m else 0.0,
        rouge_l=sum(metrics.rouge_l(outs[i], ref[i]) for i in compared) / m if m else 0.0,
        repetition_rate=metrics.repetition_rate([outs[i] for i in compared], stops),
        divergences=divs, signature=signature, first_violated_invariant=None,
        tokens_per_second=sum(len(outs[i]) for i in compared) / run.seconds if run.seconds > 0 else 0.0,
        outputs=outs,
    )
    sources = sorted({a.source for a in answers if a.source})
    level = {
        "concurrency": c, "requests": n, "compared": m, "failed": sum(a.error is not None for a in answers),
        "protocol_errors": sum(a.protocol_error is not None for a in answers),
        "finish_mismatches": sum(a.finish_problem is not None for a in answers),
        "prompt_mismatches": sum(a.prompt_mismatch is not None for a in answers),
        "overruns": overruns,
        "token_source": ", ".join(sources) if sources else None, "problems": problems, "seconds": run.seconds,
    }
    return row, level


def _verdict(answers: list[Answer], token_signature: str, overruns: int) -> str:
    """The level's signature: the first that applies, in the order of the module's list."""
    if all(a.error for a in answers):
        return COULD_NOT_AUDIT
    checks = (
        (token_signature == REFERENCE, REFERENCE),
        (any(a.prompt_mismatch for a in answers), PROMPT_MISMATCH),
        (token_signature != "clean", token_signature),
        (overruns > 0, OVERRUN),
        (any(a.protocol_error or a.finish_problem for a in answers), PROTOCOL_ERROR),
        (any(a.error for a in answers), INCOMPLETE),
    )
    return next((signature for hit, signature in checks if hit), "clean")


def endpoint_markdown(report) -> str:
    """The audit's Markdown plus a table per level of concurrency of what was sent, what failed or was malformed, and
    how the tokens were read, then the first problems of each level."""
    ep = report.meta["endpoint"]
    path = "/v1/chat/completions" if ep["api"] == "chat" else "/v1/completions"
    lines = [report.to_markdown().replace("| batch |", "| concurrency |", 1), "",
             f"Endpoint {ep['url']} (model {ep['model']}, {path}{', streamed' if ep['stream'] else ''}); "
             "concurrency: the number of requests under way at once.",
             "", "| concurrency | requests | failed | protocol errors | finish_reason mismatches | prompt mismatches "
                 "| overruns | token source | seconds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for lv in ep["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['failed']} | {lv['protocol_errors']} | "
                     f"{lv['finish_mismatches']} | {lv['prompt_mismatches']} | {lv['overruns']} | "
                     f"{lv['token_source'] or '-'} | {lv['seconds']:.1f} |")
    for lv in ep["levels"]:
        if lv["problems"]:
            lines += ["", f"Concurrency {lv['concurrency']}, first problems:", ""]
            lines += [f"- prompt {p['prompt']}: {p['kind']}: {p['detail']}" for p in lv["problems"][:5]]
    if ep["retokenized"]:
        lines += ["", "**Warning:** the server returned no token ids; its text was re-tokenized locally, so a "
                      "divergence may come from the text round trip rather than from the server."]
    return "\n".join(lines) + "\n"
