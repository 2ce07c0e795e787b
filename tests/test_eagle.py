"""The feature-reading draft head (``drafters/eagle/``): greedy output equals HF generate at batch size 1 for every
layout x batch size x K, with rows joining and leaving and rounds that draft nothing; its drafts are exactly what
the head predicts from the target's features (an exact output alone would not show a drafter that drafts badly);
sampling keeps the target's distribution although the head scores only part of the vocabulary; checkpoints round
trip; injected faults still show; the target's prefill returns its final hidden states."""

import collections
import inspect
import itertools
import json
from math import inf
from types import SimpleNamespace

import pytest
import tiny
import torch
from test_engine_exact import MAX_TOKENS, PROMPTS, _stop_token  # 13 prompts of 1..60 tokens, incl. 1 and 2
from test_kv import needs_kernel
from test_lookup import _reference
from test_policy import Scripted

import batchspec
from batchspec import SamplingParams as SP
from batchspec.drafters import EagleDrafter
from batchspec.drafters.eagle import EagleState, is_checkpoint
from batchspec.batch import InvariantError, prefill
from batchspec.engine.schedulers import ExSpec
from batchspec.model.kv import new_cache
from batchspec.model.runner import Runner
from batchspec.speculation import AdaptiveLength
from batchspec.speculation.acceptance import Copies
from batchspec.speculation.budget import DRAFT, NOT_WORTH, DraftBudget
from batchspec.speculation.fixed import FixedLength
from batchspec.speculation.plan import KINDS, Offer, Planner
from batchspec.training.head import head_forward, head_unrolled

JOIN_PROMPTS = tiny.prompts(13, seed=9) + [[4]]
JOIN_MAX = [3, 25, 8, 14, 1, 20, 6, 25, 11, 2, 17, 9, 25, 5]


def _llm(k, bs, layout="slotmask", draft=None, **kw):
    kw.setdefault("check_invariants", True)
    llm = tiny.fixed_llm(tiny.target(), draft=draft or tiny.eagle(), num_draft_tokens=k, layout=layout,
                         batch_size=bs, **kw)
    assert type(llm.drafter).__name__ == "EagleDrafter"
    return llm


def _oracle(prompts, max_tokens, stop_ids=(), dtype=torch.float64):
    m = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    return [tiny.oracle(tiny.target(dtype=dtype), p, n, stop_ids=stop_ids) for p, n in zip(prompts, m)]


@pytest.fixture(scope="module")
def ref():
    eos = _stop_token(tiny.target())
    return eos, {stop: _oracle(PROMPTS, MAX_TOKENS, [eos] if stop else ()) for stop in (False, True)}


# ------------------------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("layout,bs,k", list(itertools.product(["eqspec", "slotmask"], [1, 2, 5, 8], [1, 3, 5])))
def test_greedy_matches_oracle(ref, layout, bs, k):
    eos, want = ref
    stop = (bs + k + (layout == "eqspec")) % 2 == 0  # every (bs, k) runs once with an EOS falling mid-output
    llm = _llm(k, bs, layout)
    outs = llm.generate(PROMPTS, SP(max_tokens=MAX_TOKENS, stop_token_ids=[eos] if stop else []))
    assert [o.token_ids for o in outs] == want[stop]
    assert [o.finish_reason for o in outs] == ["stop" if stop and r[-1] == eos else "length" for r in want[stop]]
    if stop:
        assert any(len(r) < MAX_TOKENS for r in want[stop])
    s = llm.stats
    assert 0 < s.accepted < s.drafted
    if bs > 1:
        assert s.ragged_rounds > 0, "rows never accepted different counts in the same round"
        assert s.full_accepts > 0, "no row ever accepted all K drafts"


@pytest.mark.parametrize("scheduler,layout,bs,stop", [
    ("continuous", "slotmask", 3, False), ("continuous", "eqspec", 5, True),
    ("exspec", "slotmask", 3, True), ("exspec", "eqspec", 2, False),
])
def test_rows_joining_and_leaving(scheduler, layout, bs, stop):
    seen = [tok for p, m in zip(JOIN_PROMPTS, JOIN_MAX) for tok in tiny.oracle(tiny.target(), p, m)[2:14]]
    stop_ids = [max(set(seen), key=seen.count)] if stop else []  # a token the oracle emits mid-output in some rows
    llm = _llm(3, bs, layout, scheduler=ExSpec(window=3) if scheduler == "exspec" else scheduler)
    outs = llm.generate(JOIN_PROMPTS, [SP(max_tokens=m, stop_token_ids=stop_ids) for m in JOIN_MAX])
    assert [o.prompt_token_ids for o in outs] == JOIN_PROMPTS
    assert [o.token_ids for o in outs] == _oracle(JOIN_PROMPTS, JOIN_MAX, stop_ids)
    s = llm.stats
    assert s.joined_running > 0, "no request joined a running batch"
    assert 0 < s.accepted < s.drafted
    if stop:
        assert any(o.finish_reason == "stop" for o in outs)
    if scheduler == "exspec":  # batches taken from a larger window (the drafter's state copied out and back)
        assert s.schedule > 0 and s.fallback_rounds > 0 and s.grouped_rounds + s.fallback_rounds == s.rounds


@pytest.mark.parametrize("speculation", ["adaptive", "scripted"])
def test_rounds_without_drafting(speculation):
    """The default adaptive policy, and a script with runs of k = 0 rounds (each adds a pair the head must catch up on)
    among drafting ones, with requests joining: exact, invariants held."""
    policy = (Scripted((0, 3, 0, 0, 2, 1, 3, 0, 0, 0, 3)) if speculation == "scripted"
              else AdaptiveLength(tiny.profile(step=0.002, pair=0.0002)))
    llm = batchspec.LLM(tiny.target(), draft=tiny.eagle(), num_draft_tokens=3, batch_size=3, scheduler="continuous",
                        check_invariants=True, speculation=policy)
    assert llm.parts.policy.name == speculation
    prompts, max_tokens = JOIN_PROMPTS[:9], JOIN_MAX[:9]
    outs = llm.generate(prompts, [SP(max_tokens=m) for m in max_tokens])
    assert [o.token_ids for o in outs] == _oracle(prompts, max_tokens)
    s = llm.stats
    assert s.rounds_without_drafting == s.lengths.get(0, 0) and s.drafted > 0 and s.joined_running > 0
    if speculation == "scripted":
        assert s.lengths[0] > 5 and s.accepted > 0
        assert max(len(list(g)) for k, g in itertools.groupby(policy.chosen) if k == 0) >= 3


