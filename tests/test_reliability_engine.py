"""Reliability of the engine behind ``LLM.generate``: a failure mid-run keeps what finished and leaves the ``LLM``
usable; limits (context, sampling values, prompt types) are checked before any work; and the acceptance counters
count what was emitted. Each test fails on commit c74d2e9 (the code before the runner and the step engine)."""

import copy

import pytest
import tiny
import torch
from transformers import GPT2LMHeadModel

from batchspec import SamplingParams
from batchspec.params import RequestOutput

K = 3


def _count_calls(monkeypatch, obj, attr, log):
    """Wrap the instance's method ``attr`` (until the test ends) so every call is appended to ``log``."""
    original = getattr(obj, attr)

    def counted(*a, **kw):
        log.append(attr)
        return original(*a, **kw)

    monkeypatch.setattr(obj, attr, counted)


def _draft_runner(llm):
    """What runs the draft model's forwards (its ``Runner``; the model itself before runners existed)."""
    return getattr(llm.drafter, "runner", None) or llm.drafter.model


def _nothing_ran(llm):
    s = llm.stats
    return s.rounds == 0 and s.generated == 0 and s.prefill == 0 and s.verify_calls == 0


# ------------------------------------------------------------------------------------------ failure isolation
@pytest.mark.parametrize("where", ["target", "draft"])
def test_failure_mid_run_keeps_finished_outputs_and_the_llm_stays_usable(monkeypatch, where):
    t, d = tiny.target(), tiny.draft()
    prompts = tiny.prompts(5, seed=81, lo=3, hi=30)
    sp = SamplingParams(max_tokens=9)
    want = [tiny.oracle(t, p, 9) for p in prompts]

    def runner(llm):
        return llm.parts.target if where == "target" else _draft_runner(llm)

    # dry runs on a twin LLM (batch_size 1: prompts run one after another): the forwards that prompts 0-1 and 0-2 need
    twin = tiny.fixed_llm(t, draft=d, num_draft_tokens=K, batch_size=1)
    log = []
    _count_calls(monkeypatch, runner(twin), "forward", log)
    twin.generate(prompts[:2], sp)
    two = len(log)
    twin.generate(prompts[:3], sp)
    three = len(log) - two
    fail_at = two + 2  # while prompt 2 runs: prompts 0 and 1 have finished
    assert fail_at < three

    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=K, batch_size=1, check_invariants=True)
    r = runner(llm)
    original = r.forward
    calls = {"n": 0, "raised": 0}

    def flaky(*a, **kw):
        calls["n"] += 1
        if calls["n"] == fail_at:
            calls["raised"] += 1
            raise RuntimeError("injected failure")
        return original(*a, **kw)

    monkeypatch.setattr(r, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected failure") as info:
        llm.generate(prompts, sp)
    assert calls["raised"] == 1
    outs = info.value.outputs
    assert isinstance(outs, list) and len(outs) == len(prompts)
    assert [o is not None for o in outs] == [True, True, False, False, False]
    for o, p, w in zip(outs[:2], prompts, want):
        assert isinstance(o, RequestOutput) and o.prompt_token_ids == p and o.token_ids == w

    n = calls["n"]
    again = llm.generate(prompts, sp)  # the same LLM, the same (now healthy) runner
    assert calls["n"] > n
    assert [o.token_ids for o in again] == want
    assert llm.stats.accepted > 0


def test_engine_step_failure_drops_requests_and_engine_stays_usable(monkeypatch):
    t, d = tiny.target(), tiny.draft()
    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=K, batch_size=3, scheduler="continuous", check_invariants=True)
    engine = llm.engine()
    prompts = tiny.prompts(5, seed=83)
    _, reqs = llm.requests(prompts, SamplingParams(max_tokens=10))
    for r in reqs:
        engine.add_request(r)
    assert engine.step() and engine.step()  # running
    original = llm.parts.target.forward
    monkeypatch.setattr(llm.parts.target, "forward", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()
    assert not engine.has_work() and engine.step() == []
    monkeypatch.setattr(llm.parts.target, "forward", original)
    _, reqs = llm.requests(prompts[:3], SamplingParams(max_tokens=8))
    for r in reqs:
        engine.add_request(r)
    got = {}
    while engine.has_work():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert got == {i: tiny.oracle(t, p, 8) for i, p in enumerate(prompts[:3])}


def test_issue_repro_bool_max_tokens_fails_up_front_and_llm_still_works():
    t = tiny.target()
    L = tiny.fixed_llm(t, draft=tiny.draft())
    with pytest.raises(ValueError, match="max_tokens"):
        L.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=True))
    out = L.generate([[5, 6, 7]], SamplingParams(max_tokens=4))
    assert out[0].token_ids == tiny.oracle(t, [5, 6, 7], 4) and len(out[0].token_ids) == 4


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("max_tokens", 0), ("max_tokens", 4.0),
                                         ("max_tokens", -1), ("top_p", 0.0), ("temperature", float("nan"))])
