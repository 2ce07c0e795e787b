"""Sampling: warping matches Hugging Face's warpers, the rejection sampler reproduces the target distribution exactly
(and the injected faults do not), and a seeded request yields the same tokens whatever its batch, layout, scheduler.
The distributional audit of whole engines is in test_sampling_audit.py."""

import pytest
import tiny
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import batchspec
from batchspec.sampling import Stream, draw, greedy, uniforms, warp

DRAFT, ACCEPT, TARGET = Stream.DRAFT, Stream.ACCEPT, Stream.TARGET
from batchspec.engine.verify import rejection_sample

SP = batchspec.SamplingParams


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 17), vocab=st.integers(1, 70000), spread=st.integers(1, 4), nans=st.integers(0, 3),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]), seed=st.integers(0, 2**31))
def test_greedy_is_argmax_with_ties_and_nans(rows, vocab, spread, nans, dtype, seed):
    """``greedy`` (``max(-1)``, faster on CPU) picks what ``argmax`` picks: the first of tied maxima, a NaN first."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-spread, spread + 1, (rows, 2, vocab), generator=g).to(dtype)  # few values: many ties
    logits.view(-1)[torch.randint(0, logits.numel(), (nans,), generator=g)] = float("nan")
    assert torch.equal(greedy(logits), logits.argmax(-1))


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8),
                                                       (0.5, 10, 0.6), (1.0, 1, 1.0), (2.0, 0, 0.05)])
def test_warp_matches_hf_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, 40, generator=g, dtype=torch.float64) * 3
    logits[0, 0, :4] = logits[0, 0, 0]  # ties at the top
    flat = logits.reshape(-1, 40)
    want = TemperatureLogitsWarper(temperature)(None, flat)
    if top_k:
        want = TopKLogitsWarper(top_k)(None, want)
    if top_p < 1:
        want = TopPLogitsWarper(top_p)(None, want)
    want = want.softmax(-1).reshape(logits.shape)
    b = logits.shape[0]
    got = warp(logits, torch.full((b,), temperature, dtype=torch.float64), torch.full((b,), top_k),
               torch.full((b,), top_p, dtype=torch.float64))
    torch.testing.assert_close(got, want)


def test_warp_per_row_parameters_and_greedy_rows():
    logits = torch.randn(3, 2, 30, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    t, k, p = torch.tensor([0.0, 1.0, 0.5]), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.7])
    got = warp(logits, t, k, p)
    assert torch.equal(got[0], torch.nn.functional.one_hot(logits[0].argmax(-1), 30).double())
    assert ((got[1] > 0).sum(-1) == 3).all()
    assert torch.allclose(got.sum(-1), torch.ones(3, 2, dtype=torch.float64))
    assert torch.equal(warp(logits[1:2], t[1:2], k[1:2], p[1:2]), got[1:2])  # a row's result ignores its batch


def test_uniforms_are_uniform_independent_and_keyed():
    seed = torch.tensor([0, 1, 2**40 + 5, 2**62])
    index = torch.arange(20000)[None, :].expand(4, -1)
    u = uniforms(seed, index, DRAFT)
    assert u.dtype == torch.float64 and (u >= 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u.flatten().float(), bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.005
    assert abs(torch.corrcoef(torch.stack([u[0, :-1], u[0, 1:]]))[0, 1]) < 0.03  # consecutive indices
    assert abs(torch.corrcoef(u[:2])[0, 1]) < 0.03  # neighbouring seeds
    other = uniforms(seed, index, ACCEPT)
    assert abs(torch.corrcoef(torch.stack([u[0], other[0]]))[0, 1]) < 0.03  # streams
    assert torch.equal(u, uniforms(seed, index, DRAFT))
    assert torch.equal(u[2:3, 100:110], uniforms(seed[2:3], index[2:3, 100:110], DRAFT))  # a pure function


def test_draw_follows_probabilities_and_never_draws_zero_mass():
    probs = torch.tensor([0.0, 0.2, 0.0, 0.5, 0.3, 0.0], dtype=torch.float64)
    u = uniforms(torch.tensor([7]), torch.arange(100000)[None, :], TARGET)[0]
    got = draw(probs.expand(len(u), -1), u)
    freq = torch.bincount(got, minlength=6).double() / len(u)
    assert freq[[0, 2, 5]].sum() == 0
    assert (freq - probs).abs().max() < 0.01
    assert draw(2 * probs, torch.tensor(0.999999)) == 4  # unnormalised input


def _one_step(p, q, residual="p-q", n=200000, lookup_token=None):
    """Emitted first token of one speculative step with a single draft token, many seeds."""
    v = p.shape[-1]
    seed = torch.arange(n)
    zero = torch.zeros(n, 1, dtype=torch.long)
    if lookup_token is None:
        drafts = draw(q.expand(n, v), uniforms(seed, zero, DRAFT)[:, 0])[:, None]
        qq = q.expand(n, 1, v)
    else:
        drafts, qq = torch.full((n, 1), lookup_token), None
    pp = p.expand(n, 2, v)
    accepted, bonus = rejection_sample(pp, qq, drafts, torch.ones(n, dtype=torch.long),
                                       uniforms(seed, zero, ACCEPT), uniforms(seed, torch.cat([zero, zero + 1], 1), TARGET),
                                       residual)
    first = torch.where(accepted > 0, drafts[:, 0], bonus)
    return torch.bincount(first, minlength=v).double() / n, accepted.double().mean().item()


def test_rejection_sampler_is_exact_and_faults_are_not():
    p = torch.tensor([0.05, 0.4, 0.25, 0.0, 0.3], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.1, 0.2, 0.1], dtype=torch.float64)
    freq, acc = _one_step(p, q)
    assert (freq - p).abs().max() < 0.005  # 200k draws: standard error <= 0.0011
    assert abs(acc - torch.minimum(p, q).sum().item()) < 0.005  # acceptance rate = sum min(p, q)
    assert freq[3] == 0
    for residual in ("q", "p"):
        bad, _ = _one_step(p, q, residual)
        assert (bad - p).abs().max() > 0.03
    # deterministic drafter (prompt lookup): q is one-hot on its token
    freq, acc = _one_step(p, q, lookup_token=1)
    assert (freq - p).abs().max() < 0.005 and abs(acc - 0.4) < 0.005
    bad, _ = _one_step(p, q, "p", lookup_token=1)
    assert (bad - p).abs().max() > 0.1


def test_rejection_sampler_bonus_after_full_acceptance():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]], dtype=torch.float64)
    q = torch.tensor([[[0.0, 1.0, 0.0]]], dtype=torch.float64)
    u = torch.tensor([[0.5]], dtype=torch.float64)
    accepted, bonus = rejection_sample(p, q, torch.tensor([[1]]), torch.tensor([1]), u, u.expand(1, 2))
    assert accepted.tolist() == [1] and bonus.tolist() == [2]


PROMPTS = tiny.prompts(7, seed=5)


def _sample(draft, layout="slotmask", bs=8, scheduler="static", k=3, order=None):
    t = tiny.target()
    params = [SP(max_tokens=17, temperature=0.9, top_k=(8 if i % 2 else 0), top_p=(0.85 if i % 3 == 0 else 1.0),
                 seed=1000 + i) for i in range(len(PROMPTS))]
    order = order or list(range(len(PROMPTS)))
    llm = batchspec.LLM(t, draft=draft, layout=layout, batch_size=bs, scheduler=scheduler, num_draft_tokens=k,
                        check_invariants=True)
    outs = llm.generate([PROMPTS[i] for i in order], [params[i] for i in order])
    got = [None] * len(order)
    for o, i in zip(outs, order):
        got[i] = o.token_ids
    return got, llm.stats


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup", "none"])
def test_seeded_request_is_batch_invariant(drafter):
    draft = {"model": tiny.draft(), "prompt-lookup": "prompt-lookup", "none": None}[drafter]
    ref, stats = _sample(draft, bs=1)
    if drafter == "model":
        assert stats.accepted > 0 and stats.accepted < stats.drafted  # some drafts accepted, some rejected
    for kwargs in ({"bs": 3}, {"bs": 8}, {"layout": "eqspec", "bs": 3}, {"scheduler": "continuous", "bs": 2},
                   {"scheduler": "exspec", "bs": 2},
                   {"bs": 4, "order": [6, 2, 0, 5, 1, 3, 4]}):
        got, _ = _sample(draft, **kwargs)
        assert got == ref, kwargs
    assert len({tuple(r) for r in ref}) == len(ref)


def test_sampling_differs_by_seed_and_greedy_rows_stay_exact():
    t, d = tiny.target(), tiny.draft()
    llm = batchspec.LLM(t, draft=d, batch_size=6, num_draft_tokens=4, check_invariants=True)
    p = PROMPTS[2]
    hot = llm.generate([p] * 5, [SP(max_tokens=12, temperature=1.0, seed=s) for s in range(5)])
    assert len({tuple(o.token_ids) for o in hot}) > 1
    mixed = [SP(max_tokens=15, temperature=(1.0 if i % 2 else 0.0), seed=i) for i in range(len(PROMPTS))]
    outs = llm.generate(PROMPTS, mixed)
    for i, (o, prompt) in enumerate(zip(outs, PROMPTS)):
        if i % 2 == 0:
            assert o.token_ids == tiny.oracle(t, prompt, 15)


def test_unseeded_requests_follow_torch_global_seed():
    llm = batchspec.LLM(tiny.target(), batch_size=4)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append([o.token_ids for o in llm.generate(PROMPTS[:3], SP(max_tokens=8, temperature=1.0))])
    assert runs[0] == runs[1]
