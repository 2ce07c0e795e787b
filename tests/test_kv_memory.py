"""KV memory: the measure equals a hand computation, admission keeps the rectangle inside the budget (rows wait, with
outputs equal to the oracle's), a request too large alone is refused with its numbers, and /metrics shows the gauges."""

import httpx
import pytest
import servekit
import tiny

from batchspec import SamplingParams
from batchspec.engine.engine import Engine, Request
from batchspec.engine.memory import KVMemory, budget_bytes
from batchspec.model.kv import per_token_bytes
from batchspec.params import Stats

K = 3
MAX_TOKENS = 24
PROMPTS = tiny.prompts(4, seed=31, lo=12, hi=30)
# the tiny llama: 2 layers x K and V x 2 key-value heads x head_dim 8 x 8 bytes (float64)
PER_TOKEN = 2 * 2 * 2 * 8 * 8


def _llm(layout="slotmask", scheduler="continuous"):
    return tiny.fixed_llm(tiny.target("llama"), draft=tiny.draft("llama"), num_draft_tokens=K, layout=layout,
                          scheduler=scheduler, batch_size=4, check_invariants=True)


def _engine(llm, budget):
    return Engine(llm.parts, llm.scheduler, llm.batch_size, Stats(), check=True, kv_memory=budget)


def _request(i, prompt, max_tokens=MAX_TOKENS):
    return Request(prompt, max_tokens, seed=0, id=i)


def test_per_token_and_need_by_hand():
    assert per_token_bytes(tiny.target("llama")) == PER_TOKEN
    slotmask, eqspec = KVMemory.of(_llm().parts, None), KVMemory.of(_llm("eqspec").parts, None)
    assert slotmask.per_token == eqspec.per_token == 2 * PER_TOKEN  # the draft model's cache as well
    # slotmask may leave half the width as holes: 30 tokens take up to 60 slots, then a block of K + 1
    assert slotmask.need(2, 30) == 2 * (60 + K + 1) * 2 * PER_TOKEN
    assert eqspec.need(2, 30) == 2 * (30 + K + 1) * 2 * PER_TOKEN
    # rounds drawn from a window of 4 rows: the round's copy of the batch too, holes up to half the width
    windowed = KVMemory(100, None, 0.0, K + 1, part=4)
    assert windowed.need(4, 30) == 4 * (30 + K + 1) * 100 and windowed.need(6, 30) == 10 * (30 + K + 1) * 100
    assert budget_bytes(3) == 3 << 20 and budget_bytes(None) is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="kv_memory"):
            budget_bytes(bad)


def test_measure_equals_the_rectangle_by_hand():
    llm = _llm()
    engine = _engine(llm, None)
    for i, p in enumerate(PROMPTS):
        engine.add_request(_request(i, p))
    engine.step()
    batch, s = engine.batch, engine.stats
    states = (batch.target, *llm.drafter.states(batch.draft))
    assert s.kv_bytes_used == sum(len(st) * st.width * PER_TOKEN for st in states) > 0
    assert s.kv_bytes_visible == sum(n - 1 for n in batch.lengths) * 2 * PER_TOKEN
    held = sum(t.untyped_storage().nbytes() for st in states for layer in st.cache.layers for t in (layer._k, layer._v))
    assert s.kv_bytes_held == held >= s.kv_bytes_used
    assert s.kv_bytes_peak >= s.kv_bytes_used and s.kv_bytes_budget == 0
    while engine.has_work():
        engine.step()
    assert s.kv_bytes_used == s.kv_bytes_held == s.kv_bytes_visible == 0  # no rows, buffers released


@pytest.mark.parametrize("layout,scheduler", [("slotmask", "continuous"), ("eqspec", "static")])
def test_a_budget_of_two_rows_runs_them_two_at_a_time(layout, scheduler):
    llm = _llm(layout, scheduler)
    ceiling = max(len(p) for p in PROMPTS) + MAX_TOKENS
    budget = KVMemory.of(llm.parts, None).need(2, ceiling)

    def run(kv_memory):
        engine = _engine(llm, kv_memory)
        for i, p in enumerate(PROMPTS):
            engine.add_request(_request(i, p))
        out, rows = {}, []
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            rows.append(len(engine.batch) if engine.batch is not None else 0)
            if kv_memory is not None:
                assert engine.stats.kv_bytes_used <= kv_memory
        return out, max(rows), engine.stats

    out, most, stats = run(budget)
    assert most == 2 and 0 < stats.kv_bytes_peak <= budget and stats.kv_bytes_budget == budget
    for i, p in enumerate(PROMPTS):
        assert out[i] == tiny.oracle(tiny.target("llama"), p, MAX_TOKENS), i
    assert run(None)[1] == 4  # without the budget all four run at once


