"""The speculation length policy: exactness with lengths that change every round (k = 0 included), the adaptive
policy's choices and its cost model, and injected faults still showing with it on."""

import copy
import itertools

import pytest
import tiny
import torch

import batchspec
from batchspec import SamplingParams
from batchspec.engine.names import split_speculation
from batchspec.speculation import AdaptiveLength, CostModel, RoundView, expected_tokens, get_policy
from batchspec.speculation.acceptance import Acceptance
from batchspec.speculation.adaptive import DRY_ROUNDS, LOOK_EVERY, LOOK_LONGEST, PROBE_EVERY
from batchspec.speculation.budget import DRAFT, DRY, FIXED, NO_DRAFTER, NO_ROOM, NOT_WORTH, PROBE, REASONS, Outcome
from batchspec.speculation.costs import CONTEXT, DRAFT_FORWARD_SECONDS, WIDTHS
from batchspec.speculation.fixed import FixedLength


class Scripted(FixedLength):
    """Lengths from a fixed cycle (clipped to what the round allows): k = 0 rounds among drafting ones."""

    name = "scripted"

    def __init__(self, cycle=(0, 3, 0, 0, 2, 1, 3, 3, 0, 1)):
        self.cycle = itertools.cycle(cycle)
        self.chosen = []

    def length(self, rows, k_max, sampling=False):
        self.chosen.append(min(next(self.cycle), k_max))
        return self.chosen[-1]


@pytest.mark.parametrize("layout", ["slotmask", "eqspec"])
@pytest.mark.parametrize("draft", ["model", "prompt-lookup"])
@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_changing_lengths_stay_exact(layout, draft, scheduler):
    """Lengths 0..3 in a fixed cycle, rows of 1-40 tokens joining (continuous) and leaving: every row equals the
    oracle and the invariants hold after every round, for the target and the draft model's caches."""
    t = tiny.target()
    policy = Scripted()
    llm = batchspec.LLM(t, draft=tiny.draft() if draft == "model" else draft, num_draft_tokens=3, layout=layout,
                        scheduler=scheduler, batch_size=3, check_invariants=True, speculation=policy)
    prompts = tiny.prompts(7, seed=31, lo=1, hi=40)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 16) for p in prompts]
    s = llm.stats
    assert s.lengths.get(0, 0) > 3 and sum(v for k, v in s.lengths.items() if k) > 3, s.lengths
    assert s.rounds_without_drafting == s.lengths[0]
    if draft == "model":  # (prompt lookup may find nothing to propose for these random prompts)
        assert s.ragged_rounds > 0 and s.full_accepts > 0
    if scheduler == "continuous":
        assert s.joined_running > 0
    # the draft model caught up after runs of k = 0 rounds: check some such run was followed by a drafting round
    runs = [len(list(g)) for k, g in itertools.groupby(policy.chosen) if k == 0]
    assert max(runs) >= 2


def test_draft_catches_up_in_one_forward_after_plain_steps(monkeypatch):
    """After three rounds without drafting, the draft model's next forward covers the missed tokens at once."""
    t, d = tiny.target(), tiny.draft()
    llm = batchspec.LLM(t, draft=d, num_draft_tokens=2, batch_size=2, check_invariants=True,
                        speculation=Scripted((0, 0, 0, 2)))
    widths = []
    real = llm.drafter.runner.forward

    def spy(cache, input_ids, *a, **k):
        widths.append(input_ids.shape[1])
        return real(cache, input_ids, *a, **k)

    monkeypatch.setattr(llm.drafter.runner, "forward", spy)
    prompts = [[5, 6, 7], [8, 9]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 12) for p in prompts]
    # prefill forwards, then per drafting round: catch-up (2 + 3 skipped rounds) and one draft step
    assert 5 in widths and widths.count(5) >= 2


def test_expected_tokens():
    e = expected_tokens(torch.tensor([0.0, 0.5, 1.0]), 3)
    torch.testing.assert_close(e[0], torch.ones(4, dtype=torch.float64))
    torch.testing.assert_close(e[1], torch.tensor([1, 1.5, 1.75, 1.875], dtype=torch.float64))
    assert e[2, 3] > 3.9  # a draft that is always right: about k + 1 tokens


synthetic = tiny.profile


