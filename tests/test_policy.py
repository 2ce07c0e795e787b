"""The speculation length policy: exactness with lengths that change every round (k = 0 included), the adaptive
policy's choices and its cost model, and injected faults still showing with it on."""

import itertools
import math
import random

import pytest
import tiny
import torch

import batchspec
from batchspec import SamplingParams
from batchspec.engine.names import split_speculation
from batchspec.speculation import AdaptiveLength, FixedLength, expected_tokens, get_policy
from batchspec.speculation.row_values import FIXED_SHARE


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


def _learned(rate, t0, d):
    return AdaptiveLength(initial_rate=rate, costs=(t0, d))


def test_adaptive_picks_zero_when_acceptance_is_low_or_verification_dear():
    assert _learned(0.1, t0=0.05, d=0.02).length(8, 5) == 0  # the draft is rarely right
    assert _learned(0.6, t0=0.05, d=0.2).length(8, 5) == 0  # each drafted token costs 4 plain steps
    assert _learned(0.95, t0=0.05, d=0.002).length(8, 5) == 5  # right almost always, drafting cheap
    mid = _learned(0.6, t0=0.05, d=0.01).length(8, 5)
    assert 0 < mid < 5


def test_adaptive_uses_per_row_estimates():
    p = _learned(0.5, t0=0.05, d=0.005)
    p.expected = expected_tokens(torch.tensor([0.99, 0.99]), 5).mean(0).tolist()
    high = p.length(8, 5)
    p.expected = expected_tokens(torch.tensor([0.05, 0.05]), 5).mean(0).tolist()
    assert high == 5 and p.length(8, 5) == 0


def test_adaptive_measures_first_then_probes():
    p = AdaptiveLength()
    assert p.length(4, 5) == 0  # no cost known: a plain step first
    p.observe(4, 0, 1, 9.0, None)  # the first round pays one-time costs: not learned
    assert p.length(4, 5) == 0
    p.observe(4, 0, 1, 0.04, None)
    assert p.length(4, 5) == 1  # then one drafted token, for the cost of drafting
    p.observe(4, 1, 2, 0.05, None)
    assert p.cost(4) == pytest.approx((0.04, 0.0, 0.01))  # one width seen: all of the extra time per token
    p.rate = 0.05  # speculation does not pay: k = 0, with a one-token probe after probe_every rounds, then after
    chosen = [p.length(4, 5) for _ in range(8 * p.probe_every)]  # twice as many while the probes change nothing
    probes = [i for i, k in enumerate(chosen) if k]
    assert set(chosen) == {0, 1} and [b - a for a, b in zip(probes, probes[1:])] == [16, 32]
    p.rate = 0.97  # it pays: drafting, with a plain step now and then to keep the cost of one current
    chosen = [p.length(4, 5) for _ in range(4 * p.probe_every)]
    assert chosen.count(0) == 2 and max(chosen) == 5
    assert p.length(4, 5, sampling=True) == 5 and p.length(4, 0) == 0


def test_cost_model_converges_on_synthetic_timings():
    """Rounds timed as 30 ms, plus 6 ms when drafting at all and 4 ms + 1 ms per row for each token verified, with
    10% noise; a quarter of the rounds that offered drafts verify none (prompt lookup found no match): they cost a
    plain step and count as one. Per batch size T0 comes out within a few percent, and the extra cost of drafting
    rounds (a line over the last few rounds, so that it follows a drifting machine) within 30% at each width run; a
    batch size not seen borrows the nearest one's costs."""
    rng = random.Random(0)
    p = AdaptiveLength()
    for _ in range(600):
        rows, k = rng.choice([2, 8]), rng.choice([0, 0, 1, 3, 5])
        verified = k if rng.random() < 0.75 else 0
        true = 0.030 + (0.006 + verified * (0.004 + 0.001 * rows) if verified else 0.0)
        p.observe(rows, k, verified + 1, true * rng.uniform(0.9, 1.1), None)
    for rows in (2, 8):
        t0, f, d = p.cost(rows)
        assert t0 == pytest.approx(0.030, rel=0.08)
        assert d == pytest.approx(0.004 + 0.001 * rows, rel=0.25)
        for x in (1, 3, 5):
            assert f + x * d == pytest.approx(0.006 + x * (0.004 + 0.001 * rows), rel=0.3)
    assert p.cost(7) == (None, *p.cost(8)[1:])  # a batch size not seen: a plain round first, for its own T0
    assert p.length(7, 5) == 0
    p.observe(7, 0, 1, 0.029, None)
    assert p.cost(7) == (0.029, *p.cost(8)[1:])  # drafting's costs borrowed from the nearest size


