"""Schedulers: continuous batching splices waiting requests into the running batch and stays exact."""

import itertools

import pytest

import batchspec
import tiny

PROMPTS = tiny.prompts(13, seed=9) + [[4]]
MAX = [3, 25, 8, 14, 1, 20, 6, 25, 11, 2, 17, 9, 25, 5]


@pytest.mark.parametrize("layout,bs,drafter", list(itertools.product(
    ["slotmask", "eqspec"], [1, 3, 5], ["model", "prompt-lookup", "none"])))
def test_continuous_matches_oracle(layout, bs, drafter):
    t, d = tiny.target("llama"), tiny.draft("llama")
    draft = {"model": d, "prompt-lookup": "prompt-lookup", "none": None}[drafter]
    llm = batchspec.LLM(t, draft=draft, num_draft_tokens=3, layout=layout, scheduler="continuous",
                        batch_size=bs, check_invariants=True)
    outs = llm.generate(PROMPTS, [batchspec.SamplingParams(max_tokens=m) for m in MAX])
    assert [o.prompt_token_ids for o in outs] == PROMPTS  # input order
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, m) for p, m in zip(PROMPTS, MAX)]
    if bs > 1:
        assert llm.stats.joined_running > 0, "no request joined a running batch"


def test_static_never_joins_running():
    t, d = tiny.target("llama"), tiny.draft("llama")
    llm = batchspec.LLM(t, draft=d, num_draft_tokens=3, scheduler="static", batch_size=4)
    llm.generate(PROMPTS, [batchspec.SamplingParams(max_tokens=m) for m in MAX])
    assert llm.stats.joined_running == 0


def test_continuous_with_stop_tokens_and_faults_detected():
    """A join on a batch with holes and padding stays exact; an injected fault still shows under continuous."""
    t, d = tiny.target("llama"), tiny.draft("llama")
    want = [tiny.oracle(t, p, 20, stop_ids=[7, 30]) for p in PROMPTS]
    sp = batchspec.SamplingParams(max_tokens=20, stop_token_ids=[7, 30])
    llm = batchspec.LLM(t, draft=d, num_draft_tokens=4, scheduler="continuous", batch_size=4, check_invariants=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == want
    bad = batchspec.LLM(t, draft=d, num_draft_tokens=4, scheduler="continuous", batch_size=4,
                        fault="bsp-stale-positions")
    assert [o.token_ids for o in bad.generate(PROMPTS, sp)] != want
