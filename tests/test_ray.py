"""``batchspec.integrations.ray`` on a local 2-CPU Ray: outputs equal batch-size-1 greedy decoding (the HF ``generate`` oracle) for
any number of workers and block size, ids and order survive, per-row sampling columns apply, JSONL / Parquet round
trips, ``generate --ray``, a worker killed mid-run, and the one-line error without Ray."""

import json
import os
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray  # installed by scripts/setup (the ray extra): these tests must run, not skip
import tiny
import torch

import batchspec
from batchspec.cli import main
from batchspec.integrations import ray as bray

TESTS = str(Path(__file__).resolve().parent)
MODELS = {"target": tiny.target, "draft": tiny.draft, "num_draft_tokens": 3, "batch_size": 3, "speculation": "fixed"}


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    """One local Ray for the module; workers import ``tiny`` (the model factories) and this module from here."""
    path = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()


def _rows(n=11, seed=0):
    return [{"id": f"p{i:02d}", "prompt": p, "max_tokens": 4 + (i * 5) % 11}
            for i, p in enumerate(tiny.prompts(n, seed=seed))]


def _check_exact(out, rows):
    model = tiny.target()
    for r, src in zip(out, rows, strict=True):
        assert r["id"] == src["id"] and list(r["prompt"]) == list(src["prompt"])
        assert list(r["token_ids"]) == tiny.oracle(model, list(src["prompt"]), src["max_tokens"]), r["id"]
        assert r["finish_reason"] == "length" and 0 <= r["num_accepted"] <= r["num_drafted"]


@pytest.mark.parametrize("workers,block", [(1, 4), (2, 1), (2, 5)])
def test_exact_whatever_workers_and_block_size(workers, block):
    rows = _rows()
    with bray.ordered():
        ds, size = bray.prepare(ray.data.from_items(rows), block_size=block, workers=workers)
        assert size == block and ds.num_blocks() == -(-len(rows) // block)
        out = bray.generate_dataset(ds, workers=workers, block_size=size, **MODELS).take_all()
    assert [r["id"] for r in out] == [r["id"] for r in rows]  # input order kept (preserve_order)
    _check_exact(out, rows)
    assert all(r["text"] is None for r in out)  # the tiny factories give no tokenizer
    # ragged speculation: some rows accepted every draft token of a round, others rejected some
    assert any(r["num_accepted"] < r["num_drafted"] for r in out) and any(r["num_accepted"] > 0 for r in out)


def test_per_row_sampling_columns():
    ps = tiny.prompts(5, seed=3)
    model = tiny.target()
    stop = tiny.oracle(model, ps[1], 12)[5]
    blank = dict.fromkeys(bray.SAMPLING_COLUMNS)
    rows = [
        {**blank, "id": 0, "prompt": ps[0], "max_tokens": 5},
        {**blank, "id": 1, "prompt": ps[1], "max_tokens": 12, "stop_token_ids": [stop]},
        {**blank, "id": 2, "prompt": ps[2], "max_tokens": 9, "temperature": 0.8, "top_k": 20, "top_p": 0.9,
         "seed": 7},
        {**blank, "id": 3, "prompt": ps[3]},  # every column null: the predictor's defaults (max_tokens 7)
        {**blank, "id": 4, "prompt": ps[4], "max_tokens": 6, "ignore_eos": True},
    ]
    with bray.ordered():
        out = bray.generate_dataset(ray.data.from_items(rows), workers=2, block_size=2, sampling={"max_tokens": 7},
                                    **MODELS).take_all()
    by_id = {r["id"]: r for r in out}
    assert sorted(by_id) == [0, 1, 2, 3, 4]
    assert by_id[0]["token_ids"] == tiny.oracle(model, ps[0], 5)
    assert by_id[1]["token_ids"] == tiny.oracle(model, ps[1], 12, stop_ids=[stop])
    assert by_id[1]["finish_reason"] == "stop" and by_id[1]["token_ids"][-1] == stop
    assert by_id[3]["token_ids"] == tiny.oracle(model, ps[3], 7)
    assert by_id[4]["token_ids"] == tiny.oracle(model, ps[4], 6)
    # a seeded sampled row is reproducible whatever it is batched with: the same as alone, in this process
    llm = batchspec.LLM(tiny.target(), draft=tiny.draft(), num_draft_tokens=3, batch_size=3, speculation="fixed")
    alone = llm.generate([ps[2]], batchspec.SamplingParams(max_tokens=9, temperature=0.8, top_k=20, top_p=0.9,
                                                            seed=7))[0]
    assert by_id[2]["token_ids"] == alone.token_ids and len(alone.token_ids) == 9


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_pipeline_round_trip(tmp_path, fmt):
    ps = tiny.prompts(9, seed=5)
    src = tmp_path / f"in.{fmt}"
    if fmt == "jsonl":  # no id column: ids come from row order
        src.write_text("".join(json.dumps({"prompt": p, "max_tokens": 3 + i % 4, "tag": f"t{i}"}) + "\n"
                               for i, p in enumerate(ps)))
        ids = list(range(len(ps)))
    else:  # string ids carried through
        ids = [f"q{i:02d}" for i in range(len(ps))]
        pq.write_table(pa.table({"id": ids, "prompt": ps, "max_tokens": [3 + i % 4 for i in range(len(ps))],
                                 "tag": [f"t{i}" for i in range(len(ps))]}), src)
    out = tmp_path / "out"
    summary = bray.run(src, out, output_format=fmt, workers=2, block_size=2, **MODELS)
    files = sorted(p for p in out.iterdir() if bray.FORMATS.get(p.suffix) == fmt)  # Ray names JSONL files *.json
    assert len(files) > 1
    rows = bray.read_results(out, sort_by=None)  # file-name order: preserve_order keeps input order
    assert [r["id"] for r in rows] == ids and [r["tag"] for r in rows] == [f"t{i}" for i in range(len(ps))]
    _check_exact(rows, [{"id": i, "prompt": p, "max_tokens": 3 + n % 4} for n, (i, p) in enumerate(zip(ids, ps))])
    assert summary["rows"] == len(ps) and summary["tokens"] == sum(len(r["token_ids"]) for r in rows)
    assert summary["drafted"] == sum(r["num_drafted"] for r in rows) > 0
    with pytest.raises(ValueError, match="not an empty folder"):
        bray.run(src, out, output_format=fmt, **MODELS)


def test_cli_generate_ray(tmp_path, capsys):
    target_dir, draft_dir = tiny.save_dir(tmp_path / "models")
    ps = tiny.prompts(7, seed=9)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ps))
    out = tmp_path / "out"
    rc = main(["generate", "--ray", "--workers", "2", "--target", str(target_dir), "--draft", str(draft_dir),
               "--prompts", str(prompts), "--out", str(out), "--max-tokens", "10", "--num-draft-tokens", "3",
               "--batch-size", "2", "--block-size", "3"])
    assert rc == 0
    rows = bray.read_results(out)
    assert [r["id"] for r in rows] == list(range(len(ps)))
    _check_exact(rows, [{"id": i, "prompt": p, "max_tokens": 10} for i, p in enumerate(ps)])
    assert all(isinstance(r["text"], str) for r in rows)  # the saved target has a tokenizer
    printed = capsys.readouterr().out
    assert "7 prompts" in printed and "tok/s" in printed and "2 Ray workers" in printed