def test_drafter_costs_come_per_block_width():
    """For prompt lookup the policy reports what a round of each block width cost (relative to a plain step),
    measured where that width ran, from the fitted line where it did not; none before a plain step was timed."""
    p = AdaptiveLength(explore=0.0)  # measured costs as they are
    assert p.drafter_length(1, 5) == (0, None)
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    k, costs = p.drafter_length(1, 5)
    # no drafting round yet: the drafter's prior for one draft, wider blocks not before narrower ones were priced
    assert k == 5 and costs[0] == 1.0 and costs[1] is None and costs[2:] == [math.inf] * 4
    p.observe(1, 5, 2, 0.0104, None)
    assert p.drafter_length(1, 5)[1][2:] == [pytest.approx(1.08)] + [math.inf] * 3  # the line from width 2
    for _ in range(30):  # a CPU at batch 1: wider blocks nearly free up to 3 drafts, then dear
        for width, secs in ((1, 0.0100), (3, 0.0105), (4, 0.0110), (6, 0.0200)):
            p.observe(1, 5, width, secs, None)  # a round that verified nothing is a plain step
    k, costs = p.drafter_length(1, 5)
    assert costs[0] == 1.0 and costs[2] == pytest.approx(1.05) and costs[3] == pytest.approx(1.1)
    assert costs[5] == pytest.approx(2.0) and p.cost(1)[0] == pytest.approx(0.010)
    t0, f, d = p.cost(1)
    assert costs[1] == pytest.approx(1.04) and costs[4] == pytest.approx(1 + (f + 4 * d) / t0)  # width 5: the line
    assert p.drafter_length(3, 5) == (0, None)  # a batch size not seen: a plain round first (its own T0) ...
    p.observe(3, 0, 1, 0.012, None)
    # ... then none of batch 1's widths: too far off (a CPU's steps there are bound by reading the weights)
    assert p.drafter_length(3, 5)[1] == [1.0, None] + [math.inf] * 4
    p.observe(3, 5, 3, 0.018, None)
    p.observe(4, 0, 1, 0.013, None)
    assert p.drafter_length(4, 5)[1][2] == pytest.approx(1.5)  # batch 3's width 3 serves batch 4 (within a third)
    assert FixedLength().drafter_length(1, 4) == (4, [1.0] * 5)  # fixed: equal costs, every candidate offered


