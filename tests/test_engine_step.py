"""The step API: ``LLM.engine()`` -> ``Engine.add_request / step / abort / has_work``, and ``generate(on_tokens=...)``.

Every test checks that its scenario really happened (requests joined while others were running, a running request
was aborted with tokens already streamed, a waiting one was aborted before any work, streaming came in pieces)."""

import itertools

import pytest
import tiny

from batchspec import SamplingParams
from batchspec.engine.engine import Finished, StepOutput

EARLY = tiny.prompts(3, seed=21, lo=3, hi=40)
LATE = tiny.prompts(4, seed=22, lo=1, hi=50)
EARLY_MAX = [14, 9, 17]
LATE_MAX = [11, 6, 13, 8]
K = 3


def _draft(name):
    return {"model": tiny.draft("llama"), "prompt-lookup": "prompt-lookup", "none": None}[name]


def _llm(drafter, layout="slotmask", scheduler="continuous", batch_size=4, **kw):
    return tiny.fixed_llm(tiny.target("llama"), draft=_draft(drafter), num_draft_tokens=K, layout=layout,
                         scheduler=scheduler, batch_size=batch_size, check_invariants=True, **kw)


class Driver:
    """Steps an engine and records, per request id, the streamed tokens, the ``Finished`` and when they came."""

    def __init__(self, engine):
        self.engine = engine
        self.streamed: dict[int, list[int]] = {}
        self.finished: dict[int, Finished] = {}
        self.first_token_step: dict[int, int] = {}
        self.finish_step: dict[int, int] = {}
        self.steps = 0

    def running(self) -> set[int]:
        """Requests that streamed tokens and have not finished (seen from the outside)."""
        return {rid for rid, toks in self.streamed.items() if toks and rid not in self.finished}

    def step(self) -> list[StepOutput]:
        outs = self.engine.step()
        for o in outs:
            assert isinstance(o, StepOutput)
            assert o.request_id not in self.finished, f"request {o.request_id} got output after it finished"
            if o.new_token_ids:
                self.first_token_step.setdefault(o.request_id, self.steps)
            self.streamed.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished is not None:
                assert o.finished.request_id == o.request_id
                self.finished[o.request_id] = o.finished
                self.finish_step[o.request_id] = self.steps
        self.steps += 1
        return outs

    def run(self, limit=500):
        while self.engine.has_work():
            self.step()
            assert self.steps < limit, "the engine never ran out of work"
        assert self.engine.step() == []  # nothing left: a step is a no-op


@pytest.mark.parametrize("scheduler,layout,drafter", list(itertools.product(
    ["continuous", "static"], ["slotmask", "eqspec"], ["model", "prompt-lookup", "none"])) + [
    ("exspec", "slotmask", "model"), ("exspec", "eqspec", "prompt-lookup")])
def test_requests_added_while_others_run(scheduler, layout, drafter):
    t = tiny.target("llama")
    llm = _llm(drafter, layout, scheduler, batch_size=4)
    engine = llm.engine()
    assert not engine.has_work()
    ids, early = llm.requests(EARLY, [SamplingParams(max_tokens=m) for m in EARLY_MAX])
    assert [r.id for r in early] == [0, 1, 2]
    prompt_of, max_of = {}, {}
    for r, p, m in zip(early, EARLY, EARLY_MAX):
        rid = engine.add_request(r)
        assert rid == r.id
        prompt_of[rid], max_of[rid] = p, m
    d = Driver(engine)
    for _ in range(2):
        d.step()
    running_at_join = d.running()
    assert running_at_join, "no request was running when the late ones were added"
    _, late = llm.requests(LATE, [SamplingParams(max_tokens=m) for m in LATE_MAX])
    late_ids = []
    for r, p, m in zip(late, LATE, LATE_MAX):
        r.id = None  # the engine numbers them
        rid = engine.add_request(r)
        assert rid not in prompt_of, f"engine reused id {rid}"
        prompt_of[rid], max_of[rid] = p, m
        late_ids.append(rid)
        d.step()  # one more request between steps
    d.run()

    assert set(d.finished) == set(prompt_of)
    for rid, f in d.finished.items():
        want = tiny.oracle(t, prompt_of[rid], max_of[rid])
        assert d.streamed[rid] == f.token_ids == want, rid
        assert f.reason == "length" and f.rounds >= 1
        assert f.accepted <= f.drafted
    if scheduler in ("continuous", "exspec"):
        assert llm.stats.joined_running > 0, "no request was spliced into a running batch"
        # a late request streamed tokens before some early request (running when it was added) had finished
        assert any(d.first_token_step[lt] < d.finish_step[e] for lt in late_ids for e in running_at_join)
    else:  # static: nobody joins a running batch; late requests start after the early batch is done
        assert llm.stats.joined_running == 0
        assert min(d.first_token_step[lt] for lt in late_ids) > max(d.finish_step[e] for e in range(3))
    if drafter != "none":
        assert llm.stats.drafted > 0 and llm.stats.accepted > 0
    if drafter == "model":
        assert llm.stats.ragged_rounds > 0, "no ragged round happened"
    assert llm.stats.generated == sum(len(f.token_ids) for f in d.finished.values())