def _policy(rate, profile, sizes_own=False):
    p = AdaptiveLength(profile)
    p.acceptance.rate, p.sizes_own = rate, sizes_own
    return p


class _Seqs:
    """What a budget reads of the running rows, for policy tests without an engine."""

    def __init__(self, rows=1, sampling=False):
        self.sampling = sampling
        self.limit = torch.full((rows,), 64)
        self.length = torch.full((rows,), 10)
        self.prompt_len = torch.full((rows,), 5)
        self.rounds = torch.full((rows,), 3)

    def generated(self):
        return self.length - self.prompt_len


def _view(rows=8, k_max=5, waiting=False, packed=0, sampling=False):
    return RoundView(rows, k_max, _Seqs(rows, sampling), waiting, packed)


def test_cost_model_reads_the_profile_in_plain_steps():
    """Verification costs in plain steps of the same rows: per row (a block k+1 wide for every row) or in all (a
    runner that packs: rows + m tokens); batch sizes between measured ones interpolated, beyond extrapolated; the
    drafter's step and a cached pair; the share of a plain step that does not grow with its rows."""
    c = CostModel(synthetic(fixed=0.02, per_token=0.002, step=0.001, pair=0.0005))
    assert c.plain(4) == pytest.approx(0.028)
    assert c.verify(4, 0, False) == pytest.approx(1.0)
    assert c.verify(4, 2, False) == pytest.approx((0.02 + 0.002 * 12) / 0.028)  # 3 tokens a row
    assert c.verify(4, 2, True) == pytest.approx((0.02 + 0.002 * 6) / 0.028)  # 2 drafts in all: 6 tokens
    assert c.plain(3) == pytest.approx(0.026) and c.plain(16) == pytest.approx(0.052)  # between; beyond
    assert c.verify(1, 9, False) == pytest.approx((0.02 + 0.002 * 10) / 0.022)  # past the widest: the line
    assert c.step(4) == pytest.approx((0.004 + DRAFT_FORWARD_SECONDS) / 0.028)  # the forward and its bookkeeping
    assert c.pair(4) == pytest.approx(0.002 / 0.028)
    assert c.fixed_share(8) == pytest.approx(1 - 0.002 * 8 / 0.036) and c.fixed_share(1) == 1.0
    assert CostModel(synthetic(rows=(1, 2))).step(2) == 0.0  # no drafter model


def test_rows_cached_tokens_price_a_round_from_the_profiles_two_contexts():
    """From a profile measured at two contexts: a plain step over rows holding more tokens than ``CONTEXT`` costs
    more (``base``, to every size of round), and each draft more by its own row's tokens (``per_draft``); a shorter
    row less. The sized budget carries them; a profile of one context prices rounds as before (no ``context``)."""
    c = CostModel(synthetic(fixed=0.02, per_token=0.002, attend=(1e-6, 5e-7)))
    lengths = torch.tensor([CONTEXT, CONTEXT + 1024, CONTEXT - 256, CONTEXT])
    base, per_draft = c.context(4, lengths)
    assert base.item() == pytest.approx((1024 - 256) * 1e-6 / 0.028)
    assert per_draft.tolist() == pytest.approx([0.0, 1024 * 5e-7 / 0.028, -256 * 5e-7 / 0.028, 0.0])
    p = _policy(0.5, c.profile, sizes_own=True)
    view = _view(rows=4, packed=64)
    view.seqs.length = lengths
    assert p.budget(view).context[1].tolist() == pytest.approx(per_draft.tolist())
    assert _policy(0.5, synthetic(), sizes_own=True).budget(view).context is None


def test_adaptive_picks_zero_when_acceptance_is_low_or_verification_dear():
    cheap = synthetic(per_token=0.0002, step=0.0001)
    dear = synthetic(per_token=0.02, step=0.0001)
    assert _policy(0.1, cheap).best_length(8, 5) == 0  # the draft is rarely right
    assert _policy(0.6, dear).best_length(8, 5) == 0  # each verified token costs about a plain step
    assert _policy(0.97, cheap).best_length(8, 5) == 5  # right almost always, verification cheap
    assert 0 < _policy(0.6, synthetic(per_token=0.0005, step=0.0005)).best_length(8, 5) < 5


