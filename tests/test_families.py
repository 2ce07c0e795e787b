"""Qwen2, Qwen3, Gemma 3 and Mistral on the CPU fast paths: the C layer (``kernels/llama.py``, ``layer.c``'s hooks:
Qwen2's q/k/v biases, Qwen3's RMS norms of each query and key head, Gemma 3's output norms, GELU MLP and local layers'
windows, Mistral's window on every layer) and the whole prefill (``model/prefill.py``). The C path's logits, hidden
states and cache equal the model's own forward (fp32, to its rounding); the whole prefill leaves the grouped prefill's
state (float64); generation is HF ``generate`` at batch size 1, plain, with prompt lookup and with a draft model, at
batch 1 and 8, with the kernel's entry point seen to run; Gemma 3's and Mistral's rows cross the window inside a round,
with ragged acceptance."""

from __future__ import annotations

import copy
import functools

import pytest
import tiny
import torch
from test_kv import _ragged_state, _spy_on_fused
from test_prefill_whole import _compare

import batchspec
from batchspec.batch import prefilling as batch
from batchspec.model import kernels
from batchspec.model import prefill as whole
from batchspec.model.kernels import llama as fused
from batchspec.model.runner import Runner

ARCHS = ["qwen2", "qwen3", "gemma3", "mistral"]
needs_kernel = pytest.mark.skipif(kernels.library() is None, reason="the C kernels are not built here")


@functools.lru_cache(maxsize=None)
def model(arch: str, dtype=torch.float32, draft: bool = False):
    """``tiny.target(arch)`` (or its draft) in ``dtype``, a Qwen3's head norms made random (they start as ones, which
    would hide a norm applied with the other's weight)."""
    m = copy.deepcopy(tiny.draft(arch) if draft else tiny.target(arch)).to(dtype)
    g = torch.Generator().manual_seed(9 + draft)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


@pytest.fixture
def layer_calls(monkeypatch) -> list[int]:
    """The rows of each call of the C layer's entry point (``llama_layers``)."""
    lib, calls = kernels.library(), []

    class Spy:
        def __getattr__(self, name):
            return getattr(lib, name)

        def llama_layers(self, *a):
            calls.append(a[7][9])
            return lib.llama_layers(*a)

    monkeypatch.setattr(fused, "_load", lambda: Spy())
    return calls


@pytest.fixture
def prefills(monkeypatch) -> list[int]:
    """The tokens of each whole-prefill forward."""
    calls, real = [], whole._forward

    def spy(m, cache, prompts, *args):
        calls.append(sum(map(len, prompts)))
        return real(m, cache, prompts, *args)

    monkeypatch.setattr(whole, "_forward", spy)
    return calls


@needs_kernel
@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_c_layer_matches_the_models_forward(monkeypatch, layer_calls, arch, q):
    """One forward over ragged rows (a hidden slot, a hidden new slot): logits, final hidden states and every cached
    key/value equal the model's own forward."""
    t = model(arch)
    assert fused.plan(t) is not None
    ids = torch.tensor([[5, 6, 7][:q]] * 5)
    new_valid = torch.ones(5, q, dtype=torch.bool)
    new_valid[1, 0] = False
    with monkeypatch.context() as m:
        m.setattr(fused, "forward", lambda *a, **k: None)
        ref = _ragged_state(t, 3)
        want = ref.append(ids, new_valid, hidden=True)
    got = _ragged_state(t, 3)
    del layer_calls[:]
    out = got.append(ids, new_valid, hidden=True)
    assert layer_calls == [5 * q]
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden, want.hidden, rtol=1e-4, atol=1e-4)
    for a, b in zip(got.cache.layers, ref.cache.layers):  # (each softmax summed in another order than torch's)
        vis = got.valid[:, None, :, None].expand_as(a.keys)
        torch.testing.assert_close(a.keys[vis], b.keys[vis], rtol=5e-5, atol=5e-5)
        torch.testing.assert_close(a.values[vis], b.values[vis], rtol=5e-5, atol=5e-5)


@needs_kernel
@pytest.mark.parametrize("arch", ARCHS)
def test_the_c_layer_computes_only_real_rows(monkeypatch, layer_calls, arch):
    """A packed forward (``counts``): the real tokens' logits equal the model's forward over the whole rectangle."""
    t = model(arch)
    ids, counts = torch.tensor([[5, 6, 7, 8]] * 5), torch.tensor([1, 4, 2, 1, 3])
    real = torch.arange(4)[None, :] < counts[:, None]
    with monkeypatch.context() as m:
        m.setattr(fused, "forward", lambda *a, **k: None)
        want = _ragged_state(t, 3).append(ids, counts=counts, hidden=True)
    got = _ragged_state(t, 3)
    del layer_calls[:]
    out = got.append(ids, counts=counts, hidden=True)
    assert layer_calls == [int(counts.sum())]
    torch.testing.assert_close(out.logits[real], want.logits[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.hidden[real], want.hidden[real], rtol=1e-4, atol=1e-4)


PREFIX = tiny.prompts(1, seed=31, lo=20, hi=21)[0]
PROMPTS = [[7], [5, 9]] + tiny.prompts(6, seed=32, lo=3, hi=50)


@pytest.mark.parametrize("prefix", [[], PREFIX], ids=["no-prefix", "shared-prefix"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_whole_prefill_leaves_the_grouped_prefills_state(monkeypatch, prefills, arch, prefix):
    """float64: keys, values and hidden states equal the grouped prefill's to float64 rounding."""
    t = model(arch, torch.float64)
    prompts = [prefix + p for p in PROMPTS]
    done = batch.prefill(Runner(t), prompts, hidden=True)
    assert len(prefills) == 1
    monkeypatch.setattr(whole, "supported", lambda m: False)
    _compare(batch.prefill(Runner(t), prompts, hidden=True, overhead=0), done)


@needs_kernel
@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "draft"])
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("arch", ARCHS)
def test_generation_is_the_oracles(monkeypatch, layer_calls, prefills, arch, batch_size, drafter):
    """Every few-token forward of the target (and of the draft model) runs in the C layer."""
    t = model(arch)
    forwards = _spy_on_fused(monkeypatch)
    draft = {"none": None, "prompt-lookup": "prompt-lookup", "draft": model(arch, draft=True)}[drafter]
    prompts = tiny.prompts(8, seed=13, lo=2, hi=60)
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, batch_size=batch_size, check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=14))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 14) for p in prompts]
    assert forwards and all(forwards) and len(layer_calls) == len(forwards)
    if batch_size > 1:
        assert prefills  # more prompt tokens than the C layer's few-row forwards take