@pytest.mark.parametrize("scheduler,layout,drafter", [
    ("static", "slotmask", "model"), ("continuous", "eqspec", "model"), ("continuous", "slotmask", "prompt-lookup"),
    ("static", "eqspec", "none"), ("exspec", "slotmask", "model"),
])
def test_abort_running_and_waiting(scheduler, layout, drafter):
    t = tiny.target("llama")
    llm = _llm(drafter, layout, scheduler, batch_size=2)
    prefilled = []
    original_prefill = llm.parts.prefill

    def spy(runner, prompts, *a, **kw):
        prefilled.extend(tuple(p) for p in prompts)
        return original_prefill(runner, prompts, *a, **kw)

    llm.parts.prefill = spy
    engine = llm.engine()
    prompts = tiny.prompts(4, seed=31, lo=4, hi=30)
    ids, reqs = llm.requests(prompts, SamplingParams(max_tokens=20))
    explicit = [100, 7, 42, 5]
    for r, e in zip(reqs, explicit):
        r.id = e
        assert engine.add_request(r) == e  # the engine's ids, not positions in a list
    prompt_of = dict(zip(explicit, prompts))
    assert len(set(map(tuple, prompts))) == 4
    d = Driver(engine)

    assert engine.abort(12345) is False
    # 42 waits (batch_size 2, and for exspec: abort before the first step, while nothing has been admitted)
    assert engine.abort(42) is True
    d.step()
    assert 42 in d.finished and d.finished[42].reason == "abort" and d.finished[42].token_ids == []
    assert d.streamed[42] == [] and d.finished[42].rounds == 0
    assert engine.abort(42) is False  # gone

    while len(d.streamed.get(7, [])) < 3:
        d.step()
    assert 7 in d.running(), "request 7 was not running when aborted"
    had = list(d.streamed[7])
    assert len(had) < 20
    assert engine.abort(7) is True
    d.run()

    f7 = d.finished[7]
    assert f7.reason == "abort"
    assert f7.token_ids == d.streamed[7] == had, "tokens after the abort, or Finished differs from the stream"
    full = tiny.oracle(t, prompt_of[7], 20)
    assert 0 < len(f7.token_ids) < len(full) and f7.token_ids == full[: len(f7.token_ids)]
    for rid in (100, 5):
        assert d.finished[rid].reason == "length"
        assert d.streamed[rid] == d.finished[rid].token_ids == tiny.oracle(t, prompt_of[rid], 20)
    assert tuple(prompt_of[42]) not in prefilled, "the aborted waiting request was prefilled"
    assert tuple(prompt_of[5]) in prefilled
    assert set(d.finished) == {100, 7, 42, 5}
    for rid in explicit:
        assert engine.abort(rid) is False  # all finished
    assert not engine.has_work()


def test_engine_numbers_requests_after_explicit_ids():
    t = tiny.target("llama")
    llm = _llm("model", batch_size=8)
    engine = llm.engine()
    prompts = tiny.prompts(5, seed=41)
    _, reqs = llm.requests(prompts, SamplingParams(max_tokens=7))
    got = []
    for r, e in zip(reqs, [100, 7, None, 42, None]):
        r.id = e
        got.append(engine.add_request(r))
    assert got[:2] == [100, 7] and got[3] == 42
    assert len(set(got)) == 5 and all(isinstance(i, int) for i in got)
    d = Driver(engine)
    d.run()
    for rid, p in zip(got, prompts):
        assert d.streamed[rid] == d.finished[rid].token_ids == tiny.oracle(t, p, 7)


