"""What a client of an OpenAI-compatible server needs, shared by the endpoint audit (``batchspec.audit.endpoint``) and
the load generator (``loadtest``): the URL of the API and of each route, the request's prompt, and one streamed answer
folded from its Server-Sent Events line by line (``StreamedAnswer``), for a synchronous or an asynchronous reader.
Plain HTTP: no model, no engine."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from .protocol import DONE, sse_data


class AnswerError(Exception):
    """An answer the client cannot read; the message is one line."""


class StreamError(AnswerError):
    """An error event in a stream; ``error``: its ``error`` value as sent."""

    def __init__(self, error):
        super().__init__(one_line(f"error event: {json.dumps(error)}"))
        self.error = error


MAX_ANSWER_BYTES = 8 << 20  # an answer (or a stream, or one of its lines) larger is refused unread: a greedy answer of
# thousands of tokens with their log-probabilities is well under it, and one hostile answer must not take the memory
DISPLAY_CHARS = 80  # a server's string (its model id) shown in a table, a plot or a title is clipped to this


class TooLarge(AnswerError):
    """An answer over ``MAX_ANSWER_BYTES``."""

    def __init__(self, limit: int = MAX_ANSWER_BYTES):
        super().__init__(f"the answer is larger than {limit} bytes (the limit): not read")


def display(text, limit: int = DISPLAY_CHARS) -> str:
    """A server's string for display: one line, at most ``limit`` characters (an ellipsis says it was clipped)."""
    text = " ".join(str(text)[: 4 * limit].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text, limit: int = 300) -> str:
    """``text`` with its whitespace collapsed, at most ``limit`` characters."""
    return " ".join(str(text).split())[:limit]


