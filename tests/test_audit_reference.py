"""The audit's reference can be trusted: the oracle cache is keyed on every weight, and a reference that the target
itself does not prefer is reported as such instead of passing as a numerical near-tie."""

import copy
import json

import pytest
import tiny
import torch

from batchspec.audit import attribution as attr
from batchspec.audit import audit, oracle
from batchspec.audit.oracle import Oracle, fingerprint, weights_digest
from batchspec.model.loading import eos_ids

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts():
    return tiny.prompts(4)


@pytest.fixture
def model():
    """A private float64 copy of the tiny target: tests may edit it, and the shared one stays intact."""
    return copy.deepcopy(tiny.target()).to(torch.float64)


def _hf(model, prompts):
    return [tiny._generate(model, p, MAX_TOKENS, ()) for p in prompts]


# --- (a) the oracle cache follows every weight -------------------------------------------------------------------


def test_editing_any_weight_gives_a_fresh_reference(tmp_path, prompts, model):
    kw = dict(engines=["plain"], batch_sizes=[4], max_tokens=MAX_TOKENS, cache_dir=tmp_path)
    first = audit(model, None, prompts, **kw)
    assert first.rows[0].signature == "clean" and first.meta["oracle_cache"]["misses"] == len(prompts)
    assert first.meta["stop_ids"] == []
    with torch.no_grad():  # not a tensor that a sampled checksum would look at
        model.model.layers[0].self_attn.v_proj.weight.mul_(-3)
    again = audit(model, None, prompts, **kw)
    assert again.meta["oracle_cache"]["misses"] == len(prompts)  # recomputed, not read from the cache
    assert again.oracle == _hf(model, prompts) != first.oracle
    row = again.rows[0]
    assert row.exact_match == 1.0 and row.signature == "clean" and row.clean


# --- (b) the weights digest: every edit seen, nothing rehashed in vain ----------------------------------------------


def test_weights_digest_changes_with_every_edit_and_is_cached(monkeypatch, model):
    calls = []
    real = oracle._hash_weights
    monkeypatch.setattr(oracle, "_hash_weights", lambda m: calls.append(1) or real(m))
    seen = [weights_digest(model)]
    fp = fingerprint(model)
    assert weights_digest(model) == seen[0] and fingerprint(model) == fp and len(calls) == 1  # cached

    v = model.model.layers[0].self_attn.v_proj
    with torch.no_grad():  # in place, under no_grad: the version counter moves
        v.weight[3, 1] += 1e-9
    seen.append(weights_digest(model))
    assert len(calls) == 2 and fingerprint(model) != fp

    with torch.inference_mode():  # in place, in inference mode
        v.weight.mul_(-3)
    seen.append(weights_digest(model))

    same = v.weight.detach().clone()
    v.weight = torch.nn.Parameter(same)  # replaced by equal values: rehashed, same digest
    assert weights_digest(model) == seen[-1] and len(calls) == 4
    v.weight = torch.nn.Parameter(same * 2)  # replaced by other values
    seen.append(weights_digest(model))

    rotary = model.model.rotary_emb
    with torch.no_grad():  # buffers count too
        rotary.inv_freq.mul_(1.5)
    seen.append(weights_digest(model))

    model.to(torch.float32)
    seen.append(weights_digest(model))
    assert len(set(seen)) == len(seen) and len(calls) == 7
    assert weights_digest(model) == seen[-1] and len(calls) == 7

    twin = copy.deepcopy(model)  # another object with the same weights: same digest, so the disk cache is shared
    assert weights_digest(twin) == seen[-1] and len(calls) == 8


# --- (c) a reference that the target disprefers is a broken reference ----------------------------------------------


def _runner_up(model, prompt, prefix):
    logits = attr.MarginProbe(model).logits(prompt, prefix)
    return logits.topk(2).indices.tolist()


def test_margin_probe_calls_a_dispreferred_reference_a_reference_error(prompts, model):
    best, second = _runner_up(model, prompts[0], [])
    d = attr.MarginProbe(model).divergence(0, prompts[0], [best, 5], [second, 5], 0, 1e-6)
    assert d.margin < -d.tolerance < 0 and d.cls == "reference"
    assert d.as_dict()["class"] == "reference"


def test_signature_rules_put_a_wrong_reference_first():
    assert attr.REFERENCE == "stale or wrong reference" and attr.REFERENCE in attr.SIGNATURES
    assert attr.white_box_signature(0, None, n_reference=1) == attr.REFERENCE
    assert attr.white_box_signature(2, {"kind": "positions"}, n_reference=1) == attr.REFERENCE
    assert attr.black_box_signature(8, [], n_reference=3) == attr.REFERENCE
    rec = {"partial_match": 0.0, "padded": False, "solo_clean": None, "loops": False, "oracle_loops": False}
    assert attr.black_box_signature(8, [rec], n_reference=1) == attr.REFERENCE
    assert attr.white_box_signature(0, None) == "clean" and attr.black_box_signature(8, []) == "clean"


def test_a_stale_cached_reference_is_reported_not_clean(tmp_path, prompts, model):
    truth = _hf(model, prompts)
    k = 3  # corrupt prompt 0's cached reference at token k with the target's runner-up there
    best, second = _runner_up(model, prompts[0], truth[0][:k])
    assert best == truth[0][k]
    stale = truth[0][:k] + [second] + truth[0][k + 1:]
    Oracle(model, MAX_TOKENS, sorted(eos_ids(model)), tmp_path)._write([int(t) for t in prompts[0]], stale)

    def honest(batch):  # a black-box engine that returns HF's own batch-size-1 outputs
        return _hf(model, batch)

    rep = audit(model, None, prompts, engines=["plain", ("honest", honest)], batch_sizes=[2],
                max_tokens=MAX_TOKENS, cache_dir=tmp_path)
    assert rep.meta["oracle_cache"]["hits"] == 1 and rep.oracle[0] == stale
    for row in rep.rows:
        assert row.outputs == truth and row.exact_match == 0.75
        [d] = row.divergences
        assert (d.prompt, d.index, d.oracle_token, d.engine_token) == (0, k, second, best)
        assert d.margin < -d.tolerance and d.cls == "reference"
        assert row.signature == attr.REFERENCE and not row.clean
        assert (row.reference, row.numerical, row.synchronization) == (1, 0, 0)
    data = json.loads(rep.to_json(tmp_path / "audit.json").read_text())
    assert [r["reference"] for r in data["rows"]] == [1, 1]
    assert data["rows"][0]["divergences"][0]["class"] == "reference"
    md = rep.to_markdown()
    assert "| 0/0 (1 ref) | stale or wrong reference |" in md and "stale or wrong" in md.splitlines()[-1]

