"""End-to-end audit on tiny float64 models: clean engines pass, every injected fault is caught and diagnosed, a
correct lower-precision engine only ever diverges numerically, and the report, oracle cache and CLI work."""

import copy
import json

import pytest
import tiny
import torch

import batchspec
from batchspec.audit import attribution as attr
from batchspec.audit import audit
from batchspec.audit.oracle import Oracle, default_cache_dir, fingerprint
from batchspec.engine.faults import FAULTS, SAMPLING_FAULTS

MAX_TOKENS = 32
BATCH_SIZES = (2, 8)
# fault -> (signature, first violated invariant kinds). Keeping rejected KV shows as "count" unless the batch's
# realignment first trims the extra visible slots of its longest row, which leaves "content" (both are KV drift).
EXPECTED = {
    "bsp-stale-positions": ("position-id misalignment", {"positions"}),
    "bsp-keep-rejected-kv": ("kv-cache drift", {"count", "content"}),
    "dsd-draft-token-accepted": ("acceptance-rule error", None),
    "dsd-unmasked-padding": ("padding leakage", {"padding"}),
    "kv-realign-off-by-one": ("kv-cache drift", {"content"}),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread when the cores are shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("oracle")


@pytest.fixture(scope="module")
def prompts():
    return tiny.prompts(8)


@pytest.fixture(scope="module")
def report(prompts, cache):
    return audit(
        tiny.target(), tiny.draft(), prompts, engines=["slotmask", "eqspec", "faults"], batch_sizes=BATCH_SIZES,
        max_tokens=MAX_TOKENS, cache_dir=cache,
    )


def test_prompts_make_rows_accept_raggedly(prompts):
    llm = tiny.fixed_llm(tiny.target(), tiny.draft(), batch_size=8)
    llm.generate(prompts, batchspec.SamplingParams(max_tokens=MAX_TOKENS))
    assert llm.stats.ragged_rounds >= llm.stats.rounds // 2 > 0


def test_oracle_is_hf_greedy_at_batch_size_one(report, prompts):
    model = tiny.target()
    assert report.oracle == [tiny.oracle(model, p, MAX_TOKENS) for p in prompts]


def test_every_fault_is_audited_at_every_batch_size(report):
    greedy_faults = [f for f in FAULTS if f not in SAMPLING_FAULTS]  # the rest show only when sampling
    assert set(greedy_faults) == set(EXPECTED)
    assert [(r.engine, r.batch_size) for r in report.rows] == [
        (e, b) for e in ["slotmask", "eqspec"] + [f"fault:{f}" for f in greedy_faults] for b in BATCH_SIZES
    ]


@pytest.mark.parametrize("engine", ["slotmask", "eqspec"])
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_clean_engines(report, engine, batch_size):
    row = report.row(engine, batch_size)
    assert row.exact_match == 1.0 and row.partial_match == 1.0 and row.rouge_l == pytest.approx(1.0)
    assert row.divergences == [] and row.synchronization == 0
    assert row.signature == "clean" and row.first_violated_invariant is None
    assert row.n == 8 and row.tokens_per_second > 0


@pytest.mark.parametrize("fault", sorted(EXPECTED))
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_fault_is_detected_and_diagnosed(report, fault, batch_size):
    row = report.row(f"fault:{fault}", batch_size)
    signature, kinds = EXPECTED[fault]
    assert row.exact_match < 1.0
    assert row.synchronization > 0 and all(d.cls == "synchronization" for d in row.divergences)
    assert row.signature == signature
    if kinds is None:
        assert row.first_violated_invariant is None
    else:
        v = row.first_violated_invariant
        assert v["invariant"] == "I2" and v["kind"] in kinds and v["cache"] == "target"
        assert set(v["batch"]) & {d.prompt for d in row.divergences}


def test_divergence_records(report, prompts):
    for row in report.rows:
        for d in row.divergences:
            out, ref = row.outputs[d.prompt], report.oracle[d.prompt]
            assert out[: d.index] == ref[: d.index] and out != ref
            assert d.oracle_token == ref[d.index] and d.engine_token == out[d.index]
            assert d.margin > d.tolerance > 0


def _lower_precision_engine(name, dtype):
    """A correct engine (batchspec on a cast copy of the target and draft), seen by the audit as a black box."""
    target, draft = tiny.target("llama", dtype), tiny.draft("llama", dtype)

    class Engine:
        def __init__(self):
            self.name, self.dtype = name, dtype

        def __call__(self, batch):
            llm = batchspec.LLM(target, draft, layout="eqspec", batch_size=len(batch))
            return [o.token_ids for o in llm.generate(batch, batchspec.SamplingParams(max_tokens=MAX_TOKENS))]

    return Engine()


def test_float32_engine_only_diverges_numerically(prompts, cache):
    engine = _lower_precision_engine("eqspec-float32", torch.float32)
    rep = audit(tiny.target(), None, prompts, engines=[engine], batch_sizes=[1, 8], max_tokens=MAX_TOKENS,
                cache_dir=cache)
    for row in rep.rows:
        assert all(d.cls == "numerical" for d in row.divergences)
        assert row.signature == "clean" and row.first_violated_invariant is None


def test_bfloat16_engine_diverges_but_only_numerically(prompts, cache):
    engine = _lower_precision_engine("eqspec-bfloat16", torch.bfloat16)
    rep = audit(tiny.target(), None, prompts, engines=[engine], batch_sizes=[8], max_tokens=MAX_TOKENS,
                cache_dir=cache)
    row = rep.rows[0]
    assert row.exact_match < 1.0  # bfloat16 flips near-tied argmax choices...
    assert row.numerical > 0 and row.synchronization == 0  # ...and the margin test says so
    assert row.signature == "clean"
    # with float64's tolerance the same divergences would count as synchronization errors
    strict = audit(tiny.target(), None, prompts, engines=[("strict", engine, torch.float64)], batch_sizes=[8],
                   max_tokens=MAX_TOKENS, cache_dir=cache)
    assert strict.rows[0].synchronization == row.numerical and strict.rows[0].signature != "clean"


def test_a_float32_fault_is_never_a_near_tie(prompts):
    """In float32 a correct engine's near ties lie within a few units in the last place of the logit scale: a fault
    whose margin is a thousandth of it (here under 1e-3 of the scale, which the tolerance once allowed) is a
    synchronization divergence, and a correct engine stays clean."""
    target, draft = copy.deepcopy(tiny.target()).float(), copy.deepcopy(tiny.draft()).float()
    rep = audit(target, draft, prompts[:2], engines=["slotmask", "fault:kv-realign-off-by-one"], batch_sizes=[2],
                max_tokens=MAX_TOKENS, cache_dir=False)
    clean, fault = rep.rows
    assert clean.signature == "clean" and clean.exact_match == 1.0
    assert fault.divergences and all(d.cls == "synchronization" for d in fault.divergences)
    assert any(d.margin < 1e-3 * d.tolerance / attr.relative_tolerance(torch.float32) for d in fault.divergences)


def test_black_box_engine_with_padding_fault(prompts, cache):
    def padded(batch):
        llm = batchspec.LLM(tiny.target(), tiny.draft(), layout="eqspec", fault="dsd-unmasked-padding",
                            batch_size=len(batch))
        return [o.token_ids for o in llm.generate(batch, batchspec.SamplingParams(max_tokens=MAX_TOKENS))]

    rep = audit(tiny.target(), tiny.draft(), prompts, engines=[("third-party", padded)], batch_sizes=[1, 8],
                max_tokens=MAX_TOKENS, cache_dir=cache)
    alone, batched = rep.rows
    assert alone.signature == "clean" and alone.exact_match == 1.0
    assert batched.exact_match < 1.0 and batched.signature == "padding leakage"
    assert batched.first_violated_invariant is None  # no white-box view of a third-party engine


def test_outputs_are_cut_at_the_first_stop_token(prompts, cache):
    ref = audit(tiny.target(), None, prompts[:3], engines=["plain"], batch_sizes=[1], max_tokens=MAX_TOKENS,
                cache_dir=cache).oracle
    stop = ref[0][3]
    cut = [o[: o.index(stop) + 1] if stop in o else o for o in ref]

    def runs_on(batch):  # ignores stop tokens and overshoots max_tokens; the audit truncates
        return [ref[prompts.index(p)] + [stop, 1, 2, 3] for p in batch]

    rep = audit(tiny.target(), None, prompts[:3], engines=[("runs-on", runs_on)], batch_sizes=[3],
                max_tokens=MAX_TOKENS, stop_token_ids=[stop], cache_dir=cache)
    assert rep.oracle == cut and rep.oracle[0][-1] == stop
    assert rep.rows[0].outputs == cut and rep.rows[0].exact_match == 1.0


def test_report_files(report, tmp_path):
    data = json.loads(report.to_json(tmp_path / "a" / "audit.json").read_text())
    assert len(data["rows"]) == len(report.rows) and data["meta"]["n_prompts"] == 8
    row = data["rows"][-1]
    assert {"exact_match", "partial_match", "rouge_l", "repetition_rate", "n", "divergences", "signature",
            "first_violated_invariant", "tokens_per_second"} <= set(row)
    assert {"prompt", "index", "margin", "class"} <= set(row["divergences"][0])
    md = report.to_markdown()
    assert sum(line.startswith("| ") for line in md.splitlines()) == len(report.rows) + 1 and "| fault:bsp-stale-positions | 8 |" in md
    assert report.plot(tmp_path / "audit.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_oracle_cache(tmp_path, monkeypatch, prompts):
    model = tiny.target()
    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env" / "oracle"
    first = Oracle(model, 8, [2])
    out = first(prompts[:2])
    assert (first.hits, first.misses) == (0, 2) and first.dir.is_relative_to(tmp_path / "env")
    again = Oracle(model, 8, [2])
    assert again(prompts[:2]) == out and (again.hits, again.misses) == (2, 0)
    longer = Oracle(model, 9, [2])
    longer(prompts[:1])
    assert longer.misses == 1  # max_tokens is part of the key
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.lm_head.weight[5, 0] += 1.0
    assert fingerprint(changed) != fingerprint(model) != fingerprint(copy.deepcopy(model).to(torch.float32))


def test_engine_names_are_checked(prompts, cache):
    with pytest.raises(ValueError, match="unknown engine"):
        audit(tiny.target(), None, prompts, engines=["nope"], cache_dir=cache)
    with pytest.raises(ValueError, match="unknown fault"):
        audit(tiny.target(), None, prompts, engines=["fault:nope"], cache_dir=cache)
    with pytest.raises(ValueError, match="needs a name"):
        audit(tiny.target(), None, prompts, engines=[lambda b: b], cache_dir=cache)
    with pytest.raises(ValueError, match="unique"):
        audit(tiny.target(), None, prompts, engines=["eqspec", ("eqspec", lambda b: b)], cache_dir=cache)
    with pytest.raises(ValueError, match="tokenizer"):
        audit(tiny.target(), None, ["text"], engines=["plain"], cache_dir=cache)


def _save_tiny(root):
    """The tiny models as model folders, with a word-level tokenizer (token i is the word "w<i>")."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"w{i}": i for i in range(tiny.VOCAB)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0")
    for name, model in (("target", tiny.target()), ("draft", tiny.draft())):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "prompts.txt").write_text("\n".join(" ".join(f"w{t}" for t in p) for p in tiny.prompts(4)) + "\n")


def test_cli(tmp_path, monkeypatch, capsys):
    from batchspec.cli import main

    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    _save_tiny(tmp_path)
    common = ["audit", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--prompts",
              str(tmp_path / "prompts.txt"), "--dtype", "float64", "--max-tokens", "16", "--device", "cpu"]
    rc = main(common + ["--engines", "eqspec,fault:bsp-stale-positions", "--batch-sizes", "1,4",
                        "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr()
    data = json.loads((tmp_path / "out" / "audit.json").read_text())
    assert [(r["engine"], r["batch_size"]) for r in data["rows"]] == [
        ("eqspec", 1), ("eqspec", 4), ("fault:bsp-stale-positions", 1), ("fault:bsp-stale-positions", 4)
    ]
    assert data["rows"][0]["exact_match"] == 1.0
    assert (tmp_path / "out" / "audit.md").read_text().startswith("| engine |")
    assert (tmp_path / "out" / "audit.png").stat().st_size > 0
    assert "eqspec" in capsys.readouterr().out
    assert main(common + ["--engines", "eqspec", "--batch-sizes", "1,x"]) == 2
