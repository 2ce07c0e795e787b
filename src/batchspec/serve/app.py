"""The OpenAI-compatible FastAPI application over one ``LLM``: ``create_app(llm, ...)``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (plain JSON or Server-Sent Events with
``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text). Every error is OpenAI's
``{"error": {"message", "type", "param", "code"}}``. Requests go through one engine thread (``worker``): they join the
running batch at a round boundary and leave when done; a client that disconnects has its row dropped at the next
round boundary (its place under the capacity is free at once). A stream's opening chunk goes out with its first token.
``app.state.shutdown`` winds the server down: 503 for new requests, a grace period for those in flight, an error for
the rest (``_Gate``). A request of ``n`` choices runs as n rows (choice i seeded ``seed + i``), streamed with each chunk
naming its choice; a completions request of several prompts runs each as a request of its own and answers them
together (``protocol.split_prompts``, ``protocol.merge``); log-probabilities come from the engine with the tokens
(``protocol.Logprobs`` shapes them).

Hardening: request bodies must be ``application/json`` (415) of at most ``max_body_bytes`` (413, checked on
``Content-Length`` and while reading, so an oversize body is never held); JSON parsing, validation, tokenising and
chat templating run in a worker thread, so the event loop (``/health``, other streams) never waits for them; a client
mistake is a 400 naming the field; an internal failure is a 500 ``internal error, request id <id>`` whose exception
is logged with that id (its text is never sent); ``Guard`` checks ``Host`` and ``Origin`` (``guard.py``)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager, contextmanager
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..model.loading import vocab_size
from . import protocol as P
from .guard import Guard
from .metrics import ServerMetrics
from .worker import EngineWorker, QueueFull, Unavailable

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
POLL = 0.25  # seconds between checks for a vanished client or a stopped engine while waiting for tokens
DEFAULT_MAX_BODY_BYTES, PREFILL_CHUNK, PREFILL_TOKENS = P.DEFAULT_MAX_BODY_BYTES, P.PREFILL_CHUNK, P.PREFILL_TOKENS

log = logging.getLogger("batchspec.serve")


class _ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote a client's string, lone surrogates included."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def internal_error(request_id: str) -> P.APIError:
    return P.APIError(500, f"internal error, request id {request_id}", "server_error", None, "internal_error")


def model_info(llm, name: str, default_max_tokens: int = 256, default_temperature: float = 1.0) -> P.ModelInfo:
    ctx, draft_ctx = llm._contexts()
    limits = [c for c in (ctx, draft_ctx) if c is not None]
    return P.ModelInfo(name=name, vocab_size=vocab_size(llm.target), context=min(limits) if limits else None,
                       tokenizer=llm.tokenizer, default_max_tokens=default_max_tokens,
                       default_temperature=default_temperature, grammars=llm.parts.grammars)


def default_model_name(llm) -> str:
    path = getattr(llm.target.config, "_name_or_path", "") or ""
    return path.rstrip("/").rsplit("/", 1)[-1] or "batchspec"


def create_app(llm, model_name: str | None = None, api_key: str | None = None, max_queue: int = 64,
               default_max_tokens: int = 256, default_temperature: float = 1.0, retries: int = 1,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, allowed_hosts=None, allowed_origins=None,
               docs: bool = False, prefill_tokens: int | None = PREFILL_TOKENS,
               prefill_chunk: int | None = PREFILL_CHUNK) -> FastAPI:
    """The server app over ``llm`` (build it with ``scheduler="continuous"`` for continuous batching). The engine
    thread starts with the app (its lifespan) and stops with it; ``app.state.worker`` is the ``EngineWorker``;
    ``app.state.shutdown(grace, done)`` winds the server down gracefully (``_Gate``), then calls ``done``.

    ``model_name``: the id clients give as ``model`` (default: the target's directory name). ``api_key``: when set,
    ``/v1/*`` and ``/metrics`` ask for ``Authorization: Bearer <api_key>`` (an empty key is refused). ``max_queue``:
    requests that may wait beyond the batch before new ones get 429. ``default_max_tokens`` / ``default_temperature``:
    chat's ``max_tokens`` and both endpoints' ``temperature`` when a request leaves them out. ``max_body_bytes``: the
    largest request body (413 beyond). ``allowed_hosts``: ``Host`` names accepted besides the loopback ones (``["*"]``:
    any), checked on loopback connections and, once given, on all; ``allowed_origins``: web origins
    (``http://host:port``, ``"*"``) whose pages may call the server (also given CORS headers); others get 403. ``docs``:
    serve ``/docs``, ``/redoc`` and ``/openapi.json`` (off by default). ``prefill_tokens``: while rows run, the prompt
    tokens of whole requests one engine step prefills at most (``Engine``; None: every request that fits joins at
    once); ``prefill_chunk``: while rows run, a prompt with more tokens not kept yet is prefilled this many a step
    before it joins (None: whole)."""
    if api_key is not None and not api_key.strip():
        raise ValueError("the API key is empty: give a key, or none to leave the server open")
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be an integer >= 1, got {max_body_bytes!r}")
    name = model_name or default_model_name(llm)
    info = model_info(llm, name, default_max_tokens, default_temperature)
    worker = EngineWorker(llm, max_queue=max_queue, retries=retries, prefill_tokens=prefill_tokens,
                          prefill_chunk=prefill_chunk)
    metrics = ServerMetrics(worker, llm)
    created = P.now()
    texts = P.TokenTexts(llm.tokenizer)  # each token's own text, for log-probabilities (decoded once per server)
    gate = _Gate()

    @asynccontextmanager
    async def lifespan(app):
        gate.loop = asyncio.get_running_loop()
        worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(title="batchspec", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.worker, app.state.metrics, app.state.info, app.state.llm = worker, metrics, info, llm
    app.state.shutdown = gate.shutdown

    def count(endpoint: str, status: int) -> None:
        metrics.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(status)).inc()

    def error_response(err: P.APIError, endpoint: str, headers=None) -> JSONResponse:
        count(endpoint, err.status)
        return _ErrorJSON(err.body(), status_code=err.status, headers=headers)

    if allowed_origins:  # pages of these origins may call the API from a browser: answer their preflights
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(Guard, allowed_hosts=allowed_hosts, allowed_origins=allowed_origins, refused=count)

    @app.exception_handler(P.APIError)
    async def _api_error(request: Request, err: P.APIError):
        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        if err.status == 429:
            headers = {"Retry-After": "1"}
        return error_response(err, request.url.path, headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(P.APIError(exc.status_code, str(exc.detail), kind), request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):  # a bug: its text stays in the log
        rid = "req-" + uuid.uuid4().hex
        log.error("internal error, request id %s (%s %s)", rid, request.method, request.url.path, exc_info=exc)
        return error_response(internal_error(rid), request.url.path)

    def check_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise P.APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                             "invalid_request_error", None, "invalid_api_key")

    def key_salt(request: Request) -> str | None:
        """A cache salt per API key (None without keys): prompts sent with one key never start from another's."""
        if api_key is None:
            return None
        return hashlib.sha256(request.headers.get("authorization", "").partition(" ")[2].strip().encode()).hexdigest()

    def too_large(size: str) -> P.APIError:
        return P.APIError(413, f"the request body ({size}) is larger than this server's limit of {max_body_bytes} "
                          "bytes", "invalid_request_error", None, "request_too_large")

    async def read_body(request: Request) -> bytes:
        """The body, refused before it is read when it is not JSON (415) or its ``Content-Length`` is over the
        limit, and while it is read once it goes over (413): an oversize body is never held."""
        media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media != "application/json":
            raise P.APIError(415, f"the request body must be JSON sent as 'Content-Type: application/json' (got "
                             f"{media[:60]!r})", "invalid_request_error", None, "unsupported_media_type")
        length = request.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > max_body_bytes:
            raise too_large(f"{int(length)} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large(f"over {max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def prepare(raw: bytes, kind: str, salt: str | None = None) -> list:
        """In a worker thread: parse, validate, tokenise (or render the chat template) and build the engine
        requests, one per choice: ``(request, engine requests)`` for each prompt (completions may send a list of
        them); ``salt`` (the API key's) goes before the request's own ``cache_salt``. Client mistakes raise
        ``APIError`` (400), before any prompt runs."""
        try:
            body = json.loads(raw)
        except RecursionError:
            raise P.bad("the request body is nested too deeply") from None
        except json.JSONDecodeError as e:
            raise P.bad(f"the request body is not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
        except ValueError:  # not UTF-8 (UnicodeDecodeError), an integer of more than 4300 digits
            raise P.bad("the request body is not valid JSON") from None
        return [build(b, kind, salt) for b in (P.split_prompts(body) if kind == "completion" else [body])]

    def build(body, kind: str, salt: str | None):
        req = P.parse_completion(body, info) if kind == "completion" else P.parse_chat(body, info)
        if salt is not None:
            req.cache_salt = f"{salt}:{req.cache_salt or ''}"
        try:
            _, engine_requests = llm.requests([req.prompt_ids] * req.n,
                                              [P.sampling_params(req, i) for i in range(req.n)])
        except ValueError as e:  # a limit only the LLM knows (the draft's context, the dtype's smallest temperature)
            raise P.bad(P.show(str(e), 300), "temperature" if "temperature" in str(e) else None) from None
        for r in engine_requests:
            r.id = None
        return req, engine_requests

    @app.get("/health")
    async def health():
        if gate.closed:
            return error_response(shutting_down(), "/health")
        if not worker.alive:
            return error_response(P.APIError(503, "the engine thread is not running", "server_error"), "/health")
        return {"status": "ok", "running": worker.running, "queued": worker.queued}

    @app.get("/metrics")
    async def prometheus(request: Request):
        check_key(request)  # the prefix cache's counters tell one client about another's prompts
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        count("/v1/models", 200)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created,
                                            "owned_by": "batchspec", "max_model_len": info.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_key(request)
        with gate.enter():
            raw = await read_body(request)
            return await generate(request, await asyncio.to_thread(prepare, raw, "completion", key_salt(request)),
                                  "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        check_key(request)
        with gate.enter():
            raw = await read_body(request)
            return await generate(request, await asyncio.to_thread(prepare, raw, "chat", key_salt(request)),
                                  "/v1/chat/completions")

    async def generate(request: Request, prepared: list, endpoint: str):
        """Run ``prepare``'s requests (all their choices taken at once, or none) and answer them: one prompt's
        streamed or whole, several prompts' as one whole answer (``P.merge``)."""
        req = prepared[0][0]
        rid = P.new_id(req.kind)
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in prepared]

        def deliver(events: asyncio.Queue, index: int):
            def put(event):  # called on the engine thread
                loop.call_soon_threadsafe(events.put_nowait, (index, event))
            return put

        arrival = time.perf_counter()
        n = sum(len(e) for _, e in prepared)
        if n > worker.capacity:  # would be refused whenever it came: not a 429
            what = f"n is {n}" if len(prepared) == 1 else f"{len(prepared)} prompts of n={req.n} are {n} requests"
            raise P.bad(f"{what}, more requests than this server holds at once ({worker.capacity})",
                        "n" if len(prepared) == 1 else "prompt")
        if gate.ended:  # admitted before the shutdown, ready after its grace period
            raise shutting_down()
        try:
            jobs = worker.submit_all([r for _, e in prepared for r in e],
                                     [deliver(q, i) for (_, e), q in zip(prepared, queues) for i in range(len(e))],
                                     [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)])
        except QueueFull as e:
            raise P.APIError(429, f"the server is busy ({e}); retry later", "rate_limit_error", None,
                             "queue_full") from None
        except Unavailable as e:
            raise P.APIError(503, str(e), "server_error", None, "engine_unavailable") from None
        runs = []
        for (one, e), q in zip(prepared, queues):
            metrics.prompt_tokens.inc(len(one.prompt_ids))
            run = _Run(one, rid, jobs[:len(e)], q, worker, metrics, llm.tokenizer, texts, arrival)
            jobs = jobs[len(e):]
            gate.runs.add(run)
            run.done = gate.runs.discard
            runs.append(run)
        if req.stream:  # one prompt (``P.split_prompts``)
            count(endpoint, 200)
            return StreamingResponse(runs[0].sse(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        out = await _collect(request, runs)
        count(endpoint, getattr(out, "status_code", 200))
        return out

    return app


def shutting_down() -> P.APIError:
    return P.APIError(503, "the server is shutting down", "server_error", None, "shutting_down")


class _Gate:
    """Admission and the requests in flight, for a graceful shutdown. ``shutdown(grace, done)`` (from any thread, a
    signal handler's included) closes admission (new requests and ``/health`` get 503), lets the requests in flight
    finish for up to ``grace`` seconds, then ends each one left with a 503 (a stream: an error event, then
    ``[DONE]``), gives them ``LAST_WORDS`` seconds to send it and calls ``done`` (the server then stops). Another
    ``shutdown`` while waiting ends the grace period at once."""

    LAST_WORDS = 5.0

    def __init__(self):
        self.closed = False  # admission is closed
        self.ended = False  # the grace period is over
        self.pending = 0  # requests admitted whose run has not started (reading, parsing, tokenising)
        self.runs: set[_Run] = set()  # requests whose answer is on its way
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's (set when it starts)
        self._hurry: asyncio.Event | None = None
        self._task: asyncio.Task | None = None  # held: the loop keeps only a weak reference to a task

    @contextmanager
    def enter(self):
        if self.closed:
            raise shutting_down()
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1

    def shutdown(self, grace: float, done: Callable[[], None]) -> None:
        if self.loop is None or self.loop.is_closed():
            done()
        else:
            self.loop.call_soon_threadsafe(self._start, grace, done)

    def _start(self, grace: float, done: Callable[[], None]) -> None:
        if self._hurry is not None:
            self._hurry.set()
            return
        self.closed, self._hurry = True, asyncio.Event()
        self._task = asyncio.ensure_future(self._wind_down(grace, done))

    async def _wind_down(self, grace: float, done: Callable[[], None]) -> None:
        try:
            log.info("shutting down: %d request(s) in flight, %g s to finish", self._open(), grace)
            if not await self._settled(grace, self._hurry):
                log.warning("shutting down: ending %d request(s) still in flight", self._open())
                self.ended = True
                for run in list(self.runs):
                    run.end(shutting_down())
                await self._settled(self.LAST_WORDS, None)
        finally:
            done()

    def _open(self) -> int:
        return self.pending + len(self.runs)

    async def _settled(self, seconds: float, hurry: asyncio.Event | None) -> bool:
        """Whether every request in flight finished within ``seconds`` (False at once when ``hurry`` is set)."""
        end = time.monotonic() + seconds
        while self._open():
            if time.monotonic() >= end or (hurry is not None and hurry.is_set()):
                return False
            await asyncio.sleep(0.02)
        return True


async def _collect(request: Request, runs: list[_Run]):
    """The whole answer of one or several runs (the prompts of one request): a failure of one ends them all."""
    gone = asyncio.create_task(_disconnected(request))
    tasks = [asyncio.ensure_future(run.collect(gone)) for run in runs]
    try:
        outs = await asyncio.gather(*tasks)
    finally:
        gone.cancel()
        for task in tasks:
            task.cancel()
    left = [o for o in outs if not isinstance(o, dict)]  # 499: the client hung up
    return outs[0] if len(outs) == 1 else left[0] if left else P.merge(outs, runs[0].req.n)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the request body is read by then, so ``receive`` only reports that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Choice:
    """One choice of a request as it comes from the engine thread: its job, its text (with stop strings), the
    log-probabilities of its kept tokens (for a non-streamed answer) and when its first token came."""

    def __init__(self, index: int, job, tokenizer, stop):
        self.index, self.job = index, job
        self.text = P.TextStream(tokenizer, stop)
        self.logprobs: list = []
        self.prompt: list | None = None  # its prompt log-probabilities, when asked for (with its first tokens)
        self.first: float | None = None
        self.opened = False  # its stream's opening chunk went out
        self.closed = False  # the engine is done with it (or was told to drop it)
        self.reason: str | None = None  # its finish reason, once it has finished


class _Run:
    """One request's output as it comes from the engine thread, its choices side by side: text, stop strings,
    log-probabilities, timings, response bodies."""

    def __init__(self, req: P.GenRequest, rid: str, jobs, events: asyncio.Queue, worker: EngineWorker, metrics,
                 tokenizer, texts: P.TokenTexts, arrival: float):
        self.req, self.events, self.worker, self.metrics = req, events, worker, metrics
        self.choices = [_Choice(i, job, tokenizer, req.stop) for i, job in enumerate(jobs)]
        self.shapes = P.Logprobs(texts, req.tokens_as_ids)
        self.logprobs = self.shapes if req.logprobs is not None else None
        self.rid, self.created, self.arrival = rid, P.now(), arrival
        self.done: Callable[[_Run], None] = lambda run: None  # called once its answer is out (or abandoned)

    async def _next(self):
        """``(choice, event)`` for the next engine event (choice None: the engine thread stopped, or ``end``), or
        None after POLL seconds without one."""
        try:
            index, event = await asyncio.wait_for(self.events.get(), POLL)
            return (None if index is None else self.choices[index]), event
        except asyncio.TimeoutError:
            if not self.worker.alive and self.events.empty():
                return None, ("error", "the engine thread stopped")
            return None

    def _tokens(self, c: _Choice, ids, logprobs) -> tuple[list[int], str, list]:
        """Feed a choice its new tokens: (the ids kept, the text to send, their log-probabilities)."""
        if c.first is None:
            c.first = time.perf_counter()
        if self.req.max_tokens == 0:  # echo alone: the one token generated is left out
            ids, logprobs = [], None
        kept, delta = c.text.add(ids)
        if c.text.stopped is not None and not c.closed:
            c.closed = True
            self.worker.abort(c.job.id, "stop")
        kept_logprobs = list(logprobs[: len(kept)]) if logprobs is not None else []
        return kept, delta, kept_logprobs

    def _render(self, c: _Choice, entries) -> dict | None:
        """The ``logprobs`` field for ``entries``, the last of the choice's kept tokens (None when not asked for)."""
        return None if self.logprobs is None else self.logprobs.render(self.req.kind, entries, c.text.ids)

    def _choice(self, c: _Choice) -> P.Choice:
        """A finished choice's answer: with ``echo`` the prompt's text (and log-probabilities) before the output's,
        with ``prompt_logprobs`` vLLM's list of them."""
        req, text, logprobs, prompt = self.req, c.text.text, self._render(c, c.logprobs), None
        if req.prompt_alternatives is not None and c.prompt is None:
            raise RuntimeError(f"choice {c.index} finished without its prompt log-probabilities")
        if req.echo:
            tok = self.shapes.texts.tok
            head = req.prompt_text if req.prompt_text is not None or tok is None else tok.decode(
                req.prompt_ids, skip_special_tokens=True)
            text = (head or "") + text
            if logprobs is not None:
                logprobs = self.shapes.echoed(req.prompt_ids, c.prompt, req.logprobs, head or "", logprobs)
        if req.prompt_logprobs is not None:
            prompt = self.shapes.prompt(c.prompt, req.prompt_logprobs)
        return P.Choice(c.index, text, c.text.ids, c.reason, logprobs, prompt)

    def _observe(self, c: _Choice) -> None:
        end = time.perf_counter()
        m, n = self.metrics, len(c.text.ids)
        m.e2e.observe(end - self.arrival)
        if c.first is not None:
            m.ttft.observe(c.first - self.arrival)
            if n > 1:
                m.tpot.observe((end - c.first) / (n - 1))
        if c.job.started is not None:
            m.queue_time.observe(max(0.0, c.job.started - c.job.submitted))

    def _finish(self, c: _Choice, reason: str) -> None:
        c.closed = True
        c.text.flush()
        self._observe(c)
        c.reason = "stop" if c.text.stopped is not None else P.FINISH_REASONS.get(reason, reason)
        if self.req.max_tokens == 0 and reason != "abort":
            c.reason = "length"

    def _abort_open(self) -> None:
        for c in self.choices:
            if not c.closed:
                c.closed = True
                self.worker.abort(c.job.id)
        self.done(self)

    def end(self, err: P.APIError) -> None:
        """Answer ``err`` now (a stream: its error event, then ``[DONE]``); the engine drops the rows."""
        self.events.put_nowait((None, ("error", err.message, err)))

    @staticmethod
    def _error(event) -> P.APIError:
        """The error an ``("error", message[, APIError])`` event answers."""
        return event[2] if len(event) > 2 else P.APIError(500, event[1], "server_error", None, "engine_error")

    def _usage(self) -> dict:
        return P.usage(len(self.req.prompt_ids), sum(len(c.text.ids) for c in self.choices))

    async def collect(self, gone: asyncio.Future):
        """The whole answer (a response body), or a 499 once ``gone`` is done (the client hung up)."""
        try:
            while any(c.reason is None for c in self.choices):
                item = await self._next()
                if gone.done():  # the client hung up: nobody to answer
                    return Response(status_code=499)
                if item is None:
                    continue
                c, ev = item
                if ev[0] == "error":
                    raise self._error(ev)
                if c.reason is not None:  # events after a stop string ended the choice
                    continue
                if ev[0] == "tokens":
                    c.prompt = ev[3] if ev[3] is not None else c.prompt
                    c.logprobs += self._tokens(c, ev[1], ev[2])[2]
                    if c.text.stopped is not None:
                        self._finish(c, "stop")
                else:
                    self._finish(c, ev[1])
            return P.response(self.req, self.rid, self.created, [self._choice(c) for c in self.choices])
        finally:
            self._abort_open()

    async def sse(self):
        def event(body) -> str:
            return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

        try:
            async for part in self._sse(event):
                yield part
        except Exception:  # a bug after the headers went out: an error event, its text in the log
            log.exception("internal error, request id %s (while streaming)", self.rid)
            yield event(internal_error(self.rid).body())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away and the stream was cancelled
            self._abort_open()

    async def _sse(self, event):
        req, rid, created = self.req, self.rid, self.created
        opening = req.kind == "chat" or req.return_token_ids

        def lead(c: _Choice) -> str:
            """The choice's opening chunk (chat's role, the prompt's ids) before its first output, in the same write:
            sent before the prefill, it would make every client's time to first token a few milliseconds."""
            if not opening or c.opened:
                return ""
            c.opened = True
            return event(P.chunk(req, rid, created, "", [], first=True, index=c.index))

        while True:
            item = await self._next()
            if item is None:
                continue
            c, ev = item
            if ev[0] == "error":
                yield event(self._error(ev).body())
                yield "data: [DONE]\n\n"
                return
            if c.reason is not None:  # events after a stop string ended the choice
                continue
            if ev[0] == "tokens":
                kept, delta, entries = self._tokens(c, ev[1], ev[2])
                if c.text.stopped is None:
                    if kept or delta:
                        yield lead(c) + event(P.chunk(req, rid, created, delta, kept, index=c.index,
                                                      logprobs=self._render(c, entries) if entries else None))
                    continue
                reason = "stop"
            else:
                kept, delta, entries = [], "", []
                reason = ev[1]
            sent = c.text.sent
            self._finish(c, reason)
            delta += c.text.text[sent:]
            last = all(x.reason is not None for x in self.choices)
            use = self._usage() if last else None  # the whole request's, on the last choice's last chunk
            yield lead(c) + event(P.chunk(req, rid, created, delta, kept, c.reason, use=use, index=c.index,
                                          logprobs=self._render(c, entries) if entries else None))
            if last:
                if req.include_usage:
                    yield event(P.usage_chunk(req, rid, created, use))
                yield "data: [DONE]\n\n"
                return