def test_abort_several_running_rows_at_once():
    """Two running rows (one of them the last row of the batch) aborted together: both leave with a prefix of the
    oracle, the surviving row and the requests that join in their places stay exact."""
    t = tiny.target("llama")
    llm = _llm("model", "slotmask", "continuous", batch_size=3)
    engine = llm.engine()
    prompts = tiny.prompts(5, seed=51, lo=5, hi=30)
    maxes = [30, 18, 30, 9, 12]
    _, reqs = llm.requests(prompts, [SamplingParams(max_tokens=m) for m in maxes])
    for r in reqs:
        engine.add_request(r)
    d = Driver(engine)
    for _ in range(2):
        d.step()
    assert {0, 1, 2} <= d.running()
    assert engine.abort(0) and engine.abort(2)
    d.run()
    for i in (0, 2):
        f = d.finished[i]
        full = tiny.oracle(t, prompts[i], maxes[i])
        assert f.reason == "abort" and 0 < len(f.token_ids) < len(full)
        assert f.token_ids == d.streamed[i] == full[: len(f.token_ids)]
    for i in (1, 3, 4):
        assert d.finished[i].reason == "length"
        assert d.streamed[i] == d.finished[i].token_ids == tiny.oracle(t, prompts[i], maxes[i])
    assert llm.stats.joined_running > 0


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_generate_streams_with_on_tokens(scheduler):
    t = tiny.target("llama")
    llm = _llm("model", scheduler=scheduler, batch_size=3)
    prompts = tiny.prompts(7, seed=61)
    maxes = [5, 12, 1, 9, 16, 3, 10]
    calls = []
    outs = llm.generate(prompts, [SamplingParams(max_tokens=m) for m in maxes],
                        on_tokens=lambda i, new, fin: calls.append((i, list(new), fin)))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, m) for p, m in zip(prompts, maxes)]
    for i, o in enumerate(outs):
        mine = [c for c in calls if c[0] == i]
        assert sum(c[2] for c in mine) == 1, f"prompt {i}: {sum(c[2] for c in mine)} finished calls"
        assert mine[-1][2] is True, f"prompt {i}: a call came after its finished call"
        assert [tok for c in mine for tok in c[1]] == o.token_ids
        assert all(c[1] for c in mine if not c[2]), "a non-final call carried no tokens"
    # streaming really came in pieces: some prompt gained its tokens over several steps
    assert max(sum(1 for c in calls if c[0] == i) for i in range(len(prompts))) > 3
    assert all(isinstance(c[0], int) and 0 <= c[0] < len(prompts) for c in calls)


def test_on_tokens_with_stop_tokens():
    """Streamed pieces are cut at a stop token exactly like the final output."""
    t = tiny.target("llama")
    prompts = tiny.prompts(6, seed=71)
    stop = 30
    want = [tiny.oracle(t, p, 20, stop_ids=[stop]) for p in prompts]
    if not any(w and w[-1] == stop for w in want):
        stop = max({w[4] for w in want if len(w) > 4}, key=lambda s: sum(s in w for w in want))
        want = [tiny.oracle(t, p, 20, stop_ids=[stop]) for p in prompts]
    assert any(w[-1] == stop for w in want), "no prompt stops on the stop token"
    llm = _llm("model", scheduler="continuous", batch_size=4)
    pieces: dict[int, list[int]] = {}
    fins = []
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, stop_token_ids=[stop]),
                        on_tokens=lambda i, new, fin: (pieces.setdefault(i, []).extend(new), fin and fins.append(i)))
    assert [o.token_ids for o in outs] == want
    assert [pieces[i] for i in range(len(prompts))] == want
    assert sorted(fins) == list(range(len(prompts)))
    assert any(o.finish_reason == "stop" for o in outs)


