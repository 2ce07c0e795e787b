"""Static-shape steps (``graphs.py``): exact against the batch-1 oracle, padding rows never leak, prefill groups.

On CPU the static steps run without capture (``graphs="static"``); the CUDA tests capture and replay graphs and are
skipped without a GPU."""

from __future__ import annotations

import copy

import pytest
import tiny
import torch

import batchspec
from batchspec import SamplingParams
from batchspec.batch.prefilling import prefill, prefill_groups
from batchspec.model import graphs, kv
from batchspec.model.runner import Runner

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _static_steps(llm) -> int:
    st = llm.parts.target.static
    assert st, "the static path must cover the tiny Llama"
    return st.steps


@pytest.mark.parametrize("draft", [None, "model", "prompt-lookup"])
@pytest.mark.parametrize("layout", ["slotmask", "eqspec"])
@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_static_steps_exact(draft, layout, scheduler):
    t = tiny.target()
    d = tiny.draft() if draft == "model" else draft
    ps = tiny.prompts(7, seed=3)
    limits = [24, 9, 17, 24, 5, 24, 13]  # rows finish at different rounds: the batch narrows inside its bucket
    llm = batchspec.LLM(t, draft=d, graphs="static", layout=layout, scheduler=scheduler, batch_size=3,
                        check_invariants=True, num_draft_tokens=3, speculation="fixed")
    outs = llm.generate(ps, [SamplingParams(max_tokens=m) for m in limits])
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, m) for p, m in zip(ps, limits)]
    assert _static_steps(llm) >= llm.stats.verify_calls  # every decode/verify step went through the static path
    if draft is not None:
        assert llm.stats.ragged_rounds > 0
        assert max(llm.stats.lengths) == 3 and llm.stats.full_accepts > 0
    if draft == "model":
        assert llm.drafter.runner.static.steps > 0


def test_padding_rows_never_leak():
    """Rows of the buffer beyond the batch hold NaN: the real rows' logits and caches are untouched by them."""
    t = tiny.target()
    ps = [p for p in tiny.prompts(5, seed=5) if len(p) > 1][:3]  # 3 rows in a bucket of 4
    outs = []
    for mode in ("off", "static"):
        runner = Runner(t, mode)
        state = prefill(runner, ps)
        for layer in state.cache.layers:
            rows = kv.whole_buffer(layer._k)
            assert rows.shape[0] == kv.row_capacity(len(ps)) == 4
            rows[len(ps):] = float("nan")
            kv.whole_buffer(layer._v)[len(ps):] = float("nan")
        ids = torch.tensor([[p[-1], 7] for p in ps])
        before = runner.static.steps if runner.static else 0
        with torch.inference_mode():
            out = state.append(ids, hidden=True)
        assert torch.isfinite(out.logits).all() and torch.isfinite(out.hidden).all()
        assert all(torch.isfinite(layer.keys).all() for layer in state.cache.layers)
        outs.append(out)
    assert runner.static.steps == before + 1  # the append ran as one static step over the padded bucket
    torch.testing.assert_close(outs[1].logits, outs[0].logits, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[1].hidden, outs[0].hidden, rtol=1e-12, atol=1e-12)


def test_unsupported_models_run_their_modules():
    for model in (tiny.target("qwen3"), tiny.target("gpt2"), tiny.target(attn="eager")):
        assert not graphs.supported(model)
        assert Runner(model, "static").static is None
    llm = batchspec.LLM(tiny.target("qwen3"), graphs="static", batch_size=2)
    p = tiny.prompts(2, seed=1)
    assert [o.token_ids for o in llm.generate(p, SamplingParams(max_tokens=8))] == [
        tiny.oracle(tiny.target("qwen3"), q, 8) for q in p]


def test_graph_mode_is_checked():
    with pytest.raises(ValueError, match="graphs must be one of"):
        batchspec.LLM(tiny.target(), graphs="always")


def test_cpu_auto_mode_is_off():
    assert Runner(tiny.target(), "auto").static is None
    assert kv.slot_capacity(300, torch.device("cpu")) == 300
    assert kv.slot_capacity(300, torch.device("cuda")) == 512 and kv.slot_capacity(3, torch.device("cuda")) == 256