@pytest.mark.parametrize("layout", ["eqspec", "slotmask"])
@pytest.mark.parametrize("prompts,bs,k", [
    ([[7]], 1, 3), ([[5, 9]], 1, 4),
    ([[7], [3], [11]], 3, 2),  # every prompt one token: no feature at all at prefill
    ([[5, 9], [8, 2], [1, 1]], 3, 4),  # every prompt two tokens: one feature each, no pair to cache
    ([[7], [5, 9], PROMPTS[0], [11], [4, 4]], 5, 3),  # mixed with a long one: short rows padded
])
def test_one_and_two_token_prompts(layout, prompts, bs, k):
    llm = _llm(k, bs, layout)
    outs = llm.generate(prompts, SP(max_tokens=20))
    assert [o.token_ids for o in outs] == _oracle(prompts, 20)
    assert llm.stats.drafted > 0 and llm.stats.accepted > 0


# ------------------------------------------------------------------------------------------------ the drafts


def _head_drafts(drafter, history: list[int], k: int, forced=(), dtype=torch.float64, prompt: int = 0) -> list[int]:
    """The head's greedy drafts after ``history`` (its last token pending), computed from scratch: the target's
    features of every position but the last, then the head fed its own predicted features (``head_forward``); the
    first ``len(forced)`` drafts are those tokens instead of the head's (copies), the head drafting on after them.
    The features are the target's final hidden states, but at the first ``prompt - 1`` positions (those its prompt's
    prefill cached) where the whole prefill ran: the last layer's input under the final norm (``batch.FEATURES``)."""
    t = tiny.target(dtype=dtype)
    ids = torch.tensor([history])
    out = t(ids[:, :-1], output_hidden_states=True)
    feats = out.hidden_states[-1]
    if prompt > 1 and Runner(t).whole(prompt - 1):
        feats = torch.cat([t.model.norm(out.hidden_states[-2][:, : prompt - 1]), feats[:, prompt - 1 :]], 1)
    nxt, out = ids[:, 1:], []
    for i in range(k):
        states, logits = head_forward(drafter.model, drafter.fc, drafter.embedding, nxt, feats)
        out.append(forced[i] if i < len(forced) else int(drafter.token_map[logits[0, -1].argmax()]))
        feats, nxt = torch.cat([feats, states[:, -1:]], 1), torch.cat([nxt, torch.tensor([[out[-1]]])], 1)
    return out


class KindScript(Scripted):
    """For a drafter with kinds of rounds: a fixed cycle of plain rounds (None) and rounds where one kind is cheap
    and the other dear (so the drafter picks the cheap one, as wide as it can). It prices the head's rounds itself:
    ``bind`` puts ``round_costs`` in its own planner."""

    def __init__(self, cycle=(None, "copy", "copy", "head", "copy", None, "head", "copy", "copy", "copy", "head")):
        super().__init__()
        self.kinds, self.cheap = itertools.cycle(cycle), None

    def bind(self, target_runner, drafter, batch_size):
        self.planner.round_costs = self.round_costs

    def budget(self, view):
        self.cheap = next(self.kinds)
        if self.cheap is None:
            return DraftBudget.plain(NOT_WORTH)
        per_row = view.rows > 1 and view.packed_rows - view.rows >= view.k_max
        return DraftBudget(view.k_max, [1.0], per_row=per_row, reason=DRAFT)

    def round_costs(self, budget, device, waiting=0, per=1, left=None):
        n = budget.k * per
        cheap, dear = [1.0] * (n + 1), [1.0] + [9.0] * n
        rows = [cheap, dear] if self.cheap == "copy" else [dear, cheap]
        return torch.tensor(rows, dtype=torch.float64, device=device)