def test_what_they_do_not_cover_falls_back(monkeypatch):
    """float64, an output projection with a bias, head norms with another epsilon: the C layer declines; other
    architectures and attention implementations run the grouped prefill."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    assert fused.plan(model("qwen2", torch.float64)) is None
    cfg = Qwen3Config(vocab_size=tiny.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, attention_bias=True)
    assert fused.plan(Qwen3ForCausalLM(cfg).eval()) is None
    other = copy.deepcopy(model("qwen3"))
    other.model.layers[0].self_attn.k_norm.variance_epsilon = 1e-3
    assert fused.plan(other) is None
    assert whole.supported(model("qwen3", torch.float64)) and not whole.supported(tiny.target("gpt2"))
    eager = copy.deepcopy(model("qwen2"))
    eager.config._attn_implementation = "eager"
    assert not whole.supported(eager)


@needs_kernel
@pytest.mark.parametrize("arch", ARCHS)
def test_packed_weights_give_the_fp32_bits(layer_calls, arch):
    """Weights holding bf16 values, packed (``pack_model``: Qwen2's biased q/k/v stay fp32 linears, the rest bf16):
    the C layer's logits have the fp32 model's bits."""
    from batchspec.model import weights as W

    fp32 = copy.deepcopy(model(arch))
    with torch.no_grad():
        for p in fp32.parameters():
            p.copy_(p.bfloat16().float())
    packed = copy.deepcopy(fp32)
    formats = W.pack_model(packed).formats
    assert formats.get("bf16") and fused.plan(packed) is not None
    outs = []
    for m in (fp32, packed):
        st = _ragged_state(m, 3)
        outs.append(st.append(torch.tensor([[5, 6]] * 5)).logits)
    assert layer_calls and torch.equal(outs[0], outs[1])


@needs_kernel
@pytest.mark.parametrize("drafter", ["prompt-lookup", "draft"])
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_windows_in_the_c_layer(monkeypatch, layer_calls, arch, batch_size, drafter):
    """Rows whose visible tokens cross the local layers' window inside a forward of several new tokens (its first
    queries see the row's first token, its last ones do not), acceptance ragged: HF ``generate``'s tokens, every
    few-token forward in the C layer."""
    t, real, crossed, ran = model(arch), fused.forward, [], []

    def spy(m, cache, input_ids, position_ids, visible, *a, **k):
        q = input_ids.shape[1]
        if q > 1 and visible.shape[1] > q:
            before, after = visible[:, :-q].sum(1), visible.sum(1)
            crossed.append(int(((before < tiny.WINDOW) & (after > tiny.WINDOW)).sum()))
        out = real(m, cache, input_ids, position_ids, visible, *a, **k)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(fused, "forward", spy)
    draft = {"prompt-lookup": "prompt-lookup", "draft": model(arch, draft=True)}[drafter]
    prompts = tiny.prompts(6, seed=5, lo=2, hi=12) + [[7], [5, 9]]
    llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, batch_size=batch_size, check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=20))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 20) for p in prompts]
    assert ran and all(ran) and len(layer_calls) == len(ran)
    assert sum(crossed) > 0, "no row's history crossed the window inside a round"
    assert llm.stats.accepted > 0
    if drafter == "draft" and batch_size > 1:
        assert llm.stats.ragged_rounds > 0, "rows never accepted different counts in the same round"


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 16])  # the AVX-512 value sums (6 and 3 queries at once) and the 8-lane ones
def test_a_verification_block_gives_each_token_the_bits_of_its_decode_step(head_dim):
    """fp32, the C layer: a token's hidden state in a block of 1-8 new tokens, after any number of holes (rejected
    drafts hidden) and context lengths across a lane boundary, has the bits of a decode step of it alone. Each
    query's softmax sums its visible scores alone, in order (``layer.c: attend``), so speculation leaves every logit,
    and with it every greedy token and log-probability, as plain decoding computes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from batchspec.batch.prefilling import prefill

    torch.manual_seed(0)
    heads = 576 // head_dim
    cfg = LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=heads // 3, head_dim=head_dim,
                      max_position_embeddings=1024)
    runner = Runner(LlamaForCausalLM(cfg).eval())
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for context in (37, 40, 43):
            state = prefill(runner, torch.randint(0, 256, (1, context), generator=g).tolist())
            ids = torch.randint(0, 256, (1, 8), generator=g)
            steps = []
            for width in (1, 8, 2, 3, 4, 5, 6, 7, 1):  # each block's slots hidden after it: holes before the next
                out = state.append(ids[:, :width], hidden=True)
                steps.append(out.hidden[0, 0].clone())
                state.hide_tail(width, torch.zeros(1, dtype=torch.long))
            assert int((~state.valid).sum()) > 30  # the holes were there
            assert all(torch.equal(h, steps[0]) for h in steps), context
