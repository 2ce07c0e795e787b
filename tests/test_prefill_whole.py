"""The whole prefill (``model/prefill.py``): every prompt's tokens end to end in one forward, no padding, causal
attention per row. It leaves the grouped prefill's state (same slots, tokens and positions; keys, values and hidden
states equal to float64 rounding), runs in chunks when the tokens are many, and generation after it is HF
``generate`` at batch size 1, in float64 and in fp32 with packed weights."""

import pytest
import tiny
import torch

import batchspec
from batchspec.batch import prefilling as batch
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


def test_a_heads_features_are_the_last_layers_input_and_that_layer_computes_only_keys_and_values(monkeypatch):
    """``FEATURES``: at each prompt position the last layer's input under the final norm (HF's hidden states before
    the last layer), the cache as with the final states, and of the last layer only the keys' and values'
    projections run."""
    t = tiny.target()
    prompts = [PREFIX + p for p in PROMPTS[2:]]
    exact = batch.prefill(Runner(t), prompts, hidden=True)
    last, real, calls = t.model.layers[-1], whole._linear, []
    names = {id(m): n for n, m in last.named_modules()}
    monkeypatch.setattr(whole, "_linear", lambda m, *a: calls.append(names.get(id(m))) or real(m, *a))
    state, states = batch.prefill(Runner(t), prompts, hidden=batch.FEATURES)
    # one whole forward; of the last layer only the keys' and values' projections
    assert [n for n in calls if n] == ["self_attn.k_proj", "self_attn.v_proj"]
    _compare(exact, (state, exact[1]))
    width = states.shape[1]
    for r, p in enumerate(prompts):
        with torch.no_grad():
            hf = t(torch.tensor([p[:-1]]), output_hidden_states=True).hidden_states[-2]
        want = t.model.norm(hf)[0]
        torch.testing.assert_close(states[r, width - len(p) + 1 :], want, rtol=0, atol=1e-12)
    assert not torch.allclose(states, exact[1])  # not the final states


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
    for model in (tiny.target("gpt2"), tiny.target(attn="eager")):
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


def test_packed_weights_kept_expanded_give_the_bits_of_expanding_them_at_each_forward(tmp_path, monkeypatch):
    """``prefill.KEEP_FRACTION``: a packed weight expanded once, kept in oneDNN's layout, gives every prefilled key,
    value and hidden state the bits it has when the weight is expanded at each forward (what a budget too small to
    keep any does); a weight changed in place is expanded again."""
    import weakref

    from test_weights import quantised_target

    from batchspec.model.weights import PackedLinear

    path, _ = quantised_target(tmp_path)
    model = batchspec.LLM(str(path), draft=None).target
    linears = [m for m in model.model.layers.modules() if isinstance(m, PackedLinear)]
    assert linears and torch.backends.mkldnn.is_available()
    prompts = [PREFIX + p for p in PROMPTS]
    width = max(map(len, prompts))

    def run(budget):
        monkeypatch.setattr(whole, "_kept", weakref.WeakKeyDictionary())
        monkeypatch.setattr(whole, "_keeping", {"budget": budget, "used": 0})
        return whole.prefill(model, prompts, SHARED, width, True)

    def same(a, b):
        flat = [t for pair in a[0].tensors() for t in pair], [t for pair in b[0].tensors() for t in pair]
        assert len(flat[0]) == len(flat[1]) and all(map(torch.equal, *flat)) and torch.equal(a[1], b[1])

    each = run(0)
    assert not whole._kept  # nothing fits: every weight expanded at each forward
    kept = run(None)
    assert set(whole._kept) == set(linears) and whole._keeping["used"] == sum(4 * m.in_features * m.out_features
                                                                               for m in linears)
    same(kept, each)
    same(whole.prefill(model, prompts, SHARED, width, True), each)  # the kept weights again
    with torch.no_grad():
        linears[0].q[:3].zero_()  # its codes changed in place: expanded again, the new bits
    changed = whole.prefill(model, prompts, SHARED, width, True)
    assert not torch.equal(changed[1], kept[1])
    same(changed, run(0))