def test_cli_generate_ray_text_prompts(tmp_path):
    """A plain text prompt file is read by the command, encoded in the workers through the chat template."""
    target_dir, _ = tiny.save_dir(tmp_path / "models", draft_too=False)
    texts = ["w5 w9 w33 w7", "w40", "w12 w12 w12 w80 w3 w61"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(texts) + "\n")
    out = tmp_path / "out"
    assert main(["generate", "--ray", "--target", str(target_dir), "--prompts", str(prompts), "--out", str(out),
                 "--max-tokens", "6", "--out-format", "parquet"]) == 0
    rows = bray.read_results(out)
    assert [(r["id"], r["prompt_id"], r["prompt"]) for r in rows] == [(i, str(i), t) for i, t in enumerate(texts)]
    tok = tiny.tokenizer()
    for r, text in zip(rows, texts):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
                                      return_dict=False)
        assert r["token_ids"] == tiny.oracle(tiny.target(), list(ids), 6)
        assert r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True)


class DiesOnce(bray.LLMPredictor):
    """Exits its worker process the first time it is handed the row ``victim`` (a marker file remembers)."""

    def __init__(self, *args, marker, victim, **kwargs):
        super().__init__(*args, **kwargs)
        self.marker, self.victim = marker, victim

    def __call__(self, batch):
        if self.victim in batch.column("id").to_pylist() and not os.path.exists(self.marker):
            Path(self.marker).write_text(str(os.getpid()))
            os._exit(1)
        return super().__call__(batch)


def test_killed_worker_is_retried_without_loss_or_duplicates(tmp_path):
    rows = _rows(12, seed=2)
    marker = tmp_path / "died"
    with warnings.catch_warnings():  # restart limits go to the actors as ray_remote_args, which Ray deprecates
        warnings.simplefilter("ignore")
        summary = bray.run(rows, tmp_path / "out", workers=2, block_size=2, predictor=DiesOnce, marker=str(marker),
                           victim="p07", max_restarts=3, max_task_retries=3, **MODELS)
    assert marker.exists() and int(marker.read_text()) != os.getpid()  # a worker process really died
    out = bray.read_results(tmp_path / "out")
    assert [r["id"] for r in out] == [r["id"] for r in rows]  # every row once
    _check_exact(out, rows)
    assert summary["rows"] == len(rows)