def test_adaptive_uses_per_row_estimates():
    p = _policy(0.5, synthetic(per_token=0.0002))
    p.acceptance.expected = expected_tokens(torch.tensor([0.99, 0.99]), 5).mean(0).tolist()
    high = p.best_length(8, 5)
    p.acceptance.expected = expected_tokens(torch.tensor([0.05, 0.05]), 5).mean(0).tolist()
    assert high == 5 and p.best_length(8, 5) == 0


def _state(p) -> dict:
    """Everything an adaptive policy holds, as plain values."""
    out = {k: v for k, v in vars(p).items() if k not in ("costs", "acceptance")}
    return out | {"acceptance": dict(vars(p.acceptance)), "costs": copy.deepcopy(p.costs.profile.to_json())}


def test_budget_is_a_query():
    """Asking for a budget changes nothing: the same budget every time, the policy's state untouched."""
    for p, view in ((_policy(0.1, synthetic()), _view()), (_policy(0.5, synthetic(), sizes_own=True), _view()),
                    (_policy(0.5, synthetic(), sizes_own=True), _view(rows=4, packed=64))):
        p.idle, p.unverified = 7, 11
        before = _state(p)
        budgets = [p.budget(view) for _ in range(3)]
        assert all(b.k == budgets[0].k and b.reason == budgets[0].reason and b.verify == budgets[0].verify
                   for b in budgets)
        assert _state(p) == before


def _run(p, rounds, drafted=lambda n, b: 0, rows=8, k_max=5, kind=None):
    """Budgets of ``rounds`` rounds, each observed as drafting ``drafted(n, budget)`` in all (a round of ``kind``
    where it drafted)."""
    out = []
    for n in range(rounds):
        b = p.budget(_view(rows, k_max))
        out.append(b)
        d = drafted(n, b)
        p.observe(Outcome(rows, k_max, b, d, kind if d else None))
    return out


