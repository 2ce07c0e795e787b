"""The runner changes nothing shared: batchspec may run on a model while HF ``generate`` (or another ``LLM``) uses the
very same model object from another thread.

While both run, an observer thread samples everything a forward used to patch (every module's class, the config's
attention implementation, the process environment) and records any change; the tests also check that the two sides
really overlapped in time."""

import ast
import os
import re
import threading
import time
from pathlib import Path

import pytest
import tiny
import torch

import batchspec
from batchspec import SamplingParams
from batchspec.model import kernels
from batchspec.model.threads import release_idle_workers

SRC = Path(batchspec.__file__).parent
ENV = "TRANSFORMERS_SDPA_FORCE_GQA"
PROMPTS = tiny.prompts(6, seed=17, lo=2, hi=50)
N = 16


def _snapshot(model):
    return (tuple(type(m) for m in model.modules()), model.config._attn_implementation, os.environ.get(ENV))


class Observer(threading.Thread):
    """Samples ``_snapshot(model)`` as often as it can (yielding the GIL after each sample); counts samples taken
    while every flag in ``busy`` is set."""

    def __init__(self, model, busy: dict):
        super().__init__(daemon=True)
        self.model, self.busy = model, busy
        self.before = _snapshot(model)
        self.changes, self.samples, self.samples_both = [], 0, 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            both = all(self.busy.values())
            now = _snapshot(self.model)
            self.samples += 1
            if both and all(self.busy.values()):
                self.samples_both += 1
            if now != self.before:
                self.changes.append(now)
            time.sleep(0)  # hand the GIL over at once: a pure-Python loop would otherwise stall the others


class Looper(threading.Thread):
    """Runs ``llm.generate`` on ``PROMPTS`` until stopped (at least ``min_runs`` times), checking every output;
    records when each run was busy and when tokens came out."""

    def __init__(self, llm, want, busy: dict, key: str, min_runs: int = 1, max_runs: int | None = None):
        super().__init__(daemon=True)
        self.llm, self.want, self.busy, self.key = llm, want, busy, key
        self.min_runs, self.max_runs = min_runs, max_runs
        self.errors, self.token_times, self.runs = [], [], 0
        self.stop = threading.Event()
        self.started = threading.Event()

    def run(self):
        try:
            while (self.runs < self.min_runs or not self.stop.is_set()) and self.runs != self.max_runs:
                self.busy[self.key] = True
                self.started.set()
                outs = self.llm.generate(PROMPTS, SamplingParams(max_tokens=N),
                                         on_tokens=lambda i, new, fin: self.token_times.append(time.perf_counter()))
                self.busy[self.key] = False
                got = [o.token_ids for o in outs]
                if got != self.want:
                    self.errors.append(("mismatch", self.runs, got))
                self.runs += 1
        except BaseException as exc:  # reported by the main thread
            self.errors.append(("raised", self.runs, repr(exc)))
        finally:
            self.busy[self.key] = False
            self.started.set()


def _targets():
    out = [pytest.param(torch.float64, id="fp64")]
    out.append(pytest.param(torch.float32, id="fp32-c-layer", marks=pytest.mark.skipif(
        kernels._load() is None, reason="no C kernels on this machine (no compiler or AVX2)")))
    return out


def _within(times, intervals):
    return sum(any(a <= t <= b for a, b in intervals) for t in times)


def _kinds(observer) -> set:
    names = ("classes", "attention", "environment")
    return {names[i] for c in list(observer.changes) for i in range(3) if c[i] != observer.before[i]}


def test_observer_sees_a_temporary_change():
    """The observer catches changes that last only a moment (as a forward that patches and restores would), of
    each kind: a module's class, the config's attention implementation, the environment variable."""
    target = tiny.target()
    busy = {"x": True}
    observer = Observer(target, busy)
    observer.start()
    layer = target.model.layers[0].mlp.gate_proj
    cls = type(layer)
    env_before = os.environ.get(ENV)

    def restore():
        if env_before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = env_before
        target.config._attn_implementation = "sdpa"
        layer.__class__ = cls

    flips = 0
    try:
        while len(_kinds(observer)) < 3 and flips < 3000:
            flips += 1
            what = flips % 3
            if what == 0:
                os.environ[ENV] = "observer-test"
            elif what == 1:
                target.config._attn_implementation = "eager"
            else:
                layer.__class__ = type("Patched", (cls,), {})
            time.sleep(0.001)
            restore()
            time.sleep(0.001)
    finally:
        restore()
        observer.stop.set()
        observer.join(10)
    assert _kinds(observer) == {"classes", "attention", "environment"}, _kinds(observer)
    assert _snapshot(target) == observer.before


