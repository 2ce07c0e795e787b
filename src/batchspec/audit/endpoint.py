"""Audit any OpenAI-compatible endpoint at several levels of concurrency, against the local batch-size-1 oracle of the
same model (``audit_endpoint(url, target, prompts)``) or against a reference server without holding any weights
(``audit_endpoint(url, prompts=prompts, reference="self" | URL)``); ``batchspec audit --endpoint URL``.

At each level ``c`` every prompt is sent with at most ``c`` requests under way at once (a new one starts as soon as
one ends, so requests keep joining a running batch), greedy (``temperature: 0``), and the generated token ids are read
back. How they are read decides how far the audit can be trusted, and the report says which was used per level
(``token_source``):

- ``token_ids``: the server returns them (``return_token_ids``, as vLLM and ``batchspec serve`` do): exact;
- ``retokenized text``: it returns only text, which is encoded again with the local tokenizer, and when its
  ``finish_reason`` is ``"stop"`` the EOS token that the text leaves out is put back at the end (the tokenizer's EOS
  if it is one of the stop ids, else the smallest stop id): a last resort, since decoding and encoding need not
  round-trip (a divergence may then be an artefact of the text, not of the server).

``api="completions"`` (default) sends the prompts as token ids, so the server sees exactly the reference's prompt
(text prompts are encoded locally when there is a tokenizer, and sent as text when there is none); ``api="chat"``
sends each prompt as one user message and lets the server apply its chat template (the local oracle applies the local
tokenizer's). ``stream=True`` reads the answers as Server-Sent Events.

The reference, one of:

- the local oracle (``reference=None`` with a ``target``): HF ``generate`` at batch size 1 on the same model, loaded
  locally; a divergence is attributed by the audit's margin rule (``batchspec.audit.attribution``);
- another server (``reference=URL``, e.g. the same model with speculation off) or the same server at concurrency 1
  (``reference="self"``, the default when no ``target`` is given): no model is loaded, only a tokenizer when one is
  given (``tokenizer=``, or ``target`` as a path or name). Its answers are read once, at concurrency 1, asking for the
  ``top_logprobs`` most likely tokens at each position as token ids (``logprobs``, ``return_tokens_as_token_ids``);
  a divergence is attributed from them (``logprob_divergence``), or is ``unattributed`` when they are missing. The
  server under test is sent exactly what a user sends (no logprobs). A reference answer that failed or has a problem
  of its own (below, or an overrun) leaves its prompt out of every level, which is then at best ``incomplete``.
  Without a tokenizer the stop tokens are the given ``stop_token_ids`` and the last token of each reference answer
  that ended with ``finish_reason`` ``"stop"``; with one, its EOS token as well.

What is compared: the whole output the server returns, with the reference's, which ends at the first stop token (the
target's EOS ids plus ``stop_token_ids``) or at ``max_tokens``. A divergence within that length is attributed;
tokens after the first stop token or beyond ``max_tokens`` are a divergence of class ``overrun`` at the first extra
token. Every answer is checked too:

- token ids (``token_ids``, ``prompt_token_ids``) must be JSON integers in ``0..vocab-1`` (``>= 0`` without a local
  model); anything else (``504.7``, ``"5"``, ``true``, ``-1``) is a *protocol error*, never converted, and that
  answer is not compared;
- ``prompt_token_ids``, when returned, must equal the ids sent (with ``api="chat"`` and a tokenizer: the local
  template's; prompts sent as text: the reference's ``prompt_token_ids``), else it is a *prompt mismatch*;
- ``finish_reason`` must agree with the tokens: ``"stop"`` with a stop token at the end, ``"length"`` with
  ``max_tokens`` tokens (either for ``max_tokens`` tokens ending with a stop token); anything else (none,
  ``"abort"``) disagrees. Without token ids only the value is checked;
- a request that fails (an HTTP error, an answer that is not JSON or has no choice, a closed connection, no answer
  within ``timeout``, an error event, a stream that ends without ``[DONE]``) is *failed* and not compared.

Each level is one row of an ``AuditReport`` (``batch_size`` = concurrency, ``n`` = answers compared) whose
``signature`` is the first that applies: ``could not audit`` (every request failed, or no reference answer),
``stale or wrong reference``, ``prompt mismatch``, the audit's black-box signature of the synchronization and
unattributed divergences (``unattributed`` when they are all unattributed and match no bug class), ``overrun``,
``protocol error`` (a protocol error or a finish_reason that disagrees), ``incomplete`` (some requests failed or had
no reference answer, the rest are clean), ``clean``. Only ``clean`` is clean. For the black-box padding rule a prompt
counts as padded when a request under way at the same time was or grew longer than it (a server batches whatever it
has under way, in an order of its own), not by its place in a fixed batch (``black_box_records``).

Logprob rule (``logprob_divergence``). At the first divergent index ``j`` the reference's answer lists the
log-probabilities of its most likely tokens there, on the same prefix (the outputs agree before ``j``). The margin
is the reference token's log-probability minus the endpoint token's (the same difference as of their logits), and
the tolerance is ``relative_tolerance(dtype, tolerance)`` times ``max(1, largest |log-probability| listed at j)``:
the listed spread stands in for the logits' scale, which log-probabilities do not carry. ``dtype`` is the servers'
(default float32: a server does not say what it computes in, and a coarser default would excuse real bugs as rounding;
give bfloat16 or float16 for a server that computes in them). Then
``attribution.classify`` decides: numerical, synchronization, or reference (the reference's own numbers prefer the
endpoint's token). An endpoint token that is not listed has at most the lowest listed log-probability: beyond the
tolerance that bound makes the divergence synchronization; otherwise, or with no log-probabilities for the
reference's token at ``j``, it is ``unattributed``.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..serve.protocol import DONE, sse_data
from .attribution import OVERRUN, REFERENCE, Divergence

TOKEN_IDS = "token_ids"
RETOKENIZED = "retokenized text"

SELF = "self"  # the reference: the server under test itself, at concurrency 1

COULD_NOT_AUDIT = "could not audit"
PROMPT_MISMATCH = "prompt mismatch"
PROTOCOL_ERROR = "protocol error"
INCOMPLETE = "incomplete"
UNATTRIBUTED = "unattributed"  # a divergence class and a signature: no log-probabilities to tell what it is
# the signatures of a level beyond the audit's own (``batchspec.audit.attribution.SIGNATURES``)
ENDPOINT_SIGNATURES = (COULD_NOT_AUDIT, PROMPT_MISMATCH, OVERRUN, PROTOCOL_ERROR, INCOMPLETE, UNATTRIBUTED)

TOP_LOGPROBS = 5  # alternatives asked of a reference server at each position (OpenAI's completions allow up to 5)
_TOKEN_ID = re.compile(r"token_id:(\d+)")


@dataclass
class Answer:
    """One request's outcome. ``ids``: the generated token ids as returned, whole; ``source``: how they were read
    (None: there is nothing to compare). What is wrong beyond the tokens, each a one-line reason: ``error`` (the
    request failed), ``protocol_error`` (the answer's ids are not token ids), ``finish_problem`` (its finish_reason
    disagrees with its tokens), ``prompt_mismatch`` (its prompt_token_ids are not the ids sent). ``logprobs``: per
    generated token, ``{token id: log-probability}`` of the tokens the answer listed there (None: none, or not one
    per token)."""

    ids: list[int]
    source: str | None
    prompt_ids: list[int] | None = None
    error: str | None = None
    finish_reason: str | None = None
    protocol_error: str | None = None
    finish_problem: str | None = None
    prompt_mismatch: str | None = None
    logprobs: list[dict[int, float]] | None = None

    def problems(self) -> list[tuple[str, str]]:
        """(kind, reason) of each thing wrong with the answer beyond its tokens."""
        kinds = (("failed", self.error), (PROTOCOL_ERROR, self.protocol_error), ("finish_reason", self.finish_problem),
                 (PROMPT_MISMATCH, self.prompt_mismatch))
        return [(kind, why) for kind, why in kinds if why]


class _Failed(Exception):
    """A request that failed for a reason already written out."""


class _LogprobsRefused(_Failed):
    """HTTP 400 about log-probabilities: the server does not return them."""


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


def _token_id(token) -> int | None:
    """The id of a logprobs token written as ``"token_id:123"`` (vLLM's ``return_tokens_as_token_ids``), else None."""
    m = _TOKEN_ID.fullmatch(token) if isinstance(token, str) else None
    return int(m.group(1)) if m else None


def _put(entry: dict, token, logprob) -> None:
    t = _token_id(token)
    if t is not None and isinstance(logprob, (int, float)) and not isinstance(logprob, bool) and math.isfinite(logprob):
        entry[t] = float(logprob)


def logprob_entries(raw) -> list[dict[int, float]] | None:
    """One answer's (or stream chunk's) ``logprobs`` as one ``{token id: log-probability}`` per generated token: the
    completions form (``tokens``, ``token_logprobs``, ``top_logprobs``) or the chat form (``content``: ``token``,
    ``logprob``, ``top_logprobs``). Tokens not written as ``"token_id:N"`` and values that are not finite numbers are
    left out; None when ``raw`` is neither form."""
    if not isinstance(raw, dict):
        return None
    out = []
    if "content" in raw:
        if not isinstance(raw["content"], list):
            return None
        for item in raw["content"]:
            entry: dict[int, float] = {}
            if isinstance(item, dict):
                for alt in item.get("top_logprobs") or []:
                    if isinstance(alt, dict):
                        _put(entry, alt.get("token"), alt.get("logprob"))
                _put(entry, item.get("token"), item.get("logprob"))
            out.append(entry)
        return out
    tokens, lps, tops = raw.get("tokens"), raw.get("token_logprobs"), raw.get("top_logprobs")
    if not isinstance(tokens, list):
        return None
    for k, token in enumerate(tokens):
        entry = {}
        if isinstance(tops, list) and k < len(tops) and isinstance(tops[k], dict):
            for key, v in tops[k].items():
                _put(entry, key, v)
        if isinstance(lps, list) and k < len(lps):
            _put(entry, token, lps[k])
        out.append(entry)
    return out


def api_base(url: str) -> str:
    """``url`` with ``/v1`` at its end (given or not)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


@dataclass
class EndpointClient:
    """Sends one prompt at a time (``one``) to an OpenAI-compatible server and reads back its answer, checked.

    A prompt is a list of token ids, or a string (sent as the completions prompt, or with ``api="chat"`` as the user
    message); ``texts`` maps the ids of a chat prompt to its text. ``stop_token_ids`` are sent with each request;
    ``stops``: every id that ends an output (the target's EOS ids; ``stop_token_ids`` are added), for the
    finish_reason check and for the EOS that a text-only answer ends with; ``vocab_size``: token ids must be below it.
    ``timeout``: seconds to wait for the server at most, to connect and for each answer (a stream: for all of it).
    ``logprobs``: ask for that many most likely tokens at each position, as token ids (0: none); a server that
    refuses (HTTP 400 about logprobs) is asked again without them, and ``logprobs_refused`` keeps its reason."""

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
    logprobs: int = 0
    logprobs_refused: str | None = None

    def __post_init__(self):
        import httpx

        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be 'completions' or 'chat', got {self.api!r}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be a number of seconds > 0, got {self.timeout!r}")
        self.set_stops(self.stops)
        self.client = httpx.Client(timeout=self.timeout, limits=httpx.Limits(max_connections=None))
        self.base = api_base(self.url)

    def set_stops(self, stops) -> None:
        self.stops = sorted({int(s) for s in stops} | {int(s) for s in self.stop_token_ids})
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos = eos if eos in self.stops else (self.stops[0] if self.stops else None)

    def close(self):
        self.client.close()

    def _headers(self):
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _body(self, ids) -> dict:
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "return_token_ids": True,
                "stream": self.stream}
        if self.stop_token_ids:
            body["stop_token_ids"] = list(self.stop_token_ids)
        if self.logprobs:
            body.update({"logprobs": True, "top_logprobs": self.logprobs} if self.api == "chat" else
                        {"logprobs": self.logprobs})
            body["return_tokens_as_token_ids"] = True
        if self.api == "chat":
            text = ids if isinstance(ids, str) else self.texts.get(tuple(ids))
            if text is None:
                raise ValueError("chat prompts must be given as text")
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = ids if isinstance(ids, str) else list(ids)
        return body

    def one(self, ids) -> Answer:
        path = "/chat/completions" if self.api == "chat" else "/completions"
        for _ in range(2):
            try:
                token_ids, text, prompt_ids, reason, lps = (self._streamed if self.stream else self._plain)(path, ids)
            except _LogprobsRefused as e:
                if not self.logprobs:  # another request already turned them off: ask again
                    continue
                self.logprobs, self.logprobs_refused = 0, str(e)
                continue
            except Exception as e:  # the request failed: the transport, the HTTP status, the answer's form
                return Answer([], None, error=self._why(e))
            return self._answer(ids, token_ids, text, prompt_ids, reason, lps)
        return Answer([], None, error=self.logprobs_refused or "the server refused the request")

    def _why(self, e: Exception) -> str:
        import httpx

        if isinstance(e, _Failed):
            return str(e)
        if isinstance(e, (httpx.TimeoutException, TimeoutError)):
            return f"no answer within {self.timeout:g} s (the timeout)"
        if isinstance(e, json.JSONDecodeError):
            return _one_line(f"the answer is not JSON: {e.doc}")
        return _one_line(f"{type(e).__name__}: {e}")

    def _status(self, status: int, text: str, asked: bool) -> None:
        """Raise for an answer other than 200 (``asked``: the request asked for logprobs)."""
        if status == 400 and asked and "logprob" in text.lower():
            raise _LogprobsRefused(_one_line(f"HTTP {status}: {text}"))
        if status != 200:
            raise _Failed(_one_line(f"HTTP {status}: {text}"))

    def _text(self, choice: dict):
        return choice.get("text") if "text" in choice else (choice.get("message") or choice.get("delta") or {}).get(
            "content")

    def _plain(self, path: str, ids):
        body = self._body(ids)
        r = self.client.post(self.base + path, json=body, headers=self._headers())
        self._status(r.status_code, r.text, "logprobs" in body)
        choice = _choices(r.json())[0]
        token_ids = choice.get("token_ids")
        return (token_ids, self._text(choice), choice.get("prompt_token_ids"), choice.get("finish_reason"),
                _aligned(logprob_entries(choice.get("logprobs")), token_ids) if "logprobs" in body else None)

    def _streamed(self, path: str, ids):
        deadline = time.monotonic() + self.timeout
        chunks, texts, prompt_ids, reason, done = [], [], None, None, False
        body = self._body(ids)
        lps: list | None = [] if "logprobs" in body else None
        with self.client.stream("POST", self.base + path, json=body, headers=self._headers()) as r:
            if r.status_code != 200:
                self._status(r.status_code, r.read().decode(errors="replace"), "logprobs" in body)
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
                        if lps is not None:  # a chunk's logprobs belong to its tokens
                            got = _aligned(logprob_entries(ch.get("logprobs")), ch["token_ids"])
                            lps = None if got is None else lps + got
                    if ch.get("prompt_token_ids") is not None:
                        prompt_ids = ch["prompt_token_ids"]
                    text = self._text(ch)
                    texts.append(text if isinstance(text, str) else "")
                    reason = ch.get("finish_reason") or reason
        if not done:
            raise _Failed("the stream ended without [DONE]")
        bad = [c for c in chunks if not isinstance(c, list)]
        token_ids = (bad[0] if bad else [t for c in chunks for t in c]) if chunks else None
        return token_ids, "".join(texts), prompt_ids, reason, lps if token_ids is not None else None

    def _answer(self, sent, token_ids, text, prompt_ids, reason, logprobs=None) -> Answer:
        bad = _bad_ids(prompt_ids, self.vocab_size, "prompt_token_ids") if prompt_ids is not None else None
        if token_ids is not None:
            bad = bad or _bad_ids(token_ids, self.vocab_size, "token_ids")
        elif text is not None and not isinstance(text, str):
            bad = bad or f"the text is {_short(text)}, not a string"
        if bad:
            return Answer([], None, finish_reason=reason, protocol_error=bad)
        mismatch = None
        if prompt_ids is not None and not isinstance(sent, str) and prompt_ids != list(sent):
            k = next((k for k, (a, b) in enumerate(zip(prompt_ids, sent)) if a != b), min(len(prompt_ids), len(sent)))
            mismatch = (f"the server's prompt_token_ids ({len(prompt_ids)} ids) differ from the {len(sent)} ids sent "
                        f"at index {k}: {_short(prompt_ids[k:k + 8])} where {_short(list(sent[k:k + 8]))} were sent")
        if token_ids is not None:
            return Answer(list(token_ids), TOKEN_IDS, prompt_ids, finish_reason=reason, prompt_mismatch=mismatch,
                          finish_problem=self._finish_problem(token_ids, reason), logprobs=logprobs)
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


def _aligned(entries, token_ids):
    """``entries`` when there is one per token id, else None (logprobs that cannot be matched to the tokens)."""
    if isinstance(token_ids, list) and not token_ids:
        return []  # a chunk without tokens (the first, with the prompt's ids; the last, with finish_reason)
    if entries is None or not isinstance(token_ids, list) or len(entries) != len(token_ids):
        return None
    return entries


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

    def __init__(self, client: EndpointClient, prompts: list, concurrency: int):
        self.client, self.concurrency = client, concurrency
        self.prompts = [p if isinstance(p, str) else list(p) for p in prompts]
        self.answers: list[Answer] = []
        self.spans: list[tuple[float, float]] = []  # per prompt: when its request was sent and answered
        self.seconds = 0.0

    def _timed(self, prompt) -> tuple[Answer, tuple[float, float]]:
        t = time.perf_counter()
        answer = self.client.one(prompt)
        return answer, (t, time.perf_counter())

    def run(self) -> list[Answer]:
        t = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            got = list(pool.map(self._timed, self.prompts))
        self.seconds = time.perf_counter() - t
        self.answers, self.spans = [a for a, _ in got], [s for _, s in got]
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


def model_name(url: str, model: str | None, api_key: str | None, timeout: float, flag: str = "--model") -> str:
    """``model``, or the first model that the server at ``url`` lists; checks that the server can be reached."""
    if model is None:
        names = served_models(url, api_key, timeout)
        if not names:
            raise ValueError(f"{url} serves no model; give the model's name ({flag})")
        return names[0]
    _get_models(url, api_key, timeout)  # reachable? (any answer will do: a server need not list its models)
    return model


def check_levels(concurrency) -> list[int]:
    try:
        levels = [int(c) for c in concurrency]
    except (TypeError, ValueError):
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"concurrency levels must be integers >= 1, got {list(concurrency)}")
    return levels


def check_request(api: str, timeout: float) -> None:
    if api not in ("completions", "chat"):
        raise ValueError(f"api must be 'completions' or 'chat', got {api!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")


def audit_endpoint(url: str, target=None, prompts=(), concurrency=(1, 8, 32), model: str | None = None, *,
                   reference: str | None = None, reference_model: str | None = None, tokenizer=None,
                   max_tokens: int = 64, api: str = "completions", stream: bool = False, chat_template: bool = True,
                   api_key: str | None = None, stop_token_ids=(), tolerance=None, dtype=None, device=None,
                   cache_dir=None, timeout: float = 600.0, top_logprobs: int = TOP_LOGPROBS, progress: bool = False):
    """Audit the endpoint at ``url`` at each level of ``concurrency``; returns an ``AuditReport`` with one row per
    level (``batch_size`` = concurrency, engine ``endpoint:<model>``, ``n`` = answers compared, ``outputs`` None for a
    request without one) and ``meta["endpoint"]``: url, model, api, stream, and per level: requests, compared, failed,
    protocol_errors, finish_mismatches, prompt_mismatches, overruns, unreferenced (prompts with no reference answer),
    token_source, seconds and ``problems`` (one ``{prompt, kind, detail}`` per thing wrong with a request: failed,
    protocol error, finish_reason, prompt mismatch, overrun).

    The reference (see the module): ``reference=None`` and a ``target``: the local oracle of ``target`` (the same
    model as the server's, loaded locally: a model or a path or a built-in name, as for ``audit``); ``reference=
    "self"`` (the default without a ``target``) or a URL: that server's answers at concurrency 1, no model loaded;
    ``meta["reference"]`` then says what it was (kind, url, model, logprobs, answers, problems, seconds).
    ``reference_model``: the reference server's model id (default: the first of its ``/v1/models``);
    ``top_logprobs``: how many log-probabilities to ask of it per position (0: none, every divergence unattributed).
    ``dtype``: with a reference, the servers' dtype for the tolerance (default float32).

    ``prompts``: strings or token-id lists; with ``api="completions"`` strings are encoded locally when there is a
    tokenizer (through the chat template when ``chat_template`` and the tokenizer has one) and sent as token ids, else
    sent as text; ``api="chat"`` needs strings. ``model``: the server's model id (default: the first of
    ``/v1/models``). ``timeout``: seconds to wait for a server at most, for ``/v1/models`` and for each answer.
    ``cache_dir``: the oracle cache, as for ``audit`` (False: none). Raises ``ConnectionError`` when a server cannot be
    reached."""
    levels = check_levels(concurrency)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts to audit")
    check_request(api, timeout)
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if reference is None and target is None:
        reference = SELF
    if reference is not None and (not isinstance(reference, str) or not reference.strip()):
        raise ValueError(f"reference must be 'self' or a server's URL, got {reference!r}")
    if not isinstance(top_logprobs, int) or isinstance(top_logprobs, bool) or top_logprobs < 0:
        raise ValueError(f"top_logprobs must be an integer >= 0, got {top_logprobs!r}")
    model = model_name(url, model, api_key, timeout)
    args = dict(url=url, model=model, prompts=prompts, levels=levels, tokenizer=tokenizer, max_tokens=max_tokens,
                api=api, stream=stream, chat_template=chat_template, api_key=api_key, stop_token_ids=stop_token_ids,
                tolerance=tolerance, dtype=dtype, timeout=timeout, progress=progress)
    if reference is None:
        return _audit_with_oracle(target=target, device=device, cache_dir=cache_dir, **args)
    return _audit_with_reference(target=target, reference=reference, reference_model=reference_model,
                                 top_logprobs=top_logprobs, **args)


def _audit_with_oracle(url, model, target, prompts, levels, tokenizer, max_tokens, api, stream, chat_template, api_key,
                       stop_token_ids, tolerance, dtype, device, cache_dir, timeout, progress):
    from batchspec.model.loading import eos_ids, load_model, load_tokenizer, vocab_size

    from ..progress import Progress
    from . import attribution as attr
    from .core import _tolerance_table
    from .inputs import Context
    from .metrics import repetition_rate
    from .oracle import Oracle
    from .report import AuditReport

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
    try:
        with Progress(progress, len(ids) + len(levels), "endpoint audit") as bar:
            bar.describe("oracle (HF greedy, batch size 1)")
            ref = oracle(ids, bar.advance)
            judge = _OracleJudge(ids, ref, stops, ctx, probe, rel_tol)
            rows, levels_meta = _levels(name, client, ids, levels, judge, bar)
    finally:
        client.close()
    meta = {
        "target_fingerprint": oracle.fingerprint, "target_dtype": str(model_obj.dtype).removeprefix("torch."),
        "device": str(model_obj.device), "n_prompts": len(ids), "max_tokens": max_tokens,
        "num_draft_tokens": "-", "stop_ids": stops, "batch_sizes": levels, "engines": [name],
        "tolerance": _tolerance_table(tolerance), "oracle_repetition_rate": repetition_rate(ref, stops),
        "oracle_cache": {"dir": str(oracle.dir) if oracle.dir else None, "hits": oracle.hits, "misses": oracle.misses},
        "endpoint": _endpoint_meta(url, model, api, stream, levels_meta),
    }
    return AuditReport(rows, meta, ref)


def _endpoint_meta(url, model, api, stream, levels_meta) -> dict:
    return {"url": url, "model": model, "api": api, "stream": stream, "levels": levels_meta,
            "retokenized": any(lv["token_source"] and RETOKENIZED in lv["token_source"] for lv in levels_meta)}


def reference_tokenizer(target, tokenizer):
    """The tokenizer of an audit without a local model: ``tokenizer`` (an object, a path or a name) or, when it is
    None, ``target`` given as a path or a name; None when neither is given. Only the tokenizer is loaded."""
    from batchspec.model.loading import load_tokenizer

    spec = tokenizer if tokenizer is not None else target
    if spec is None:
        return None
    if not isinstance(spec, (str, os.PathLike)) and not hasattr(spec, "encode"):
        raise ValueError("without a local oracle the target is only read for its tokenizer: give a path or a name "
                         "(or tokenizer=), not a model")
    tok = load_tokenizer(spec)
    if tok is None:
        raise ValueError(f"no tokenizer found for {spec!r}; leave it out to send text prompts as text")
    return tok


def prompt_items(prompts, tok, api: str, chat_template: bool) -> tuple[list, dict]:
    """What is sent for each prompt: its token ids when there is a tokenizer (or the prompt is ids), else its text;
    and (for ``api="chat"``) the text of each id list."""
    if tok is not None:
        return _encode(prompts, tok, api, chat_template)
    if api == "chat" and not all(isinstance(p, str) for p in prompts):
        raise ValueError("api='chat' needs text prompts")
    return [p if isinstance(p, str) else [int(t) for t in p] for p in prompts], {}


def _audit_with_reference(url, model, target, reference, reference_model, prompts, levels, tokenizer, max_tokens, api,
                          stream, chat_template, api_key, stop_token_ids, tolerance, dtype, timeout, top_logprobs,
                          progress):
    import torch

    from ..progress import Progress
    from . import attribution as attr
    from . import metrics
    from .report import AuditReport

    tok = reference_tokenizer(target, tokenizer)
    items, texts = prompt_items(prompts, tok, api, chat_template)
    if reference == SELF:
        ref_url, ref_model = url, reference_model or model
    else:
        ref_url = reference
        ref_model = model_name(reference, reference_model, api_key, timeout, "--reference-model")
    given = {int(s) for s in stop_token_ids}
    if getattr(tok, "eos_token_id", None) is not None:
        given.add(int(tok.eos_token_id))
    common = dict(tokenizer=tok, max_tokens=max_tokens, api=api, stream=stream, api_key=api_key, timeout=timeout,
                  stop_token_ids=[int(s) for s in stop_token_ids], texts=texts, stops=sorted(given))
    ref_client = EndpointClient(ref_url, ref_model, logprobs=top_logprobs, **common)
    client = EndpointClient(url, model, **common)
    name = f"endpoint:{model}"
    rel_tol = attr.relative_tolerance(dtype if dtype is not None else torch.float32, tolerance)
    try:
        with Progress(progress, 1 + len(levels), "endpoint audit") as bar:
            bar.describe(f"reference ({'the server itself' if reference == SELF else ref_url}, concurrency 1)")
            ref_run = ConcurrentRun(ref_client, items, 1)
            ref_answers = ref_run.run()
            bar.advance()
            stops = sorted(given | {a.ids[-1] for a in ref_answers
                                    if a.source == TOKEN_IDS and a.finish_reason == "stop" and a.ids})
            for c in (ref_client, client):
                c.set_stops(stops)
            judge = _ReferenceJudge(items, ref_answers, ref_client, stops, max_tokens, rel_tol, client)
            rows, levels_meta = _levels(name, client, items, levels, judge, bar)
    finally:
        client.close()
        ref_client.close()
    refs = [r for r in judge.refs if r is not None]
    lps = judge.logprobs_status(top_logprobs)
    where = ("the same server at concurrency 1" if reference == SELF
             else f"{ref_url} (model {ref_model}) at concurrency 1")
    dname = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
    meta = {
        "target_fingerprint": None, "target_dtype": dname, "device": None, "n_prompts": len(items),
        "max_tokens": max_tokens, "num_draft_tokens": "-", "stop_ids": stops, "batch_sizes": levels, "engines": [name],
        "tolerance": {"relative": rel_tol, "dtype": dname, "basis": "logprobs"},
        "oracle": f"{where}; divergences attributed from its logprobs ({lps})",
        "oracle_repetition_rate": metrics.repetition_rate(refs, stops) if refs else 0.0,
        "oracle_cache": None,
        "reference": {"kind": SELF if reference == SELF else "endpoint", "url": ref_url, "model": ref_model,
                      "api": api, "stream": stream, "top_logprobs": top_logprobs, "logprobs": lps,
                      "answers": len(refs), "requests": len(items), "problems": judge.problems,
                      "token_source": ", ".join(sorted({a.source for a in ref_answers if a.source})) or None,
                      "stops_learned": sorted(set(stops) - given), "seconds": ref_run.seconds,
                      "tokenizer": tok is not None},
        "endpoint": _endpoint_meta(url, model, api, stream, levels_meta),
    }
    return AuditReport(rows, meta, list(judge.refs))


@dataclass
class LogprobDivergence(Divergence):
    """A divergence attributed from the reference's log-probabilities; ``basis`` says how: ``"logprobs"`` (both
    tokens listed), ``"bound"`` (the endpoint's token is not listed: the margin is a lower bound) or None
    (unattributed, or a length difference)."""

    basis: str | None = None

    def as_dict(self) -> dict:
        return {**super().as_dict(), "basis": self.basis}


def logprob_divergence(i: int, output, ref, entry: dict[int, float] | None, index: int,
                       rel_tol: float) -> Divergence:
    """Attribute prompt ``i``'s first divergence at ``index`` from ``entry``, the reference answer's
    ``{token id: log-probability}`` at that position (None: it has none); see the module's logprob rule."""
    from . import attribution as attr

    o_tok = ref[index] if index < len(ref) else None
    e_tok = output[index] if index < len(output) else None
    if o_tok is None or e_tok is None:  # a length difference: no token to weigh, as with the margin rule
        return LogprobDivergence(i, index, None, None, "synchronization", o_tok, e_tok)
    if not entry or o_tok not in entry:
        return LogprobDivergence(i, index, None, None, UNATTRIBUTED, o_tok, e_tok)
    tol = rel_tol * max(1.0, max(abs(v) for v in entry.values()))
    if e_tok in entry:
        margin = entry[o_tok] - entry[e_tok]
        return LogprobDivergence(i, index, margin, tol, attr.classify(margin, tol), o_tok, e_tok, "logprobs")
    bound = entry[o_tok] - min(entry.values())  # the endpoint's token is below every listed one
    if bound > tol:
        return LogprobDivergence(i, index, bound, tol, "synchronization", o_tok, e_tok, "bound")
    return LogprobDivergence(i, index, None, tol, UNATTRIBUTED, o_tok, e_tok)


class _OracleJudge:
    """The local oracle: its outputs, the margin rule, the audit's black-box records."""

    def __init__(self, ids, ref, stops, ctx, probe, rel_tol):
        self.ids, self.refs, self.stops, self.ctx, self.probe, self.rel_tol = ids, ref, stops, ctx, probe, rel_tol
        self.max_tokens = ctx.max_tokens

    def divergence(self, i, cut, j):
        return self.probe.divergence(i, self.ids[i], cut, self.refs[i], j, self.rel_tol)

    def prompt_mismatch(self, i, answer):
        return None

    def records(self, run, cuts, flagged):
        return black_box_records(run, cuts, self.refs, [len(p) for p in self.ids], flagged, self.stops, self._solo)

    def _solo(self, run, i) -> bool:
        from . import metrics

        solo = metrics.truncate(run.call([self.ids[i]])[0], self.stops, self.max_tokens)
        j = metrics.first_divergence(solo, self.refs[i])
        return j is None or self.divergence(i, solo, j).cls == "numerical"


class _ReferenceJudge:
    """A reference server's answers at concurrency 1: the outputs (None for a prompt whose answer cannot serve), its
    log-probabilities for the logprob rule, its prompt ids, and the black-box records from re-runs at the endpoint."""

    def __init__(self, items, answers: list[Answer], ref_client, stops, max_tokens, rel_tol, client):
        from . import metrics

        self.items, self.answers, self.stops, self.max_tokens = items, answers, stops, max_tokens
        self.rel_tol, self.client = rel_tol, client
        self.refused = ref_client.logprobs_refused
        self.refs, self.problems = [], []
        for i, a in enumerate(answers):
            if a.source == TOKEN_IDS:  # the stop tokens are known now: check its finish_reason again
                a.finish_problem = ref_client._finish_problem(a.ids, a.finish_reason)
            problems = a.problems()
            cut = metrics.truncate(a.ids, stops, max_tokens) if a.source is not None else None
            if cut is not None and len(a.ids) > len(cut):
                problems.append((OVERRUN, f"{len(a.ids) - len(cut)} tokens after index {len(cut) - 1}"))
            self.problems += [{"prompt": i, "kind": kind, "detail": why} for kind, why in problems]
            self.refs.append(cut if a.source is not None and not problems else None)

    def logprobs_status(self, asked: int) -> str:
        if not asked:
            return "not asked for"
        if self.refused:
            return f"refused: {self.refused}"
        usable = [i for i, r in enumerate(self.refs) if r is not None]
        have = sum(self.answers[i].logprobs is not None for i in usable)
        if not have:
            return "not returned (as token ids)"
        return "returned" if have == len(usable) else f"returned for {have} of {len(usable)} answers"

    def divergence(self, i, cut, j):
        lps = self.answers[i].logprobs
        entry = lps[j] if lps is not None and j < len(lps) else None
        return logprob_divergence(i, cut, self.refs[i], entry, j, self.rel_tol)

    def prompt_mismatch(self, i, answer):
        """Prompts sent as text: the endpoint's prompt ids must be the reference's."""
        mine, theirs = answer.prompt_ids, self.answers[i].prompt_ids
        if not isinstance(self.items[i], str) or mine is None or theirs is None or mine == theirs:
            return None
        k = next((k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        return (f"the server's prompt_token_ids ({len(mine)} ids) differ from the reference's ({len(theirs)} ids) at "
                f"index {k}: {_short(mine[k:k + 8])} where the reference has {_short(theirs[k:k + 8])}")

    def _length(self, i):
        item = self.items[i]
        if not isinstance(item, str):
            return len(item)
        ids = self.answers[i].prompt_ids
        return len(ids) if ids is not None else None

    def records(self, run, cuts, flagged):
        return black_box_records(run, cuts, self.refs, [self._length(i) for i in range(len(self.items))], flagged,
                                 self.stops, self._solo)

    def _solo(self, run, i) -> bool:
        from . import metrics

        solo = self.client.one(self.items[i])
        cut = metrics.truncate(solo.ids, self.stops, self.max_tokens)
        j = metrics.first_divergence(cut, self.refs[i])
        return solo.source is not None and (j is None or self.divergence(i, cut, j).cls == "numerical")


def black_box_records(run: ConcurrentRun, cuts, refs, lengths, flagged, stops, solo_clean) -> list[dict]:
    """The records of ``attribution.black_box_signature`` for the ``flagged`` divergences of one level. A server
    batches the requests it has under way, whenever they came and in an order of its own, so a prompt counts as
    *padded* when a request under way at the same time (``run.spans``) was or grew longer than it (its prompt plus its
    output longer than this prompt; ``lengths``: prompt lengths, None where unknown), not by its place in a fixed
    batch; ``solo_clean(run, i)``: whether prompt ``i`` decodes cleanly alone, asked only when the padding rule could
    apply."""
    from . import metrics

    def padded(i) -> bool:
        n, (start, end) = lengths[i], run.spans[i]
        return n is not None and any(
            j != i and lengths[j] is not None and lengths[j] + len(cuts[j]) > n and s < end and start < e
            for j, (s, e) in enumerate(run.spans))

    recs = [{"prompt": d.prompt, "partial_match": metrics.partial_match(cuts[d.prompt], refs[d.prompt]),
             "padded": padded(d.prompt), "loops": metrics.ends_in_loop(cuts[d.prompt], stops),
             "oracle_loops": metrics.ends_in_loop(refs[d.prompt], stops), "solo_clean": None} for d in flagged]
    if run.concurrency > 1 and recs and all(r["padded"] for r in recs):
        for r in recs:
            r["solo_clean"] = solo_clean(run, r["prompt"])
    return recs


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


def _levels(name, client, items, levels, judge, bar) -> tuple[list, list[dict]]:
    """Every level in turn: its ``AuditRow`` and its summary (``_level``), the progress ``bar`` advanced a level."""
    rows, metas = [], []
    for c in levels:
        bar.describe(f"{name} concurrency {c}")
        run = ConcurrentRun(client, items, c)
        row, level = _level(name, run, run.run(), judge)
        rows.append(row)
        metas.append(level)
        bar.advance()
    return rows, metas


def _level(name, run: ConcurrentRun, answers: list[Answer], judge):
    """The ``AuditRow`` of one level and its summary: whole outputs compared with the reference's (see the module).
    ``judge``: the reference (``_OracleJudge`` or ``_ReferenceJudge``)."""
    from . import attribution as attr
    from . import metrics
    from .report import AuditRow

    ref, stops, max_tokens = judge.refs, judge.stops, judge.max_tokens
    n, c = len(answers), run.concurrency
    for i, a in enumerate(answers):
        if a.source is not None and a.prompt_mismatch is None:
            a.prompt_mismatch = judge.prompt_mismatch(i, a)
    compared = [i for i, a in enumerate(answers) if a.source is not None and ref[i] is not None]
    unreferenced = sum(r is None for r in ref)
    outs = [a.ids if a.source is not None else None for a in answers]
    cuts = [metrics.truncate(o, stops, max_tokens) if o is not None else [] for o in outs]
    divs, problems = [], []
    for i in compared:
        j = metrics.first_divergence(cuts[i], ref[i])
        if j is not None:
            divs.append(judge.divergence(i, cuts[i], j))
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
    loose = [d for d in divs if d.cls == UNATTRIBUTED]
    n_ref = sum(d.cls == "reference" for d in divs)
    overruns = sum(d.cls == OVERRUN for d in divs)
    records = judge.records(run, cuts, sync + loose)
    token_signature = attr.black_box_signature(c, records, n_reference=n_ref)
    if token_signature == "unknown" and loose and not sync:
        token_signature = UNATTRIBUTED
    signature = _verdict(answers, token_signature, overruns, unreferenced, n - unreferenced)
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
        "overruns": overruns, "unreferenced": unreferenced,
        "token_source": ", ".join(sources) if sources else None, "problems": problems, "seconds": run.seconds,
    }
    return row, level


def _verdict(answers: list[Answer], token_signature: str, overruns: int, unreferenced: int = 0,
             referenced: int = 1) -> str:
    """The level's signature: the first that applies, in the order of the module's list."""
    if all(a.error for a in answers) or not referenced:
        return COULD_NOT_AUDIT
    checks = (
        (token_signature == REFERENCE, REFERENCE),
        (any(a.prompt_mismatch for a in answers), PROMPT_MISMATCH),
        (token_signature != "clean", token_signature),
        (overruns > 0, OVERRUN),
        (any(a.protocol_error or a.finish_problem for a in answers), PROTOCOL_ERROR),
        (any(a.error for a in answers) or unreferenced > 0, INCOMPLETE),
    )
    return next((signature for hit, signature in checks if hit), "clean")


def endpoint_verdict(report) -> tuple[int, str]:
    """The endpoint audit's exit status and verdict in a line: 1 when a level is not clean (anything but ``clean``
    and ``could not audit``), else 2 when a level could not be audited, else 0."""
    broken = [f"concurrency {r.batch_size} ({r.signature})" for r in report.rows
              if not r.clean and r.signature != COULD_NOT_AUDIT]
    if broken:
        return 1, f"not clean: {', '.join(broken)}"
    unaudited = [f"concurrency {r.batch_size}" for r in report.rows if r.signature == COULD_NOT_AUDIT]
    if unaudited:
        ref = report.meta.get("reference")
        why = "no reference answer" if ref is not None and not ref["answers"] else "every request failed"
        return 2, f"could not audit: {', '.join(unaudited)} ({why})"
    return 0, f"clean at concurrency {', '.join(str(r.batch_size) for r in report.rows)}"


def endpoint_markdown(report) -> str:
    """The audit's Markdown plus a table per level of concurrency of what was sent, what failed or was malformed, and
    how the tokens were read, then the first problems of each level (and of the reference's answers)."""
    ep = report.meta["endpoint"]
    path = "/v1/chat/completions" if ep["api"] == "chat" else "/v1/completions"
    lines = [f"**Verdict: {endpoint_verdict(report)[1]}**", "",
             report.to_markdown().replace("| batch |", "| concurrency |", 1), "",
             f"Endpoint {ep['url']} (model {ep['model']}, {path}{', streamed' if ep['stream'] else ''}); "
             "concurrency: the number of requests under way at once.",
             "", "| concurrency | requests | failed | protocol errors | finish_reason mismatches | prompt mismatches "
                 "| overruns | no reference | token source | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for lv in ep["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['failed']} | {lv['protocol_errors']} | "
                     f"{lv['finish_mismatches']} | {lv['prompt_mismatches']} | {lv['overruns']} | "
                     f"{lv.get('unreferenced', 0)} | {lv['token_source'] or '-'} | {lv['seconds']:.1f} |")
    ref = report.meta.get("reference")
    if ref is not None:
        lines += ["", f"Reference: {report.meta['oracle']}; {ref['answers']} of {ref['requests']} answers usable "
                      f"({ref['seconds']:.1f} s)."]
        if ref["problems"]:
            lines += ["", "Reference answers left out:", ""]
            lines += [f"- prompt {p['prompt']}: {p['kind']}: {p['detail']}" for p in ref["problems"][:5]]
    divs = [(r.batch_size, d) for r in report.rows for d in r.divergences if d.cls != "numerical"]
    if divs:
        lines += ["", "First divergences (not numerical):", "",
                  "| concurrency | prompt | index | class | reference token | endpoint token | margin | tolerance |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {c} | {d.prompt} | {d.index} | {d.cls} | {d.oracle_token} | {d.engine_token} | "
                  f"{'-' if d.margin is None else f'{d.margin:.4g}'} | "
                  f"{'-' if d.tolerance is None else f'{d.tolerance:.3g}'} |" for c, d in divs[:20]]
    for lv in ep["levels"]:
        if lv["problems"]:
            lines += ["", f"Concurrency {lv['concurrency']}, first problems:", ""]
            lines += [f"- prompt {p['prompt']}: {p['kind']}: {p['detail']}" for p in lv["problems"][:5]]
    if ep["retokenized"]:
        lines += ["", "**Warning:** the server returned no token ids; its text was re-tokenized locally, so a "
                      "divergence may come from the text round trip rather than from the server."]
    return "\n".join(lines) + "\n"