def _torch_causal(q, keys, values, first, scale):
    """Reference: torch's attention over zero queries for positions 0..first-1 then ``q`` (square, so causal)."""
    full = torch.cat([q.new_zeros((first, *q.shape[1:])), q]).transpose(0, 1)[None]
    got = torch.nn.functional.scaled_dot_product_attention(full, keys[None], values[None], is_causal=True,
                                                           scale=scale, enable_gqa=q.shape[1] != keys.shape[0])
    return got[0, :, first:].transpose(0, 1)


@pytest.mark.parametrize("n,first", [(1, 0), (5, 0), (7, 3), (40, 0), (70, 20), (97, 31), (300, 24), (701, 100)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
def test_the_causal_kernel_is_torchs_attention(n, first, heads, kv_heads):
    """``kernels.causal_attention`` against torch's (fp32, to its rounding): queries of positions ``first..n-1``,
    blocks of 6 queries, tiles of 24 and steps of 32 keys cut anywhere, grouped and plain heads, strided query and key
    views."""
    from batchspec.model import kernels

    if kernels.library() is None or torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the kernel needs the built kernels and AVX-512")
    g = torch.Generator().manual_seed(n * 100 + first)
    q = torch.randn(n - first, heads + 2, 64, generator=g)[:, 1:-1] * 3  # heads 64 apart, rows (heads + 2) * 64
    cache = torch.randn(2, kv_heads, n + 10, 64, generator=g) * 3  # [k/v, kv heads, slots, D]: rows of a wider cache
    keys, values = cache[0, :, 5 : 5 + n], cache[1, :, 5 : 5 + n]
    out = torch.full_like(q, float("nan"))
    assert kernels.causal_attention(q, keys, values, out, first, 0.125)
    # values ~3 in size, sums in another order than torch's: fp32 rounding of ~1e-5 a value (up to 1.9e-5 seen on one
    # CPU's torch)
    torch.testing.assert_close(out, _torch_causal(q, keys, values, first, 0.125), rtol=1e-5, atol=5e-5)
    narrow = [t[..., :32].contiguous() for t in (q, keys, values, out)]  # head dimension 32: not this kernel's
    assert not kernels.causal_attention(*narrow, first, 0.1)


def test_the_causal_kernel_gives_a_query_the_same_bits_in_any_tile():
    """A query's output has the same bits computed among many (tiles of queries and heads shared out between
    threads, steps of keys shared by a tile) as alone: its sums run in one order whatever runs beside it."""
    from batchspec.model import kernels

    if kernels.library() is None or torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the kernel needs the built kernels and AVX-512")
    g = torch.Generator().manual_seed(5)
    n, first = 400, 37
    q, keys, values = torch.randn(n - first, 9, 64, generator=g) * 3, *torch.randn(2, 3, n, 64, generator=g) * 3
    out = torch.empty_like(q)
    assert kernels.causal_attention(q, keys, values, out, first, 0.125)
    for i in (first, first + 5, first + 6, first + 23, first + 24, 200, n - 1):
        alone = torch.empty_like(q[:1])
        assert kernels.causal_attention(q[i - first : i - first + 1], keys[:, : i + 1], values[:, : i + 1], alone, i,
                                        0.125)
        assert torch.equal(alone, out[i - first : i - first + 1]), i


def test_fp32_generation_with_the_causal_kernel_is_the_oracles(forwards, monkeypatch):
    """An fp32 Llama with heads of 64 dimensions (two query heads on one key/value head): its whole prefill's
    attention runs in the kernel, and generation is HF ``generate``'s at batch size 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from batchspec.model import kernels

    if kernels.library() is None or torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the kernel needs the built kernels and AVX-512")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0 if tiny.VOCAB in p.shape else 2.5)
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    ran, real = [], kernels.causal_attention
    monkeypatch.setattr(kernels, "causal_attention", lambda *a: ran.append(real(*a)) or ran[-1])
    prompts = [PREFIX + p for p in PROMPTS]
    outs = batchspec.LLM(model, draft=None, batch_size=16).generate(prompts, batchspec.SamplingParams(max_tokens=12))
    assert forwards and ran and all(ran)
    assert [o.token_ids for o in outs] == [tiny.oracle(model, p, 12) for p in prompts]