@pytest.mark.parametrize("dtype", _targets())
def test_engine_and_hf_generate_share_one_model(dtype):
    target, draft = tiny.target(dtype=dtype), tiny.draft(dtype=dtype)
    want = [tiny.oracle(target, p, N) for p in PROMPTS]  # computed beforehand, alone
    before = _snapshot(target)
    busy = {"engine": False, "hf": False}
    observer = Observer(target, busy)
    engine = Looper(batchspec.LLM(target, draft=draft, num_draft_tokens=3, batch_size=4), want, busy, "engine",
                    min_runs=2)
    observer.start()
    engine.start()
    engine.started.wait(30)
    hf_intervals, hf_errors = [], []
    try:
        for _ in range(3):
            for p, w in zip(PROMPTS, want):
                busy["hf"] = True
                a = time.perf_counter()
                got = tiny._generate(target, p, N, ())  # HF generate(do_sample=False) at batch 1, not memoised
                hf_intervals.append((a, time.perf_counter()))
                busy["hf"] = False
                if got != w:
                    hf_errors.append((p, got, w))
    finally:
        busy["hf"] = False
        engine.stop.set()
        engine.join(60)
        observer.stop.set()
        observer.join(10)
    assert not engine.is_alive() and not observer.is_alive()
    assert not engine.errors, engine.errors[:2]
    assert not hf_errors, hf_errors[:2]
    assert engine.runs >= 2
    assert not observer.changes, f"the model or environment changed while both ran: {observer.changes[0]}"
    assert _snapshot(target) == before
    assert observer.samples_both >= 100, f"only {observer.samples_both} samples while both ran"
    overlap = _within(engine.token_times, hf_intervals)
    assert overlap >= 5, f"the engine emitted only {overlap} token batches while HF generate ran"


@pytest.mark.parametrize("dtype", _targets())
def test_two_llms_share_one_target_in_two_threads(dtype):
    target = tiny.target(dtype=dtype)
    want = [tiny.oracle(target, p, N) for p in PROMPTS]
    busy = {"a": False, "b": False}
    observer = Observer(target, busy)
    a = Looper(batchspec.LLM(target, draft=tiny.draft(dtype=dtype), num_draft_tokens=3, layout="slotmask",
                             batch_size=3, check_invariants=True), want, busy, "a", min_runs=6, max_runs=6)
    b = Looper(batchspec.LLM(target, draft="prompt-lookup", num_draft_tokens=4, layout="eqspec",
                             scheduler="continuous", batch_size=4, check_invariants=True), want, busy, "b",
               min_runs=6, max_runs=6)
    observer.start()
    a.start()
    b.start()
    a.join(60)
    b.join(60)
    observer.stop.set()
    observer.join(10)
    assert not a.is_alive() and not b.is_alive()
    assert not a.errors, a.errors[:2]
    assert not b.errors, b.errors[:2]
    assert a.runs == b.runs == 6
    assert not observer.changes
    assert observer.samples_both >= 100, f"only {observer.samples_both} samples while both ran"
    # the two really ran at once: tokens of each came out while the other was generating
    assert a.token_times and b.token_times
    span_a, span_b = (min(a.token_times), max(a.token_times)), (min(b.token_times), max(b.token_times))
    assert _within(a.token_times, [span_b]) >= 5 and _within(b.token_times, [span_a]) >= 5