def test_rounds_sized_row_by_row_are_priced_from_the_line():
    """Rounds a drafter sized row by row (``step`` = rows: costs per drafts verified in all) are priced from the line
    through all of them, a size run once not at its own round's cost less the exploration discount; the sizes
    measured still bound how far beyond them a round may go (one draft a row)."""
    p = AdaptiveLength()
    p.observe(8, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(8, 0, 1, 0.020, None)
    p.observe(8, 40, 6 + 1, 0.0306, None)  # size 6 ran once, slowly: 1.53 plain steps where the line says 1.3
    for _ in range(10):
        for m in (4, 8):  # 1 ms per draft verified
            p.observe(8, 40, m + 1, 0.020 + 0.001 * m, None)
    costs = p.drafter_length(8, 40, step=8)[1]
    assert costs[6] == pytest.approx(1.3, rel=0.05) and costs[16] == pytest.approx(1.8, rel=0.05)
    assert costs[17:] == [math.inf] * 24  # more than a draft a row beyond the widest measured (8)
    assert p.drafter_length(8, 40)[1][6] == pytest.approx(1.53 * 0.8)  # a width's own rounds, with step 1


def test_rounds_that_verify_nothing_are_plain_steps():
    """A drafter that sized its round to nothing ran a plain step: it times the plain step (the slow first round at a
    batch size fades) and fits no drafting line (which, fed only such rounds, would price every width as free)."""
    p = AdaptiveLength(smoothing=1.0)
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    p.observe(1, 5, 1, 0.012, None)
    assert p.cost(1) == (0.012, None, None)
    assert p.drafter_length(1, 3) == (3, [1.0, None, math.inf, math.inf])


def test_a_catch_up_round_does_not_price_the_other_kinds():
    """A head catching up on a long prompt costs 3 plain steps once: its kind's line, not the head's or the copies'
    (which, priced from it, would never be tried again)."""
    p = AdaptiveLength(explore=0.0)  # measured costs as they are
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    p.observe(1, 5, 2, 0.030, None, "catch-up")
    costs = p.drafter_length(1, 5, ("copy", "head", "catch-up"))[1]
    assert costs["catch-up"][1] == pytest.approx(3.0) and costs["catch-up"][2] == pytest.approx(5.0)
    assert costs["head"][1] is None and costs["copy"][1] is None


def test_a_catch_up_round_is_priced_per_pair_over_a_head_round():
    """A round that caches 100 waiting pairs on top of a head round of width 3 (1.2 plain steps) and took 2.2 costs
    0.01 a pair: what a later catch-up costs scales with its own wait, not with that round's."""
    p = AdaptiveLength(explore=0.0)
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    kinds = ("copy", "head", "catch-up")
    assert p.drafter_length(1, 5, kinds)[1]["work"] == {kind: None for kind in kinds}
    p.observe(1, 5, 3, 0.012, None, "head")
    p.observe(1, 5, 3, 0.022, None, "catch-up", work=100, base="head")
    assert p.drafter_length(1, 5, kinds)[1]["work"]["catch-up"] == pytest.approx(0.01)
    p.observe(1, 5, 3, 0.0125, None, "catch-up", work=10, base="head")  # a short wait: 0.005 a pair
    assert p.drafter_length(1, 5, kinds)[1]["work"]["catch-up"] == pytest.approx(0.0075)
    # without a head round of that width or a head line, nothing to measure against
    q = AdaptiveLength(explore=0.0)
    q.observe(1, 0, 1, 9.0, None)
    q.observe(1, 0, 1, 0.010, None)
    q.observe(1, 5, 3, 0.022, None, "catch-up", work=100, base="head")
    assert q.drafter_length(1, 5, kinds)[1]["work"]["catch-up"] is None


def test_one_slow_round_does_not_price_a_width_out_of_reach():
    """A width measured once at 1.55 plain steps (a round the machine slowed) is taken at 0.8x that until measured
    again, the mean of its first rounds then replacing the slow one, the discount shrinking as 1/rounds."""
    p = AdaptiveLength()
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    p.observe(1, 5, 3, 0.0155, None, "head")
    assert p.drafter_length(1, 5, ("head",))[1]["head"][2] == pytest.approx(1.55 * 0.8)
    p.observe(1, 5, 3, 0.0125, None, "head")
    assert p.drafter_length(1, 5, ("head",))[1]["head"][2] == pytest.approx(1.4 * (1 - 0.2 / 2))
    for _ in range(98):
        p.observe(1, 5, 3, 0.0125, None, "head")
    assert p.drafter_length(1, 5, ("head",))[1]["head"][2] == pytest.approx(1.25 * 0.998, rel=1e-3)


def test_a_drafter_priced_out_is_probed_on_its_own_prior():
    """One slow round priced every size out of reach (2 plain steps a draft) and nothing would draft again to correct
    it: after ``probe_every`` rounds that verified nothing, one small round (half a draft a row, at least one) is
    priced by the drafter's own prior and measured; while only probes draft the wait doubles, up to 8x, and a round
    that drafts of its own accord resets it. Per kind for a drafter with kinds."""
    p = AdaptiveLength(explore=0.0, probe_every=4)
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    p.observe(1, 5, 2, 0.030, None)  # a slow minute: 2 plain steps a draft

    def rounds_to_a_probe(kinds=None, step=1):
        for n in range(100):
            k, costs = p.drafter_length(1, 5, kinds, step)
            small = [1.0] + [None] * max(1, step // 2) + [math.inf] * (5 - max(1, step // 2))
            if k and costs == small:  # the drafter's prior, a small round
                return n
            if k and kinds and all(costs[kind] == small for kind in kinds):
                assert costs["work"] == {kind: None for kind in kinds}
                return n
            if k and not kinds:
                assert costs[1] > 1.9  # priced from the slow rounds: the drafter verifies nothing
            p.observe(1, 5, 1, 0.010, None)  # a round sized to nothing (or the plain step the policy asks for)

    gaps = []
    for _ in range(5):
        gaps.append(rounds_to_a_probe())
        p.observe(1, 5, 2, 0.030, None)  # the probe drafted, as dear as before
    # (one more where the plain step the policy asks for every 2 x probe_every rounds fell in the probe's place)
    assert gaps[:3] == [4, 8, 16] and all(g in (32, 33) for g in gaps[3:]), gaps
    p.observe(1, 5, 2, 0.0105, None)  # a round drafted of its own accord
    p.observe(1, 5, 2, 0.030, None, "copy")  # and two slow ones of each kind
    p.observe(1, 5, 2, 0.030, None, "head")
    assert rounds_to_a_probe(("copy", "head")) == 4
    p.observe(1, 5, 1, 0.010, None)  # the probe verified nothing
    p.observe(1, 5, 2, 0.0105, None)  # a round drafted of its own accord
    assert rounds_to_a_probe(step=4) == 4  # rows sized one by one (4 rows): at most 2 drafts in all


def test_plain_step_asked_for_only_when_none_came_of_itself():
    """A drafter that sizes its rounds gets a plain step (k = 0) after 2 x ``probe_every`` rounds in a row that
    drafted, to keep the plain step's cost fresh; a round it sized to nothing measured one already, so the count
    starts again from there."""
    p = AdaptiveLength(explore=0.0, probe_every=4)
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)

    def plain_steps(rounds, sized_to_nothing=()):
        asked = []
        for n in range(rounds):
            k, _ = p.drafter_length(1, 5)
            if not k:
                asked.append(n)
            p.observe(1, k, 1 if not k or n in sized_to_nothing else 2, 0.010 if not k else 0.011, None)
        return asked

    assert plain_steps(24) == [7, 15, 23]
    assert plain_steps(24, sized_to_nothing={5}) == [13, 21]  # 8 drafting rounds after round 5, not 7 after 23
    assert plain_steps(24, sized_to_nothing={2, 9, 16}) == []  # never 8 in a row


def test_drafter_asked_every_few_rounds_while_nothing_is_verified():
    """After ``probe_every`` rounds in a row that verified nothing, the drafter is asked every ``look_every``-th round
    only (the others are plain steps, without its work); a round that verifies drafts has it asked every round again."""
    def asked(rounds, verified=()):
        p = AdaptiveLength(explore=0.0, probe_every=4, look_every=3)
        p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
        p.observe(1, 0, 1, 0.010, None)
        p.unverified, p.dry_interval = 0, 10 ** 6  # counted from here; no probes on the drafter's own prior
        out = []
        for n in range(rounds):
            k, _ = p.drafter_length(1, 5)
            if k:
                out.append(n)
            p.observe(1, k, 2 if k and n in verified else 1, 0.010, None)
        return out

    assert asked(16) == [0, 1, 2, 3, 6, 9, 12, 15]
    # the round asked at 6 verified drafts: asked every round again, and (drafting resumed) 4 dry rounds later a probe
    # on the drafter's own prior (11)
    assert asked(16, verified={6}) == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11, 13]
    assert AdaptiveLength(look_every=1).look_every == 1  # asked every round: the classic behaviour


