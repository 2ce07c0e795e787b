"""The model runner's CPU fast paths: few-row linear layers and attention split into runs of rows, the C kernels."""

import inspect

import pytest
import tiny
import torch
from test_policy import synthetic

import batchspec
from batchspec.model import kernels, runner
from batchspec.speculation import AdaptiveLength


def _visible(firsts, width):
    """Rows whose visible slots start at ``firsts[b]`` and run to the end."""
    return torch.arange(width)[None, :] >= torch.tensor(firsts)[:, None]


def test_row_segments_splits_short_rows_from_long_ones():
    width, q = 100, 3
    segs = runner.row_segments(_visible([80, 90, 85, 0, 10], width), q)
    assert segs == [(0, 3, 80), (3, 5, 0)]


def test_row_segments_declines_when_little_is_saved():
    assert runner.row_segments(_visible([0, 5, 10, 3], 100), 1) is None  # rows of similar lengths
    assert runner.row_segments(_visible([50], 100), 1) is None  # one row: nothing to split
    # a row that sees only its new slots: its run starts at the first query slot
    visible = torch.cat([_visible([100, 0, 0], 100), torch.ones(3, 2, dtype=torch.bool)], 1)
    assert runner.row_segments(visible, 2) == [(0, 1, 100), (1, 3, 0)]
    # a row whose only visible slot is its last query slot still keeps every query slot
    visible = torch.zeros(2, 12, dtype=torch.bool)
    visible[0, -1] = visible[1, :] = True
    assert runner.row_segments(visible, 4) == [(0, 1, 8), (1, 2, 0)]


def test_few_row_linear_matches_linear():
    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(24, 40, bias=bias).double()
        x = torch.randn(3, 2, 24, dtype=torch.float64)
        want = lin(x)
        few = runner.FewRowLinear.sharing(lin)
        assert few.weight is lin.weight and few.bias is lin.bias
        got = few(x)
        many = few(torch.randn(kernels.FEW_ROWS + 1, 24, dtype=torch.float64))  # falls back to nn.Linear
        assert type(lin) is torch.nn.Linear
        assert got.shape == want.shape and got.is_contiguous() and many.shape == (kernels.FEW_ROWS + 1, 40)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_segmented_attention_runs_and_stays_exact(monkeypatch):
    """Prompts of 2-4 and 50-60 tokens in one batch: attention splits into runs, output equals the oracle, and the
    model is left exactly as it was (plain linears, sdpa) for anyone else."""
    t, d = tiny.target(), tiny.draft()
    prompts = [p[:4] for p in tiny.prompts(4, seed=5, lo=2, hi=4)] + tiny.prompts(4, seed=6, lo=50, hi=60)
    used = []
    real = runner.slot_sdpa

    def spy(*args, segments=None, **kwargs):
        used.append(segments)
        return real(*args, segments=segments, **kwargs)

    runner._register_slot_sdpa()
    monkeypatch.setitem(runner.AttentionInterface._global_mapping, runner.SLOT_SDPA, spy)
    for layout in ("slotmask", "eqspec"):
        for draft in (d, None):
            llm = tiny.fixed_llm(t, draft=draft, num_draft_tokens=3, layout=layout, batch_size=8,
                                check_invariants=True)
            outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=12))
            assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 12) for p in prompts]
    assert used and any(s and len(s) == 2 for s in used), "attention never ran in row runs"
    for model in (t, d):
        assert model.config._attn_implementation == "sdpa"
        assert all(type(m) is not runner.FewRowLinear for m in model.modules())


@pytest.mark.parametrize("arch", ["qwen3", "gpt2"])
def test_segmented_attention_other_architectures(arch):
    t = tiny.target(arch)
    prompts = [[5, 6], [7]] + tiny.prompts(2, seed=7, lo=40, hi=50)
    llm = tiny.fixed_llm(t, draft="prompt-lookup", num_draft_tokens=2, batch_size=4, check_invariants=True)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=10))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 10) for p in prompts]


