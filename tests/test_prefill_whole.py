"""The whole prefill (``model/prefill.py``): every prompt's tokens end to end in one forward, no padding, causal
attention per row. It leaves the grouped prefill's state (same slots, tokens and positions; keys, values and hidden
states equal to float64 rounding), runs in chunks when the tokens are many, and generation after it is HF
``generate`` at batch size 1, in float64 and in fp32 with packed weights."""

import pytest
import tiny
import torch

import batchspec
from batchspec.engine import batch
from batchspec.model import prefill as whole
from batchspec.model.loading import load_model
from batchspec.model.runner import Runner

PREFIX = tiny.prompts(1, seed=31, lo=20, hi=21)[0]
# lengths 1 (caches nothing), 2, and up to ~50: ragged, some equal
PROMPTS = [[7], [5, 9]] + tiny.prompts(6, seed=32, lo=3, hi=50) + [[4] * 12, [6] * 12]
# behind PREFIX, [7] caches PREFIX alone, and every row keeps a cached token of its own: all but its last are shared
SHARED = len(PREFIX) - 1


@pytest.fixture
def forwards(monkeypatch):
    """``(rows, shared)`` of each whole-prefill forward."""
    calls = []
    real = whole._forward

    def spy(model, cache, prompts, rows, shared, *args):
        calls.append((list(rows), shared))
        return real(model, cache, prompts, rows, shared, *args)

    monkeypatch.setattr(whole, "_forward", spy)
    return calls


def _compare(a, b):
    (sa, ha), (sb, hb) = a, b
    for name in ("valid", "tokens", "positions"):
        assert torch.equal(getattr(sa, name), getattr(sb, name)), name
    visible = sa.valid[:, None, :, None]
    assert len(sa.cache.tensors()) == len(sb.cache.tensors())
    for (k0, v0), (k1, v1) in zip(sa.cache.tensors(), sb.cache.tensors()):
        assert k0.shape == k1.shape
        torch.testing.assert_close(k1 * visible, k0 * visible, rtol=0, atol=1e-12)
        torch.testing.assert_close(v1 * visible, v0 * visible, rtol=0, atol=1e-12)
        assert not (k1 * ~visible).any()  # padding slots hold zeros
    torch.testing.assert_close(hb, ha, rtol=0, atol=1e-12)
    assert not (hb * ~sb.valid[..., None]).any()


@pytest.mark.parametrize("prefix", [[], PREFIX], ids=["no-prefix", "shared-prefix"])
def test_the_whole_prefill_leaves_the_grouped_prefills_state(forwards, monkeypatch, prefix):
    prompts = [prefix + p for p in PROMPTS] if prefix else PROMPTS
    t = tiny.target()
    done = batch.prefill(Runner(t), prompts, hidden=True)
    assert len(forwards) == 1 and forwards[0][1] == (SHARED if prefix else 0)
    assert forwards[0][0] == list(range(1 if not prefix else 0, len(prompts)))  # a one-token prompt caches nothing
    monkeypatch.setattr(whole, "supported", lambda model: False)
    grouped = batch.prefill(Runner(t), prompts, hidden=True, overhead=0)
    assert len(forwards) == 1
    _compare(grouped, done)


def test_many_tokens_run_in_chunks_of_whole_rows(forwards, monkeypatch):
    t = tiny.target()
    prompts = [PREFIX + p for p in PROMPTS]
    one = batch.prefill(Runner(t), prompts, hidden=True)
    monkeypatch.setattr(whole, "MAX_TOKENS", 80)  # the prefix and ~2 rows a forward
    chunked = batch.prefill(Runner(t), prompts, hidden=True)
    chunks = forwards[1:]
    assert len(chunks) > 3
    assert sorted(r for rows, _ in chunks for r in rows) == list(range(len(prompts)))
    own = [len(p) - 1 - SHARED for p in prompts]
    for rows, shared in chunks:
        assert shared == SHARED  # each chunk computes the prefix for its rows
        assert len(rows) == 1 or shared + sum(own[r] for r in rows) <= 80
    _compare(one, chunked)


def test_what_it_does_not_cover_runs_grouped(forwards):
    for model in (tiny.target("qwen3"), tiny.target(attn="eager")):
        batch.prefill(Runner(model), PROMPTS, hidden=True)
    assert forwards == []


@pytest.mark.parametrize("drafter", ["eagle", "none"])
def test_generation_after_a_whole_prefill_is_the_oracles(forwards, drafter):
    t = tiny.target()
    prompts = [PREFIX + p for p in PROMPTS]
    llm = tiny.fixed_llm(t, draft=tiny.eagle() if drafter == "eagle" else None, num_draft_tokens=3, batch_size=16)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=12))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 12) for p in prompts]
    assert forwards and all(shared == SHARED for _, shared in forwards)


def test_fp32_packed_weights_after_a_whole_prefill_are_the_oracles(forwards, tmp_path):
    """In fp32 the C layer takes prefills of up to ``packed_rows`` tokens; more go whole, here with GGUF-block weights
    expanded for the products."""
    from test_weights import quantised_target

    path, _ = quantised_target(tmp_path)
    llm = batchspec.LLM(str(path), draft=None, batch_size=16)
    assert llm.weights.formats  # packed
    prompts = [PREFIX + p for p in PROMPTS]
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=12))
    assert forwards  # more tokens than the C layer's few-row forwards take
    oracle_model = load_model(path, weights="fp32")
    assert [o.token_ids for o in outs] == [tiny.oracle(oracle_model, p, 12) for p in prompts]
