"""The endpoint audit's client: one prompt at a time to an OpenAI-compatible server, streamed or not, its answer read
back and checked (``EndpointClient``); every prompt of a level with a number of requests under way at once
(``ConcurrentRun``); the server's models (``model_name``)."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ...serve.client import (AnswerError, StreamedAnswer, api_base, api_path, auth_headers, choice_text, choices,
                             one_line, prompt_field, read_body, run_within, sse_lines)
from .answer import (RETOKENIZED, TOKEN_IDS, Answer, aligned, bad_ids, finish_problem, first_difference,
                     logprob_entries, short, streamed_logprobs)


class Failed(AnswerError):
    """A request that failed for a reason already written out."""


class LogprobsRefused(Failed):
    """HTTP 400 about log-probabilities: the server does not return them."""


@dataclass
class EndpointClient:
    """Sends one prompt at a time (``one``) to an OpenAI-compatible server and reads back its answer, checked.

    A prompt is a list of token ids, or a string (sent as the completions prompt, or with ``api="chat"`` as the user
    message); ``texts`` maps the ids of a chat prompt to its text. ``stop_token_ids`` are sent with each request;
    ``stops``: every id that ends an output (the target's EOS ids; ``stop_token_ids`` are added), for the
    finish_reason check and for the EOS that a text-only answer ends with; ``vocab_size``: token ids must be below it.
    ``timeout``: seconds to wait for the server at most, for each whole answer (a wall-clock limit, however slowly it
    trickles in); an answer (or a stream) over ``MAX_ANSWER_BYTES`` is a failed request.
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
            ids = ids if isinstance(ids, str) else self.texts.get(tuple(ids))
            if ids is None:
                raise ValueError("chat prompts must be given as text")
        body.update(prompt_field(self.api, ids))
        return body

    def one(self, ids) -> Answer:
        path = api_path(self.api)
        for _ in range(2):
            try:
                exchange = self._streamed if self.stream else self._plain
                token_ids, text, prompt_ids, reason, lps, raw = run_within(self.timeout, exchange, path, ids,
                                                                           time.monotonic() + self.timeout)
            except LogprobsRefused as e:
                if not self.logprobs:  # another request already turned them off: ask again
                    continue
                self.logprobs, self.logprobs_refused = 0, str(e)
                continue
            except Exception as e:  # the request failed: the transport, the HTTP status, the answer's form
                return Answer([], None, error=self._why(e))
            answer = self._answer(ids, token_ids, text, prompt_ids, reason, lps)
            answer.raw_logprobs = raw if self.logprobs else None
            return answer
        return Answer([], None, error=self.logprobs_refused or "the server refused the request")

    def _why(self, e: Exception) -> str:
        import httpx

        if isinstance(e, AnswerError):
            return str(e)
        if isinstance(e, (httpx.TimeoutException, TimeoutError)):
            return f"no answer within {self.timeout:g} s (the timeout)"
        if isinstance(e, json.JSONDecodeError):
            return one_line(f"the answer is not JSON: {e.doc[:1000]}")
        return one_line(f"{type(e).__name__}: {e}")

    def _status(self, status: int, text: str, asked: bool) -> None:
        """Raise for an answer other than 200 (``asked``: the request asked for logprobs)."""
        if status == 400 and asked and "logprob" in text.lower():
            raise LogprobsRefused(one_line(f"HTTP {status}: {text}"))
        if status != 200:
            raise Failed(one_line(f"HTTP {status}: {text}"))

    def _plain(self, path: str, ids, deadline: float):
        body = self._body(ids)
        with self.client.stream("POST", self.base + path, json=body, headers=auth_headers(self.api_key)) as r:
            data = read_body(r, deadline)
        self._status(r.status_code, data.decode(errors="replace"), "logprobs" in body)
        choice = choices(json.loads(data))[0]
        token_ids = choice.get("token_ids")
        return (token_ids, choice_text(choice), choice.get("prompt_token_ids"), choice.get("finish_reason"),
                aligned(logprob_entries(choice.get("logprobs")), token_ids) if "logprobs" in body else None,
                [(token_ids, choice.get("logprobs"))])

    def _streamed(self, path: str, ids, deadline: float):
        body, answer = self._body(ids), StreamedAnswer()
        with self.client.stream("POST", self.base + path, json=body, headers=auth_headers(self.api_key)) as r:
            if r.status_code != 200:
                self._status(r.status_code, read_body(r, deadline).decode(errors="replace"), "logprobs" in body)
            for line in sse_lines(r, deadline):
                if answer.feed(line):
                    break
        if not answer.done:
            raise Failed("the stream ended without [DONE]")
        chunks = answer.token_chunks
        bad = [c for c in chunks if not isinstance(c, list)]
        token_ids = (bad[0] if bad else [t for c in chunks for t in c]) if chunks else None
        lps = streamed_logprobs(answer) if "logprobs" in body and token_ids is not None else None
        raw = list(zip(answer.token_chunks, answer.logprob_chunks))
        return token_ids, "".join(answer.texts), answer.prompt_ids, answer.finish_reason, lps, raw

    def _answer(self, sent, token_ids, text, prompt_ids, reason, logprobs=None) -> Answer:
        bad = bad_ids(prompt_ids, self.vocab_size, "prompt_token_ids") if prompt_ids is not None else None
        if token_ids is not None:
            bad = bad or bad_ids(token_ids, self.vocab_size, "token_ids")
        elif text is not None and not isinstance(text, str):
            bad = bad or f"the text is {short(text)}, not a string"
        if bad:
            return Answer([], None, finish_reason=reason, protocol_error=bad)
        mismatch = None
        if prompt_ids is not None and not isinstance(sent, str) and prompt_ids != list(sent):
            k = first_difference(prompt_ids, sent)
            mismatch = (f"the server's prompt_token_ids ({len(prompt_ids)} ids) differ from the {len(sent)} ids sent "
                        f"at index {k}: {short(prompt_ids[k:k + 8])} where {short(list(sent[k:k + 8]))} were sent")
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
        return finish_problem(ids, reason, self.stops, self.max_tokens)


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

    def concurrent_with(self, i: int) -> list[int]:
        """The prompts whose requests were under way at some time while prompt ``i``'s was."""
        start, end = self.spans[i]
        return [j for j, (s, e) in enumerate(self.spans) if j != i and s < end and start < e]

    def call(self, batch: list[list[int]]) -> list[list[int]]:
        return [self.client.one(list(p)).ids for p in batch]


def _get_models(url: str, api_key: str | None, timeout: float) -> tuple[int, str]:
    """The status and body of ``GET /v1/models``, read whole within ``timeout`` seconds (wall clock) and at most
    ``MAX_ANSWER_BYTES``; ``ConnectionError`` when the server cannot be reached or does not answer in time."""
    import httpx

    def get():
        with httpx.stream("GET", api_base(url) + "/models", headers=auth_headers(api_key), timeout=timeout) as r:
            return r.status_code, read_body(r, deadline).decode(errors="replace")

    deadline = time.monotonic() + timeout
    try:
        return run_within(timeout, get)
    except (httpx.TimeoutException, TimeoutError):
        raise ConnectionError(f"cannot reach {url}: no answer from /v1/models within {timeout:g} s") from None
    except AnswerError as e:
        raise ConnectionError(f"cannot read {api_base(url)}/models: {e}") from None
    except httpx.TransportError as e:
        raise ConnectionError(f"cannot reach {url}: {one_line(e) or type(e).__name__}") from None
    except httpx.InvalidURL as e:
        raise ValueError(f"{url!r} is not a URL: {e}") from None


def served_models(url: str, api_key: str | None = None, timeout: float = 30.0) -> list[str]:
    """The model ids that ``/v1/models`` lists; ``ConnectionError`` when the server cannot be reached in ``timeout``
    seconds, ``ValueError`` when it answers with an error or without a model list."""
    status, text = _get_models(url, api_key, timeout)
    if status != 200:
        fix = "check the API key (--api-key)" if status in (401, 403) else "give the model's name (--model)"
        raise ValueError(f"{api_base(url)}/models answered HTTP {status} ({one_line(text, 120)}); {fix}")
    try:
        return [str(m["id"]) for m in json.loads(text)["data"]]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{api_base(url)}/models did not answer with a list of models ({one_line(text, 120)}); "
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