needs_kernel = pytest.mark.skipif(kernels._load() is None, reason="no C compiler or no AVX2 here")


@needs_kernel
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13, kernels.MAX_ROWS])
@pytest.mark.parametrize("n", [1, 2, 7, 64])
@pytest.mark.parametrize("k", [40, 13])
def test_skinny_kernel_matches_matmul(m, n, k):
    g = torch.Generator().manual_seed(m * 100 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    got = kernels.skinny_linear(x, w)
    want = (x.double() @ w.double().T).float()
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a transposed (non-contiguous) input gives the same result
    torch.testing.assert_close(kernels.skinny_linear(x.T.contiguous().T, w), got, rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 13, 30])
@pytest.mark.parametrize("k", [40, 13])
def test_skinny_kernel_rows_do_not_depend_on_their_neighbours(n, k):
    """A row's outputs have the same bits whether it runs alone or in any place of a block of 2..17 rows (blocks of
    8, then one of the 1-7 left, every block summing in one order): a verification block gives the logits a decode
    step gives."""
    g = torch.Generator().manual_seed(n * 10 + k)
    x, w = torch.randn(25, k, generator=g), torch.randn(n, k, generator=g)
    alone = torch.cat([kernels.skinny_linear(x[i : i + 1], w) for i in range(25)])
    for m in range(2, 26):
        assert torch.equal(kernels.skinny_linear(x[:m], w), alone[:m]), m
        assert torch.equal(kernels.skinny_linear(x[25 - m :], w), alone[25 - m :]), m


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 13, 30])
@pytest.mark.parametrize("k", [40, 13, 576])
def test_skinny_kernel_avx512_blocks_give_the_avx2_bits(n, k):
    """Blocks of 8 rows run with AVX-512 where the CPU has it (two rows per register, in the AVX2 kernel's order
    of sums), 4-7 rows in one block of 4, 6 or 8 and 9-16 rows in one block of 10-16 (an odd row padded with a zero
    row): the same bits as the AVX2 blocks (1-3 rows run there either way)."""
    lib = kernels._load()
    if not lib.skinny_avx512(1):
        pytest.skip("this CPU has no AVX-512")
    g = torch.Generator().manual_seed(n * 10 + k)
    x, w = torch.randn(21, k, generator=g), torch.randn(n, k, generator=g)
    try:
        wide = [kernels.skinny_linear(x[:m], w) for m in range(1, 22)]
        lib.skinny_avx512(0)
        narrow = [kernels.skinny_linear(x[:m], w) for m in range(1, 22)]
    finally:
        lib.skinny_avx512(1)
    for a, b in zip(wide, narrow):
        assert torch.equal(a, b)


def test_skinny_kernel_declines_what_it_does_not_cover(monkeypatch):
    w = torch.randn(16, 40)
    assert kernels.skinny_linear(torch.randn(kernels.MAX_ROWS + 1, 40), w) is None
    assert kernels.skinny_linear(torch.randn(2, 40, dtype=torch.float64), w.double()) is None
    assert kernels.skinny_linear(torch.randn(2, 40), w.T.contiguous().T) is None  # weight not contiguous
    monkeypatch.setenv("BATCHSPEC_KERNELS", "0")
    assert kernels.skinny_linear(torch.randn(2, 40), w) is None


@needs_kernel
def test_engine_with_skinny_kernel_stays_exact(monkeypatch):
    """float32 Qwen3 kept off the C layer, its linear layers all through the kernel: output equals the oracle."""
    from batchspec.model.kernels import llama as fused

    monkeypatch.setattr(fused, "forward", lambda *a, **k: None)
    t = tiny.target("qwen3", dtype=torch.float32)
    calls = []
    real = kernels.skinny_linear

    def spy(x, w):
        y = real(x, w)
        calls.append(y is not None)
        return y

    prompts = tiny.prompts(6, seed=11, lo=2, hi=40)
    try:
        kernels.skinny_linear = spy  # what the runner's linears call (kernels.linear)
        llm = tiny.fixed_llm(t, draft="prompt-lookup", num_draft_tokens=3, batch_size=6, check_invariants=True)
        outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=12))
    finally:
        kernels.skinny_linear = real
    assert calls and all(calls), "the kernel never ran (or declined) inside the engine"
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 12) for p in prompts]


