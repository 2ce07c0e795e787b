"""Prompt lookup chooses each row's draft length from its match: the longest earlier occurrence of the row's suffix
gives the candidates, and learned survival per (match length, draft index) decides how many to offer."""

import contextlib
from math import inf
from types import SimpleNamespace
from unittest import mock

import pytest
import tiny
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import batchspec
from batchspec.drafters import lookup
from batchspec.drafters.lookup import PromptLookup as Drafter
from batchspec.model import kernels
from batchspec.speculation.acceptance import PRIOR_WEIGHT, survival
from batchspec.speculation.budget import DRAFT, FIXED, DraftBudget
from batchspec.speculation.plan import MARGIN, Planner


class PromptLookup:
    """Prompt lookup as the engine runs it: it offers, the planner plans (``propose``) and learns (``commit``)."""

    def __init__(self, **kw):
        self.drafter, self.planner = Drafter(**kw), Planner()

    def propose(self, seqs, state, budget):
        self.plan = self.planner.plan(self.drafter.offer(seqs, state, budget.k), budget)
        return self.drafter.propose(seqs, state, self.plan)

    def commit(self, state, proposal, accepted, target):
        self.planner.learn(self.plan, proposal, accepted, target)

    def survival(self, k, device):
        return self.planner.copies.survival(k, device)

    @property
    def offered(self):
        return self.planner.copies.offered

    @property
    def hits(self):
        return self.planner.copies.hits


def B(k, verify=None, per_row=False, worth=None):
    """A round's budget: ``verify`` costs to size it by (None: every candidate up to k, as a fixed length)."""
    return DraftBudget(k, verify, per_row=per_row, worth=worth, reason=DRAFT if verify else FIXED)


def linear(per, n=6):
    return [1 + per * j for j in range(n)]


def _seqs(rows, sampling=False):
    width = max(map(len, rows))
    hist = torch.zeros((len(rows), width + 8), dtype=torch.long)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = torch.tensor(r)
    return SimpleNamespace(history=hist, length=torch.tensor([len(r) for r in rows]), sampling=sampling)


# row 0 ends with a 1-token match (9 ... 9), row 1 with a 4-token match (1 2 3 4 ... 1 2 3 4)
WEAK = [9, 20, 21, 22, 23, 24, 25, 26, 27, 9]
STRONG = [1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 1, 2, 3, 4]


def test_longest_match_and_its_continuation():
    p = _seqs([WEAK, STRONG]).__dict__
    d = PromptLookup()
    # nothing learned yet: a first copy starts at n / (n + 2) (1/3 after the 1-token match, 2/3 after the 4-token
    # one), each later index like the one before; at 0.2 plain steps per column the tokens per cost peak at 2
    # drafts (E(2) / 1.4 = 2.54 against E(1) / 1.2 = 2.50 and E(3) / 1.6 = 2.43)
    assert d.propose(SimpleNamespace(**p), None, B(5, linear(0.2))).n_drafts.tolist() == [2, 2]
    prop = d.propose(SimpleNamespace(**p), None, B(5))
    assert d.plan.offer.match.tolist() == [1, 4]
    assert prop.n_drafts.tolist() == [5, 5]
    assert prop.drafts[0].tolist() == [20, 21, 22, 23, 24] and prop.drafts[1].tolist() == [30, 31, 32, 33, 34]


def test_length_follows_what_each_match_length_earned():
    d, costs = PromptLookup(), B(5, linear(0.3))
    seqs = _seqs([WEAK, STRONG])
    for _ in range(20):  # weak matches: the first draft is always rejected; strong ones: all accepted
        prop = d.propose(seqs, None, costs)
        d.commit(None, prop, torch.tensor([0, 5]), None)
    prop = d.propose(seqs, None, costs)
    assert prop.n_drafts.tolist() == [5, 5]  # the strong row pays for the columns; the weak one rides along
    assert prop.drafts.shape[1] == 5
    alone = d.propose(_seqs([WEAK]), None, costs)  # a batch of weak matches only: a plain step
    assert alone.n_drafts.tolist() == [0] and alone.drafts.shape[1] == 0
    assert d.propose(seqs, None, B(5)).n_drafts.tolist() == [5, 5]  # a fixed length: every candidate up to K