def test_a_request_too_large_alone_is_refused_with_its_numbers():
    llm = _llm()
    memory = KVMemory.of(llm.parts, None)
    engine = _engine(llm, memory.need(1, 40) - 1)
    with pytest.raises(ValueError, match=r"request 7: 16 prompt tokens \+ max_tokens 24 need up to \d+ bytes .* "
                                         r"over the KV memory budget of \d+ bytes"):
        engine.add_request(_request(7, list(range(1, 17))))
    assert not engine.has_work()
    engine.add_request(_request(8, list(range(1, 16))))  # one token less fits
    llm.memory.budget = memory.need(1, 40) - 1
    with pytest.raises(ValueError, match="prompt 0: 16 prompt tokens .* KV memory budget"):
        llm.generate([list(range(1, 17))], SamplingParams(max_tokens=24))


def test_the_server_shows_the_gauges_and_refuses_a_request_too_large():
    llm = servekit.llm()
    budget = KVMemory.of(llm.parts, None).need(2, 64)
    llm.memory.budget = budget
    with servekit.served(llm) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 200,
                                               "temperature": 0})
        assert r.status_code == 400 and "KV memory budget" in r.json()["error"]["message"], r.text
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8,
                                               "temperature": 0})
        assert r.status_code == 200, r.text
        text = http.get("/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["batchspec_kv_bytes_capacity"] == budget
    assert 0 < values["batchspec_kv_bytes_peak"] <= budget
    for name in ("used", "held", "visible"):
        assert f"batchspec_kv_bytes_{name}" in values


@pytest.mark.parametrize("layout", ["slotmask", "eqspec"])
def test_the_rectangle_narrows_when_its_longest_row_leaves(layout):
    """The layouts compact the rectangle to the rows that stay (slotmask once holes and padding pass half its
    width), so the bytes in use follow the longest row still running, not the longest that ran."""
    llm = tiny.fixed_llm(tiny.target("llama"), layout=layout, scheduler="continuous", batch_size=2)
    engine = _engine(llm, None)
    engine.add_request(_request(0, PROMPTS[1] + PROMPTS[0], max_tokens=2))  # 49 tokens, leaves after 2 rounds
    engine.add_request(_request(1, PROMPTS[3][:5], max_tokens=12))
    engine.step()
    wide = engine.stats.kv_bytes_used
    assert wide == 2 * 49 * PER_TOKEN  # both rows as wide as the long prompt (no drafter: the target's cache alone)
    engine.step()
    assert engine.batch.request_ids == [1]
    assert engine.stats.kv_bytes_used == (engine.batch.lengths[0] - 1) * PER_TOKEN < wide / 4


@pytest.mark.parametrize("name", ["static", "continuous", "exspec"])
def test_schedulers_admit_no_more_than_fits(name):
    from batchspec.engine.schedulers import get_scheduler

    s = get_scheduler(name)
    assert s.admit(0, [5] * 6, 4, None, fits=lambda n: n <= 2) == 2
    assert s.admit(0, [5] * 6, 4, None, fits=lambda n: False) == 0
    assert s.admit(0, [5] * 6, 4, None, fits=None) == min(6, s.room(0, 4))
    if name != "static":  # rows running: the token budget and the memory bound, whichever is smaller
        assert s.admit(1, [5] * 6, 4, 10, fits=lambda n: n <= 1) == 1
        assert s.admit(1, [5] * 6, 4, 10, fits=lambda n: n <= 3) == 2


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_flag_and_its_help(command, capsys):
    from batchspec.cli.commands import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):  # the help formats (a bare % in it would not)
        parser.parse_args([command, "--help"])
    assert "--kv-memory MIB" in capsys.readouterr().out
    assert parser.parse_args([command, "--kv-memory", "512"]).kv_memory == 512