@needs_kernel
def test_skinny_kernel_builds_into_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path))
    path = kernels._build()
    assert path is not None and path.parent == tmp_path / "kernels" and path.stat().st_size > 0
    assert not list(path.parent.glob("*.tmp"))
    assert kernels._build() == path  # built once per source version


def _spy_on_fused(monkeypatch) -> list[bool]:
    """Record, per forward, whether the fused Llama path ran (True) or declined (False)."""
    from batchspec.model.kernels import llama as fused

    calls = []
    real = fused.forward

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fused, "forward", spy)
    return calls


def _ragged_state(model, seed):
    """A left-padded batch of prompts of 1-30 tokens, with one hidden (rejected) slot in the middle of one row."""
    from batchspec.batch import prefill

    st = prefill(runner.Runner(model), tiny.prompts(5, seed=seed, lo=1, hi=30))
    st.append(torch.tensor([[3, 4]] * 5), torch.tensor([[True, True]] * 3 + [[False, True]] * 2))
    return st


def _llama(hidden, head_dim, heads, inter):
    """A random fp32 Llama with the given widths (2 layers, one key/value head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=tiny.VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():  # larger than the default init, so that every part of a layer moves the logits visibly
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model.eval()


@needs_kernel
@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("arch", ["tiny", "wide", "odd"])
def test_fused_llama_layer_matches_the_model(monkeypatch, q, arch):
    """One forward through the C layers equals the model's own forward (fp32): logits and every cached key/value,
    over ragged rows, a hidden slot, and a hidden new slot. Heads of 8 and of 128 dimensions (two register blocks);
    widths that are not multiples of 8 and heads x head_dim != hidden (like the default draft's 162)."""
    from batchspec.model.kernels import llama as fused

    t = {"tiny": lambda: tiny.target(dtype=torch.float32), "wide": lambda: _llama(128, 128, 2, 256),
         "odd": lambda: _llama(36, 16, 2, 76)}[arch]()
    assert fused.plan(t) is not None
    ids = torch.tensor([[5, 6, 7][:q]] * 5)
    new_valid = torch.ones(5, q, dtype=torch.bool)
    new_valid[1, 0] = False  # a hole among the new slots (a draft's carry slot)
    got, want = _ragged_state(t, 3), None
    with monkeypatch.context() as m:
        m.setattr(fused, "forward", lambda *a, **k: None)
        ref = _ragged_state(t, 3)
        want = ref.append(ids, new_valid, hidden=True)
    calls = _spy_on_fused(monkeypatch)
    out = got.append(ids, new_valid, hidden=True)
    assert calls == [True]
    torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
    # the final hidden states (what the head reads) come back from both paths, equal
    assert out.hidden.shape == want.hidden.shape == (5, q, t.config.hidden_size)
    torch.testing.assert_close(out.hidden, want.hidden, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(t.lm_head(want.hidden), want.logits, rtol=1e-5, atol=1e-5)
    for a, b in zip(got.cache.layers, ref.cache.layers):
        vis = got.valid[:, None, :, None].expand_as(a.keys)
        torch.testing.assert_close(a.keys[vis], b.keys[vis], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values[vis], b.values[vis], rtol=1e-5, atol=1e-5)
    assert got.width == ref.width


@needs_kernel
def test_fused_llama_follows_the_cache_buffers_when_they_grow_or_change(monkeypatch):
    """The C layer's pointers to a cache's buffers are kept between forwards; decoding past the buffers' room (they
    grow: new tensors) and after the rows are regathered into fresh buffers, every forward still writes and reads the
    cache's own buffers: logits and keys equal the model's own forwards step by step."""
    from batchspec.model.kernels import llama as fused

    t = tiny.target(dtype=torch.float32)
    got = _ragged_state(t, 5)
    with monkeypatch.context() as m:
        m.setattr(fused, "forward", lambda *a, **k: None)
        ref = _ragged_state(t, 5)
    calls = _spy_on_fused(monkeypatch)
    seen = []  # the first layer's key buffers, in order (kept: no id is reused)
    for step in range(150):
        ids = torch.full((5, 1), 3 + step % 7)
        out = got.append(ids)
        if not seen or seen[-1] is not got.cache.layers[0]._k:
            seen.append(got.cache.layers[0]._k)
        with monkeypatch.context() as m:
            m.setattr(fused, "forward", lambda *a, **k: None)
            want = ref.append(ids)
        torch.testing.assert_close(out.logits, want.logits, rtol=1e-4, atol=1e-4)
        if step == 40:  # the rows' slots rebuilt into new buffers (as a finished row's removal does)
            for st in (got, ref):
                for layer in st.cache.layers:
                    layer.set(layer.keys.clone(), layer.values.clone())
    assert len(calls) == 150 and all(calls)
    assert len(seen) >= 3, [k.shape for k in seen]  # grown past the first buffers' room, and replaced
    for a, b in zip(got.cache.layers, ref.cache.layers):
        vis = got.valid[:, None, :, None].expand_as(a.keys)
        torch.testing.assert_close(a.keys[vis], b.keys[vis], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("arch", ["tiny", "odd"])
def test_fused_llama_packs_rows_with_fewer_real_tokens(monkeypatch, arch):
    """With ``counts``, only each row's first counts[b] new tokens are computed (as one packed set of rows): their
    logits, final hidden states (asked for by a drafter that reads the target's features) and cached keys/values
    equal the model's own forward over the whole rectangle; the padding slots are hidden, their logits and states
    0."""
    from batchspec.model.kernels import llama as fused

    t = {"tiny": lambda: tiny.target(dtype=torch.float32), "odd": lambda: _llama(36, 16, 2, 76)}[arch]()
    ids = torch.tensor([[5, 6, 7, 8]] * 5)
    counts = torch.tensor([1, 4, 2, 1, 3])
    real = torch.arange(4)[None, :] < counts[:, None]
    with monkeypatch.context() as m:
        m.setattr(fused, "forward", lambda *a, **k: None)
        ref = _ragged_state(t, 3)
        want = ref.append(ids, counts=counts, hidden=True)
    got = _ragged_state(t, 3)
    lib = kernels._load()
    rows = []
    layers = lib.llama_layers

    class Spy:  # the rows the C layer was given: the packed ones only
        def __getattr__(self, name):
            return getattr(lib, name)

        def llama_layers(self, *a):
            rows.append(a[7][9])
            return layers(*a)

    monkeypatch.setattr(fused, "_load", lambda: Spy())
    out = got.append(ids, counts=counts, hidden=True)
    assert rows and set(rows) == {int(counts.sum())}  # 11 rows computed, not 20
    tokens = out.tokens()  # greedy tokens from the packed rows, before any layout of the logits
    assert out._logits.shape[0] == int(counts.sum())
    assert torch.equal(tokens[real], want.logits.argmax(-1)[real]) and not tokens[~real].any()
    torch.testing.assert_close(out.logits[real], want.logits[real], rtol=1e-4, atol=1e-4)
    assert torch.equal(out.tokens(), tokens) and torch.equal(out.logits.argmax(-1), tokens)
    torch.testing.assert_close(out.hidden[real], want.hidden[real], rtol=1e-4, atol=1e-4)
    assert (out.logits[~real] == 0).all() and (out.hidden[~real] == 0).all()
    assert torch.equal(got.valid, ref.valid) and not got.valid[:, -4:][~real].any()
    for a, b in zip(got.cache.layers, ref.cache.layers):
        vis = got.valid[:, None, :, None].expand_as(a.keys)
        torch.testing.assert_close(a.keys[vis], b.keys[vis], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.values[vis], b.values[vis], rtol=1e-5, atol=1e-5)


@needs_kernel
def test_engine_with_packed_verification_stays_exact(monkeypatch):
    """Prompt lookup on an fp32 Llama: rows propose different numbers of drafts, so verification blocks are packed
    (only real tokens computed); the output equals the oracle, with the invariants checked each round."""
    from batchspec.model.kernels import llama as fused

    t = tiny.target(dtype=torch.float32)
    packed = []
    real = fused.forward

    def spy(*a, **k):
        args = inspect.signature(real).bind(*a, **k).arguments
        counts, q = args.get("counts"), args["input_ids"].shape[1]
        if counts is not None and int(counts.sum()) < counts.numel() * q:
            packed.append(True)
        return real(*a, **k)

    monkeypatch.setattr(fused, "forward", spy)
    prompts = tiny.prompts(8, seed=4)
    policy = AdaptiveLength(synthetic(per_token=0.0001))  # verification cheap: rows draft what they have
    llm = batchspec.LLM(t, draft="prompt-lookup", num_draft_tokens=4, batch_size=4, check_invariants=True,
                        speculation=policy)
    budgets, plan = [], policy.plan  # every budget a drafter's offer is planned within
    policy.plan = lambda offer, budget: budgets.append((offer.rows, budget)) or plan(offer, budget)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=24))
    assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 24) for p in prompts]
    assert packed and llm.stats.accepted > 0 and llm.stats.ragged_rounds > 0
    assert any(b.per_row for _, b in budgets)  # rows were sized one by one (batches of several rows; the runner packs)
    # rows are valued only where the batch runs to its last row (no request waiting), and then unequally at times
    free = [(rows, b.worth) for rows, b in budgets if b.per_row and b.worth is not None]
    assert free and any(b.per_row and b.worth is None for _, b in budgets)  # rounds with requests waiting too
    for rows, v in free:
        share = policy.costs.fixed_share(rows)  # a token saves its row at least the rest of a step's share
        assert len(v) == rows and v.min() >= 1 - share - 1e-9 and v.max() <= 1 + (rows - 1) * share + 1e-9
    assert any(v.std() > 0.1 for _, v in free)  # some rows were worth more than others