def test_partial_survival_cuts_at_the_first_weak_index():
    d = PromptLookup()
    seqs = _seqs([STRONG])
    for _ in range(30):  # the first two drafts always accepted, the third never (every candidate offered)
        prop = d.propose(seqs, None, B(5))
        d.commit(None, prop, torch.tensor([2]), None)
    assert d.propose(seqs, None, B(5, linear(0.5))).n_drafts.tolist() == [2]
    s = d.survival(5, "cpu")[4]
    assert s[0] > 0.9 and s[1] > 0.9 and s[2] < 0.5 and (s[1:] <= s[:-1]).all()  # a product: never rises


def test_survival_multiplies_conditional_rates():
    """Half the rounds reject the first draft, the others accept all five: a draft after an accepted one was always
    accepted, so surviving five drafts is as likely as surviving one (counting the later drafts of rounds that had
    already failed as rejections would multiply the first failure in at every index)."""
    d = PromptLookup()
    seqs = _seqs([STRONG])
    for accepted in [0, 5] * 40:
        d.commit(None, d.propose(seqs, None, B(5)), torch.tensor([accepted]), None)
    s = d.survival(5, "cpu")[4]
    assert 0.4 < s[0] < 0.6 and s[4] > 0.9 * s[0], s
    assert d.offered[4].tolist() == [80, 40, 40, 40, 40] and d.hits[4].tolist() == [40] * 5


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10**7), min_size=1, max_size=12), min_size=1, max_size=9),
       st.floats(0.0, 1.0))
def test_survival_unrolled_equals_the_recurrence(columns, first):
    """The unrolled form against the recurrence it unrolls, one index at a time, on counts from none to millions."""
    offered = torch.tensor([sorted(c, reverse=True) + [0] * (12 - len(c)) for c in columns], dtype=torch.float64)
    hits = (offered * torch.rand(offered.shape, generator=torch.Generator().manual_seed(len(columns)),
                                 dtype=torch.float64)).floor()
    rate, cols = torch.full((len(columns),), first, dtype=torch.float64), []
    for j in range(offered.shape[1]):
        rate = (hits[:, j] + PRIOR_WEIGHT * rate) / (offered[:, j] + PRIOR_WEIGHT)
        cols.append(rate)
    expect = torch.stack(cols, 1).cumprod(1)
    torch.testing.assert_close(survival(hits, offered, first), expect, rtol=1e-9, atol=1e-300)
    per_row = torch.full((len(columns),), first, dtype=torch.float64)  # one start per leading index
    torch.testing.assert_close(survival(hits, offered, per_row), expect, rtol=1e-9, atol=1e-300)


def test_batch_width_weighs_every_row():
    """A column is verified when the rows' summed chances there cover its cost for the whole batch."""
    d = PromptLookup()
    strong, weak = _seqs([STRONG]), _seqs([WEAK])
    for _ in range(30):  # learn with every candidate offered
        d.commit(None, d.propose(strong, None, B(5)), torch.tensor([5]), None)  # strong matches: all accepted
        d.commit(None, d.propose(weak, None, B(5)), torch.tensor([0]), None)  # weak ones: none
    dear = B(5, linear(0.4))  # a column: 0.4 plain steps
    assert d.propose(_seqs([STRONG, WEAK]), None, dear).n_drafts.tolist() == [5, 5]  # (2 + 5) / 3 > 2 / 1
    assert d.propose(_seqs([STRONG] + [WEAK] * 3), None, dear).n_drafts.tolist() == [0] * 4  # (4 + 5) / 3 < 4 / 1
    cheaper = B(5, linear(0.2))  # (4 + 5) / 2 > 4 / 1
    assert d.propose(_seqs([STRONG] + [WEAK] * 3), None, cheaper).n_drafts.tolist() == [5] * 4