def _check_drafts(scheduler, monkeypatch, corrupt=None, copy=False, policy=None, dtype=torch.float64,
                  order=(1, 7, 0, 2, 3, 4, 5, 6)):
    """Requests in two waves (the second joins a batch that has run rounds without drafting) under a length script
    with runs of k = 0, every round's drafts recorded; returns (row-rounds checked, those whose drafts differ from
    ``_head_drafts``, states joined or written back with fewer features kept than the batch, row-rounds whose
    drafts began with copies, rounds per kind). With ``copy``, every row with a match drafts its copies first (the
    rates say so); in a "copy" round rows draft their copies only. ``dtype``: the target's and the head's;
    ``order``: the ``JOIN_PROMPTS`` sent, the first two first."""
    drafter = tiny.eagle(copy=copy, dtype=dtype)
    if copy:
        sure = lambda self, k, device, keys=9: torch.ones((keys, k), dtype=torch.float64)  # noqa: E731
        monkeypatch.setattr(Copies, "survival", sure)
    rounds, waited, propose, commit = [], [], drafter.propose, drafter.commit
    narrower = {"put": 0, "merge": 0}
    for op in ("put", "merge"):  # count the joins / window write-backs that pad a narrower feature window
        real = getattr(EagleState, op)

        def spy_op(self, *args, _real=real, _op=op):
            narrower[_op] += args[-1].feats.shape[1] < self.feats.shape[1]
            return _real(self, *args)

        monkeypatch.setattr(EagleState, op, spy_op)

    def spy(seqs, state, budget):
        waited.append(state.waiting)
        proposal = propose(seqs, state, budget)
        rounds.append((seqs.history.tolist(), seqs.length.tolist(), proposal.drafts.tolist(),
                       proposal.n_drafts.tolist(), proposal.kind))
        return proposal

    def bad_commit(state, proposal, accepted, target):
        commit(state, proposal, accepted, target)
        corrupt(state)

    drafter.propose = spy
    if corrupt is not None:
        drafter.commit = bad_commit
    llm = batchspec.LLM(tiny.target(dtype=dtype), draft=drafter, num_draft_tokens=3, batch_size=3, scheduler=scheduler,
                        check_invariants=True, speculation=policy or Scripted((0, 3, 0, 0, 0, 2, 1, 3, 0, 3)))
    prompts, max_tokens = [JOIN_PROMPTS[i] for i in order], [JOIN_MAX[i] for i in order]
    ids, requests = llm.requests(prompts, [SP(max_tokens=m) for m in max_tokens])
    engine, got = llm.engine(), {}
    for i, r in enumerate(requests):
        if i == 2:  # the first wave (two rows of 25 new tokens) has run 5 rounds
            for _ in range(5):
                got.update({o.request_id: o.finished.token_ids for o in engine.step() if o.finished})
        engine.add_request(r)
    while engine.has_work():
        got.update({o.request_id: o.finished.token_ids for o in engine.step() if o.finished})
    assert [got[i] for i in range(len(prompts))] == _oracle(prompts, max_tokens, dtype=dtype)  # drafts change nothing
    s = llm.stats
    assert s.lengths.get(0, 0) > 3 and s.joined_running > 0 and 0 < s.accepted < s.drafted
    checked = wrong = copied = 0
    kinds = collections.Counter(kind for *_, kind in rounds)
    with torch.no_grad():
        for history, lengths, drafts, counts, kind in rounds:
            for h, n, d, c in zip(history, lengths, drafts, counts):
                plen = max(len(p) for p in prompts if h[: len(p)] == p)
                _, start = _reference(h[:n], 8, 1) if copy else (0, None)
                forced = [] if start is None else h[start:n][: len(d)]
                if kind == "copy":  # the copies alone, whatever the head would say
                    checked += 1
                    wrong += d[:c] != forced
                elif n >= 2:  # (a one-token row has no pair yet: its first draft comes from no feature)
                    checked += 1
                    copied += bool(forced) and forced != _head_drafts(drafter, h[:n], len(forced), dtype=dtype,
                                                                      prompt=plen)
                    wrong += d != _head_drafts(drafter, h[:n], len(d), forced, dtype=dtype, prompt=plen)
    kinds["most waiting"] = max(waited, default=0)
    return checked, wrong, narrower, copied, kinds


@pytest.mark.parametrize("scheduler", ["continuous", ExSpec(window=2)], ids=["continuous", "exspec"])
def test_drafts_are_the_heads_predictions(scheduler, monkeypatch):
    """Every draft of every row in every round equals the head's prediction from the row's true history: the
    features and cached pairs stay in step through rejections, k = 0 rounds, joins, window copies and compaction."""
    checked, wrong, narrower, _, _ = _check_drafts(scheduler, monkeypatch)
    assert checked > 25 and wrong == 0, (checked, wrong)
    # rows joined a batch keeping more features per row (after k = 0 rounds); with exspec, rows drafted in a round
    # from the window were written back into it
    assert narrower["put" if isinstance(scheduler, ExSpec) else "merge"] > 0, narrower


def test_drafts_check_catches_stale_features(monkeypatch):
    """The check above has teeth: features one position off (invisible to the output and to the invariants) fail
    it."""
    shift = lambda state: setattr(state, "feats", state.feats.roll(1, 1))  # noqa: E731
    checked, wrong, _, _, _ = _check_drafts("continuous", monkeypatch, corrupt=shift)
    assert wrong > checked // 4, (checked, wrong)


@pytest.mark.parametrize("scheduler", ["continuous", ExSpec(window=2)], ids=["continuous", "exspec"])
def test_copies_then_the_head(scheduler, monkeypatch):
    """Rows whose text repeats draft prompt lookup's copies (here: whenever there is a match), and the head drafts on
    from them, fed the copied tokens: every round's drafts equal that, computed from scratch; the features stay in
    step although the drafts came from two sources."""
    checked, wrong, _, copied, _ = _check_drafts(scheduler, monkeypatch, copy=True)
    assert checked > 25 and wrong == 0, (checked, wrong)
    assert copied > 5, "copies never differed from what the head would have drafted"


def test_copy_rounds_leave_the_head_in_step(monkeypatch):
    """Rounds that verify copies only (the head does not run; its features wait, each row's as many as it accepted)
    among rounds that run the head and plain ones, rows joining: the head's drafts after them are still its
    predictions from the true history (it catches up on every waiting pair), outputs exact, invariants held."""
    # the one-token prompt (13) joins with a one-column window: narrower than the batch's, whatever was accepted
    checked, wrong, narrower, copied, kinds = _check_drafts("continuous", monkeypatch, copy=True, policy=KindScript(),
                                                            order=(1, 7, 0, 2, 13, 3, 4, 5, 6))
    assert checked > 25 and wrong == 0, (checked, wrong)
    # the head caught up on more pairs than a round's block (the features set aside by copy and plain rounds)
    assert kinds["copy"] > 5 and kinds["head"] > 5 and kinds["most waiting"] > 3 + 1, kinds
    assert copied > 0 and narrower["merge"] > 0


@needs_kernel
def test_copy_rounds_sized_row_by_row_leave_the_head_in_step(monkeypatch):
    """On an fp32 Llama, whose C layer packs verification: copy rounds size each row on its own (rows verify
    different numbers of copies, padding not computed, the features still returned), and the head, catching up on
    the features of such rounds, still drafts its predictions from the true history; outputs exact, invariants
    held."""
    from batchspec.model.kernels import llama as fused

    packed, real = collections.Counter(), fused.forward

    def spy(*a, **k):
        args = inspect.signature(real).bind(*a, **k).arguments
        counts, q = args.get("counts"), args["input_ids"].shape[1]
        if counts is not None and args.get("hidden") and int(counts.sum()) < counts.numel() * q:
            packed[q - 1] += 1
        return real(*a, **k)

    monkeypatch.setattr(fused, "forward", spy)
    checked, wrong, _, _, kinds = _check_drafts("continuous", monkeypatch, copy=True, policy=KindScript(),
                                                dtype=torch.float32)
    assert checked > 25 and wrong == 0, (checked, wrong)
    assert kinds["copy"] > 5 and kinds["head"] > 5, kinds
    assert sum(packed.values()) > 3, packed  # copy rounds whose rows verified different numbers of copies