@needs_kernel
@pytest.mark.parametrize("q", [1, 3, 4, 7])
@pytest.mark.parametrize("hidden,heads,head_dim", [(128, 2, 128), (192, 3, 64)])
def test_fused_llama_avx512_gives_the_avx2_bits(q, hidden, heads, head_dim):
    """Where the CPU has AVX-512, the linear blocks of 8 rows, attention's scores (queries in pairs, their sums
    reduced together), its visibility pass and its weighted sums of values (6 or 3 queries at once) use it in the
    AVX2 kernels' order of sums: a forward's logits and cache have the same bits either way. Queries per key/value
    head: even and odd (a padded pair), up to 21 (blocks of three pairs and what is left); rows of 3-32 slots (blocks
    of 8 keys and a short last one)."""
    lib = kernels._load()
    if not lib.skinny_avx512(1):
        pytest.skip("this CPU has no AVX-512")
    t = _llama(hidden, head_dim, heads, 256)  # heads of 128 dimensions (weighted sums 64 at a time) and of 64
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11][:q]] * 5)
    try:
        outs = []
        for on in (1, 0):
            lib.skinny_avx512(on)
            st = _ragged_state(t, 3)
            outs.append((st.append(ids).logits, [layer.keys.clone() for layer in st.cache.layers]))
    finally:
        lib.skinny_avx512(1)
    (a, ka), (b, kb) = outs
    assert torch.equal(a, b)
    assert all(torch.equal(x, y) for x, y in zip(ka, kb))


