"""Prefill of prompts that share a prefix (a chat template's system prompt): the prefix is computed once and the rows'
own tokens attend to it, in the grouped prefill (a forward for the prefix, then one per group) and in the whole one
(every token end to end in one forward, ``model/prefill.py``). The state it leaves is the one the plain prefill leaves (same slots, tokens and positions;
keys, values and hidden states equal to float64 rounding), and generation from it is HF ``generate`` at batch size 1,
with a draft model and with a feature-reading head (which reads the prefill's hidden states)."""

import pytest
import tiny
import torch

import batchspec
from batchspec.batch import prefilling as batch
from batchspec.model import prefill as whole
from batchspec.model.runner import Runner

PREFIX = tiny.prompts(1, seed=21, lo=20, hi=21)[0]  # 20 tokens, above SHARED_PREFIX_MIN
TAILS = tiny.prompts(7, seed=22, lo=1, hi=30)  # 1..29 tokens of each row's own (a row of one keeps only its last)
PROMPTS = [PREFIX + t for t in TAILS]


@pytest.fixture(params=["grouped", "whole"])
def shared_calls(request, monkeypatch):
    """The length of each shared prefix a prefill computed once, with the grouped prefill or the whole one."""
    calls = []
    if request.param == "grouped":
        monkeypatch.setattr(whole, "supported", lambda model: False)
        real = batch._prefix

        def spy(runner, prefix, hidden, *rest):
            calls.append(len(prefix))
            return real(runner, prefix, hidden, *rest)

        monkeypatch.setattr(batch, "_prefix", spy)
    else:
        real_forward = whole._forward

        def spy_forward(model, cache, prompts, rows, shared, *args):
            if shared:
                calls.append(shared)
            return real_forward(model, cache, prompts, rows, shared, *args)

        monkeypatch.setattr(whole, "_forward", spy_forward)
    return calls


def _state(prompts, share: bool, monkeypatch):
    monkeypatch.setattr(batch, "SHARED_PREFIX_MIN", 16 if share else 10**9)
    return batch.prefill(Runner(tiny.target()), prompts, hidden=True, overhead=0)


def test_the_shared_prefill_leaves_the_plain_prefills_state(shared_calls, monkeypatch):
    plain, plain_h = _state(PROMPTS, False, monkeypatch)
    assert shared_calls == []
    shared, shared_h = _state(PROMPTS, True, monkeypatch)
    assert shared_calls == [len(PREFIX)]  # every row keeps at least its last cached token: the whole prefix is shared
    for name in ("valid", "tokens", "positions"):
        assert torch.equal(getattr(plain, name), getattr(shared, name)), name
    visible = plain.valid[:, None, :, None]
    for (k0, v0), (k1, v1) in zip(plain.cache.tensors(), shared.cache.tensors()):
        assert k0.shape == k1.shape
        torch.testing.assert_close(k1 * visible, k0 * visible, rtol=0, atol=1e-12)
        torch.testing.assert_close(v1 * visible, v0 * visible, rtol=0, atol=1e-12)
    torch.testing.assert_close(shared_h, plain_h, rtol=0, atol=1e-12)


@pytest.mark.parametrize("prompts", [
    [PREFIX[:15] + t for t in TAILS],  # a prefix below SHARED_PREFIX_MIN
    PROMPTS + [[PREFIX[0]]],  # a one-token prompt caches nothing: nothing all rows share
    [PROMPTS[0]],  # one row
], ids=["short-prefix", "one-token-prompt", "one-row"])
def test_what_is_not_shared(shared_calls, monkeypatch, prompts):
    _state(prompts, True, monkeypatch)
    assert shared_calls == []


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
@pytest.mark.parametrize("drafter", ["model", "eagle", "none"])
def test_generation_after_a_shared_prefill_is_the_oracles(shared_calls, scheduler, drafter):
    t = tiny.target()
    draft = {"model": tiny.draft(), "eagle": tiny.eagle(), "none": None}[drafter]
    prompts = PROMPTS + [PREFIX + [5, 9, 11], PREFIX[:-1]]  # the last one is all prefix but its last token
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, batch_size=4, scheduler=scheduler,
                         check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 12) for p in prompts]
    assert shared_calls  # the batches' prefills shared the prefix
    if draft is not None:
        assert llm.stats.accepted > 0