def test_sampling_params_changed_after_construction_are_checked_up_front(field, value):
    """``SamplingParams`` is a mutable dataclass: a value set after construction must be refused like one given to
    the constructor, before any work (not a crash mid-run, nor a silently empty or garbage output: today
    ``max_tokens=True`` raises a RuntimeError mid-run, ``0`` returns ``[]``, ``top_p=0.0`` samples token V-1)."""
    t = tiny.target()
    L = tiny.fixed_llm(t, draft=tiny.draft())
    sp = SamplingParams(max_tokens=4, temperature=0.7, seed=1)
    setattr(sp, field, value)
    with pytest.raises(ValueError, match=field):
        L.generate([[5, 6, 7], [8, 9, 10, 11]], sp)
    assert _nothing_ran(L)
    assert L.generate([[5, 6, 7]], SamplingParams(max_tokens=4))[0].token_ids == tiny.oracle(t, [5, 6, 7], 4)


# --------------------------------------------------------------------------------------------------- context
def _repetitive(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, tiny.VOCAB, (17,), generator=g).tolist()
    return (phrase * (n // len(phrase) + 1))[:n]


def _record_k(llm):
    """Record (k offered for, most drafts proposed) of every round that drafted."""
    seen, asked = [], []
    offer, propose = llm.drafter.offer, llm.drafter.propose

    def spy_offer(seqs, state, k):
        asked.append(k)
        return offer(seqs, state, k)

    def spy(seqs, state, plan):
        p = propose(seqs, state, plan)
        seen.append((asked[-1], int(p.n_drafts.max()) if p.n_drafts.numel() else 0))
        return p

    llm.drafter.offer, llm.drafter.propose = spy_offer, spy
    return seen


@pytest.mark.parametrize("drafter", ["prompt-lookup", "model"])
@pytest.mark.parametrize("layout", ["slotmask", "eqspec"])
def test_learned_positions_fill_the_whole_context(layout, drafter):
    t = tiny.target("gpt2")
    assert t.config.n_positions == 256
    prompt = _repetitive(200)
    want = tiny.oracle(t, prompt, 56)  # HF serves 200 + 56 = 256 positions
    assert len(want) == 56
    draft = "prompt-lookup" if drafter == "prompt-lookup" else tiny.draft("gpt2")
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=5, layout=layout, batch_size=2, check_invariants=True)
    seen = _record_k(llm)
    outs = llm.generate([prompt, prompt[:150]], SamplingParams(max_tokens=56))
    assert outs[0].token_ids == want and outs[0].finish_reason == "length"
    assert outs[1].token_ids == tiny.oracle(t, prompt[:150], 56)
    assert any(k < 5 and n > 0 for k, n in seen), f"the block was never clipped near the end of the context: {seen}"
    assert llm.stats.accepted > 0


def test_beyond_the_context_is_refused_up_front_naming_the_prompt():
    t = tiny.target("gpt2")
    llm = tiny.fixed_llm(t, draft="prompt-lookup", num_draft_tokens=5, batch_size=1)
    with pytest.raises(ValueError, match=r"prompt 1\b.*257"):
        llm.generate([[5, 6, 7], _repetitive(200)], SamplingParams(max_tokens=57))
    assert _nothing_ran(llm)
    assert llm.generate([_repetitive(200)], SamplingParams(max_tokens=56))[0].token_ids == \
        tiny.oracle(t, _repetitive(200), 56)


def _short(src, n_positions):
    """A copy of the tiny GPT-2 model ``src`` with only its first ``n_positions`` learned positions."""
    cfg = copy.deepcopy(src.config)
    cfg.n_positions = n_positions
    model = GPT2LMHeadModel(cfg)
    state = src.state_dict()
    state["transformer.wpe.weight"] = state["transformer.wpe.weight"][:n_positions]
    model.load_state_dict(state)
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.to(src.dtype).eval()


def _short_draft(n_positions=32):
    """The tiny GPT-2 draft (agrees often with the tiny GPT-2 target) with only ``n_positions`` learned positions."""
    return _short(tiny.draft("gpt2"), n_positions)


def test_draft_with_a_shorter_context_is_refused_up_front(monkeypatch):
    t, short = tiny.target("gpt2"), _short_draft(32)
    assert short.config.n_positions == 32 and short.config.vocab_size == tiny.VOCAB
    llm = tiny.fixed_llm(t, draft=short, num_draft_tokens=5, batch_size=1)
    log = []
    _count_calls(monkeypatch, llm.parts.target, "forward", log)
    _count_calls(monkeypatch, _draft_runner(llm), "forward", log)
    ok, too_long = _repetitive(10, 1), _repetitive(20, 2)  # 10 + 20 = 30 fits; 20 + 20 = 40 does not
    with pytest.raises(ValueError, match=r"(?s)prompt 1\b.*draft.*context.*32"):
        llm.generate([ok, too_long], SamplingParams(max_tokens=20))
    assert log == [] and _nothing_ran(llm), "work ran before the error"


def test_draft_context_filled_exactly_is_served():
    t, short = tiny.target("gpt2"), _short_draft(32)
    llm = tiny.fixed_llm(t, draft=short, num_draft_tokens=5, batch_size=2, check_invariants=True)
    seen = _record_k(llm)
    prompts = [_repetitive(12, 3), _repetitive(7, 4)]
    outs = llm.generate(prompts, [SamplingParams(max_tokens=20), SamplingParams(max_tokens=25)])  # 32 each
    assert [o.token_ids for o in outs] == [tiny.oracle(t, prompts[0], 20), tiny.oracle(t, prompts[1], 25)]
    assert any(k < 5 for k, _ in seen), f"the draft's block was never clipped: {seen}"
    assert llm.stats.accepted > 0


def _short_target(n_positions=128):
    """The tiny GPT-2 target with only ``n_positions`` learned positions."""
    return _short(tiny.target("gpt2"), n_positions)


def test_the_default_policy_measures_within_short_learned_contexts():
    """The adaptive policy (the default) times forwards on a synthetic batch before any request: with a learned
    position table shorter than that batch's usual length, it measures within the table, and a prompt that fills the
    context to its last position is served exactly (prompt lookup; a draft model shorter than the target)."""
    from batchspec import LLM

    t = _short_target(128)
    prompt = _repetitive(100, 5)
    llm = LLM(t, draft="prompt-lookup", num_draft_tokens=4, batch_size=2, check_invariants=True)
    assert llm.parts.policy.name == "adaptive"
    out = llm.generate([prompt, prompt[:60]], SamplingParams(max_tokens=28))
    assert out[0].token_ids == tiny.oracle(t, prompt, 28) and out[1].token_ids == tiny.oracle(t, prompt[:60], 28)
    short = _short_draft(48)
    llm = LLM(t, draft=short, num_draft_tokens=4, batch_size=1, check_invariants=True)
    assert llm.generate([prompt[:44]], SamplingParams(max_tokens=4))[0].token_ids == tiny.oracle(t, prompt[:44], 4)
    with pytest.raises(ValueError, match=r"44 prompt tokens \+ max_tokens 20 = 64 exceeds the draft model's context "
                                         r"of 48"):
        llm.generate([prompt[:44]], SamplingParams(max_tokens=20))


# ------------------------------------------------------------------------------------------- counters
def _spy_raw_accepts(llm):
    raw = []
    original = llm.parts.accept

    def spy(*a, **kw):
        accepted, bonus = original(*a, **kw)
        raw.extend(accepted.tolist())
        return accepted, bonus

    llm.parts.accept = spy
    return raw


def test_one_token_outputs_report_no_accepted_drafts():
    t, d = tiny.target(), tiny.draft()
    prompts = tiny.prompts(10, seed=91)
    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=4, batch_size=8)
    raw = _spy_raw_accepts(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 1) for p in prompts]
    assert sum(a > 0 for a in raw) >= 3, "the draft never agreed: the scenario did not happen"
    for o in outs:
        assert len(o.token_ids) == 1 and o.num_rounds == 1
        assert o.num_accepted == 0, f"a 1-token output reports {o.num_accepted} accepted drafts"
    s = llm.stats
    assert s.accepted == 0 and s.generated == len(prompts) and s.row_rounds == len(prompts)
    assert s.mean_accepted_length == 1.0  # tokens emitted per row per round, bonus included


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup"])
def test_accepted_counts_only_emitted_tokens(drafter):
    t = tiny.target()
    draft = tiny.draft() if drafter == "model" else "prompt-lookup"
    prompts = tiny.prompts(12, seed=93)
    maxes = [1, 2, 3, 5, 7, 9, 2, 13, 4, 6, 1, 11]
    stop = 30
    params = [SamplingParams(max_tokens=m, stop_token_ids=[stop] if i % 3 == 0 else []) for i, m in enumerate(maxes)]
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=5, batch_size=4, scheduler="continuous")
    raw = _spy_raw_accepts(llm)
    outs = llm.generate(prompts, params)
    for o, p, sp in zip(outs, prompts, params):
        assert o.token_ids == tiny.oracle(t, p, sp.max_tokens, stop_ids=sp.stop_token_ids)
    assert any(a > 0 for a in raw), "nothing was ever accepted"
    cut = [o for o, sp in zip(outs, params) if len(o.token_ids) == sp.max_tokens]
    assert cut, "no output ended at its max_tokens limit"
    for o in outs:
        assert o.num_accepted <= o.num_drafted
        assert o.num_accepted + (o.num_rounds - 1) <= len(o.token_ids), o
    s = llm.stats
    assert s.accepted == sum(o.num_accepted for o in outs)
    assert s.generated == sum(len(o.token_ids) for o in outs)
    assert s.accepted + s.row_rounds - len(outs) <= s.generated
    assert 1.0 <= s.mean_accepted_length <= 6.0


