"""The distributional audit: its exact reference and statistics on known cases, then speculative sampling checked
against the exact distribution of plain sampling (first token and first two tokens), and the injected sampler faults
rejected by the same machinery.

Models: a tiny float64 Llama with a 20-token vocabulary, so that the distribution of two tokens (a few hundred cells)
can be estimated from a few thousand samples, and a draft that is a perturbed copy of it (total-variation distance
0.2-0.3 from the target at these temperatures: a rejection is frequent, so a wrong residual shows).

False alarms: every clean-engine check below uses ALPHA = 1e-4 for its engine (Bonferroni-split over its prompts and
prefix lengths), and there are 18 of them (16 grid cells, the plain engine, the CLI run), so correct engines fail
this file with probability at most 18 * 1e-4 < 0.2% whatever seeds are used; the self-checks of the statistics on
samples of our own add about 0.1%. The seeds are fixed (each check has its own seed range), so a run is
reproducible; the thresholds were chosen as if they were not. The faults are caught with p-values below 1e-10.
"""

from __future__ import annotations

import copy
import functools
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import batchspec
from batchspec.audit.distribution import (
    IMPOSSIBLE,
    OTHER,
    DistributionReport,
    chi2_sf,
    chi_square,
    compare,
    distribution_audit,
    exact_distribution,
    expected_noise_tvd,
    pool_cells,
)

VOCAB = 20
ALPHA = 1e-4
SAMPLES = 2000
# a single token (prompt lookup has nothing to match), a random prompt, and one that repeats "12 8", so prompt lookup
# proposes 7, a token the target gives probability 0.56 at temperature 0.7 (0.34 at 1.0)
PROMPTS = [[5], [3, 9, 14, 2, 7, 1, 18, 11], [12, 8, 7, 15, 12, 8]]
SETTINGS = [(0.7, 0, 1.0), (0.7, 5, 0.9), (1.0, 0, 1.0), (1.0, 5, 0.9)]  # (temperature, top_k, top_p)


def _build(seed: int = 0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger weights: peaked, varied next-token distributions (entropy about 2 nats)
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0 if VOCAB in p.shape else 2.5)
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.double().eval()


@functools.lru_cache(maxsize=None)
def small_target():
    return _build()


@functools.lru_cache(maxsize=None)
def small_draft(noise: float = 0.4):
    model = copy.deepcopy(small_target())
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * noise * p.std())
    return model


def _drafter(name):
    return small_draft() if name == "model" else "prompt-lookup"


# ------------------------------------------------------------------------------------------------ statistics


def test_chi2_sf_known_values():
    # upper 5% / 1% points of the chi-square distribution (standard tables)
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(6.634896601021214, 1) == pytest.approx(0.01, rel=1e-9)
    assert chi2_sf(5.991464547107979, 2) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(124.3421134, 100) == pytest.approx(0.05, rel=1e-6)
    for x in (0.3, 2.0, 7.5, 40.0):  # df 2 is the exponential distribution with mean 2
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
    assert chi2_sf(1.0, 1) == pytest.approx(math.erfc(math.sqrt(0.5)), rel=1e-12)  # df 1: a squared normal
    assert chi2_sf(0.0, 3) == 1.0 and chi2_sf(math.inf, 3) == 0.0
    assert chi2_sf(0.0, 0) == 1.0 and chi2_sf(2.0, 0) == 0.0


def test_pooling_and_chi_square_by_hand():
    # the pool of small cells (0.5 + 1.5 + 2 = 4 < 5) also takes the smallest remaining cell (7)
    assert pool_cells([10, 3, 1, 0, 6], [9.0, 2.0, 1.5, 0.5, 7.0]) == ([10, 10], [9.0, 11.0])
    assert pool_cells([4, 6], [5.0, 5.0]) == ([4, 6], [5.0, 5.0])
    stat, df, p = chi_square([10, 3, 1, 0, 6], [9.0, 2.0, 1.5, 0.5, 7.0])
    assert df == 1 and stat == pytest.approx(1 / 9 + 1 / 11) and p == pytest.approx(chi2_sf(1 / 9 + 1 / 11, 1))
    assert chi_square([50, 50], [50.0, 50.0]) == (0.0, 1, 1.0)
    stat, df, p = chi_square([30, 70], [50.0, 50.0])
    assert stat == pytest.approx(16.0) and df == 1 and p == pytest.approx(math.erfc(4 / math.sqrt(2)))
    # a cell of expected count 0 pools with the smallest possible cell
    stat, df, p = chi_square([50, 47, 3], [50.0, 50.0, 0.0])
    assert (stat, df) == (pytest.approx(0.36), 1)
    assert chi_square([97, 3], [100.0, 0.0]) == (0.0, 0, 1.0)  # one cell left: nothing to test ...
    assert expected_noise_tvd([1.0], 100) == 0.0
    assert expected_noise_tvd([0.5, 0.5], 100) == pytest.approx(math.sqrt(0.5 / (math.pi * 100)))