class DepthScript(KindScript):
    """Plain rounds among head rounds whose plan is one draft a row wide (wider head rounds dear, copy rounds
    dearer)."""

    def __init__(self, cycle=(None, "head", "head", None, "head")):
        super().__init__(cycle)

    def round_costs(self, budget, device, waiting=0, per=1, left=None):
        n = budget.k * per
        one = [1.0] * (per + 1) + [9.0] * (n - per)  # m drafts in all: one a row (per) or fewer
        return torch.tensor([[1.0] + [99.0] * n, one], dtype=torch.float64, device=device)


def _head_rounds(monkeypatch):
    """Spy on ``EagleDrafter.propose``: a list that gets (drafts per row, verified per row) of every head round."""
    seen, real = [], EagleDrafter.propose

    def spy(self, seqs, state, k):
        p = real(self, seqs, state, k)
        if p.kind == "head":
            seen.append((p.drafts.shape[1], p.n_drafts.tolist()))
        return p

    monkeypatch.setattr(EagleDrafter, "propose", spy)
    return seen


@pytest.mark.parametrize("sure", [0.0, 0.999, 2.0], ids=["always-sure", "sure-of-copies", "never-sure"])
def test_head_rounds_draft_as_deep_as_the_head_is_sure_one_row(sure, monkeypatch):
    """One row, greedy rounds sized by the drafter: a head round planned one draft wide drafts on while the head is
    sure of its drafts (here: always, to K; of copies only; never), and stops when it is not; the output equals the
    oracle, the invariants hold."""
    from batchspec.speculation import plan as eagle

    monkeypatch.setattr(eagle, "DEPTH_CONFIDENCE", sure)
    seen = _head_rounds(monkeypatch)
    llm = batchspec.LLM(tiny.target(), draft=tiny.eagle(), num_draft_tokens=4, batch_size=1, check_invariants=True,
                        speculation=DepthScript())
    prompts = JOIN_PROMPTS[:6]
    outs = llm.generate(prompts, SP(max_tokens=20))
    assert [o.token_ids for o in outs] == _oracle(prompts, 20)
    widths = collections.Counter(w for w, _ in seen)
    assert all(n == [w] for w, n in seen), seen  # one row: every draft it drafted is verified
    if sure == 0.0:
        assert set(widths) == {4}, widths  # past the plan's one draft, to K
    elif sure == 2.0:
        assert set(widths) == {1}, widths
    else:  # rounds with copies draft through them and one more: ragged across rounds
        assert widths[1] > 2 and sum(v for w, v in widths.items() if w > 1) > 2, widths


@needs_kernel
@pytest.mark.parametrize("sure", [0.0, 0.999, 2.0], ids=["always-sure", "sure-of-copies", "never-sure"])
def test_head_rounds_draft_as_deep_as_the_head_is_sure_row_by_row(sure, monkeypatch):
    """On an fp32 Llama, whose C layer packs verification: a head round planned one draft a row wide drafts on while
    some row is sure of its drafts, and each row verifies its drafts up to the first it is not sure of (rows with
    copies through them and one more, the others one); every draft is still the head's prediction from the true
    history, outputs exact, invariants held."""
    from batchspec.speculation import plan as eagle

    monkeypatch.setattr(eagle, "DEPTH_CONFIDENCE", sure)
    seen = _head_rounds(monkeypatch)
    checked, wrong, _, copied, kinds = _check_drafts("continuous", monkeypatch, copy=True, policy=DepthScript(),
                                                     dtype=torch.float32)
    assert checked > 25 and wrong == 0, (checked, wrong)
    assert kinds["head"] > 5, kinds
    if sure == 0.0:
        assert all(w == 3 and n == [3] * len(n) for w, n in seen), seen
    elif sure == 2.0:
        assert all(w == 1 for w, _ in seen), seen
    else:
        assert any(w > 1 for w, _ in seen) and any(len(set(n)) > 1 for _, n in seen), seen
        assert all(max(n) == w for w, n in seen), seen  # the round stops once no row is sure


def test_copy_rounds_sized_row_by_row():
    """Where verification packs (``budget.per_row``): a copy round verifies the batch's likeliest copies (the strong
    row all of its copies, the weak rows none, where one width made every row verify them), within what the runner
    packs; a head round of width j is priced as rows x j drafts plus j steps of the head."""
    planner = Planner()
    k, rows = 3, 4
    match = torch.tensor([1, 8, 1, 1])
    n_copies, copies = torch.full((rows,), k), torch.arange(rows * k).view(rows, k) + 10
    planner.copies._tables(k, "cpu")
    planner.copies.offered[8], planner.copies.hits[8] = 100.0, 97.0  # copies of 8-token matches: nearly always right
    planner.copies.offered[1], planner.copies.hits[1] = 100.0, 10.0
    planner.head.table = torch.tensor([10.0, 100.0], dtype=torch.float64)  # the head: seldom right
    offer = Offer(rows, torch.device("cpu"), copies, n_copies, match, 9, KINDS)

    def plan(verify, per_row=False, worth=None, step=9.0):
        p = planner.plan(offer, DraftBudget(k, verify, step, 0.0, per_row, worth, DRAFT))
        return p.kind, p.width, p.use, p.drafts

    assert plan([1 + 0.1 * j for j in range(k + 1)])[:2] == ("copy", 3)  # a column of the rectangle
    kind, width, _, n = plan([1 + 0.1 * j for j in range(k + 1)])
    assert n.tolist() == [3] * 4  # one width: every row verifies 3
    per_draft = [1 + 0.08 * m for m in range(rows * k + 1)]  # per draft verified, in all
    kind, width, _, n = plan(per_draft, per_row=True)
    assert (kind, width, n.tolist()) == ("copy", 3, [0, 3, 0, 0])
    far_ahead = torch.tensor([1.0, 0.1, 1.0, 1.0], dtype=torch.float64)  # the strong row far ahead: worth little
    assert plan(per_draft, True, far_ahead)[:2] == ("copy", 0)  # a plain step
    dearer = per_draft[:2] + [c + 0.3 for c in per_draft[2:]]  # past 1 draft, only the strong row's pay
    assert plan(dearer, True, torch.tensor([0.2, 1.6, 1.0, 1.2], dtype=torch.float64))[3].tolist() == [0, 3, 0, 0]
    weak_first = torch.tensor([0.2, 0.1, 1.0, 10.0], dtype=torch.float64)  # a weak row's copy worth the most
    assert plan(dearer, True, weak_first)[3].tolist() == [0, 0, 0, 1]
    assert plan(per_draft[:3], True)[3].tolist() == [0, 2, 0, 0]  # the runner packs at most 2 drafts
    # the head right every time: a head round one draft a row wide beats the copies at that cost
    planner.head.table = torch.tensor([100.0, 100.0], dtype=torch.float64)
    one_a_row = [1.0, 1.02, 1.04, 1.06, 1.1] + [9.0] * (rows * k - rows)
    assert plan(one_a_row, per_row=True, step=0.0)[:2] == ("head", 1)
    assert plan(one_a_row, per_row=True, step=9.0)[0] == "copy"  # the head's steps dear: copies