def test_fused_llama_declines_what_it_does_not_cover(monkeypatch):
    from batchspec.model.kernels import llama as fused

    assert fused.plan(tiny.target()) is None  # float64
    assert fused.plan(tiny.target("gpt2", dtype=torch.float32)) is None  # other architecture
    monkeypatch.setenv("BATCHSPEC_KERNELS", "0")
    assert fused.plan(tiny.target(dtype=torch.float32)) is None


@needs_kernel
def test_engine_with_fused_llama_stays_exact(monkeypatch):
    """fp32 Llama target and draft, every few-token forward through the C layers: output equals the oracle for both
    layouts, with the invariants checked each round."""

    t, d = tiny.target(dtype=torch.float32), tiny.draft(dtype=torch.float32)
    calls = _spy_on_fused(monkeypatch)
    prompts = tiny.prompts(6, seed=12, lo=1, hi=50)
    for layout in ("slotmask", "eqspec"):
        llm = tiny.fixed_llm(t, draft=d, num_draft_tokens=3, layout=layout, batch_size=4, check_invariants=True)
        outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=14))
        assert llm.stats.ragged_rounds > 0
        assert [o.token_ids for o in outs] == [tiny.oracle(t, p, 14) for p in prompts]
    assert calls and all(calls), "the fused layers never ran (or declined) inside the engine"


