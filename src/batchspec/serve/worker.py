"""The engine thread: one ``Engine`` (continuous batching) owned by one thread, fed through a thread-safe inbox.

HTTP handlers call ``submit`` (a request joins at the next round boundary), ``abort`` (its row leaves at the next
round boundary) and read their tokens from the ``deliver`` callback they gave, which the engine thread calls with
``("tokens", ids, logprobs, prompt_logprobs)`` (``logprobs``: a ``TokenLogprob`` per id, or None when the request asked
for none; ``prompt_logprobs``: the engine's, with a request's first tokens when it asked for them, else None), then
``("done", reason, Finished)`` or ``("error", message)``. Only the engine thread touches the engine. A request of n
choices is n engine requests, submitted together (``submit_all``).

Admission: at most ``batch_size + max_queue`` requests are in flight (running or waiting); ``submit`` raises
``QueueFull`` beyond that, so a burst is shed instead of queueing without bound. A request aborted (its client left)
gives its place back at once, though its row leaves only at the next round boundary: the count is of the requests
someone still waits for, and the engine takes the abort before any request submitted after it.

Failures: if a step raises, the engine drops every request (``Engine.step`` resets it) and the thread carries on.
Each dropped request is started again from its prompt, once (``retries``), and the tokens it had already delivered are
skipped when they come again: greedy decoding, and sampling with the request's seed (drawn at submission when the
client gave none), reproduce them exactly whatever else is batched. A request whose retries are spent gets
``("error", "internal error, request id <name>")``: an error event's message never holds an exception's text (that
goes to the log, with the request's name). A request the engine refuses (``Engine.add_request``'s checks) fails
alone: it never joins the batch. The thread never dies of an exception in a step or in a callback."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from ..engine.engine import Request
from ..model.threads import release_idle_workers

log = logging.getLogger("batchspec.serve")


class QueueFull(Exception):
    pass


class Unavailable(Exception):
    pass


@dataclass
class Job:
    request: Request
    deliver: Callable[[tuple], None]
    submitted: float = field(default_factory=time.perf_counter)
    attempts: int = 0
    delivered: int = 0  # tokens handed out
    skip: int = 0  # tokens to drop when they come again after a restart
    cancelled: str | None = None  # why the request was dropped ("abort": the client left; "stop": a stop string)
    started: float | None = None  # when the engine thread took it
    name: str | None = None  # the id clients see (logged with failures); None: the engine's id

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def label(self) -> str:
        return self.name if self.name is not None else f"#{self.id}"

    @property
    def failed(self) -> str:
        return f"internal error, request id {self.label}"


class EngineWorker:
    def __init__(self, llm, max_queue: int = 64, retries: int = 1, idle_wait: float = 0.05,
                 prefill_tokens: int | None = None, prefill_chunk: int | None = None):
        self.llm = llm
        self.engine = llm.engine(prefill_tokens, prefill_chunk)
        # The engine steps on its own thread: this thread's idle OpenMP workers (it loaded the model) would make every
        # parallel op there wake its workers through the kernel (model/threads.py).
        release_idle_workers()
        self.capacity = llm.batch_size + max_queue
        self.retries, self.idle_wait = retries, idle_wait
        self.inbox: queue.Queue = queue.Queue()
        self.jobs: dict[int, Job] = {}  # every request the engine holds (running or waiting), by id
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._held: set[int] = set()  # ids of the requests that hold a place under ``capacity``
        self.running = 0  # rows in the engine's batch after the last step
        self.errors = 0  # steps that raised
        self.restarts = 0  # requests started again after a failed step
        self.finished: Counter = Counter()  # finish reason -> requests
        self.on_finish: Callable[[Job, object], None] | None = None  # called on the engine thread
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    # ----------------------------------------------------------------------------------------- any thread
    def start(self) -> "EngineWorker":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="batchspec-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.inbox.put(("stop", None))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    @property
    def in_flight(self) -> int:
        return len(self._held)

    @property
    def queued(self) -> int:
        """Requests accepted that hold no row of the running batch yet."""
        return max(0, len(self._held) - self.running)

    def submit(self, request: Request, deliver: Callable[[tuple], None], name: str | None = None) -> Job:
        """Hand a request to the engine thread (its id is set here; ``name``: the id its client sees, for the log).
        Raises ``QueueFull`` when ``capacity`` requests are in flight, ``Unavailable`` when the engine thread is not
        running."""
        return self.submit_all([request], [deliver], [name])[0]

    def submit_all(self, requests: list[Request], delivers: list[Callable[[tuple], None]],
                   names: list[str | None]) -> list[Job]:
        """``submit`` for several requests at once (the choices of one HTTP request): all are taken or, when they do
        not all fit under ``capacity``, none (``QueueFull``)."""
        with self._lock:
            if not self.alive:
                raise Unavailable("the engine is not running")
            if len(self._held) + len(requests) > self.capacity:
                raise QueueFull(f"{len(self._held)} requests in flight, {len(requests)} more asked for (capacity "
                                f"{self.capacity})")
            for request in requests:
                request.id = next(self._ids)
                self._held.add(request.id)
        jobs = [Job(r, d, name=n) for r, d, n in zip(requests, delivers, names)]
        for job in jobs:
            self.inbox.put(("add", job))
        return jobs

    def abort(self, request_id: int, reason: str = "abort") -> None:
        """Drop a request: its place under ``capacity`` is free at once, its row leaves the batch at the next round
        boundary. ``reason`` is what ``finished`` counts it as ("abort" when the client left, "stop" when its text
        reached a stop string)."""
        self._release(request_id)
        self.inbox.put(("abort", (request_id, reason)))

    def idle(self) -> bool:
        """No request anywhere (inbox, engine, jobs)."""
        return not self._held and not self.jobs and not self.engine.has_work() and self.inbox.empty()

    # ----------------------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while True:
                try:
                    if self._handle_inbox():
                        return
                    if self.engine.has_work():
                        self._step()
                except Exception:  # a bug in the bookkeeping: log it, keep serving
                    self.errors += 1
                    log.exception("engine thread: unexpected error")
        finally:
            self._stopped.set()
            self._fail_all("the server is shutting down")

    def _handle_inbox(self) -> bool:
        """Take every message waiting (blocking briefly when there is nothing to run); True on stop."""
        block = not self.engine.has_work()
        while True:
            try:
                kind, arg = self.inbox.get(block, self.idle_wait) if block else self.inbox.get_nowait()
            except queue.Empty:
                return False
            block = False
            if kind == "stop":
                return True
            if kind == "add":
                self._add(arg)
            elif kind == "abort":
                rid, reason = arg
                job = self.jobs.get(rid)
                if job is not None and not job.cancelled:
                    job.cancelled = reason
                    if not self.engine.abort(rid):
                        self._finish(job, "abort", None)

    def _add(self, job: Job) -> None:
        job.started = time.perf_counter()
        self.jobs[job.id] = job
        try:
            self.engine.add_request(dataclasses.replace(job.request, stop_ids=set(job.request.stop_ids)))
        except Exception:  # it never joined the batch: nobody else is touched
            log.exception("the engine refused request %s", job.label)
            del self.jobs[job.id]
            self._release(job.id)
            self.finished["error"] += 1
            self._send(job, ("error", job.failed))

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            self.errors += 1
            log.exception("engine step failed; starting again the requests it held (%s)",
                          ", ".join(j.label for j in self.jobs.values()))
            self._recover(e)
            return
        self.running = len(self.engine.batch) if self.engine.batch is not None else 0
        for o in outs:
            job = self.jobs.get(o.request_id)
            if job is None:
                continue
            new, lps = o.new_token_ids, o.logprobs
            if job.skip:
                n = min(job.skip, len(new))
                new, job.skip = new[n:], job.skip - n
                lps = None if lps is None else lps[n:]
            if new or o.prompt_logprobs is not None:
                job.delivered += len(new)
                self._send(job, ("tokens", list(new), lps, o.prompt_logprobs))
            if o.finished is not None:
                self._finish(job, o.finished.reason, o.finished)

    def _recover(self, exc: Exception) -> None:
        """After a failed step (the engine dropped everything): start each request again, or fail it."""
        self.running = 0
        for job in list(self.jobs.values()):
            if job.cancelled:
                self._finish(job, "abort", None)
            elif job.attempts < self.retries:
                job.attempts += 1
                job.skip = job.delivered
                self.restarts += 1
                try:
                    self.engine.add_request(dataclasses.replace(job.request, stop_ids=set(job.request.stop_ids)))
                except Exception:
                    log.exception("request %s could not be started again", job.label)
                    self._finish(job, "error", None, job.failed)
            else:
                log.error("request %s failed: the engine step raised %s: %s (retries spent)", job.label,
                          type(exc).__name__, exc)
                self._finish(job, "error", None, job.failed)

    def _finish(self, job: Job, reason: str, finished, message: str | None = None) -> None:
        self.jobs.pop(job.id, None)
        self._release(job.id)
        self.finished[job.cancelled if reason == "abort" and job.cancelled else reason] += 1
        if self.on_finish is not None:
            try:
                self.on_finish(job, finished)
            except Exception:
                log.exception("on_finish callback failed")
        self._send(job, ("error", message) if reason == "error" else ("done", reason, finished))

    def _release(self, request_id: int) -> None:
        with self._lock:
            self._held.discard(request_id)

    def _send(self, job: Job, event: tuple) -> None:
        try:
            job.deliver(event)
        except Exception:  # e.g. the client's event loop is gone
            log.debug("could not deliver an event to request %s", job.id, exc_info=True)

    def _fail_all(self, message: str) -> None:
        for job in list(self.jobs.values()):
            self._finish(job, "error", None, message)
        self.engine.reset()
        while True:  # requests submitted but never taken
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._release(arg.id)
                self._send(arg, ("error", message))
