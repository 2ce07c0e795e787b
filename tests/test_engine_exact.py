"""Greedy output equals HF generate at batch size 1, token for token, for every layout x batch size x K x drafter."""

import itertools

import pytest
import tiny
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchspec

PROMPTS = tiny.prompts(11, seed=3) + [[7], [5, 9]]  # lengths ~1..60, incl. 1- and 2-token prompts
MAX_TOKENS = 23  # not a multiple of K+1 for any K tested


def _stop_token(model):
    """A token the oracle emits mid-output for several prompts, so EOS falls inside verified blocks."""
    outs = [tiny.oracle(model, p, MAX_TOKENS) for p in PROMPTS]
    counts = {}
    for o in outs:
        for t in set(o[3:15]):
            counts[t] = counts.get(t, 0) + 1
    return max(counts, key=counts.get)


@pytest.fixture(scope="module", params=["llama"])
def setup(request):
    t, d = tiny.target(request.param), tiny.draft(request.param)
    eos = _stop_token(t)
    ref = {
        stop: [tiny.oracle(t, p, MAX_TOKENS, stop_ids=[eos] if stop else ()) for p in PROMPTS]
        for stop in (False, True)
    }
    return t, d, eos, ref


def run(t, draft, layout, bs, k, stop_ids=(), prompts=PROMPTS, max_tokens=MAX_TOKENS):
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=k, layout=layout, batch_size=bs, check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_ids)))
    return llm, outs


GRID = [
    (layout, bs, k, drafter)
    for layout, bs, k, drafter in itertools.product(
        ["eqspec", "slotmask"], [1, 2, 5, 8], [1, 3, 5], ["model", "prompt-lookup", "none"]
    )
    if drafter != "none" or k == 1  # plain decoding has no K
]


@pytest.mark.parametrize("layout,bs,k,drafter", GRID)
def test_matches_oracle(setup, layout, bs, k, drafter):
    t, d, eos, ref = setup
    draft = {"model": d, "prompt-lookup": "prompt-lookup", "none": None}[drafter]
    stop = (bs + k) % 2 == 0  # half the grid runs with an EOS that falls mid-output
    llm, outs = run(t, draft, layout, bs, k, stop_ids=[eos] if stop else ())
    assert [o.token_ids for o in outs] == ref[stop]
    for o, r in zip(outs, ref[stop]):
        assert o.finish_reason == ("stop" if stop and r[-1] == eos else "length")
        assert len(o.token_ids) <= MAX_TOKENS
    if drafter != "none":
        assert llm.stats.drafted > 0 and llm.stats.accepted > 0
    if drafter == "model" and bs > 1:
        assert llm.stats.ragged_rounds > 0, "rows never accepted different counts in the same round"
        assert llm.stats.full_accepts > 0, "no row ever accepted all K drafts (bonus after dK never ran)"


def test_eos_falls_mid_block(setup):
    t, d, eos, ref = setup
    llm, outs = run(t, d, "slotmask", 8, 5, stop_ids=[eos])
    assert [o.token_ids for o in outs] == ref[True]
    assert llm.stats.dropped_after_stop > 0, "no verified token was ever dropped after a stop token"
    assert any(o.finish_reason == "stop" for o in outs) and any(o.finish_reason == "length" for o in outs)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3"])
@pytest.mark.parametrize("layout", ["eqspec", "slotmask"])
def test_other_architectures(arch, layout):
    t, d = tiny.target(arch), tiny.draft(arch)
    ref = [tiny.oracle(t, p, MAX_TOKENS) for p in PROMPTS]
    for draft, bs, k in ((d, 5, 3), ("prompt-lookup", 8, 4), (None, 8, 1)):
        llm, outs = run(t, draft, layout, bs, k)
        assert [o.token_ids for o in outs] == ref, (arch, layout, draft, bs, k)
    llm, _ = run(t, d, layout, 8, 3)
    assert llm.stats.ragged_rounds > 0 and llm.stats.full_accepts > 0


def test_eager_attention_matches():
    t, d = tiny.target("llama", attn="eager"), tiny.draft("llama", attn="eager")
    ref = [tiny.oracle(t, p, MAX_TOKENS) for p in PROMPTS]
    for layout in ("eqspec", "slotmask"):
        _, outs = run(t, d, layout, 8, 4)
        assert [o.token_ids for o in outs] == ref


def test_slotmask_compacts_and_keeps_holes():
    """Both slotmask paths run: holes stay in place for a while, and compaction happens when they pile up."""
    t, d = tiny.target("llama"), tiny.draft("llama")
    from batchspec.engine.layouts import SlotMask

    calls = {"align": 0, "compact": 0}
    layout = SlotMask()
    original = layout.align

    def spy(state, width):
        before = state.width
        original(state, width)
        calls["align"] += 1
        calls["compact"] += state.width != before

    layout.align = spy
    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=5, batch_size=8, check_invariants=True)
    llm.parts.layout = layout
    outs = llm.generate(PROMPTS, batchspec.SamplingParams(max_tokens=40))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 40) for p in PROMPTS]
    assert 0 < calls["compact"] < calls["align"] / 2


def test_per_prompt_sampling_params_and_order(setup):
    t, d, eos, ref = setup
    params = [batchspec.SamplingParams(max_tokens=m) for m in (5, 1, 23, 9, 17, 2, 23, 11, 4, 23, 8, 3, 6)]
    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=3, batch_size=4, check_invariants=True)
    outs = llm.generate(PROMPTS, params)
    for o, p, r, sp in zip(outs, PROMPTS, ref[False], params):
        assert o.prompt_token_ids == p
        assert o.token_ids == r[: sp.max_tokens]
        assert o.finish_reason == "length"
    assert llm.stats.generated == sum(len(o.token_ids) for o in outs)


def test_ignore_eos_and_generation_config_eos(setup):
    t, d, eos, ref = setup
    t.generation_config.eos_token_id = [eos, 10_000 % tiny.VOCAB]
    try:
        want = [tiny.oracle(t, p, MAX_TOKENS, stop_ids=t.generation_config.eos_token_id) for p in PROMPTS]
        _, outs = run(t, d, "slotmask", 8, 3)
        assert [o.token_ids for o in outs] == want
        llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=3, batch_size=8)
        outs = llm.generate(PROMPTS, batchspec.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outs] == ref[False]
    finally:
        t.generation_config.eos_token_id = None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=9),
    k=st.integers(1, 6),
    bs=st.integers(1, 9),
    layout=st.sampled_from(["eqspec", "slotmask"]),
    drafter=st.sampled_from(["model", "prompt-lookup"]),
    eos=st.one_of(st.none(), st.integers(1, tiny.VOCAB - 1)),
    max_tokens=st.integers(1, 20),
    seed=st.integers(0, 10_000),
)
def test_property_matches_oracle(lengths, k, bs, layout, drafter, eos, max_tokens, seed):
    t, d = tiny.target("llama"), tiny.draft("llama")
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, tiny.VOCAB, (n,), generator=g).tolist() for n in lengths]
    stop = [eos] if eos is not None else []
    want = [tiny.oracle(t, p, max_tokens, stop_ids=stop) for p in prompts]
    _, outs = run(t, d if drafter == "model" else drafter, layout, bs, k, stop, prompts, max_tokens)
    assert [o.token_ids for o in outs] == want