@pytest.mark.parametrize("rows", [[0, 4, 2], [3, 1], [2, 0, 1], [1, 0, 4, 3], [0, 1, 2]])
def test_select_rows_moves_rows_into_place(rows):
    """``kv.select_rows`` makes ``new[i] = old[rows[i]]`` in every layer: rows moving from the tail into the places of
    leaving ones are copied row by row in place; orders where a row would be read after it was written (a
    permutation) take the gathered copy."""
    from batchspec.model import kv

    g = torch.Generator().manual_seed(0)
    cache = kv.SlotCache(2)
    want = []
    for layer in cache.layers:
        k, v = (torch.randn(5, 2, 7, 4, generator=g) for _ in range(2))
        layer.update(k, v)
        want.append((k[rows], v[rows]))
    kv.select_rows(cache, torch.tensor(rows))
    for layer, (k, v) in zip(cache.layers, want):
        assert layer.length == 7 and torch.equal(layer.keys, k) and torch.equal(layer.values, v)


@pytest.mark.parametrize("rows", [[0, 4, 2], [3, 1], [2, 0, 1], [0, 1, 2]])
def test_move_rows_is_indexing(rows):
    """``kv.move_rows(t, rows)`` equals ``t[rows]``: in place (a view of t's first rows) where rows only move from the
    tail into the places of leaving ones, a gathered copy otherwise."""
    from batchspec.model import kv

    t = torch.randn(5, 3, 4, generator=torch.Generator().manual_seed(1))
    want = t[rows].clone()
    got = kv.move_rows(t, torch.tensor(rows))
    assert torch.equal(got, want)
    assert (got.data_ptr() == t.data_ptr()) == (rows in ([0, 4, 2], [3, 1], [0, 1, 2]))


def _cache(rows: int, slots: int, seed: int, capacity: int | None = None):
    """A 2-layer ``SlotCache`` of ``rows`` random rows and ``slots`` used slots (buffers of ``capacity`` slots)."""
    from batchspec.model import kv

    g = torch.Generator().manual_seed(seed)
    cache = kv.SlotCache(2)
    for layer in cache.layers:
        k, v = (torch.randn(rows, 2, slots, 4, generator=g) for _ in range(2))
        layer.lazy_initialization(k, v)
        layer.fresh(k, v, rows, slots)
        if capacity is not None:
            layer._ensure(k, v, capacity)
        layer.keys.copy_(k)
        layer.values.copy_(v)
    return cache