def test_chi_square_is_calibrated_and_has_power():
    probs = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.04, 0.03, 0.02, 0.005, 0.005], dtype=torch.float64)
    g = torch.Generator().manual_seed(123)
    n, reps = 400, 400
    p_null = []
    for _ in range(reps):
        counts = torch.bincount(torch.multinomial(probs, n, True, generator=g), minlength=len(probs)).tolist()
        p_null.append(chi_square(counts, (probs * n).tolist())[2])
    # under the null the p-values are close to uniform: 5% below 0.05 (binomial sd 1.1%), 1% below 0.01
    assert 0.015 <= sum(p < 0.05 for p in p_null) / reps <= 0.095
    assert sum(p < 0.01 for p in p_null) / reps <= 0.035
    # a sampler that moves 0.08 of the mass from the first to the second cell is found at once
    biased = probs.clone()
    biased[0] -= 0.08
    biased[1] += 0.08
    counts = torch.bincount(torch.multinomial(biased, 4000, True, generator=g), minlength=len(probs)).tolist()
    assert chi_square(counts, (probs * 4000).tolist())[2] < 1e-8


# ------------------------------------------------------------------------------------------------ the reference


def _warp_by_hand(logits, temperature, top_k, top_p):
    x = logits.double() / temperature
    if top_k:
        kth = x.sort(descending=True).values[top_k - 1]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1:
        s, order = x.sort(descending=True)
        ps = s.softmax(-1)
        before = ps.cumsum(-1) - ps  # keep a token while the mass ranked above it is below top_p
        drop = torch.zeros_like(x, dtype=torch.bool)
        drop[order] = before >= top_p
        x = x.masked_fill(drop, -math.inf)
    return x.softmax(-1)


@torch.no_grad()
def _next_probs(prefix, temperature, top_k, top_p):
    logits = small_target()(torch.tensor([prefix])).logits[0, -1]
    return _warp_by_hand(logits, temperature, top_k, top_p)


@pytest.mark.parametrize("setting", SETTINGS)
def test_reference_first_token_is_the_warped_softmax(setting):
    temperature, top_k, top_p = setting
    for prompt in PROMPTS:
        ref = exact_distribution(small_target(), prompt, temperature, top_k, top_p, n_tokens=1, coverage=1.0)
        want = _next_probs(prompt, temperature, top_k, top_p)
        got = torch.zeros(VOCAB, dtype=torch.float64)
        for (t,), p in ref.cells[0].items():
            got[t] = p
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
        support = int((want > 0).sum())
        assert len(ref.cells[0]) == support and ref.other(1) < 1e-12
        if top_k:
            assert support <= top_k


def test_reference_joint_is_the_product_of_conditionals():
    temperature, top_k, top_p = 1.0, 5, 0.9
    prompt = PROMPTS[2]
    ref = exact_distribution(small_target(), prompt, temperature, top_k, top_p, n_tokens=2, coverage=1.0)
    first = _next_probs(prompt, temperature, top_k, top_p)
    assert math.fsum(ref.cells[1].values()) == pytest.approx(1.0, abs=1e-12)
    for (t1,), p1 in ref.cells[0].items():
        second = _next_probs(prompt + [t1], temperature, top_k, top_p)
        assert p1 == pytest.approx(float(first[t1]), rel=1e-12)
        for t2 in range(VOCAB):
            want = float(first[t1] * second[t2])
            assert ref.cells[1].get((t1, t2), 0.0) == pytest.approx(want, rel=1e-10, abs=1e-15)
        # outside the warped support after t1: impossible; inside: its own cell
        for t2 in range(VOCAB):
            cell = ref.classify([t1, t2], 2)
            assert cell == ((t1, t2) if second[t2] > 0 else IMPOSSIBLE)
    outside = int(first.argmin())
    assert first[outside] == 0 and ref.classify([outside, 0], 1) == IMPOSSIBLE
    assert ref.classify([int(first.argmax())], 2) == IMPOSSIBLE  # too short