def test_rows_sized_one_by_one_where_verification_packs():
    """Per-token costs (the runner computes only each row's real tokens): the strong row drafts all five, the weak
    rows none, where one width for the batch would have made every row verify five; with equal costs every
    candidate is offered, as with one width."""
    d = PromptLookup()
    strong, weak = _seqs([STRONG]), _seqs([WEAK])
    for _ in range(30):
        d.commit(None, d.propose(strong, None, B(5)), torch.tensor([5]), None)
        d.commit(None, d.propose(weak, None, B(5)), torch.tensor([0]), None)
    batch = _seqs([WEAK, STRONG, WEAK, WEAK])
    assert d.propose(batch, None, B(5, linear(0.2))).n_drafts.tolist() == [5] * 4  # per column of the rectangle
    prop = d.propose(batch, None, B(5, linear(0.1, 21), per_row=True))  # per draft verified, in all
    assert prop.n_drafts.tolist() == [0, 5, 0, 0] and prop.drafts.shape[1] == 5
    packs3 = B(5, linear(0.1, 4), per_row=True)  # the runner packs at most 3 drafts
    assert d.propose(batch, None, packs3).n_drafts.tolist() == [0, 3, 0, 0]
    assert d.propose(batch, None, B(5)).n_drafts.tolist() == [5] * 4  # fixed: every candidate


def test_rows_sized_by_what_their_tokens_are_worth():
    """With ``worth`` (where the batch runs to its last row), a row's drafts count at its worth: of two rows with the
    same candidates, the one worth more drafts first; worth little, neither drafts."""
    d = PromptLookup()
    for _ in range(30):
        d.commit(None, d.propose(_seqs([STRONG]), None, B(5)), torch.tensor([5]), None)
    batch = _seqs([STRONG, STRONG])
    five = [1 + 0.05 * m for m in range(6)] + [9.0] * 5  # 5 drafts in all, not more
    assert d.propose(batch, None, B(5, five, True)).n_drafts.tolist() == [3, 2]  # equal chances: they take turns
    worth = torch.tensor([0.5, 1.5], dtype=torch.float64)
    assert d.propose(batch, None, B(5, five, True, worth)).n_drafts.tolist() == [0, 5]
    steep = linear(0.3, 11)  # 5 sure drafts of a row worth 1 pay, worth 0.2 they do not
    assert d.propose(batch, None, B(5, steep, True, torch.ones(2, dtype=torch.float64))).n_drafts.tolist() == [5, 5]
    little = torch.full((2,), 0.2, dtype=torch.float64)
    assert d.propose(batch, None, B(5, steep, True, little)).n_drafts.tolist() == [0, 0]


def test_a_round_drafts_only_where_it_beats_a_plain_step_by_the_margin():
    """A copy expected to pay, but by less than ``MARGIN`` of a plain step's tokens, is not drafted; one that pays by
    more is."""
    d = PromptLookup()
    for _ in range(30):
        d.commit(None, d.propose(_seqs([STRONG]), None, B(1)), torch.tensor([1]), None)
    p = d.survival(1, "cpu")[4, 0].item()  # the copy's chance after a 4-token match (STRONG's)
    assert 0.5 < p < 1
    even = (1 + p) / (1 + MARGIN)  # the verification's price at which the copy's round just beats the margin
    assert 1 + p > 1.02 * even  # a price just above it still pays by expectation
    assert d.propose(_seqs([STRONG]), None, B(1, [1.0, 1.02 * even])).n_drafts.tolist() == [0]
    assert d.propose(_seqs([STRONG]), None, B(1, [1.0, 0.98 * even])).n_drafts.tolist() == [1]


