"""Schedulers: continuous batching splices waiting requests into the running batch and stays exact."""

import itertools

import pytest
import tiny

import batchspec
from batchspec.engine.schedulers import Continuous, ExSpec, Static

PROMPTS = tiny.prompts(13, seed=9) + [[4]]
MAX = [3, 25, 8, 14, 1, 20, 6, 25, 11, 2, 17, 9, 25, 5]


@pytest.mark.parametrize("layout,bs,drafter", list(itertools.product(
    ["slotmask", "eqspec"], [1, 3, 5], ["model", "prompt-lookup", "none"])))
def test_continuous_matches_oracle(layout, bs, drafter):
    t, d = tiny.target("llama"), tiny.draft("llama")
    draft = {"model": d, "prompt-lookup": "prompt-lookup", "none": None}[drafter]
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, layout=layout, scheduler="continuous",
                        batch_size=bs, check_invariants=True)
    outs = llm.generate(PROMPTS, [batchspec.SamplingParams(max_tokens=m) for m in MAX])
    assert [o.prompt_token_ids for o in outs] == PROMPTS  # input order
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, m) for p, m in zip(PROMPTS, MAX)]
    if bs > 1:
        assert llm.stats.joined_running > 0, "no request joined a running batch"


def test_static_never_joins_running():
    t, d = tiny.target("llama"), tiny.draft("llama")
    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=3, scheduler="static", batch_size=4)
    llm.generate(PROMPTS, [batchspec.SamplingParams(max_tokens=m) for m in MAX])
    assert llm.stats.joined_running == 0


def test_continuous_with_stop_tokens_and_faults_detected():
    """A join on a batch with holes and padding stays exact; an injected fault still shows under continuous."""
    t, d = tiny.target("llama"), tiny.draft("llama")
    want = [tiny.oracle(t, p, 20, stop_ids=[7, 30]) for p in PROMPTS]
    sp = batchspec.SamplingParams(max_tokens=20, stop_token_ids=[7, 30])
    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=4, scheduler="continuous", batch_size=4, check_invariants=True)
    assert [o.token_ids for o in llm.generate(PROMPTS, sp)] == want
    bad = tiny.fixed_llm(t, draft=d, num_draft_tokens=4, scheduler="continuous", batch_size=4,
                        fault="bsp-stale-positions")
    assert [o.token_ids for o in bad.generate(PROMPTS, sp)] != want


@pytest.mark.parametrize("layout,bs,window,drafter", [
    ("slotmask", 3, 4, "model"), ("eqspec", 3, 4, "model"), ("slotmask", 2, 2, "prompt-lookup"),
    ("eqspec", 4, 3, "prompt-lookup"), ("slotmask", 5, 2, "none"), ("eqspec", 1, 4, "model"),
])
def test_exspec_matches_oracle(layout, bs, window, drafter):
    t, d = tiny.target("llama"), tiny.draft("llama")
    draft = {"model": d, "prompt-lookup": "prompt-lookup", "none": None}[drafter]
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, layout=layout, scheduler=ExSpec(window=window),
                        batch_size=bs, check_invariants=True)
    outs = llm.generate(PROMPTS, [batchspec.SamplingParams(max_tokens=m) for m in MAX])
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, m) for p, m in zip(PROMPTS, MAX)]
    s = llm.stats
    assert s.grouped_rounds + s.fallback_rounds == s.rounds
    if bs > 1:
        assert s.fallback_rounds > 0 and s.joined_running > 0  # mixed batches were realigned; requests joined
        assert s.row_rounds <= bs * s.rounds and s.schedule > 0  # batches drawn from a larger window


def _grouping_rate(prompts, draft, bs):
    t = tiny.target("llama")
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, scheduler="exspec", batch_size=bs, check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 12) for p in prompts]
    return llm.stats.grouping_rate


def test_exspec_groups_identical_lengths():
    """The paper's experiment in small: prompts truncated to one length group far more often than random lengths."""
    same = [p[:12] for p in tiny.prompts(24, seed=4, lo=12, hi=60)]
    rand = tiny.prompts(24, seed=4, lo=1, hi=60)
    assert _grouping_rate(same, None, 4) == 1.0  # plain decoding: a group advances in step, always one length
    assert _grouping_rate(same, tiny.draft("llama"), 4) >= 0.2
    assert _grouping_rate(rand, tiny.draft("llama"), 4) <= 0.1
    assert _grouping_rate(rand, None, 4) <= 0.2