def test_reference_cap_pools_the_tail_into_other():
    prompt = PROMPTS[1]
    full = exact_distribution(small_target(), prompt, 1.0, n_tokens=2, coverage=1.0)
    capped = exact_distribution(small_target(), prompt, 1.0, n_tokens=2, coverage=0.9, max_cells=40)
    assert len(capped.cells[0]) < VOCAB and len(capped.cells[1]) <= 40
    for level in (0, 1):
        kept = math.fsum(capped.cells[level].values())
        assert capped.other(level + 1) == pytest.approx(1.0 - kept)
        for k, p in capped.cells[level].items():  # the kept cells are the most probable ones, exactly
            assert p == pytest.approx(full.cells[level][k], rel=1e-12)
        smallest = min(capped.cells[level].values())
        assert all(p <= smallest + 1e-15 for k, p in full.cells[level].items() if k not in capped.cells[level])
    assert capped.cells[0] and 1 - math.fsum(capped.cells[0].values()) < 0.1 + 1e-12
    dropped = next(k for k in full.cells[0] if k not in capped.cells[0])
    assert capped.classify([dropped[0], 0], 1) == OTHER and capped.classify([dropped[0], 0], 2) == OTHER


def test_compare_with_an_exact_sampler_and_a_biased_one():
    """The statistics against a sampler of our own: draws straight from the exact joint pass, a mixture with the
    uniform distribution fails."""
    ref = exact_distribution(small_target(), PROMPTS[0], 0.7, n_tokens=2, coverage=1.0)
    keys = list(ref.cells[1])
    probs = torch.tensor([ref.cells[1][k] for k in keys])
    g = torch.Generator().manual_seed(7)
    exact = [list(keys[i]) for i in torch.multinomial(probs, SAMPLES, True, generator=g).tolist()]
    for length in (1, 2):
        c = compare(ref, exact, length)
        assert c.p_value > 1e-4 and c.impossible == 0 and c.tvd < 3 * c.tvd_noise
    mixed = 0.85 * probs + 0.15 / len(keys)
    biased = [list(keys[i]) for i in torch.multinomial(mixed, SAMPLES, True, generator=g).tolist()]
    assert compare(ref, biased, 2).p_value < 1e-8 and compare(ref, biased, 1).p_value < 1e-8


def test_compare_flags_impossible_tokens_even_with_one_cell():
    ref = exact_distribution(small_target(), PROMPTS[0], 1.0, top_k=1, n_tokens=1)  # one possible first token
    (only,), = ref.cells[0]
    assert compare(ref, [[only]] * 100, 1).p_value == 1.0
    c = compare(ref, [[only]] * 99 + [[(only + 1) % VOCAB]], 1)  # ... but compare fails an impossible token
    assert c.impossible == 1 and c.p_value == 0.0 and c.tvd == pytest.approx(0.01)


# ------------------------------------------------------------------------------------------------ the engines

GRID = [(layout, drafter, s) for layout in ("slotmask", "eqspec") for drafter in ("model", "prompt-lookup")
        for s in SETTINGS]


@pytest.mark.parametrize("case", range(len(GRID)),
                         ids=[f"{lay}-{d}-T{t}-k{k}-p{p}" for lay, d, (t, k, p) in GRID])
def test_speculative_sampling_matches_the_exact_distribution(case):
    layout, drafter, (temperature, top_k, top_p) = GRID[case]
    # K=1 with slotmask (the second token is often the bonus), K=3 with eqspec (both tokens from one round)
    k = 1 if layout == "slotmask" else 3
    sampling = batchspec.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=case * SAMPLES)
    report = distribution_audit(
        small_target(), _drafter(drafter), PROMPTS, sampling, engines=[layout], num_draft_tokens=k,
        samples=SAMPLES, n_tokens=2, batch_size=256, alpha=ALPHA,
    )
    assert len(report.rows) == len(PROMPTS) * 2
    assert report.passed(layout), report.to_markdown()
    assert all(r.impossible == 0 for r in report.rows), report.to_markdown()
    assert report.meta["engines"][layout]["mean_accepted_length"] > 1.0  # speculation did happen