@pytest.mark.parametrize("mine,theirs,in_place", [
    ((5, 9), (3, 9), True),  # as wide, 8 rows in a buffer of 8 (``row_capacity(5)``)
    ((5, 9), (2, 4), True),  # narrower rows join
    ((3, 9), (2, 5), False),  # 5 rows do not fit a buffer of 4
    ((5, 6), (2, 9), False),  # wider rows join: the running rows move right, into new buffers
])
def test_join_rows_is_stack_rows_written_in_place_where_there_is_room(mine, theirs, in_place):
    """``kv.join_rows`` gives what ``kv.stack_rows`` gives (each cache right-aligned in the wider width, padding zeros),
    writing the joining rows into the running cache's own buffers where they have room for them (rows and slots, and
    the running rows at least as wide), else into new buffers; slots a joining row's place held before are zeroed."""
    from batchspec.model import kv

    (r1, s1), (r2, s2) = mine, theirs
    width = max(s1, s2)
    want = kv.stack_rows([(_cache(r1, s1, 0), r1), (_cache(r2, s2, 1), r2)], width, 2)
    running = _cache(r1, s1, 0)
    for layer in running.layers:  # stale values where a joining row will go (a row that left)
        kv.whole_buffer(layer._k)[r1:].fill_(7.0)
        kv.whole_buffer(layer._v)[r1:].fill_(7.0)
    before = running.layers[0]._k.data_ptr()
    got = kv.join_rows(running, r1, _cache(r2, s2, 1), r2, width)
    assert (got is running and got.layers[0]._k.data_ptr() == before) == in_place
    for a, b in zip(got.layers, want.layers):
        assert a.length == b.length == width
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert a._k.is_contiguous() and a._k.shape[0] == r1 + r2


def test_rows_join_a_wider_running_batch_in_place_and_stay_exact(monkeypatch):
    """Short prompts joining a running batch of long ones go into its buffers (no copy of the running rows), long ones
    into new buffers; every output equals HF batch-1 greedy (a draft model: its cache joins the same way). The slots
    a new buffer leaves unset (``kv._unwritten``) hold NaN here: none is read before it is written."""
    from batchspec.model import kv

    unset = []
    real_unwritten = kv._unwritten

    def nan(like, shape):
        unset.append(shape)
        return real_unwritten(like, shape).fill_(float("nan"))

    monkeypatch.setattr(kv, "_unwritten", nan)
    seen = []
    join = kv.join_rows

    def spy(cache, rows, other, more, width):
        out = join(cache, rows, other, more, width)
        seen.append(out is cache)
        return out

    monkeypatch.setattr(kv, "join_rows", spy)
    t = tiny.target("llama")
    llm = tiny.fixed_llm(t, draft=tiny.draft("llama"), num_draft_tokens=3, batch_size=8, scheduler="continuous",
                         check_invariants=True)
    early = tiny.prompts(3, seed=31, lo=30, hi=40)
    late = tiny.prompts(2, seed=32, lo=3, hi=8) + tiny.prompts(1, seed=33, lo=60, hi=70)
    engine = llm.engine()
    want = {}
    _, reqs = llm.requests(early, [batchspec.SamplingParams(max_tokens=12)] * 3)
    for r, p in zip(reqs, early):
        want[engine.add_request(r)] = tiny.oracle(t, p, 12)
    got = {}

    def step():
        for o in engine.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)

    step()
    _, reqs = llm.requests(late, [batchspec.SamplingParams(max_tokens=10)] * 3)
    for r, p in zip(reqs, late):
        r.id = None
        want[engine.add_request(r)] = tiny.oracle(t, p, 10)
        step()
    while engine.has_work():
        step()
    assert got == want
    assert llm.stats.joined_running >= 3
    assert True in seen and False in seen, f"joins in place / into new buffers: {seen}"
    assert unset  # the wider rows' new buffers began unset