def test_exspec_select_serves_full_groups_and_bounds_waiting():
    s = ExSpec(window=4, max_wait=3)
    rows, grouped = s.select([5, 7, 7, 9, 7, 5], 3)
    assert rows == [1, 2, 4] and grouped
    rows, grouped = s.select([5, 9, 9, 9, 9, 5], 3)  # rows 0 and 5 now wait 2 rounds
    assert rows == [1, 2, 3] and grouped
    rows, grouped = s.select([5, 10, 10, 10, 9, 5], 3)
    assert rows == [1, 2, 3]
    rows, grouped = s.select([5, 11, 11, 11, 9, 5], 3)  # rows 0 and 5 waited 3 rounds: served first, in a fallback
    assert rows == [0, 1, 5] and not grouped
    assert s.waits == [0, 0, 1, 1, 3, 0]
    s.forget([0, 4])
    assert s.waits == [0, 3]
    assert s.select([3, 4], 3) == (None, False)  # fewer rows than a batch: all run
    with pytest.raises(ValueError, match="window must be an integer >= 1"):
        ExSpec(window=0)


def test_exspec_with_stop_tokens_and_a_fault():
    """Stop tokens mid-block under exspec stay exact; an injected fault still shows through the window's copies."""
    t, d = tiny.target("llama"), tiny.draft("llama")
    seen = [tok for p in PROMPTS for tok in tiny.oracle(t, p, 20)[2:14]]
    stop = max(set(seen), key=seen.count)  # a token the oracle emits mid-output in several rows
    want = [tiny.oracle(t, p, 20, stop_ids=[stop]) for p in PROMPTS]
    sp = batchspec.SamplingParams(max_tokens=20, stop_token_ids=[stop])
    llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=4, scheduler=ExSpec(window=3), batch_size=3,
                        check_invariants=True)
    outs = llm.generate(PROMPTS, sp)
    assert [o.token_ids for o in outs] == want
    assert sum(o.finish_reason == "stop" for o in outs) >= 3 and llm.stats.fallback_rounds > 0
    bad = tiny.fixed_llm(t, draft=d, num_draft_tokens=4, scheduler="exspec", batch_size=3, fault="bsp-keep-rejected-kv")
    assert [o.token_ids for o in bad.generate(PROMPTS, sp)] != want


@pytest.mark.parametrize("scheduler", [Continuous(), ExSpec(window=2)])
def test_admit_keeps_to_the_prompt_token_budget_while_rows_run(scheduler):
    """``admit``'s token budget: with rows running, requests join in order while their prompts fit it, and at least
    one joins however long its prompt; with nothing running (a batch starting) or no budget, the scheduler's room is
    all that counts."""
    assert scheduler.room(1, 8) >= 7
    assert scheduler.admit(0, [50] * 20, 8, token_budget=30) == min(20, scheduler.room(0, 8))  # nothing runs
    assert scheduler.admit(1, [12] * 20, 8) == scheduler.room(1, 8)  # no budget
    assert scheduler.admit(1, [12] * 20, 8, token_budget=30) == 2  # 12 + 12 fit 30, a third does not
    assert scheduler.admit(1, [10] * 20, 8, token_budget=30) == 3  # exactly the budget fits
    assert scheduler.admit(1, [40, 2, 2], 8, token_budget=30) == 1  # a long prompt still joins, alone
    assert scheduler.admit(1, [2, 40, 2], 8, token_budget=30) == 1  # then the long one waits while rows run
    assert scheduler.admit(1, [], 8, token_budget=30) == 0
    assert scheduler.admit(7, [2] * 20, 8, token_budget=30) == scheduler.room(7, 8)  # the room still bounds it


def test_static_admits_a_full_batch_only_when_nothing_runs():
    assert Static().admit(0, [50] * 6, 4, token_budget=30) == 4  # a batch starting: no budget
    assert Static().admit(0, [5] * 2, 4) == 2
    assert Static().admit(1, [5] * 6, 4, token_budget=30) == Static().admit(1, [5] * 6, 4) == 0