@pytest.mark.parametrize("drafter", ["model", "prompt-lookup"])
@pytest.mark.parametrize("fault", ["draft-bonus", "no-residual"])
def test_sampler_faults_are_rejected(fault, drafter):
    sampling = batchspec.SamplingParams(temperature=0.7, seed=10**6)
    report = distribution_audit(
        small_target(), _drafter(drafter), PROMPTS, sampling, engines=[f"fault:{fault}"], num_draft_tokens=2,
        samples=SAMPLES, n_tokens=2, batch_size=256, alpha=ALPHA,
    )
    name = f"fault:{fault}"
    assert not report.passed(name) and report.passed()  # passed() alone ignores injected faults
    # prompt lookup only proposes on the repeating prompt; the model drafts on every prompt
    caught = [2] if drafter == "prompt-lookup" else [0, 1, 2]
    for i in caught:
        for length in (1, 2):
            r = report.row(name, i, length)
            assert r.p_value < 1e-12 and not r.passed, report.to_markdown()
        # the first token alone: far outside sampling noise (over two tokens the noise is spread over ~100 cells)
        r = report.row(name, i, 1)
        assert r.tvd > 3 * r.tvd_noise, report.to_markdown()


def test_plain_sampling_through_the_public_audit():
    sampling = batchspec.SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=50 * SAMPLES)
    report = batchspec.audit(small_target(), None, PROMPTS, engines=["plain"], batch_sizes=[4, 256],
                             sampling=sampling, samples=SAMPLES, n_tokens=2, alpha=ALPHA)
    assert isinstance(report, DistributionReport)
    assert report.meta["batch_size"] == 256 and report.meta["threshold"] == pytest.approx(ALPHA / 6)
    assert report.passed() and report.engines() == {"plain": True}, report.to_markdown()
    md = report.to_markdown()
    assert "| engine | prompt | tokens |" in md and "- plain: pass" in md
    data = json.loads(json.dumps(report.as_dict()))
    assert len(data["rows"]) == 6 and data["meta"]["seeds"] == [50 * SAMPLES, 51 * SAMPLES - 1]
    assert report.meta["reference_cells"][0][0] <= 5  # top-k 5


def test_bad_arguments():
    with pytest.raises(ValueError, match="temperature > 0"):
        distribution_audit(small_target(), None, PROMPTS, batchspec.SamplingParams(), engines=["plain"])
    with pytest.raises(ValueError, match="temperature > 0"):
        distribution_audit(small_target(), None, PROMPTS, None, engines=["plain"])
    hot = batchspec.SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="batchspec engines only"):
        distribution_audit(small_target(), None, PROMPTS, hot, engines=[("mine", lambda b: b)])
    with pytest.raises(ValueError, match="samples"):
        distribution_audit(small_target(), None, PROMPTS, hot, engines=["plain"], samples=0)
    with pytest.raises(ValueError, match="unknown engine"):
        distribution_audit(small_target(), None, PROMPTS, hot, engines=["nope"])
    with pytest.raises(ValueError, match="coverage"):
        exact_distribution(small_target(), PROMPTS[0], 1.0, coverage=0.0)


def test_cli(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from batchspec.cli import main

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0")
    for name, model in (("target", small_target()), ("draft", small_draft())):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{t}" for t in p) for p in PROMPTS[1:]) + "\n")
    common = ["audit", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompts",
              str(tmp_path / "prompts.txt"), "--no-chat-template", "--dtype", "float64", "--device", "cpu"]
    rc = main(common + ["--engines", "eqspec,fault:no-residual", "--temperature", "0.7", "--top-k", "8", "--samples",
                        "600", "--n-tokens", "1", "--alpha", str(ALPHA), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    data = json.loads((tmp_path / "out" / "distribution.json").read_text())
    assert data["meta"]["temperature"] == 0.7 and data["meta"]["top_k"] == 8 and data["meta"]["samples"] == 600
    assert data["meta"]["batch_size"] == 64 and data["meta"]["prompt_lengths"] == [8, 6]
    assert data["engines"]["eqspec"] is True and data["engines"]["fault:no-residual"] is False
    assert [(r["engine"], r["prompt"], r["n_tokens"]) for r in data["rows"]] == [
        ("eqspec", 0, 1), ("eqspec", 1, 1), ("fault:no-residual", 0, 1), ("fault:no-residual", 1, 1)
    ]
    assert (tmp_path / "out" / "distribution.md").read_text().startswith("Distributional audit")
    assert "eqspec" in printed
    assert main(common + ["--top-k", "8"]) == 2  # warping without a temperature
    assert main(common + ["--temperature", "-1"]) == 2
    assert "--temperature" in capsys.readouterr().err
