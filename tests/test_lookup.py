"""Prompt lookup chooses each row's draft length from its match: the longest earlier occurrence of the row's suffix
gives the candidates, and learned survival per (match length, draft index) decides how many to offer."""

from types import SimpleNamespace

import torch

import batchspec
import tiny
from batchspec.drafters import PromptLookup


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
    prop = PromptLookup().propose(SimpleNamespace(**p), None, 5)
    assert prop.match.tolist() == [1, 4]
    assert prop.n_drafts.tolist() == [5, 5]  # nothing learned yet: the prior trusts every index
    assert prop.drafts[0].tolist() == [20, 21, 22, 23, 24] and prop.drafts[1].tolist() == [30, 31, 32, 33, 34]


def test_length_follows_what_each_match_length_earned():
    d = PromptLookup(default_cost=0.3)
    seqs = _seqs([WEAK, STRONG])
    for _ in range(20):  # weak matches: the first draft is always rejected; strong ones: all accepted
        prop = d.propose(seqs, None, 5)
        d.commit(None, prop, torch.tensor([0, 5]), None)
    prop = d.propose(seqs, None, 5)
    assert prop.n_drafts.tolist() == [5, 5]  # the strong row pays for the columns; the weak one rides along
    assert prop.drafts.shape[1] == 5
    alone = d.propose(_seqs([WEAK]), None, 5)  # a batch of weak matches only: a plain step
    assert alone.n_drafts.tolist() == [0] and alone.drafts.shape[1] == 0
    d.cost_per_token = 0.0  # what speculation="fixed" sets: every candidate up to K
    assert d.propose(seqs, None, 5).n_drafts.tolist() == [5, 5]


def test_partial_survival_cuts_at_the_first_weak_index():
    d = PromptLookup(default_cost=0.5)
    seqs = _seqs([STRONG])
    for _ in range(30):  # the first two drafts always accepted, the third never
        prop = d.propose(seqs, None, 5)
        d.commit(None, prop, torch.tensor([2]), None)
    assert d.propose(seqs, None, 5).n_drafts.tolist() == [2]
    s = d.survival(5, "cpu")[4]
    assert s[0] > 0.9 and s[1] > 0.9 and s[2] < 0.5 and (s[1:] <= s[:-1]).all()  # a product: never rises


def test_batch_width_weighs_every_row():
    """A column is verified when the rows' summed chances there cover its cost for the whole batch."""
    d = PromptLookup(default_cost=0.4)
    strong, weak = _seqs([STRONG]), _seqs([WEAK])
    d.cost_per_token = 0.0  # learn with every candidate offered
    for _ in range(30):
        d.commit(None, d.propose(strong, None, 5), torch.tensor([5]), None)  # strong matches: all accepted
        d.commit(None, d.propose(weak, None, 5), torch.tensor([0]), None)  # weak ones: none
    d.cost_per_token = None  # back to the default cost, 0.4
    assert d.propose(_seqs([STRONG, WEAK]), None, 5).n_drafts.tolist() == [5, 5]  # ~1 token per column >= 0.8
    assert d.propose(_seqs([STRONG] + [WEAK] * 3), None, 5).n_drafts.tolist() == [0] * 4  # ~1 < 0.4 x 4 rows
    d.cost_per_token = 0.2  # measured cheaper: 1 >= 0.2 x 4
    assert d.propose(_seqs([STRONG] + [WEAK] * 3), None, 5).n_drafts.tolist() == [5] * 4


def test_sampling_offers_every_candidate():
    d = PromptLookup(default_cost=0.3)
    for _ in range(20):
        prop = d.propose(_seqs([WEAK]), None, 5)
        d.commit(None, prop, torch.tensor([0]), None)
    assert d.propose(_seqs([WEAK], sampling=True), None, 5).n_drafts.tolist() == [5]


def test_engine_learns_and_stays_exact():
    t = tiny.target()
    prompts = tiny.prompts(8, seed=4)
    llm = tiny.fixed_llm(t, draft="prompt-lookup", num_draft_tokens=6, batch_size=4, check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=30))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 30) for p in prompts]
    d = llm.drafter
    assert d.offered.sum() > 0 and (d.hits <= d.offered).all() and d.hits.sum() > 0
    assert (d.offered[:, 1:] <= d.offered[:, :-1]).all()  # index j is offered only with every index before it
    assert llm.stats.accepted > 0 and llm.stats.ragged_rounds > 0