def test_a_draft_model_is_probed_after_rounds_without_drafting():
    """Length 0 round after round: every ``PROBE_EVERY``-th round drafts one token a row, so the acceptance
    estimates stay current; while probes change nothing the wait doubles (up to ``PROBE_LONGEST`` times), and a
    round that drafts resets it."""
    p = _policy(0.05, synthetic())
    budgets = _run(p, 8 * PROBE_EVERY + 8 * PROBE_EVERY)
    probes = [i for i, b in enumerate(budgets) if b.reason == PROBE]
    assert all(b.k == 1 for b in budgets if b.reason == PROBE)
    assert all(b.k == 0 and b.reason == NOT_WORTH for b in budgets if b.reason != PROBE)
    assert probes[0] == PROBE_EVERY - 1
    assert [b - a for a, b in zip(probes, probes[1:])][:3] == [2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    p.acceptance.rate = 0.97  # it pays now: drafting every round, and the wait is back to PROBE_EVERY
    assert all(b.reason == DRAFT and b.k == 5 for b in _run(p, 3, lambda n, b: 8 * b.k))
    p.acceptance.rate = 0.05
    assert [b.reason for b in _run(p, PROBE_EVERY)][-1] == PROBE


def test_a_dry_drafter_is_asked_ever_less_often():
    """A drafter that sizes its own rounds and verified nothing for ``DRY_ROUNDS`` rounds in a row is asked again
    after ``LOOK_EVERY`` rounds, then after waits twice the last up to ``LOOK_LONGEST`` (the others are plain steps
    without its work); a round that verifies drafts has it asked every round again, the waits from the start."""
    p = _policy(0.5, synthetic(), sizes_own=True)
    assert not p.dry()
    rounds = DRY_ROUNDS + (1 + 2 + 4) * LOOK_EVERY + 3 * LOOK_LONGEST
    budgets = _run(p, rounds)
    assert p.dry()  # rows joining now leave their prompt for the drafter's next catch-up
    asked = [i for i, b in enumerate(budgets) if b.k]
    assert asked[:DRY_ROUNDS] == list(range(DRY_ROUNDS))
    waits = [b - a for a, b in zip(asked[DRY_ROUNDS - 1:], asked[DRY_ROUNDS:])]
    assert waits == [LOOK_EVERY, 2 * LOOK_EVERY, 4 * LOOK_EVERY] + [LOOK_LONGEST] * 3 and LOOK_LONGEST == 4 * LOOK_EVERY
    assert all(b.reason == DRY for b in budgets if not b.k)
    assert p.budget(_view(8, 5)).k == p.budget(_view(8, 5)).k  # a query: asking twice changes nothing
    _run(p, LOOK_LONGEST, lambda n, b: 2 if b.k else 0)  # asked within the longest wait, verifies: every round again
    assert [b.k > 0 for b in _run(p, 4, lambda n, b: 2, kind="head")] == [True] * 4
    assert not p.dry()
    again = [i for i, b in enumerate(_run(p, DRY_ROUNDS + 2 * LOOK_EVERY)) if b.k]
    assert again == list(range(DRY_ROUNDS)) + [DRY_ROUNDS + LOOK_EVERY - 1]  # the waits start again from LOOK_EVERY


def test_rows_joining_after_a_round_without_the_head_leave_their_prompt_waiting():
    """The head ran in the last round: rows joining cache their prompt's pairs; a round that ran no head (copies
    only, or a plain step: nothing promised it at this batch) has them wait for its next catch-up, which the plan
    prices, until a round runs the head again."""
    p = _policy(0.5, synthetic(), sizes_own=True)
    _run(p, 2, lambda n, b: 3, kind="head")
    assert not p.dry()
    _run(p, 1, lambda n, b: 3, kind="copy")
    assert p.dry() and p.unverified == 0
    _run(p, 1, lambda n, b: 3, kind="head")
    assert not p.dry()
    _run(p, 1)  # a round that drafted nothing
    assert p.dry()


def test_sized_budgets_carry_costs_per_row_or_per_width():
    """For a drafter that sizes its own rounds: per row where the runner packs K drafts for every row (the round's
    drafts in all, up to what it packs), with what each row's tokens are worth only while no request waits; per block
    width otherwise (one row, or a runner that does not pack); K when sampling, nothing at the context's end."""
    c = CostModel(synthetic(step=0.001, pair=0.0002))
    p = _policy(0.5, c.profile, sizes_own=True)
    b = p.budget(_view(rows=4, k_max=5, packed=4 + 12))
    assert b.per_row and b.reason == DRAFT and len(b.verify) == 13 and b.worth is not None and len(b.worth) == 4
    assert b.verify[3] == pytest.approx(c.verify(4, 3, True) + c.overhead(4)) and b.step == pytest.approx(c.step(4))
    assert b.verify[0] == 1.0  # a plain step has no drafting round's bookkeeping
    assert p.budget(_view(rows=4, k_max=5, packed=64, waiting=True)).worth is None
    b = p.budget(_view(rows=4, k_max=5, packed=4 + 3))  # the runner packs fewer than K a row: per width
    assert not b.per_row and b.verify == pytest.approx([c.verify(4, j, False) + (c.overhead(4) if j else 0)
                                                         for j in range(6)])
    b = p.budget(_view(rows=1, k_max=5, packed=256))
    assert not b.per_row and len(b.verify) == 6
    assert p.budget(_view(rows=4, sampling=True)).reason == FIXED and p.budget(_view(k_max=0)).reason == NO_ROOM


def test_one_slow_round_changes_no_cost():
    """Costs come from the profile: a round the machine slowed (or any outcome) leaves every later budget's costs as
    they were."""
    p = _policy(0.5, synthetic(), sizes_own=True)
    before = p.budget(_view(rows=4, packed=64)).verify
    for _ in range(5):
        p.observe(Outcome(4, 5, p.budget(_view(rows=4, packed=64)), 3))
    assert p.budget(_view(rows=4, packed=64)).verify == before


def test_profile_measured_once_then_read_from_the_cache(monkeypatch):
    """The first use measures the target (and the drafter's model) and writes the profile under the cache folder;
    later uses, in this process or another, read it; another thread count is another machine; costs never fall with
    the width or the rows; other kernels, another profile."""
    from batchspec.model.runner import Runner
    from batchspec.speculation import costs

    t, d = tiny.target(), tiny.draft()
    runner, drafter = Runner(t), batchspec.LLM(t, draft=d, speculation="fixed").drafter
    monkeypatch.setattr(costs, "_loaded", {})
    prof = costs.load_or_measure(runner, 4, drafter)
    assert sorted(prof.target) == [1, 2, 4] and all(len(v) == len(WIDTHS) for v in prof.target.values())
    for r, v in prof.target.items():
        assert v == sorted(v)
    assert [prof.target[r][0] for r in (1, 2, 4)] == sorted(prof.target[r][0] for r in (1, 2, 4))
    assert sorted(prof.step) == [1, 2, 4] and prof.pair > 0
    path = costs.profile_path(prof.key)
    assert path.is_file()
    monkeypatch.setattr(costs, "_loaded", {})
    monkeypatch.setattr(costs, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert costs.load_or_measure(runner, 4, drafter).target == prof.target  # read from the file
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert costs.profile_key(runner, drafter, 4) != prof.key
    finally:
        torch.set_num_threads(threads)
    assert costs.profile_key(runner, drafter, 8) != prof.key and costs.profile_key(runner, None, 4) != prof.key
    monkeypatch.setattr(costs.kernels, "source_digest", lambda: "other kernels")  # kernels changed: measured anew
    assert costs.profile_key(runner, drafter, 4) != prof.key


def test_rounds_are_counted_by_decision():
    """Every round is counted by what decided its budget; rounds that verified drafts are the ones counted "draft"
    (a budget the drafter sized to nothing counts as "not worth it")."""
    t = tiny.target()
    llm = batchspec.LLM(t, draft="prompt-lookup", num_draft_tokens=3, batch_size=4,
                        speculation=AdaptiveLength(synthetic(per_token=0.0001)))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9]] + tiny.prompts(2, seed=8)
    outs = llm.generate(prompts, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 16) for p in prompts]
    s = llm.stats
    assert sum(s.decisions.values()) == s.rounds and set(s.decisions) <= set(REASONS)
    assert s.decisions.get(DRAFT, 0) > 0 and s.drafted > 0
    assert s.decisions.get(DRAFT, 0) + s.rounds_without_drafting == s.rounds
    plain = batchspec.LLM(t)
    plain.generate(prompts, SamplingParams(max_tokens=4))
    assert plain.stats.decisions == {NO_DRAFTER: plain.stats.rounds}


