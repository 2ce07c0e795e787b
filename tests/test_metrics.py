"""Audit metrics, margin classification and signature rules on hand-made sequences."""

import pytest
import tiny
import torch

from batchspec.audit import attribution as attr
from batchspec.audit import metrics as m

EOS = 2


# --- truncation --------------------------------------------------------------------------------------------------


def test_truncate_keeps_the_first_stop_token_and_drops_the_rest():
    assert m.truncate([5, 6, EOS, 7, EOS], {EOS}) == [5, 6, EOS]
    assert m.truncate([EOS, 5], {EOS}) == [EOS]
    assert m.truncate([5, 6, 7], {EOS}) == [5, 6, 7]
    assert m.truncate([5, 6, 7, EOS], {EOS}, max_tokens=2) == [5, 6]
    assert m.truncate([5, 6, 7], (), max_tokens=10) == [5, 6, 7]


def test_metrics_compare_after_truncation():
    oracle = m.truncate([4, 4, EOS], {EOS})
    ran_on = m.truncate([4, 4, EOS, 9, 9, 9], {EOS})  # an engine that does not stop: the tail is not its output
    assert m.exact_match(ran_on, oracle) and m.partial_match(ran_on, oracle) == 1.0
    stopped_early = m.truncate([4, EOS, 4], {EOS})
    assert not m.exact_match(stopped_early, oracle)
    assert m.partial_match(stopped_early, oracle) == pytest.approx(1 / 3)
    assert m.first_divergence(stopped_early, oracle) == 1


# --- partial match -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "output, oracle, expected",
    [
        ([1, 2, 3, 4], [1, 2, 3, 4], 1.0),
        ([1, 2, 9, 9], [1, 2, 3, 4], 0.5),
        ([9, 2, 3, 4], [1, 2, 3, 4], 0.0),  # immediate divergence
        ([1, 2], [1, 2, 3, 4], 0.5),  # stopped early
        ([1, 2, 3, 4, 5], [1, 2, 3, 4], 0.8),  # ran past the oracle: never 1.0 unless equal
        ([], [], 1.0),
        ([1], [], 0.0),
    ],
)
def test_partial_match(output, oracle, expected):
    assert m.partial_match(output, oracle) == pytest.approx(expected)
    assert (m.partial_match(output, oracle) == 1.0) == m.exact_match(output, oracle)


def test_first_divergence():
    assert m.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert m.first_divergence([1, 2, 4], [1, 2, 3]) == 2
    assert m.first_divergence([1, 2], [1, 2, 3]) == 2
    assert m.first_divergence([7], [1, 2, 3]) == 0


def test_rouge_l_masks_corruption_that_exact_and_partial_match_expose():
    oracle = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    shuffled = [11, 10, 12, 13, 14, 15, 16, 17, 18, 19]  # one swap at the start
    assert m.rouge_l(oracle, oracle) == pytest.approx(1.0)
    assert m.partial_match(shuffled, oracle) == 0.0
    assert m.rouge_l(shuffled, oracle) > 0.85
    assert m.rouge_l([], []) == 1.0
    assert m.rouge_l([1, 2], [3, 4]) == 0.0


# --- repetition rule ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, period",
    [
        ([3, 4, 5] + [7] * 8, 1),  # eight identical tokens
        ([3, 4, 5] + [7] * 7, None),  # seven are not enough
        ([9, 4, 5, 4, 5, 4, 5, 4, 5], 2),  # four repeats of a 2-gram
        ([4, 5, 4, 5, 4, 5], None),  # three repeats of a 2-gram span only 6 tokens
        ([0, 5, 6, 7, 5, 6, 7, 5, 6, 7], 3),  # three repeats of a 3-gram
        ([0, 5, 6, 7, 5, 6, 7, 5, 6], None),  # 2.67 repeats
        ([0] + list(range(10, 20)) * 3, 10),  # three repeats of a 10-gram
        (list(range(20, 37)) * 3, None),  # a 17-gram is longer than the longest period looked for
        ([3, 4] + [7] * 8 + [EOS], 1),  # a trailing stop token is ignored
        ([7] * 8 + [3], None),  # the loop must reach the end
        ([], None),
    ],
)
def test_loop_rule(ids, period):
    assert m.loop_period(ids, {EOS}) == period
    assert m.ends_in_loop(ids, {EOS}) == (period is not None)


def test_repetition_rate():
    outs = [[7] * 8, [1, 2, 3], [1, 2] * 4, [5]]
    assert m.repetition_rate(outs) == 0.5
    assert m.repetition_rate([]) == 0.0


# --- margins and tolerance ---------------------------------------------------------------------------------------


def test_classify_margin():
    assert attr.classify(0.0, 1e-6) == "numerical"  # an exact tie
    assert attr.classify(-1e-6, 1e-6) == "numerical"
    assert attr.classify(-0.5, 1e-6) == "reference"  # the target itself prefers the engine's token: a wrong oracle
    assert attr.classify(1e-6, 1e-6) == "numerical"
    assert attr.classify(2e-6, 1e-6) == "synchronization"
    assert attr.classify(None, 1.0) == "synchronization"  # a length difference has no margin