# ------------------------------------------------------------------------------------------------ source scan
ALLOWED = {("runner.py", "private_copy", "mine.config._attn_implementation")}
FORBIDDEN_CALLS = {"putenv", "unsetenv", "set_attn_implementation"}
ENV_METHODS = {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
GUARDED_ATTRS = {"__class__", "_attn_implementation"}


def _is_environ(node) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def shared_writes(source: str, filename: str = "<src>") -> list[str]:
    """Lines of ``source`` that write the process environment, an object's class or a config's attention
    implementation (assignments, ``del``, ``setattr``/``object.__setattr__``, ``os.putenv``, environ methods)."""
    tree = ast.parse(source)
    found = []
    funcs = [(n.lineno, n.end_lineno, n.name) for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    def where(node):
        inner = [f for f in funcs if f[0] <= node.lineno <= f[1]]
        return min(inner, key=lambda f: f[1] - f[0])[2] if inner else "<module>"

    def report(node, what):
        target = ast.unparse(node) if not isinstance(node, ast.Call) else ""
        if (Path(filename).name, where(node), target) in ALLOWED:
            return
        found.append(f"{filename}:{node.lineno}: {what}: {ast.get_source_segment(source, node) or ast.unparse(node)}")

    def check_target(t):
        if isinstance(t, (ast.Tuple, ast.List)):
            for e in t.elts:
                check_target(e)
        elif isinstance(t, ast.Subscript) and _is_environ(t.value):
            report(t, "writes os.environ")
        elif isinstance(t, ast.Attribute) and t.attr in GUARDED_ATTRS:
            report(t, f"assigns .{t.attr}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                check_target(t)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            check_target(node.target)
        elif isinstance(node, ast.Delete):
            for t in node.targets:
                check_target(t)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in FORBIDDEN_CALLS:
                report(node, f"calls {name}")
            elif isinstance(f, ast.Attribute) and name in ENV_METHODS and _is_environ(f.value):
                report(node, f"calls os.environ.{name}")
            elif name in ("setattr", "__setattr__", "delattr") and any(
                    isinstance(a, ast.Constant) and a.value in GUARDED_ATTRS for a in node.args):
                report(node, f"calls {name} on a guarded attribute")
    return found


def test_scanner_catches_every_form():
    bad = '''
import os
def f(m, config, C):
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    del os.environ["X"]
    os.environ.update(X="1")
    os.environ.setdefault("X", "1")
    os.putenv("X", "1")
    object.__setattr__(m, "__class__", C)
    setattr(m, "__class__", C)
    m.__class__ = C
    config._attn_implementation = "eager"
    m.set_attn_implementation("eager")
    mine.config._attn_implementation = "x"
'''
    assert len(shared_writes(bad, "runner.py")) == 11  # the last one is allowed only inside private_copy
    ok = '''
import os
def private_copy(mine):
    x = os.environ.get("X")
    if mine.config._attn_implementation == "sdpa":
        mine.config._attn_implementation = "mine"
'''
    assert shared_writes(ok, "runner.py") == []
    assert len(shared_writes(ok, "kv.py")) == 1


def test_no_source_file_writes_shared_state():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    found = []
    allowed_seen = 0
    for path in files:
        text = path.read_text()
        found += shared_writes(text, str(path.relative_to(SRC)))
        allowed_seen += len(re.findall(r"\bmine\.config\._attn_implementation\s*=(?!=)", text))
    assert not found, "\n".join(found)
    assert any(f.name == "runner.py" for f in files)
    assert allowed_seen == 1  # the private copy's own config, and nothing else


def _tids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _in_fresh_thread(fn):
    """``fn()`` on a new thread (its own OpenMP pool, none yet), with 2 OpenMP threads there; its result."""
    out: list = []

    def run():
        try:
            torch.set_num_threads(2)
            out.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            out.append(e)

    old = torch.get_num_threads()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    torch.set_num_threads(old)
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _open_pool() -> set[str]:
    """Run a parallel op on this thread; the OpenMP workers it started (its pool)."""
    before = _tids()
    x = torch.ones(1 << 21)
    x.add(x)
    return _tids() - before


def test_release_idle_workers_ends_the_calling_threads_pool():
    """A parallel op leaves the thread a pool of idle workers; releasing ends exactly them; the next op starts a new
    pool. (A second thread's pool is what made the server's engine thread slow.)"""

    def probe():
        workers = _open_pool()
        assert workers, "the parallel op started no OpenMP worker: nothing to release"
        assert release_idle_workers()
        gone = workers - _tids()
        again = _open_pool()
        return workers, gone, again

    workers, gone, again = _in_fresh_thread(probe)
    assert gone == workers and len(again) == len(workers)


def test_the_server_worker_leaves_no_idle_workers_on_the_loading_thread():
    """``EngineWorker`` is built on the thread that loaded the model and steps the engine on another: it ends the
    loading thread's pool, so the engine thread's pool is the process's only one."""
    import servekit

    from batchspec.serve.worker import EngineWorker

    def probe():
        before = _tids()
        llm = servekit.llm()
        _open_pool()
        workers = _tids() - before
        EngineWorker(llm)
        return workers, _tids()

    workers, after = _in_fresh_thread(probe)
    assert workers and not workers & after