def test_a_rows_cached_tokens_price_its_drafts():
    """With ``context`` (a draft's attention over its row's tokens): of two rows with the same candidates, the
    shorter drafts first, and where the longer row's drafts cost more than they bring only the shorter one drafts; a
    round every row pays ``base``: a plain step too, so drafts that paid still pay."""
    d = PromptLookup()
    for _ in range(30):
        d.commit(None, d.propose(_seqs([STRONG]), None, B(5)), torch.tensor([5]), None)
    batch = _seqs([STRONG, STRONG])
    five = [1 + 0.05 * m for m in range(6)] + [9.0] * 5  # 5 drafts in all, not more

    def priced(per_draft, base=0.0, verify=five):
        b = B(5, verify, True)
        b.context = (torch.tensor(base, dtype=torch.float64), torch.tensor(per_draft, dtype=torch.float64))
        return d.propose(batch, None, b).n_drafts.tolist()

    assert priced([0.0, 0.0]) == [3, 2]  # equal: they take turns, as without
    assert priced([0.1, 0.0]) == [0, 5]  # the first row's drafts dearer: the second's first
    steep = linear(0.3, 11)
    assert priced([0.0, 0.0], verify=steep) == [5, 5]
    assert priced([0.9, 0.0], verify=steep) == [0, 5]  # 1.2 plain steps a draft: the first row's do not pay
    assert priced([0.9, 0.9], verify=steep) == [0, 0]
    assert priced([0.0, 0.0], 2.0, steep) == [5, 5]  # every size dearer alike: drafting pays more, not less


def test_row_values_favour_the_rows_that_finish_last():
    """A row that will take the most rounds (tokens left at its own pace) moves the batch's end by a round a token
    and is worth its row's share and every row's fixed share; rows well ahead only their row's share; rows level
    with others little more than that when their pace is sure (all of them would have to gain to move the end), about
    a token each when it is not (the first rounds, or rows whose accepted drafts vary)."""
    from batchspec.speculation.row_values import row_values

    FIXED_SHARE = 0.5  # a step's share that does not grow with its rows, as measured at 8 rows on a 2-core CPU

    def seqs(done, rounds, limit=64):
        done = torch.tensor(done)
        return SimpleNamespace(generated=lambda: done, rounds=torch.tensor(rounds), limit=torch.full_like(done, limit))

    own = 1 - FIXED_SHARE  # a token's saving for its own row
    level = row_values(seqs([10] * 3, [10] * 3), FIXED_SHARE)  # level rows at a sure pace of 1: 54 rounds left
    assert len(set(level.tolist())) == 1 and own < level[0].item() < 0.7
    # the more rows level, the less one token moves the end
    assert row_values(seqs([10] * 8, [10] * 8), FIXED_SHARE)[0] < level[0]
    assert row_values(seqs([20] * 3, [10] * 3), FIXED_SHARE)[0] > 0.9  # level, but at an unsure pace of 2
    before = row_values(seqs([0, 0], [0, 0]), FIXED_SHARE)  # before the first round
    assert before.tolist() == pytest.approx([0.98] * 2, abs=0.01)
    v = row_values(seqs([40, 40, 10], [20, 20, 20]), FIXED_SHARE)  # 12, 12 and 54 rounds left
    assert v[2].item() == pytest.approx(own + 3 * FIXED_SHARE, abs=0.01)
    assert v[:2].tolist() == pytest.approx([own] * 2, abs=0.01)
    v = row_values(seqs([20, 20], [10, 20]), fixed=0.7)  # the same tokens left, the first row at twice the pace
    assert v.tolist() == pytest.approx([0.3, 0.3 + 2 * 0.7], abs=0.01)
    v = row_values(seqs([20, 21, 60], [20, 20, 20]), FIXED_SHARE)  # 44, 41, 1.3 rounds left: a close second
    assert v[0] > 1.5 and own + 0.02 < v[1] < 1.0 and v[2].item() == pytest.approx(own, abs=0.001)