@pytest.mark.parametrize("lengths,overhead,want", [
    ([5, 3, 5, 9, 0, 3], 1, [[4], [1, 5], [0, 2], [3]]),  # small overhead: equal lengths share, nothing padded
    ([5, 3, 5, 9, 0, 3], 4096, [[4, 1, 5, 0, 2, 3]]),  # large overhead: one padded forward
])
def test_prefill_groups(lengths, overhead, want):
    assert prefill_groups(lengths, overhead) == want


def test_prefill_groups_bound_padded_tokens():
    groups = prefill_groups([2000] * 40, 4096, max_tokens=1 << 16)
    assert sorted(r for g in groups for r in g) == list(range(40))
    assert all(len(g) * 2000 <= 1 << 16 for g in groups) and len(groups) == 2


@pytest.mark.parametrize("draft", [None, "model"])
def test_padded_prefill_exact(monkeypatch, draft):
    """A GPU's prefill pads prompts of different lengths into one forward: outputs stay exact (checked on CPU)."""
    monkeypatch.setitem(batchspec.batch.prefilling.PREFILL_OVERHEAD, "cpu", 1 << 20)
    t = tiny.target()
    ps = tiny.prompts(6, seed=7)
    assert len({len(p) for p in ps}) > 2
    llm = batchspec.LLM(t, draft=tiny.draft() if draft else None, batch_size=6, check_invariants=True,
                        num_draft_tokens=3)
    outs = llm.generate(ps, SamplingParams(max_tokens=16))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 16) for p in ps]


@cuda
@pytest.mark.parametrize("draft", [None, "model", "prompt-lookup"])
def test_cuda_graphs_exact(draft):
    t = tiny.target(dtype=torch.float64)
    dev_t = tiny._build("llama", 0, torch.float64, "sdpa").to("cuda")
    d = None if draft is None else draft if draft == "prompt-lookup" else copy.deepcopy(tiny.draft()).to("cuda")
    ps = tiny.prompts(6, seed=4)
    llm = batchspec.LLM(dev_t, draft=d, batch_size=6, check_invariants=True, num_draft_tokens=3, speculation="fixed")
    sp = SamplingParams(max_tokens=20)
    first = llm.generate(ps, sp)
    again = llm.generate(ps, sp)
    want = [tiny.oracle(t, p, 20) for p in ps]
    assert [o.token_ids for o in first] == want and [o.token_ids for o in again] == want
    st = llm.parts.target.static
    assert st.capture and st.captured > 0 and st.steps > 0


def test_released_buffers_serve_the_next_batch(monkeypatch):
    """Finished batches give their cache buffers back; the next batch of the same shape reuses them (so a GPU's
    graphs, bound to buffer addresses, are reused); outputs stay exact."""
    monkeypatch.setattr(kv, "POOL_DEVICES", {"cpu"})
    monkeypatch.setattr(kv, "_pool", {})
    t = tiny.target()
    ps = [p for p in tiny.prompts(6, seed=9) if len(p) > 2][:4]
    seen = set()
    real = kv._rows_buffer

    def spy(like, rows, slots, dim):
        buf = real(like, rows, slots, dim)
        seen.add(buf.data_ptr())
        assert not buf.any()  # handed out zeroed
        return buf

    monkeypatch.setattr(kv, "_rows_buffer", spy)
    llm = batchspec.LLM(t, draft=tiny.draft(), graphs="static", batch_size=1, check_invariants=True,
                        num_draft_tokens=3, prefix_cache=0)  # the second run prefills as the first did
    sp = SamplingParams(max_tokens=12)
    assert [o.token_ids for o in llm.generate(ps, sp)] == [tiny.oracle(t, p, 12) for p in ps]
    first = set(seen)
    assert sum(len(v) for v in kv._pool.values()) > 0
    seen.clear()
    assert [o.token_ids for o in llm.generate(ps, sp)] == [tiny.oracle(t, p, 12) for p in ps]
    assert seen <= first  # every buffer of the second run came back from the first