def test_copies_used_where_they_earned_it():
    """The first drafts' acceptance is learned for the head and for copies per match length from every drafting
    round (both sources scored against the target's token, whichever was drafted); a row copies when its match
    length's copies were accepted more often than the head's drafts, at the time of the round."""
    drafter, policy = tiny.eagle(), FixedLength()
    chosen, propose = [], drafter.propose

    def spy(seqs, state, plan):
        k, offer = plan.width, plan.offer
        head_rate = policy.planner.head.survival(k, seqs.length.device)[0]
        copy_rate = policy.planner.copies.survival(k, seqs.length.device)[:, 0]
        proposal = propose(seqs, state, plan)
        assert proposal.kind == "head"  # fixed length: the head runs every round
        n_copies = offer.count
        use = (n_copies > 0) & (copy_rate[offer.match] > head_rate)
        assert use.tolist() == plan.use.tolist()
        want = torch.where(use, offer.candidates[:, 0], proposal.first)
        weak = int(((n_copies > 0) & ~use).sum())
        chosen.append((proposal.drafts[:, 0].tolist(), want.tolist(), int(use.sum()), weak))
        return proposal

    drafter.propose = spy
    llm = _llm(3, 4, draft=drafter, speculation=policy)
    prompts = JOIN_PROMPTS + tiny.prompts(12, seed=3)
    outs = llm.generate(prompts, SP(max_tokens=25))
    assert [o.token_ids for o in outs] == _oracle(prompts, 25)
    assert all(got == want for got, want, _, _ in chosen)
    assert sum(c[2] for c in chosen) > 10, "no row copied"
    assert sum(c[3] for c in chosen) > 10, "every match was copied: the rule never refused one"
    head_hits, head_scored = policy.planner.head.table
    assert head_scored == llm.stats.row_rounds and 0 < head_hits < head_scored
    assert 0 < policy.planner.copies.hits[:, 0].sum() < policy.planner.copies.offered[:, 0].sum()


def test_copy_off_and_under_sampling():
    """``copy=False`` drafts with the head alone; sampling never copies (the proposal carries no first drafts)."""
    for copy, params in ((False, SP(max_tokens=12)), (True, SP(max_tokens=12, temperature=0.8, seed=1))):
        drafter, policy = tiny.eagle(copy=copy), FixedLength()
        seen, propose = [], drafter.propose
        drafter.propose = lambda seqs, state, plan: seen.append(propose(seqs, state, plan)) or seen[-1]
        _llm(3, 4, draft=drafter, speculation=policy).generate(JOIN_PROMPTS, params)
        assert seen and all(p.first is None and p.kind is None for p in seen)
        assert policy.planner.head.table is None and policy.planner.copies.offered is None


# ------------------------------------------------------------------------------------------------ sampling


def _greedy_path_prompt():
    start = torch.randint(1, tiny.VOCAB, (10,), generator=torch.Generator().manual_seed(11)).tolist()
    return start + tiny.oracle(tiny.target(), start, 12)  # where the head learned: drafts often agree


@pytest.mark.parametrize("setting", [(0.5, 0), (1.5, 20)], ids=["T0.5-on-the-greedy-path", "T1.5-top20"])
def test_sampling_keeps_the_target_distribution(setting):
    """The head samples from its distribution spread over the whole vocabulary (zero outside its token map); the
    first two tokens follow the target's exact distribution (chi-square), tokens outside the map included, and the
    first drafts (one history, many seeds) follow the ``q`` the head reports to the rejection sampler (1e-4 split
    over these 3 checks). A sampler drawing the replacement from the draft's distribution is rejected. At T 0.5 the
    head is confident and often right; at T 1.5 its distribution spreads over many tokens."""
    from batchspec.audit.distribution import chi_square, compare, exact_distribution

    temperature, top_k = setting
    t, n, samples = tiny.target(), 2, 2000
    prompt = _greedy_path_prompt() if temperature < 1 else tiny.prompts(2, seed=7, lo=3, hi=12)[1]
    ref = exact_distribution(t, prompt, temperature, top_k, n_tokens=n, coverage=0.999, max_cells=1024)
    p_values = {}
    for fault in (None, "draft-bonus"):
        drafter = tiny.eagle()
        outside = torch.ones(tiny.VOCAB, dtype=torch.bool)
        outside[drafter.token_map] = False
        propose, qs, first = drafter.propose, [], []

        def spy(seqs, state, budget):
            proposal = propose(seqs, state, budget)
            qs.append(proposal.q)
            assert not outside[proposal.drafts].any()
            rows = seqs.length == len(prompt)  # a request's first round: the same history for every seed
            first.append((proposal.drafts[rows, 0], proposal.q[rows, 0]))
            return proposal

        drafter.propose = spy
        llm = batchspec.LLM(t, draft=drafter, num_draft_tokens=3, batch_size=250, fault=fault)
        outs = llm.generate([prompt] * samples, [SP(max_tokens=n, temperature=temperature, top_k=top_k,
                                                    seed=90_000 + j) for j in range(samples)])
        q = torch.cat([x.flatten(0, 1) for x in qs])
        assert q.shape[-1] == tiny.VOCAB and (q[:, outside] == 0).all()
        torch.testing.assert_close(q.sum(-1), torch.ones(len(q), dtype=q.dtype))
        assert llm.stats.accepted > 0.01 * samples  # drafts were accepted (at most one counts per row)
        drafts, q1 = (torch.cat(x) for x in zip(*first))
        assert len(drafts) == samples and torch.allclose(q1, q1[0].expand_as(q1), rtol=0, atol=1e-12)
        tokens = [o.token_ids for o in outs]
        p_values[fault] = [compare(ref, tokens, length).p_value for length in (1, 2)]
        if fault is None:
            counts = torch.bincount(drafts, minlength=tiny.VOCAB)
            p_values["drafts"] = chi_square(counts.tolist(), (q1[0] * samples).tolist())[2]
            assert sum(outside[tok[0]].item() for tok in tokens) > 0.02 * samples  # unmapped tokens come out
    assert min(p_values[None] + [p_values["drafts"]]) > 1e-4 / 3, p_values
    assert min(p_values["draft-bonus"]) < 1e-8, p_values