def test_latest_occurrence_gives_the_candidates():
    """The suffix 5 6 occurs twice before the end, followed by 7 8 the first time and 40 41 the second: the latest
    occurrence continues."""
    d = PromptLookup()
    prop = d.propose(_seqs([[5, 6, 7, 8, 5, 6, 40, 41, 5, 6]]), None, B(2))  # every candidate offered
    assert d.plan.offer.match.tolist() == [2] and prop.drafts.tolist() == [[40, 41]]


def test_block_width_maximises_tokens_per_cost():
    """Rows whose drafts are always accepted, and costs nearly flat up to 3 drafts then steep: the round verifies 3
    (E(j) / cost(j): 4 / 1.06 beats 5 / 2); with a linear cost of 0.1 per column it verifies all 5."""
    d = PromptLookup()
    seqs = _seqs([STRONG])
    for _ in range(30):
        d.commit(None, d.propose(seqs, None, B(5)), torch.tensor([5]), None)
    assert d.propose(seqs, None, B(5, [1.0, 1.02, 1.04, 1.06, 2.0, 3.0])).n_drafts.tolist() == [3]
    assert d.propose(seqs, None, B(5, linear(0.1))).n_drafts.tolist() == [5]
    # costs never fall with the width, and widths the budget does not price are out of reach
    assert B(5, [1.0, 1.2, 1.1, 1.6]).verify_tensor(5, "cpu").tolist() == [1.0, 1.2, 1.2, 1.6, inf, inf]
    assert d.propose(seqs, None, B(5, [1.0, 1.01, 1.02])).n_drafts.tolist() == [2]


def _reference(row, max_ngram, min_ngram):
    """(match length, start of the candidates) by brute force: the longest suffix of up to max_ngram tokens with an
    earlier occurrence that something follows, the latest such occurrence; (0, None) without one."""
    for n in range(min(max_ngram, len(row) - 1), min_ngram - 1, -1):
        ends = [i for i in range(n - 1, len(row) - 1) if row[i - n + 1 : i + 1] == row[len(row) - n :]]
        if ends:
            return n, ends[-1] + 1
    return 0, None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=4),
       st.integers(1, 8), st.integers(1, 3))
def test_matching_equals_brute_force(rows, max_ngram, min_ngram):
    """Small vocabularies, so that matches of every length occur; rows of different lengths in one batch. Both the C
    scan (where the kernels build) and the tensor version."""
    min_ngram = min(min_ngram, max_ngram)
    d = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram)
    seqs = _seqs(rows)
    paths = [False] + [True] * (kernels.lookup_match(seqs.history, seqs.length, max_ngram) is not None)
    for tensors in paths:
        with mock.patch.object(lookup, "lookup_match", lambda *a: None) if tensors else contextlib.nullcontext():
            prop = d.propose(seqs, None, B(3))
        for i, row in enumerate(rows):
            n, start = _reference(row, max_ngram, min_ngram)
            assert d.plan.offer.match[i] == n
            want = [] if start is None else row[start : start + 3]
            assert prop.drafts[i, : prop.n_drafts[i]].tolist() == want


def test_sampling_offers_every_candidate():
    d, costs = PromptLookup(), B(5, linear(0.3))
    for _ in range(20):
        prop = d.propose(_seqs([WEAK]), None, costs)
        d.commit(None, prop, torch.tensor([0]), None)
    assert d.propose(_seqs([WEAK]), None, costs).n_drafts.tolist() == [0]
    assert d.propose(_seqs([WEAK], sampling=True), None, costs).n_drafts.tolist() == [5]


def test_engine_learns_and_stays_exact():
    t = tiny.target()
    prompts = tiny.prompts(8, seed=4)
    llm = tiny.fixed_llm(t, draft="prompt-lookup", num_draft_tokens=6, batch_size=4, check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=30))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 30) for p in prompts]
    d = llm.parts.policy.planner.copies
    assert d.offered.sum() > 0 and (d.hits <= d.offered).all() and d.hits.sum() > 0
    assert (d.offered[:, 1:] <= d.offered[:, :-1]).all()  # index j is offered only with every index before it
    assert llm.stats.accepted > 0 and llm.stats.ragged_rounds > 0