def test_tolerance_per_dtype_and_overrides():
    assert attr.relative_tolerance(torch.float64) == 1e-6
    assert attr.relative_tolerance(torch.float32) == 1e-5
    assert attr.relative_tolerance(torch.bfloat16) > attr.relative_tolerance(torch.float16) > 1e-3
    assert attr.relative_tolerance("float32", 0.5) == 0.5
    assert attr.relative_tolerance(torch.float32, {"float32": 1e-4}) == 1e-4
    assert attr.relative_tolerance(torch.float64, {torch.float32: 1e-4}) == 1e-6
    assert attr.coarser(torch.float64, torch.float32, None) == torch.float32
    assert attr.coarser(torch.float16, torch.bfloat16) == torch.bfloat16


def test_margin_probe_measures_the_targets_preference():
    model = tiny.target()
    prompt = tiny.prompts(1)[0]
    probe = attr.MarginProbe(model)
    logits = probe.logits(prompt, [])
    top2 = logits.topk(2).indices.tolist()
    gap = float(logits[top2[0]] - logits[top2[1]])
    scale = max(1.0, float(logits.abs().max()))
    oracle, output = [top2[0], 5], [top2[1], 5]
    d = probe.divergence(3, prompt, output, oracle, 0, 1e-6)
    assert (d.prompt, d.index, d.oracle_token, d.engine_token) == (3, 0, top2[0], top2[1])
    assert d.margin == pytest.approx(gap) and d.tolerance == pytest.approx(1e-6 * scale)
    assert d.cls == "synchronization"  # a random model's top-2 gap is far above float64 noise
    assert probe.divergence(3, prompt, output, oracle, 0, gap / scale * 1.01).cls == "numerical"
    short = probe.divergence(0, prompt, oracle[:1], oracle, 1, 1.0)
    assert short.margin is None and short.cls == "synchronization"


# --- signature rules ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, signature",
    [
        ("positions", "position-id misalignment"),
        ("count", "kv-cache drift"),
        ("content", "kv-cache drift"),
        ("shape", "kv-cache drift"),
        ("padding", "padding leakage"),
    ],
)
def test_white_box_signature(kind, signature):
    assert attr.white_box_signature(2, {"kind": kind}) == signature
    assert attr.white_box_signature(0, {"kind": kind}) == "clean"


def test_white_box_without_violation_is_an_acceptance_rule_error():
    assert attr.white_box_signature(3, None) == "acceptance-rule error"
    assert attr.white_box_signature(0, None) == "clean"


def _rec(pm=0.5, padded=False, solo=None, loops=False, oracle_loops=False):
    return {"partial_match": pm, "padded": padded, "solo_clean": solo, "loops": loops, "oracle_loops": oracle_loops}


def test_black_box_signature_rules():
    assert attr.black_box_signature(8, []) == "clean"
    assert attr.black_box_signature(8, [_rec(padded=True, solo=True)] * 3) == "padding leakage"
    # a padded row that also diverges alone is not padding leakage; neither is anything at batch size 1
    assert attr.black_box_signature(8, [_rec(padded=True, solo=True), _rec(padded=True, solo=False)]) == "unknown"
    assert attr.black_box_signature(1, [_rec(padded=True, solo=True)]) == "unknown"
    assert attr.black_box_signature(8, [_rec(pm=0.0), _rec(pm=0.2)]) == "position-id misalignment"
    assert attr.black_box_signature(8, [_rec(pm=0.6, loops=True), _rec(pm=0.8)]) == "kv-cache drift"
    # the oracle looping as well is no evidence of drift
    assert attr.black_box_signature(8, [_rec(pm=0.6, loops=True, oracle_loops=True)]) == "unknown"
    assert set(attr.SIGNATURES) >= {"clean", "unknown", attr.REFERENCE} and len(attr.SIGNATURES) == 7


def test_invariant_kind_from_attribute_or_message():
    class Err(AssertionError):
        def __init__(self, invariant, message, kind=None):
            super().__init__(message)
            self.invariant, self.kind, self.row, self.round, self.cache = invariant, kind, 1, 2, "target"

    assert attr.invariant_kind(Err("I2", "whatever", "padding")) == "padding"
    assert attr.invariant_kind(Err("I1", "layer 0 keys have batch 3")) == "shape"
    assert attr.invariant_kind(Err("I2", "valid slots do not carry positions 0..n-1 in order")) == "positions"
    assert attr.invariant_kind(Err("I2", "4 valid KV entries but 3 tokens processed")) == "count"
    assert attr.invariant_kind(Err("I2", "a visible slot holds a token the row did not accept")) == "content"
    rec = attr.invariant_record(Err("I2", "x", "count"), [0, 1])
    assert rec["invariant"] == "I2" and rec["kind"] == "count" and rec["row"] == 1 and rec["batch"] == [0, 1]