def test_seeded_sampling_is_batch_invariant():
    prompts = tiny.prompts(6, seed=5)
    params = [SP(max_tokens=15, temperature=0.8, top_k=(10 if i % 2 else 0), seed=500 + i) for i in range(6)]
    runs = []
    for kw in ({"batch_size": 1}, {"batch_size": 6}, {"batch_size": 2, "scheduler": "continuous"},
               {"batch_size": 3, "layout": "eqspec"}):
        llm = batchspec.LLM(tiny.target(), draft=tiny.eagle(), num_draft_tokens=3, check_invariants=True, **kw)
        runs.append([o.token_ids for o in llm.generate(prompts, params)])
        assert llm.stats.accepted > 0
    assert all(r == runs[0] for r in runs[1:]) and len({tuple(r) for r in runs[0]}) == 6


# ------------------------------------------------------------------------------------------------ checkpoints


def test_checkpoint_round_trip(tmp_path):
    mem = tiny.eagle()
    head = tmp_path / "head"
    EagleDrafter.save(head, mem.model, mem.fc, mem.token_map, card={"target": "tiny"})
    target_dir, _ = tiny.save_dir(tmp_path, draft_too=False)
    assert is_checkpoint(head) and is_checkpoint(str(head)) and not is_checkpoint(target_dir)
    assert json.loads((head / "eagle.json").read_text()) == {"target": "tiny"}
    want = _oracle(PROMPTS, MAX_TOKENS)
    runs = {}
    for name, target, draft, dtype in (("memory", tiny.target(), mem, None), ("path", tiny.target(), str(head), None),
                                       ("dirs", str(target_dir), str(head), torch.float64)):
        llm = _llm(3, 5, draft=draft, dtype=dtype)
        d = llm.drafter
        if name != "memory":
            assert d is not mem and d.model.dtype == d.fc.weight.dtype == torch.float64
            assert torch.equal(d.token_map, mem.token_map) and torch.equal(d.fc.weight, mem.fc.weight)
            assert torch.equal(d.fc.bias, mem.fc.bias) and d.embedding is llm.target.get_input_embeddings()
            for (a, x), (b, y) in zip(d.model.state_dict().items(), mem.model.state_dict().items()):
                assert a == b and torch.equal(x, y), a
        outs = llm.generate(PROMPTS, SP(max_tokens=MAX_TOKENS))
        runs[name] = ([o.token_ids for o in outs], llm.stats.drafted, llm.stats.accepted)
    assert runs["memory"][0] == want and runs["memory"][2] > 0
    assert runs["path"] == runs["memory"] and runs["dirs"] == runs["memory"]  # the same drafts, too


def test_an_f16_head_keeps_its_weights_f16_biased_fc_included(tmp_path):
    """``weights="auto"``: a head whose weights are fp16 values (as the shipped one's) runs them as f16 in an fp32
    target, its biased ``fc`` too (the bias added after the product); the outputs are still the oracle's."""
    from batchspec.model.weights import PackedLinear

    mem = tiny.eagle()
    model = type(mem.model)(mem.model.config).float()  # a copy in fp32: the cached head stays as it is
    fc = torch.nn.Linear(mem.fc.in_features, mem.fc.out_features)
    model.load_state_dict({k: v.half().float() for k, v in mem.model.state_dict().items()})
    with torch.no_grad():
        fc.weight.copy_(mem.fc.weight.half().float())
        fc.bias.copy_(mem.fc.bias.half().float())
    head = tmp_path / "head"
    EagleDrafter.save(head, model, fc, mem.token_map)
    target = tiny.target(dtype=torch.float32)
    llm = tiny.fixed_llm(target, draft=str(head), num_draft_tokens=3, batch_size=4)
    d = llm.drafter
    assert isinstance(d.fc, PackedLinear) and d.fc.packed.kind == "f16" and d.fc.bias is not None
    x = torch.randn(3, fc.in_features)
    assert torch.allclose(d.fc(x), fc(x), rtol=1e-6, atol=1e-6)
    got = [o.token_ids for o in llm.generate(PROMPTS, SP(max_tokens=MAX_TOKENS))]
    assert got == _oracle(PROMPTS, MAX_TOKENS, dtype=torch.float32) and llm.stats.accepted > 0


# ------------------------------------------------------------------------------------------------ faults