def test_predictor_in_process_formats_and_errors():
    """The mapper itself, without Ray: pyarrow, pandas and numpy batches, Spec-Bench ``turns``, row ids in errors."""
    pred = bray.LLMPredictor(tiny.target, sampling=batchspec.SamplingParams(max_tokens=4), threads=1)
    ps = tiny.prompts(3, seed=4)
    want = [tiny.oracle(tiny.target(), p, 4) for p in ps]
    table = pa.table({"id": ["a", "b", "c"], "prompt": ps, "x": [1, 2, 3]})
    got = pred(table)
    assert got.column_names == ["id", "prompt", "x", *bray.OUTPUT_COLUMNS]
    assert got.column("token_ids").to_pylist() == want and got.column("x").to_pylist() == [1, 2, 3]
    df = pred(table.to_pandas())
    assert [list(t) for t in df["token_ids"]] == want and list(df["id"]) == ["a", "b", "c"]
    column = np.empty(len(ps), dtype=object)
    column[:] = [np.array(p) for p in ps]
    arrays = pred({"id": np.array([0, 1, 2]), "prompt": column})
    assert [t.tolist() for t in arrays["token_ids"]] == want and arrays["num_drafted"].tolist() == [0, 0, 0]
    turns = pred(pa.table({"turns": [[p, [1]] for p in ps]}))
    assert turns.column("token_ids").to_pylist() == want
    assert pred(table.slice(0, 0)).num_rows == 0
    with pytest.raises(ValueError, match="row b is empty"):
        pred(pa.table({"id": ["a", "b"], "prompt": [ps[0], []]}))
    with pytest.raises(ValueError, match="row 1: max_tokens"):
        pred(pa.table({"id": [0, 1], "prompt": ps[:2], "max_tokens": [3, -1]}))
    with pytest.raises(ValueError, match="no 'prompt' column"):
        pred(pa.table({"text": ["x"]}))


def test_predictor_passes_every_llm_argument_on():
    """The worker's ``LLM`` gets every argument it is given, ``weights`` included (it was dropped), as keywords or as
    an ``EngineConfig``; both at once is refused."""
    pred = bray.LLMPredictor(tiny.target, weights="fp32", batch_size=3, prefix_cache=0, threads=1)
    assert (pred.llm.weights_mode, pred.llm.batch_size, pred.llm.config.prefix_cache) == ("fp32", 3, 0)
    config = batchspec.EngineConfig(tiny.target, draft=tiny.draft, weights="fp32", num_draft_tokens=2, dtype="float64")
    pred = bray.LLMPredictor(config=config, threads=1)
    assert (pred.llm.weights_mode, pred.llm.k, pred.llm.target.dtype) == ("fp32", 2, tiny.target().dtype)
    assert pred.llm.config.target is tiny.target()  # the factory was called in the worker
    with pytest.raises(ValueError, match="not both"):
        bray.LLMPredictor(tiny.target, config=config)


def test_cli_generate_ray_hands_its_model_flags_on(monkeypatch, tmp_path):
    """``generate --ray`` gives the workers the same ``EngineConfig`` as ``generate`` builds its ``LLM`` from."""
    target_dir, _ = tiny.save_dir(tmp_path / "models", draft_too=False)
    seen = {}

    def run(source, out, **kwargs):
        seen.update(kwargs)
        return {"rows": 1, "tokens": 1, "seconds": 1.0, "drafted": 0, "accepted": 0, "workers": 1, "block_size": 1,
                "out": str(out), "format": "jsonl"}

    monkeypatch.setattr(bray, "run", run)
    assert main(["generate", "--ray", "--target", str(target_dir), "--out", str(tmp_path / "out"), "--weights",
                 "fp32", "--prefix-cache", "0", "--batch-size", "3", "--dtype", "float64", "--layout", "eqspec"]) == 0
    assert seen["config"] == batchspec.EngineConfig(str(target_dir), weights="fp32", prefix_cache=0, batch_size=3,
                                                    dtype=torch.float64, layout="eqspec")


def test_missing_ray_is_a_one_line_error(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # ``import ray`` now fails as if it were not installed
    monkeypatch.setitem(sys.modules, "ray.data", None)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(batchspec, "LLM", no_model)
    out = tmp_path / "out"
    assert main(["generate", "--ray", "--workers", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("batchspec generate: error: Ray is not installed")
    assert 'pip install "batchspec[ray]"' in err[0]
    assert not out.exists()
    with pytest.raises(bray.RayNotInstalled, match="batchspec\\[ray\\]"):
        bray.require_ray()


def test_cli_ray_refuses_bad_output_before_loading(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(batchspec, "LLM", lambda *a, **k: pytest.fail("a model was loaded"))
    assert main(["generate", "--ray"]) == 2
    assert "--out DIR" in capsys.readouterr().err
    full = tmp_path / "full"
    full.mkdir()
    (full / "old.jsonl").write_text("{}\n")
    assert main(["generate", "--ray", "--out", str(full)]) == 2
    assert "not empty" in capsys.readouterr().err
    missing = str(tmp_path / "no-such-model")
    assert main(["generate", "--ray", "--target", missing, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not found" in err[0]