def test_two_engines_of_one_llm_are_independent():
    """Each ``llm.engine()`` has its own scheduler state: stepping (or aborting in) one engine must not disturb
    another engine of the same LLM. ExSpec remembers per-row waits, so a shared scheduler object breaks here."""
    t = tiny.target("llama")
    llm = _llm("prompt-lookup", scheduler="exspec", batch_size=2)
    prompts = tiny.prompts(6, seed=4)
    a = Driver(llm.engine())
    _, reqs = llm.requests(prompts, SamplingParams(max_tokens=12))
    for r in reqs:
        a.engine.add_request(r)
    a.step()
    assert len(a.running()) == 2 and a.engine.has_work()  # a window of 6 rows, 2 of them ran
    b = Driver(llm.engine())
    _, reqs = llm.requests(prompts[:1], SamplingParams(max_tokens=12))
    b.engine.add_request(reqs[0])
    b.step()  # one row
    assert a.engine.abort(0) is True
    a.run()
    b.run()
    assert a.finished[0].reason == "abort"
    for i in range(1, 6):
        assert a.streamed[i] == a.finished[i].token_ids == tiny.oracle(t, prompts[i], 12)
    assert b.streamed[0] == b.finished[0].token_ids == tiny.oracle(t, prompts[0], 12)


def test_add_request_refuses_an_id_in_use():
    """Two requests with one id cannot both be reported (one ``Finished`` would be lost): refused up front."""
    llm = _llm("model", batch_size=4)
    engine = llm.engine()
    _, reqs = llm.requests(tiny.prompts(3, seed=1), SamplingParams(max_tokens=5))
    reqs[0].id = reqs[1].id = 1
    engine.add_request(reqs[0])
    with pytest.raises(ValueError, match="1"):
        engine.add_request(reqs[1])
    reqs[2].id = None
    rid = engine.add_request(reqs[2])
    assert rid != 1
    d = Driver(engine)
    d.run()
    assert set(d.finished) == {1, rid}


@pytest.mark.parametrize("budget", [None, 30])
def test_prefill_tokens_bound_what_joins_a_running_batch(budget):
    """With a prefill budget, requests waiting to join a running batch are prefilled a few at a time (at least one
    a step, in order, up to the budget's prompt tokens), so the running rows are stalled for a share of them at a
    time; a batch that starts from nothing takes every request that fits. Outputs are the oracle's either way."""
    llm = _llm("prompt-lookup", batch_size=6)
    engine, t = llm.engine(prefill_tokens=budget), llm.target
    prompts = [tiny.prompts(1, seed=60 + i, lo=12, hi=12)[0] for i in range(6)]
    ids, requests = llm.requests(prompts, SamplingParams(max_tokens=20))
    joins = []
    real = engine._admit

    def spy():
        before = len(engine.waiting)
        real()
        joins.append((before - len(engine.waiting), engine.batch is not None))

    engine._admit = spy
    engine.add_request(requests[0])
    engine.add_request(requests[1])
    d = Driver(engine)
    d.step()  # the first two start a batch
    for r in requests[2:]:
        engine.add_request(r)
    d.run()
    assert {rid: f.token_ids for rid, f in d.finished.items()} == {i: tiny.oracle(t, p, 20) for i, p in
                                                                      enumerate(prompts)}
    admitted = [n for n, _ in joins if n]
    assert admitted[0] == 2  # nothing was running: both joined
    assert admitted[1:] == ([4] if budget is None else [2, 2])  # 12-token prompts, 30 tokens a step: two at a time


def test_read_once_brings_named_tensors_back_in_one_read(monkeypatch):
    """The round's host read: ints, bools and floats of any shape (scalars, empty dimensions included) come back by
    name as each tensor's own ``tolist()`` would give them (floats to the bit, through the int64 transfer), with one
    ``tolist()`` in all."""
    import torch

    from batchspec.engine.readback import read_once

    segments = [("flags", torch.tensor([True, False, True])), ("n", torch.tensor(7)),
                ("block", torch.arange(12).view(3, 4)), ("p", torch.tensor([0.1, -1e-30, float("-inf")])),
                ("lp", torch.randn(2, 3, 2, generator=torch.Generator().manual_seed(0))),
                ("none", torch.zeros(2, 0, dtype=torch.long)), ("half", torch.tensor([1 / 3], dtype=torch.float32)),
                ("ids", torch.tensor([[5, -2**62]]))]
    want = {name: t.tolist() for name, t in segments}
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or real(t))
    got = read_once(segments)
    assert got == want and len(reads) == 1
    assert [type(v) for v in got["flags"]] == [int] * 3 and type(got["p"][0]) is float