def test_acceptance_estimates_come_from_the_rounds():
    """Running an engine fills the policy's per-row estimates; a draft equal to the target is estimated near 1, a
    random one near 0 (with fixed costs, the choices follow)."""
    t = tiny.target()
    prompts = tiny.prompts(4, seed=3)
    cheap = synthetic(per_token=0.0005, step=0.0005)
    good = AdaptiveLength(cheap)
    batchspec.LLM(t, draft=t, num_draft_tokens=4, batch_size=4, speculation=good).generate(
        prompts, SamplingParams(max_tokens=20))
    bad = AdaptiveLength(cheap)
    stranger = tiny.draft(noise=3.0)
    llm = batchspec.LLM(t, draft=stranger, num_draft_tokens=4, batch_size=4, speculation=bad)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 20) for p in prompts]
    assert good.acceptance.rate > 0.9 and good.acceptance.tokens(4) > 4 and bad.acceptance.rate < 0.4
    assert llm.stats.rounds_without_drafting > llm.stats.rounds // 2


@pytest.mark.parametrize("fault", ["bsp-stale-positions", "bsp-keep-rejected-kv", "dsd-draft-token-accepted",
                                   "dsd-unmasked-padding"])
def test_faults_show_through_with_the_adaptive_policy(fault):
    t, d = tiny.target(), tiny.draft()
    prompts = tiny.prompts(6, seed=5, lo=2, hi=30)
    llm = batchspec.LLM(t, draft=d, num_draft_tokens=3, batch_size=6, fault=fault,
                        speculation=AdaptiveLength(synthetic(per_token=0.0002, step=0.0002)))
    outs = llm.generate(prompts, SamplingParams(max_tokens=16))
    assert llm.stats.drafted > 0
    assert [o.token_ids for o in outs] != [tiny.oracle(t, p, 16) for p in prompts]


def test_names_and_defaults():
    assert batchspec.LLM(tiny.target()).parts.policy.name == "adaptive"
    assert get_policy("fixed").name == "fixed"
    with pytest.raises(ValueError, match="unknown speculation"):
        batchspec.LLM(tiny.target(), speculation="sometimes")
    assert split_speculation("fault:bsp-stale-positions:fixed") == ("fault:bsp-stale-positions", "fixed")
    assert split_speculation("fault:bsp-stale-positions") == ("fault:bsp-stale-positions", None)