def run_within(seconds: float, fn, *args):
    """``fn(*args)`` with a wall-clock limit: its result, or ``TimeoutError`` once ``seconds`` have passed. httpx's
    timeouts bound each read, not the exchange: a server that trickles a byte a second never trips them. ``fn`` goes
    on in a daemon thread until its own deadline check (``read_body``, ``sse_lines``) or a read timeout stops it."""
    box: dict = {}

    def go():
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    worker = threading.Thread(target=go, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError
    if "error" in box:
        raise box["error"]
    return box["value"]


def _counted(total: int, chunk: bytes, deadline: float, limit: int) -> int:
    """``total`` bytes read with ``chunk``; ``TooLarge`` past ``limit``, ``TimeoutError`` past ``deadline``."""
    total += len(chunk)
    if total > limit:
        raise TooLarge(limit)
    if time.monotonic() > deadline:
        raise TimeoutError
    return total


def _chunks(response, deadline: float, limit: int | None):
    """The response's body in chunks, ``TimeoutError`` past ``deadline`` (``time.monotonic()``), ``TooLarge`` past
    ``limit`` bytes in all."""
    total, limit = 0, MAX_ANSWER_BYTES if limit is None else limit
    for chunk in response.iter_bytes():
        total = _counted(total, chunk, deadline, limit)
        yield chunk


async def _achunks(response, deadline: float, limit: int | None):
    """``_chunks`` of an asynchronous response."""
    total, limit = 0, MAX_ANSWER_BYTES if limit is None else limit
    async for chunk in response.aiter_bytes():
        total = _counted(total, chunk, deadline, limit)
        yield chunk


def read_body(response, deadline: float, limit: int | None = None) -> bytes:
    """A streamed response's whole body, read by ``deadline`` and at most ``limit`` bytes (default
    ``MAX_ANSWER_BYTES``; see ``_chunks``)."""
    return b"".join(_chunks(response, deadline, limit))


async def aread_body(response, deadline: float, limit: int | None = None) -> bytes:
    """``read_body`` of an asynchronous response."""
    return b"".join([chunk async for chunk in _achunks(response, deadline, limit)])


def _lines(rest: bytes, chunk: bytes) -> tuple[list[str], bytes]:
    """The whole lines of ``rest + chunk``, and what is left after the last line end."""
    *lines, rest = (rest + chunk).split(b"\n")
    return [line.rstrip(b"\r").decode(errors="replace") for line in lines], rest


def sse_lines(response, deadline: float, limit: int | None = None):
    """A streamed response's lines (as ``iter_lines``), read by ``deadline`` and at most ``limit`` bytes in all."""
    rest = b""
    for chunk in _chunks(response, deadline, limit):
        lines, rest = _lines(rest, chunk)
        yield from lines
    if rest:
        yield _lines(rest, b"\n")[0][0]


async def asse_lines(response, deadline: float, limit: int | None = None):
    """``sse_lines`` of an asynchronous response."""
    rest = b""
    async for chunk in _achunks(response, deadline, limit):
        lines, rest = _lines(rest, chunk)
        for line in lines:
            yield line
    if rest:
        yield _lines(rest, b"\n")[0][0]


def api_base(url: str) -> str:
    """``url`` with ``/v1`` at its end (given or not)."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def api_path(api: str) -> str:
    """The route of ``api`` ("chat" or "completions") under the API's base."""
    return "/chat/completions" if api == "chat" else "/completions"


def auth_headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def prompt_field(api: str, prompt) -> dict:
    """The request's prompt: one user message for ``api="chat"``, else the completions prompt (text or token ids)."""
    if api == "chat":
        return {"messages": [{"role": "user", "content": prompt}]}
    return {"prompt": prompt if isinstance(prompt, str) else list(prompt)}


def choice_text(choice: dict):
    """A choice's text: ``text`` (completions), else the content of its ``message`` (chat) or ``delta`` (a chunk)."""
    if "text" in choice:
        return choice.get("text")
    return (choice.get("message") or choice.get("delta") or {}).get("content")


def choices(msg, empty: bool = False) -> list[dict]:
    """The choices of an answer (``empty``: a stream chunk may have none, as a usage chunk); ``AnswerError`` when it
    has no list of choice objects."""
    found = msg.get("choices") if isinstance(msg, dict) else None
    if isinstance(found, list) and all(isinstance(c, dict) for c in found) and (found or empty):
        return found
    raise AnswerError(one_line(f"no choice in the answer: {json.dumps(msg)}"))


@dataclass
class StreamedAnswer:
    """One streamed answer, folded from its Server-Sent Events by ``feed(line)``, which is True at ``[DONE]``.

    ``strict``: every event must carry a list of choice objects (``AnswerError`` otherwise); not strict, an event
    without choices has none. An error event raises ``StreamError``. Per choice with token ids: ``token_chunks`` and
    ``logprob_chunks`` (its ``token_ids`` and ``logprobs`` as sent); per choice: its text in ``texts`` ("" when not a
    string) and counted in ``text_chunks`` when not empty. ``first``: ``time.perf_counter()`` when the first choice
    with output (text or token ids) was read, ``gap`` the longest wait between two of them (a stream held back by
    other requests' prefill); ``usage``: the last usage sent."""

    strict: bool = True
    token_chunks: list = field(default_factory=list)
    logprob_chunks: list = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    text_chunks: int = 0
    prompt_ids: object = None
    finish_reason: object = None
    usage: object = None
    first: float | None = None
    gap: float = 0.0
    done: bool = False
    _last: float | None = None

    def feed(self, line: str) -> bool:
        msg = sse_data(line)
        if msg is None:
            return False
        if msg == DONE:
            self.done = True
            return True
        if isinstance(msg, dict) and "error" in msg:
            raise StreamError(msg["error"])
        found = choices(msg, empty=True) if self.strict else msg.get("choices") or []
        if msg.get("usage"):
            self.usage = msg["usage"]
        for ch in found:
            self._choice(ch)
        return False

    def _choice(self, ch: dict) -> None:
        ids, text = ch.get("token_ids"), choice_text(ch)
        if ids is not None:
            self.token_chunks.append(ids)
            self.logprob_chunks.append(ch.get("logprobs"))
        if ch.get("prompt_token_ids") is not None:
            self.prompt_ids = ch["prompt_token_ids"]
        if text or ids:
            now = time.perf_counter()
            if self.first is None:
                self.first = now
            else:
                self.gap = max(self.gap, now - self._last)
            self._last = now
        self.text_chunks += bool(text)
        self.texts.append(text if isinstance(text, str) else "")
        self.finish_reason = ch.get("finish_reason") or self.finish_reason