def test_fixed_share_from_plain_steps_at_two_sizes():
    """The share of a step that does not grow with its rows: a line through plain steps at the batch's size and at
    the smallest size measured at most half of it; the prior until there is one."""
    p = AdaptiveLength()
    assert p.fixed_share(8) == FIXED_SHARE and FixedLength().fixed_share(8) == FIXED_SHARE
    p.t0 = {8: 0.031, 6: 0.030}
    assert p.fixed_share(8) == FIXED_SHARE  # 6 rows is too close to 8 to tell
    p.t0[3] = 0.0248
    assert p.fixed_share(8) == pytest.approx(1 - (0.031 - 0.0248) / 5 * 8 / 0.031)
    p.t0[1] = 0.0227  # the smallest counts
    assert p.fixed_share(8) == pytest.approx(1 - (0.031 - 0.0227) / 7 * 8 / 0.031)
    p.t0 = {8: 0.031, 2: 0.040}  # a slower small batch (the machine drifted): nothing grows with the rows
    assert p.fixed_share(8) == 1.0


def test_drafter_costs_are_relative_to_the_plain_step_of_their_time():
    """The machine slows down 1.5x after width 6 was last run: width 6 keeps its cost relative to a plain step (2x),
    instead of looking cheap against the slower step."""
    p = AdaptiveLength(smoothing=1.0, width_smoothing=1.0, explore=0.0)
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    p.observe(1, 5, 6, 0.020, None)
    p.observe(1, 0, 1, 0.015, None)
    p.observe(1, 5, 3, 0.0165, None)
    costs = p.drafter_length(1, 5)[1]
    assert costs[5] == pytest.approx(2.0) and costs[2] == pytest.approx(1.1)