@pytest.mark.parametrize("fault", ["bsp-keep-rejected-kv", "bsp-stale-positions", "dsd-draft-token-accepted"])
def test_faults_show_through(fault):
    prompts = tiny.prompts(6, seed=5, lo=2, hi=30)
    sp = SP(max_tokens=16)
    llm = _llm(3, 6, fault=fault, check_invariants=False)
    outs = llm.generate(prompts, sp)
    assert llm.stats.drafted > 0 and [o.token_ids for o in outs] != _oracle(prompts, 16)
    if fault != "dsd-draft-token-accepted":  # (an acceptance-rule fault leaves the caches consistent)
        with pytest.raises(InvariantError) as e:
            _llm(3, 6, fault=fault).generate(prompts, sp)
        assert e.value.invariant == "I2" and e.value.cache == "target"


def test_head_cache_is_checked():
    """The invariant checker reads the head's slots: a rejected draft pair left visible is reported for the draft."""
    llm = _llm(3, 4)
    commit = llm.drafter.commit

    def bad_commit(state, proposal, accepted, target):
        commit(state, proposal, accepted, target)
        state.slots.valid[:, -1] = True  # a pair built from a predicted feature

    llm.drafter.commit = bad_commit
    with pytest.raises(InvariantError) as e:
        llm.generate(tiny.prompts(6), SP(max_tokens=20))
    assert e.value.invariant == "I2" and e.value.cache == "draft"


# ------------------------------------------------------------------------------------------------ features


@pytest.mark.parametrize("overhead", [1, 10**6, None], ids=["per-length", "one-padded-forward", "whole"])
def test_prefill_features_are_the_final_hidden_states(overhead, monkeypatch):
    """``batch.prefill(hidden=True)``: per prompt, the target's ``hidden_states[-1]`` at every token but the last,
    right-aligned, zeros on the left; whether rows of different lengths share one left-padded forward or not, or
    go end to end through one forward (``model/prefill.py``, no runner forward)."""
    from batchspec.model import prefill as whole

    if overhead is not None:
        monkeypatch.setattr(whole, "supported", lambda model: False)
    t = tiny.target()
    prompts = [[7], [5, 9], PROMPTS[1], [3, 1, 4, 1, 5, 9, 2, 6], [8, 8, 8, 8, 8, 8, 8, 8], [2, 7, 1]]
    runner, calls = Runner(t), []
    forward = runner.forward

    def spy(cache, ids, pos, visible=None, *a, **kw):
        calls.append(visible is not None)
        return forward(cache, ids, pos, visible, *a, **kw)

    runner.forward = spy
    state, feats = prefill(runner, prompts, overhead=overhead, hidden=True)
    # a forward per length (1, 2, 7, 33) / one for all / none of the runner's
    assert calls == {1: [False] * 4, 10**6: [True], None: []}[overhead]
    w = max(map(len, prompts)) - 1
    assert feats.shape == (len(prompts), w, t.config.hidden_size) and feats.dtype == torch.float64
    with torch.no_grad():
        for r, p in enumerate(prompts):
            n = len(p) - 1
            assert (feats[r, : w - n] == 0).all()
            if n:
                want = t(torch.tensor([p[:-1]]), output_hidden_states=True).hidden_states[-1][0]
                torch.testing.assert_close(feats[r, w - n:], want, rtol=1e-12, atol=1e-12)
    # the forward reading input vectors (as the head's do) equals the one reading ids
    ids = torch.tensor([PROMPTS[1]])
    pos = torch.arange(ids.shape[1])[None]
    a = Runner(t).forward(new_cache(t), ids, pos, None, 0, "all")
    b = Runner(t).forward(new_cache(t), ids, pos, None, 0, "all", embeds=t.get_input_embeddings()(ids))
    assert a.hidden.shape == (1, ids.shape[1], t.config.hidden_size)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)