# --------------------------------------------------------------------------------------------- prompt types
@pytest.mark.parametrize("prompt", [
    {5: 1, 6: 2}, b"\x05\x06\x07", [5, 5.9, 7], [True, 6, 7], [5, 6, False], ["5", "6"], {5, 6, 7},
    torch.tensor([5.0, 6.0]), torch.tensor([[5, 6, 7]]), [[5, 6, 7]], None, 5,
], ids=["dict", "bytes", "float", "bool-true", "bool-false", "str-tokens", "set", "float-tensor", "2d-tensor",
        "nested-list", "none", "int"])
def test_prompts_of_wrong_types_are_refused(prompt):
    t = tiny.target()
    llm = tiny.fixed_llm(t, draft="prompt-lookup")
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([[5, 6, 7], prompt], SamplingParams(max_tokens=3))
    assert _nothing_ran(llm)


def test_integer_tokens_of_other_types_are_accepted():
    np = pytest.importorskip("numpy")
    t = tiny.target()
    llm = tiny.fixed_llm(t, draft="prompt-lookup")
    want = tiny.oracle(t, [5, 6, 7, 5, 6], 6)
    prompts = [
        [np.int64(5), np.int64(6), np.int32(7), np.int64(5), np.int16(6)],
        np.array([5, 6, 7, 5, 6], dtype=np.int64),
        torch.tensor([5, 6, 7, 5, 6]),
        (5, 6, 7, 5, 6),
        [torch.tensor(5), 6, 7, 5, 6],
    ]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6))
    for o in outs:
        assert o.token_ids == want
        assert o.prompt_token_ids == [5, 6, 7, 5, 6] and all(type(x) is int for x in o.prompt_token_ids)


# ------------------------------------------------------------------------------------------- temperature
def test_temperature_too_small_for_the_dtype_is_refused_up_front():
    t32 = tiny.target(dtype=torch.float32)
    llm = tiny.fixed_llm(t32, draft=tiny.draft(dtype=torch.float32), num_draft_tokens=K)
    params = [SamplingParams(max_tokens=5, temperature=0.7, seed=1), SamplingParams(max_tokens=5, temperature=1e-40)]
    with pytest.raises(ValueError, match=r"prompt 1\b.*temperature"):
        llm.generate([[5, 6, 7], [8, 9, 10]], params)
    assert _nothing_ran(llm)

    t64 = tiny.target()
    llm = tiny.fixed_llm(t64, draft=tiny.draft(), num_draft_tokens=K)
    prompts = tiny.prompts(4, seed=95)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=1e-40, seed=3))
    # a temperature this small samples the argmax: the greedy oracle's tokens
    assert [o.token_ids for o in outs] == [tiny.oracle(t64, p, 8) for p in prompts]
    assert llm.stats.drafted > 0
