"""The greedy token of a q8_0 head without every logit (``kernels/argmax.c``, ``PackedLinear.greedy``): scored with
8-bit integer products, the few outputs the score cannot rule out computed exactly. The oracle is the argmax of the
packed kernel's own outputs (``sampling.greedy``: the first maximum on ties), and HF ``generate`` for whole runs."""

from __future__ import annotations

import pytest
import tiny
import torch
from test_weights import gguf_values, quantised_target

from batchspec import SamplingParams
from batchspec.sampling import greedy
from batchspec.model import kernels
from batchspec.model import weights as W

lib = kernels.library()
pytestmark = pytest.mark.skipif(lib is None or not lib.q8_argmax_supported(),
                                reason="needs the C kernels and AVX-512 VNNI")


@pytest.fixture(autouse=True)
def everywhere(monkeypatch):
    """The fast greedy at every row count it takes, also where it is off by default (``GREEDY_ROWS``)."""
    monkeypatch.setattr(W, "GREEDY_ROWS", {"half": (1, W.GREEDY_MOST), "full": (1, W.GREEDY_MOST)})


def q8_head(n=3000, k=192, seed=0) -> tuple[W.PackedLinear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = gguf_values(torch.randn(n, k, generator=g) * 0.05, "q8_0")
    head = W.PackedLinear(W.pack(v))
    assert head.packed.kind == "q8_0"
    return head, v


def states(m, k=192, seed=1) -> torch.Tensor:
    """Like a model's final states: mostly small, a few large dimensions (the digits' scale is set by the largest)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    x[:, 7] *= 40
    return x


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("k", [160, 192, 256])
def test_fast_greedy_is_the_argmax_of_the_packed_outputs(rows, k):
    """Rows of 5, 6 and 8 blocks: scored two blocks a register, in two sums, and the blocks left over one at a time."""
    head, _ = q8_head(k=k)
    for seed in range(6):
        x = states(rows, k=k, seed=seed)
        got = head.greedy(x)
        assert got is not None
        assert torch.equal(got, greedy(head(x)))
    x = states(4, k=k)
    assert torch.equal(head.greedy(x.view(2, 2, k)), greedy(head(x)).view(2, 2))  # any shape


def test_ties_and_near_ties_are_decided_by_the_exact_outputs():
    """Duplicates of the best row before and after it (exact ties: the first wins), and copies one code apart where x
    is smallest (outputs an ulp or so apart, well inside the score's bound): only exact arithmetic tells them apart."""
    head, v = q8_head(seed=2)
    x = states(1, seed=3)
    best = int(greedy(head(x)))
    small = int(x[0].abs().argmin())  # the dimension that moves an output least
    d = head.packed.d[best, small // 32]
    for shift in (0, 1, -1):
        w = v.clone()
        near = w[best].clone()
        near[small] += shift * d  # one code further (gguf values stay exact: a q8_0 code of the same block)
        lower, higher = max(best - 5, 0), min(best + 5, w.shape[0] - 1)
        w[lower], w[higher] = w[best], near
        packed = W.pack(w)
        assert packed is not None and packed.kind == "q8_0"
        h = W.PackedLinear(packed)
        full = h(x)
        assert full[0, lower] == full[0, best]  # an exact tie, really
        if shift:
            assert 0 < abs(float(full[0, higher] - full[0, best])) < 1e-4  # a near-tie, really
        got = h.greedy(x)
        assert got is not None and torch.equal(got, greedy(full))
        assert int(got) in (lower, higher)  # the first of the tied rows, or the copy one code up


def test_where_it_cannot_decide_it_says_so():
    """Non-finite or all-zero states, more rows than one pass scores, every row a candidate, or a format other than
    q8_0: None, and the caller computes the logits."""
    head, v = q8_head()
    x = states(2)
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 3] = bad
        assert head.greedy(y) is None
    assert head.greedy(torch.zeros(1, 192)) is None
    assert head.greedy(states(W.GREEDY_MOST + 1)) is None
    same = W.PackedLinear(W.pack(v[:1].repeat(2000, 1)))  # 2000 equal outputs: too many candidates
    assert same.greedy(x) is None
    q41 = W.PackedLinear(W.pack(gguf_values(v, "q4_1")))
    assert q41.packed.kind == "q4_1" and q41.greedy(x) is None


def test_it_runs_at_the_row_counts_chosen_for_the_cpu(monkeypatch):
    """By default: 1-4 rows where the packed blocks run at half width, 7-8 where they run at full width."""
    head, _ = q8_head()
    monkeypatch.setattr(W, "GREEDY_ROWS", {"half": (1, 4), "full": (7, 8)})
    was = lib.packed_full_width(-1)
    try:
        lib.packed_full_width(1)
        wide = lib.skinny_avx512(-1)  # without AVX-512 the half-width choice holds
        assert [head.greedy(states(r)) is not None for r in range(1, 9)] == [not wide] * 4 + [False] * 2 + [wide] * 2
        lib.packed_full_width(0)
        assert [head.greedy(states(r)) is not None for r in range(1, 9)] == [True] * 4 + [False] * 4
    finally:
        lib.packed_full_width(was)


def test_the_engine_reads_greedy_tokens_without_the_logits_and_matches_the_oracle(tmp_path, monkeypatch):
    """A tied q8_0 head: decode steps and verification blocks of up to ``GREEDY_MOST`` rows take their tokens from
    the fast argmax (the head's logits are never computed for them), and the outputs are HF's batch-1 greedy ones,
    with and without drafts."""
    path, _ = quantised_target(tmp_path, tie=True)
    calls = {"fast": 0, "logits": 0, "wide": 0}
    fast, forward = W.PackedLinear.greedy, W.PackedLinear.forward

    def counted_greedy(self, x):
        out = fast(self, x)
        calls["fast"] += out is not None
        return out

    def counted_forward(self, x):
        if self.out_features == tiny.VOCAB:
            calls["wide" if x.numel() // x.shape[-1] > W.GREEDY_MOST else "logits"] += 1
        return forward(self, x)

    monkeypatch.setattr(W.PackedLinear, "greedy", counted_greedy)
    monkeypatch.setattr(W.PackedLinear, "forward", counted_forward)
    from batchspec.model.loading import load_model

    oracle_model = load_model(path, weights="fp32")
    prompts = tiny.prompts(6, seed=5)
    for draft in (None, "prompt-lookup"):
        llm = tiny.fixed_llm(path, draft=draft, batch_size=3)
        assert llm.target.lm_head.packed.kind == "q8_0"
        calls.update(fast=0, logits=0, wide=0)
        got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=20))]
        assert got == [tiny.oracle(oracle_model, p, 20) for p in prompts]
        assert calls["fast"] >= 12 and calls["logits"] == 0, calls  # (the wider blocks: computed, and counted)
        calls.update(fast=0, logits=0, wide=0)  # log-probabilities need the logits: they are computed
        out = llm.generate(prompts[:2], SamplingParams(max_tokens=6, logprobs=1))
        assert [o.token_ids for o in out] == [g[:6] for g in got[:2]] and calls["logits"] > 0


def test_threads_sharing_a_head_get_their_own_tokens():
    """Engines may share a model across threads: each thread's scores are its own."""
    from concurrent.futures import ThreadPoolExecutor

    head, _ = q8_head()
    xs = [states(1 + i % 4, seed=i) for i in range(8)]
    want = [greedy(head(x)) for x in xs]

    def run(i):
        return all(torch.equal(head.greedy(xs[i]), want[i]) for _ in range(30))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(run, range(8)))