def test_head_forward_is_the_drafting_arithmetic():
    """The head's cached forward over pairs (through the runner, with the pair inputs as ``embeds``) equals
    ``head_forward``, the training forward, for every position."""
    d, t = tiny.eagle(), tiny.target()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        feats = t(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
        states, logits = head_forward(d.model, d.fc, d.embedding, ids[:, 1:], feats)
    out = d.runner.forward(new_cache(d.model), ids[:, :-1], torch.arange(feats.shape[1])[None], None, 0, "all",
                           embeds=d._inputs(ids[:, 1:], feats))
    assert logits.shape[-1] == len(d.token_map) < tiny.VOCAB
    torch.testing.assert_close(out.logits, logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.hidden, states, rtol=1e-12, atol=1e-12)


def test_unrolled_training_forward_is_chained_drafting():
    """``head_unrolled`` step d at position i equals drafting from scratch: the real pairs up to i-d, then the head
    fed its own predicted features for d more pairs (with the true next tokens), through ``head_forward``."""
    d, t = tiny.eagle(), tiny.target()
    ids = torch.tensor([PROMPTS[1] + PROMPTS[2]])
    with torch.no_grad():
        feats = t(ids, output_hidden_states=True).hidden_states[-1][:, :-1]
        steps = head_unrolled(d.model, d.fc, d.embedding, ids[:, 1:], feats, 3)
        n, checked = feats.shape[1], 0
        torch.testing.assert_close(steps[0], head_forward(d.model, d.fc, d.embedding, ids[:, 1:], feats),
                                   rtol=1e-12, atol=1e-12)
        for depth in (1, 2):
            for i in range(depth, n):
                f, nxt = feats[:, : i - depth + 1], ids[:, 1: i - depth + 2]
                for e in range(depth):
                    states, logits = head_forward(d.model, d.fc, d.embedding, nxt, f)
                    f = torch.cat([f, states[:, -1:]], 1)
                    nxt = ids[:, 1: i - depth + 3 + e]
                states, logits = head_forward(d.model, d.fc, d.embedding, nxt, f)
                torch.testing.assert_close(steps[depth][0][:, i], states[:, -1], rtol=1e-10, atol=1e-10)
                torch.testing.assert_close(steps[depth][1][:, i], logits[:, -1], rtol=1e-10, atol=1e-10)
                checked += 1
    assert checked == 2 * n - 3 and n > 8


def test_round_costs_from_the_budget():
    """A copy round costs its verification (never falling with m, unpriced sizes out of reach); a head round of j
    steps that plus j steps of the head; after a long wait (more pairs than a round's block) each pair beyond it at
    the budget's price, shared by ``CATCH_UP_SHARED`` rounds or by the rounds left when fewer."""
    from batchspec.speculation.plan import CATCH_UP_SHARED

    d, cpu = SimpleNamespace(planner=Planner()), torch.device("cpu")
    b = DraftBudget(3, [1.0, 1.1, 1.05, 1.2], 0.1, 0.01, reason=DRAFT)
    copy, head = d.planner.round_costs(b, cpu).tolist()
    assert copy == pytest.approx([1.0, 1.1, 1.1, 1.2]) and head == pytest.approx([1.0, 1.2, 1.3, 1.5])
    assert d.planner.round_costs(b, cpu, waiting=4)[1].tolist() == pytest.approx(head)  # a round's block: no extra
    extra = 0.01 * (200 - 4) / CATCH_UP_SHARED
    assert d.planner.round_costs(b, cpu, waiting=200)[1].tolist() == pytest.approx([h + extra for h in head])
    near_end = 0.01 * (200 - 4) / 2
    assert d.planner.round_costs(b, cpu, waiting=200, left=torch.tensor(2))[1].tolist() == pytest.approx(
        [h + near_end for h in head])
    assert d.planner.round_costs(b, cpu, waiting=200, left=torch.tensor(50))[1].tolist() == pytest.approx(
        [h + extra for h in head])
    short = DraftBudget(3, [1.0, 1.5], 0.1, 0.0, reason=DRAFT)  # sizes the budget does not price
    copy, head = d.planner.round_costs(short, cpu).tolist()
    assert copy == [1.0, 1.5, inf, inf] and head == pytest.approx([1.0, 1.6, inf, inf])
    per_row = DraftBudget(2, [1.0 + 0.1 * m for m in range(7)], 0.3, 0.0, per_row=True, reason=DRAFT)
    copy, head = d.planner.round_costs(per_row, cpu, per=3).tolist()  # 3 rows: a head step every 3 drafts
    assert head == pytest.approx([c + 0.3 * m / 3 for m, c in enumerate(copy)])


class DryFixed(FixedLength):
    """Drafts every round, yet says its drafter is dry: rows joining leave their prompt's pairs waiting."""

    def dry(self):
        return True


@pytest.mark.parametrize("dry", [False, True], ids=["drafting", "dry"])
def test_rows_joining_a_running_batch_cache_their_prompt_at_admission(dry, monkeypatch):
    """A batch's first rows leave their prompt's pairs waiting (the head catches up when it first runs); rows joining
    a running batch cache them at admission, grouped by length, so the running rows' catch-up never widens to a
    joiner's prompt: their state starts one feature wide with every pair but the pending one's cached. While the
    policy says the drafter is dry, joining rows leave theirs waiting too, and the catch-up takes them: the outputs
    are the oracle's either way."""
    seen, real = [], EagleDrafter.prefill

    def spy(self, prompts, hidden=None, joining=False):
        state = real(self, prompts, hidden, joining)
        seen.append((joining, [len(p) for p in prompts], state.processed.tolist(), state.waiting))
        return state

    monkeypatch.setattr(EagleDrafter, "prefill", spy)
    llm = batchspec.LLM(tiny.target(), draft=tiny.eagle(), num_draft_tokens=3, batch_size=3, scheduler="continuous",
                        check_invariants=True, speculation=DryFixed() if dry else "fixed")
    prompts, max_tokens = JOIN_PROMPTS[:9], JOIN_MAX[:9]
    outs = llm.generate(prompts, [SP(max_tokens=m) for m in max_tokens])
    assert [o.token_ids for o in outs] == _oracle(prompts, max_tokens)
    assert llm.stats.joined_running > 0 and llm.stats.accepted > 0
    first = [s for s in seen if not s[0]]
    joined = [s for s in seen if s[0] and max(s[1]) > 2]
    if dry:
        assert len(first) == len(seen) > 1 and not joined, seen
    assert first and (joined or dry), seen
    for _, lengths, processed, waiting in first:
        assert processed == [0] * len(lengths) and waiting == max(lengths) - 1
    for _, lengths, processed, waiting in joined:
        assert processed == [max(n - 2, 0) for n in lengths] and waiting == 1


def test_joining_rows_cache_only_the_heads_keys_and_values_end_to_end(monkeypatch):
    """Rows joining a running batch cache their pairs in one forward of the head over their input vectors end to end
    (``model/prefill.py``), which computes only what its cache holds: of the head's linears, the keys' and values'
    (no queries, attention or MLP). Its keys and values are those of the grouped forwards the engine runs elsewhere."""
    from batchspec.model import prefill as whole

    d, t = tiny.eagle(), tiny.target()
    prompts = [PROMPTS[1], [3, 1, 4, 1, 5, 9, 2, 6], [8] * 8, [2, 7, 1], [7, 5]]
    _, feats = prefill(Runner(t), prompts, hidden=True)
    used, linear = [], whole._linear
    monkeypatch.setattr(whole, "_linear", lambda module, *a: used.append(module) or linear(module, *a))
    ends = d.prefill(prompts, feats, joining=True)
    attn = d.model.model.layers[0].self_attn
    assert used and {id(m) for m in used} == {id(attn.k_proj), id(attn.v_proj)}
    monkeypatch.setattr(whole, "supported", lambda model: False)
    used.clear()
    grouped = d.prefill(prompts, feats, joining=True)
    assert not used
    a, b = ends.slots, grouped.slots
    assert torch.equal(a.valid, b.valid) and torch.equal(a.positions, b.positions) and a.valid.sum() > 20
    assert torch.equal(ends.processed, grouped.processed) and torch.equal(ends.feats, grouped.feats)
    for x, y in zip(a.cache.layers, b.cache.layers):
        for u, v in ((x.keys, y.keys), (x.values, y.values)):  # [B, heads, S, D]: the valid slots'
            torch.testing.assert_close(u.transpose(1, 2)[a.valid], v.transpose(1, 2)[b.valid], rtol=1e-12, atol=1e-12)