def test_changing_lengths_keep_the_sampling_distribution():
    """Speculative sampling with lengths that change every round (0..3; the adaptive policy keeps K when sampling,
    so this covers any length policy): the first three tokens follow the exact distribution of plain sampling
    (chi-square at 1e-4; the same test rejects an injected sampler fault)."""
    from test_sampling_audit import small_draft, small_target

    from batchspec.audit.distribution import compare, exact_distribution

    t = small_target()
    prompt, n = [3, 9, 14, 2, 7, 1, 18, 11], 3
    ref = exact_distribution(t, prompt, 0.7, n_tokens=n, coverage=0.999, max_cells=1024)
    p_values = {}
    for fault in (None, "no-residual"):
        llm = batchspec.LLM(t, draft=small_draft(), num_draft_tokens=3, batch_size=250, fault=fault,
                            speculation=Scripted((0, 3, 1, 2, 0, 3)))
        outs = llm.generate([prompt] * 1500, [SamplingParams(max_tokens=n, temperature=0.7, seed=40_000 + i)
                                              for i in range(1500)])
        assert llm.stats.lengths.get(0, 0) and llm.stats.lengths.get(3, 0)
        p_values[fault] = compare(ref, [o.token_ids for o in outs], n).p_value
    assert p_values[None] > 1e-4 and p_values["no-residual"] < 1e-6, p_values


def test_prior_is_the_drafters_long_run_rate():
    """The prior blended into each row's estimate is the mean over drafting rounds, then a slow moving average: two
    unlucky rounds barely move it, and rounds without drafting (whose evidence is stale) do not move it at all."""
    a = Acceptance()
    for _ in range(40):  # drafting rounds whose rows' evidence says ~0.4
        a.update([1.0, 1.4, 1.5, 3.0, 5.0], drafted=True)
    assert a.rate == pytest.approx(0.4, abs=0.01)
    for _ in range(2):  # two rounds in which every draft was rejected
        a.update([1.0, 1.1, 1.1, 0.0, 4.0], drafted=True)
    assert 0.35 < a.rate < 0.4
    before = a.rate
    for _ in range(30):
        a.update([1.0, 1.1, 1.1, 0.0, 4.0], drafted=False)
    assert a.rate == before


def test_drafters_draft_exactly_the_plan():
    """A drafter given a plan drafts exactly its counts, whatever its candidates promise: prompt lookup the first
    ``plan.drafts`` of each row's candidates (none for a row whose count is 0 though it has a match), the draft model
    ``plan.width`` a row."""
    from types import SimpleNamespace

    from batchspec.drafters import ModelDrafter, PromptLookup
    from batchspec.speculation.plan import DraftPlan

    rows = [[1, 2, 3, 4, 30, 31, 32, 33, 1, 2, 3, 4], [5, 6, 7, 8, 9, 5, 6], [7, 8, 40, 41, 42, 7, 8]]
    hist = torch.zeros((3, 20), dtype=torch.long)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = torch.tensor(r)
    seqs = SimpleNamespace(history=hist, length=torch.tensor([len(r) for r in rows]), sampling=False, processors=set())
    d = PromptLookup()
    offer = d.offer(seqs, None, 4)
    assert offer.count.tolist() == [4, 4, 4]
    for counts in ([0, 3, 1], [2, 2, 2], [4, 0, 0]):
        n = torch.tensor(counts)
        p = d.propose(seqs, None, DraftPlan(offer, None, n, max(counts), DRAFT))
        assert p.n_drafts.tolist() == counts and p.drafts.shape[1] == max(counts)
        for i, c in enumerate(counts):
            assert p.drafts[i, :c].tolist() == offer.candidates[i, :c].tolist()
    m = ModelDrafter(tiny.draft())
    state = m.prefill(rows)
    offer = m.offer(seqs, state, 3)
    assert offer.candidates is None
    p = m.propose(seqs, state, DraftPlan(offer, None, torch.full((3,), 2), 2, DRAFT))
    assert p.n_drafts.tolist() == [2, 2, 2] and p.drafts.shape == (3, 2)