def test_stale_width_costs_are_measured_afresh():
    """A width measured while the machine was slow (3x) and not chosen since is forgotten after ``stale`` rounds
    (with its kind's line), and its next round replaces the old cost instead of averaging with it. Per kind of round,
    for a drafter with kinds: each kind's line prices only its own widths."""
    p = AdaptiveLength(stale=10, explore=0.0, probe_every=100)  # no probe on the drafter's prior in between
    p.observe(1, 0, 1, 9.0, None)  # one-time costs: not learned
    p.observe(1, 0, 1, 0.010, None)
    p.observe(1, 5, 3, 0.030, None, "head")  # a slow minute
    p.observe(1, 5, 2, 0.0105, None, "copy")
    costs = p.drafter_length(1, 5, ("copy", "head"))[1]
    assert costs["head"][2] == pytest.approx(3.0) and costs["copy"][1] == pytest.approx(1.05)
    assert costs["head"][1] == pytest.approx(2.0) and costs["head"][3] == pytest.approx(4.0)  # the head's line
    assert costs["copy"][2] == pytest.approx(1.1) and costs["copy"][3] == math.inf  # the copies' line; not yet
    for _ in range(9):
        p.observe(1, 0, 1, 0.010, None)
    assert p.drafter_length(1, 5, ("copy", "head"))[1]["head"][2] == pytest.approx(3.0)  # 10 rounds on: still fresh
    for _ in range(2):
        p.observe(1, 0, 1, 0.010, None)
    costs = p.drafter_length(1, 5, ("copy", "head"))[1]
    assert costs["head"][1] is None and costs["copy"][1] is None and costs["head"][2] == math.inf  # forgotten
    p.observe(1, 5, 3, 0.011, None, "head")
    assert p.drafter_length(1, 5, ("copy", "head"))[1]["head"][2] == pytest.approx(1.1)  # afresh, not averaged


def test_acceptance_estimates_come_from_the_rounds():
    """Running an engine fills the policy's per-row estimates; a draft equal to the target is estimated near 1, a
    random one near 0 (with fixed costs, the choices follow)."""
    t = tiny.target()
    prompts = tiny.prompts(4, seed=3)
    good = AdaptiveLength(costs=(0.05, 0.005))
    batchspec.LLM(t, draft=t, num_draft_tokens=4, batch_size=4, speculation=good).generate(
        prompts, SamplingParams(max_tokens=20))
    bad = AdaptiveLength(costs=(0.05, 0.005))
    stranger = tiny.draft(noise=3.0)
    llm = batchspec.LLM(t, draft=stranger, num_draft_tokens=4, batch_size=4, speculation=bad)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 20) for p in prompts]
    assert good.rate > 0.9 and good.tokens(4) > 4 and bad.rate < 0.4
    assert llm.stats.rounds_without_drafting > llm.stats.rounds // 2


@pytest.mark.parametrize("fault", ["bsp-stale-positions", "bsp-keep-rejected-kv", "dsd-draft-token-accepted",
                                   "dsd-unmasked-padding"])
def test_faults_show_through_with_the_adaptive_policy(fault):
    t, d = tiny.target(), tiny.draft()
    prompts = tiny.prompts(6, seed=5, lo=2, hi=30)
    llm = batchspec.LLM(t, draft=d, num_draft_tokens=3, batch_size=6, fault=fault,
                        speculation=AdaptiveLength(costs=(0.05, 0.002)))
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
    p = AdaptiveLength()
    for _ in range(40):  # drafting rounds whose rows' evidence says ~0.4
        p.observe(1, 2, 3, 0.01, [1.0, 1.4, 1.5, 3.0, 5.0])
    assert p.rate == pytest.approx(0.4, abs=0.01)
    for _ in range(2):  # two rounds in which every draft was rejected
        p.observe(1, 2, 3, 0.01, [1.0, 1.1, 1.1, 0.0, 4.0])
    assert 0.35 < p.rate < 0.4
    before = p.rate
    for _ in range(30):
        p.observe(1, 0, 1, 0.01, [1.0, 1.1, 1.1, 0.0, 4.0])
    assert p.rate == before
