"""A user error never costs a run and never changes the user's objects: bad flags, prompt files, ``--out`` paths,
devices and model paths are refused at once with one line and exit status 2, before any model loads. Outputs are
never lost: a failed write leaves the previous file as it was, and Ctrl-C writes what finished."""

import builtins
import errno
import io
import json
import os
import stat
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tiny
import torch

import batchspec
import batchspec.model.loading as models
from batchspec.cli import main
from batchspec.cli.common import write_atomic
from batchspec.engine.engine import Engine
from batchspec.integrations import ray as bray


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny.save_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to load a model from disk fails the test: the error must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("w5 w6 w7\nw9 w10\n")
    return path


def _one_error_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"batchspec {command}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _args(command, target_dir, prompts, *extra):
    engines = [] if command == "generate" else ["--engines", "plain"]
    return [command, "--target", str(target_dir), "--draft", "none", "--prompts", str(prompts), *engines, *extra]


# ------------------------------------------------------------------------------------------------ --out


@pytest.mark.parametrize("command,kind,message", [
    ("generate", "folder", "is a folder; give a file path"),
    ("generate", "under-file", "is a file, not a folder"),
    ("audit", "file", "is a file, not a folder"),
    ("audit", "under-file", "is a file, not a folder"),
    ("bench", "file", "is a file, not a folder"),
    ("bench", "under-file", "is a file, not a folder"),
])
def test_bad_out_is_refused_before_any_model_loads(dirs, prompts, tmp_path, no_model_load, capsys, command, kind,
                                                   message):
    regular = tmp_path / "regular"
    regular.write_text("keep me")
    out = {"folder": tmp_path, "file": regular, "under-file": regular / "sub" / "out.jsonl"}[kind]
    assert main(_args(command, dirs[0], prompts, "--out", str(out))) == 2
    assert message in _one_error_line(capsys, command)
    assert regular.read_text() == "keep me"


def test_generate_creates_the_out_folder_before_loading(dirs, prompts, tmp_path, no_model_load):
    out = tmp_path / "new" / "deeper" / "out.jsonl"
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(_args("generate", dirs[0], prompts, "--out", str(out)))
    assert out.parent.is_dir()


# ------------------------------------------------------------------------------------------------ flags


@pytest.mark.parametrize("argv", [
    ["audit", "--limit", "0"], ["audit", "--limit", "-1"], ["bench", "--limit", "0"], ["bench", "--limit", "-1"],
    ["bench", "--truncate", "0"], ["bench", "--truncate", "-1"], ["generate", "--max-tokens", "0"],
    ["audit", "--samples", "0"],
])
def test_counts_below_one_are_refused(dirs, prompts, no_model_load, capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(_args(argv[0], dirs[0], prompts, *argv[1:]))
    assert e.value.code == 2
    assert f"argument {argv[1]}: must be an integer >= 1, got '{argv[2]}'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["generate", "audit"])
@pytest.mark.parametrize("flag", [["--top-k", "5"], ["--top-p", "0.9"]])
def test_top_k_top_p_without_temperature_refused_alike(dirs, prompts, no_model_load, capsys, command, flag):
    assert main(_args(command, dirs[0], prompts, *flag)) == 2
    assert "--top-k and --top-p apply to sampling: give --temperature > 0 as well" in _one_error_line(capsys, command)


@pytest.mark.parametrize("device,message", [
    ("bogus", "unknown device 'bogus'"),
    pytest.param("cuda", "device 'cuda' is not available", marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="a CUDA device is present")),
])
def test_unusable_device_is_one_line(dirs, prompts, capsys, device, message):
    for command in ("generate", "audit", "bench"):
        assert main(_args(command, dirs[0], prompts, "--device", device)) == 2
        assert message in _one_error_line(capsys, command)
    with pytest.raises(ValueError, match=message):
        batchspec.LLM(tiny.target("llama"), device=device)


@pytest.mark.parametrize("command", ["generate", "audit", "bench"])
def test_empty_prompt_file_refused(dirs, tmp_path, no_model_load, capsys, command):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    assert main(_args(command, dirs[0], empty)) == 2
    assert f"no prompts in {empty}" in _one_error_line(capsys, command)


def test_non_utf8_prompt_file_is_named(dirs, tmp_path, no_model_load, capsys):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\u00e9 w5\n".encode("latin-1"))
    assert main(_args("generate", dirs[0], bad)) == 2
    assert f"prompt file {bad} is not UTF-8 text" in _one_error_line(capsys, "generate")


# ------------------------------------------------------------------------------------------------ prompt file records


@pytest.fixture
def no_ray_start(monkeypatch):
    """Starting Ray fails the test: a bad prompt file must be refused in this process first."""
    import ray

    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray was started before the prompt file was checked"))


GOOD_LINES = "".join(json.dumps({"question_id": i, "turns": [f"w{i + 5} w9"]}) + "\n" for i in range(6))


@pytest.mark.parametrize("ray_", [False, True], ids=["local", "ray"])
@pytest.mark.parametrize("line,expected", [
    ('{"turns": [12345]}', ['"turns"[0] must be a string', "got 12345"]),
    ('{"turns": [null]}', ['"turns"[0] must be a string', "got null"]),
    ('{"turns": []}', ['"turns" must be a non-empty list', "got []"]),
    ('{"turns": "w5 w6"}', ['"turns" must be a non-empty list', 'got "w5 w6"']),
    ('{"turns": ["  "]}', ['"turns"[0] is empty']),
    ('{"prompt": 5}', ['"prompt" must be a string', "got 5"]),
    ('{"turns": ["w5"]', ["not valid JSON", "each line must be one JSON object"]),
    ('["w5 w6"]', ["expected a JSON object", 'got ["w5 w6"]']),
    ('{"question": "w5"}', ['no "turns" or "prompt" field']),
])
def test_bad_prompt_record_names_file_and_line_before_loading(dirs, tmp_path, no_model_load, no_ray_start, capsys,
                                                              ray_, line, expected):
    bad = tmp_path / "p.jsonl"
    bad.write_text(GOOD_LINES + line + "\n" + GOOD_LINES)  # the bad record is line 7
    ray_args = ["--ray", "--out", str(tmp_path / "out")] if ray_ else []
    assert main(_args("generate", dirs[0], bad, *ray_args)) == 2
    err = _one_error_line(capsys, "generate")
    assert f"{bad} line 7: " in err and all(e in err for e in expected), err


def test_empty_prompt_file_refused_before_ray_starts(dirs, tmp_path, no_model_load, no_ray_start, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(_args("generate", dirs[0], empty, "--ray", "--out", str(tmp_path / "out"))) == 2
    assert f"no prompts in {empty}" in _one_error_line(capsys, "generate")


def test_ray_prompt_files_are_checked_as_the_workers_read_them(tmp_path):
    ids = tmp_path / "ids.jsonl"  # token-id prompts and sampling columns, as Ray's workers take them
    ids.write_text('{"prompt": [5, 6]}\n\n{"prompt": [7], "max_tokens": 3.0, "seed": null}\n')
    assert bray.check_prompt_file(ids) == 2
    array = tmp_path / "array.json"  # one JSON array: Ray reads that too
    array.write_text(json.dumps([{"turns": ["w5"]}, {"turns": ["w6"]}, {"turns": ["w7"]}], indent=1))
    assert bray.check_prompt_file(array) == 3
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": "w5"}\n{"prompt": [5, 6]}\n')
    with pytest.raises(ValueError, match=f'{mixed} line 2: the prompt is "prompt" token ids, but {mixed} line 1 gives'):
        bray.check_prompt_file(mixed)
    sampling = tmp_path / "sampling.jsonl"
    sampling.write_text('{"prompt": "w5"}\n{"prompt": "w6"}\n{"prompt": "w7", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=f"{sampling} line 3: max_tokens must be an integer >= 1 and < 2\\*\\*31, got 0"):
        bray.check_prompt_file(sampling, batchspec.SamplingParams())
    negative = tmp_path / "negative.jsonl"
    negative.write_text('{"prompt": [5, -1]}\n')
    with pytest.raises(ValueError, match=f'{negative} line 1: "prompt" has token id -1'):
        bray.check_prompt_file(negative)
    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.table({"prompt": ["w5", "w6"]}), folder / "a.parquet")
    pq.write_table(pa.table({"prompt": [[5, 6]]}), folder / "b.parquet")
    assert bray.check_prompt_file(folder) == 3
    pq.write_table(pa.table({"text": ["w5"]}), folder / "c.parquet")
    with pytest.raises(ValueError, match='c.parquet: no "prompt" or "turns" column'):
        bray.check_prompt_file(folder)
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"prompt": [1.5]}), numbers)
    with pytest.raises(ValueError, match='column "prompt" has type double'):
        bray.check_prompt_file(numbers)


# ------------------------------------------------------------------------------------------------ outputs


@pytest.fixture
def quiet_loading():
    """No "Loading weights" bar from transformers on stderr, so that the command's own line is all there is."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    yield
    if was:
        logging.enable_progress_bar()


@pytest.fixture
def disk_fills(monkeypatch):
    """``disk_fills(folder)``: from then on a file opened for writing in ``folder`` takes half of its first write and
    then fails with ENOSPC, as on a disk that fills up; every other file opens as usual."""
    original = io.open

    class Filling:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def writelines(self, lines):
            for line in lines:
                self.write(line)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def fill(folder):
        def opener(file, mode="r", *args, **kwargs):
            f = original(file, mode, *args, **kwargs)
            writing = not isinstance(file, int) and any(c in mode for c in "wxa")
            return Filling(f) if writing and Path(file).resolve().parent == Path(folder).resolve() else f

        monkeypatch.setattr(builtins, "open", opener)
        monkeypatch.setattr(io, "open", opener)

    return fill


def test_write_atomic_replaces_whole_files_only(tmp_path, disk_fills):
    data = tmp_path / "data.txt"
    data.write_text("old\n")
    data.chmod(0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(data)
    write_atomic(link, lambda f: f.write("new\n"))
    assert link.is_symlink() and data.read_text() == "new\n" and stat.S_IMODE(data.stat().st_mode) == 0o640
    disk_fills(tmp_path)
    with pytest.raises(ValueError, match=f"could not write {data}: No space left on device; the previous file is "
                                         "unchanged"):
        write_atomic(data, lambda f: f.write("newer\n" * 100))
    assert data.read_text() == "new\n"
    with pytest.raises(ValueError, match="nothing was written"):
        write_atomic(tmp_path / "fresh.txt", lambda f: f.write("x\n"))
    assert sorted(os.listdir(tmp_path)) == ["data.txt", "link.txt"]  # no temporary file left behind


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_full_disk_leaves_the_previous_output_unchanged(dirs, prompts, tmp_path, disk_fills, quiet_loading, capsys,
                                                       command):
    folder = tmp_path / "run"
    folder.mkdir()
    out = folder / ("out.jsonl" if command == "generate" else "bench.json")
    out.write_bytes(b'{"prompt_id": "0", "token_ids": [1, 2], "finish_reason": "length"}\n' * 3)
    before = out.read_bytes()
    disk_fills(folder)
    extra = ["--out", str(out if command == "generate" else folder), "--max-tokens", "4"]
    if command == "bench":
        extra += ["--batch-sizes", "1", "--repeats", "1", "--no-hf"]
    assert main(_args(command, dirs[0], prompts, *extra)) == 2
    err = _one_error_line(capsys, command)
    assert f"could not write {out}: No space left on device; the previous file is unchanged" in err
    assert out.read_bytes() == before and os.listdir(folder) == [out.name]


def _interrupt_after(monkeypatch, finished: int):
    """Ctrl-C inside the engine: its first step after ``finished`` prompts have finished raises KeyboardInterrupt
    (counted per engine: each run has its own)."""
    step = Engine.step

    def step_then_interrupt(self):
        if getattr(self, "finished_so_far", 0) >= finished:
            raise KeyboardInterrupt
        outs = step(self)
        self.finished_so_far = getattr(self, "finished_so_far", 0) + sum(o.finished is not None for o in outs)
        return outs

    monkeypatch.setattr(Engine, "step", step_then_interrupt)


def _main_ctrl_c(argv) -> int:
    try:
        return main(argv)
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the command as a traceback")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_ctrl_c_writes_the_finished_prompts_and_says_how_many_are_missing(dirs, tmp_path, monkeypatch, quiet_loading,
                                                                          capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6 w7\nw9 w10\nw11\nw12 w13\nw14 w15 w16\n")
    argv = _args("generate", dirs[0], prompts, "--batch-size", "1", "--max-tokens", "6")
    whole = tmp_path / "whole.jsonl"
    assert main([*argv, "--out", str(whole)]) == 0
    reference = [json.loads(line) for line in whole.read_text().splitlines()]
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier run's output\n")
    _interrupt_after(monkeypatch, 2)
    capsys.readouterr()
    assert _main_ctrl_c([*argv, "--out", str(out)]) == 130
    assert _one_line(capsys) == (f"batchspec generate: interrupted: wrote 2 of 5 prompts to {out}; 3 missing (their "
                                 'rows have finish_reason "interrupted")')
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert rows[:2] == reference[:2]  # batch size 1: the first two prompts finished, exactly as in a whole run
    assert all(r["finish_reason"] == "interrupted" and r["token_ids"] is None and r["text"] is None for r in rows[2:])

    assert _main_ctrl_c(argv) == 130  # no --out: the count, in one line
    assert _one_line(capsys) == ("batchspec generate: interrupted: 2 of 5 prompts finished, 3 missing; nothing "
                                 "written (no --out)")


def test_ctrl_c_while_loading_writes_nothing(dirs, prompts, tmp_path, monkeypatch, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", interrupt)
    out = tmp_path / "out.jsonl"
    out.write_text("an earlier run's output\n")
    assert _main_ctrl_c(_args("generate", dirs[0], prompts, "--out", str(out))) == 130
    assert _one_line(capsys) == "batchspec generate: interrupted before any prompt was generated; nothing written"
    assert out.read_text() == "an earlier run's output\n"


# ------------------------------------------------------------------------------------------------ model specs


@pytest.mark.parametrize("spec", ["./no-such-model", "~/no-such-model-dir", "no-such-dir/model", "/no/such/model",
                                  "missing.gguf", "someone/no-such-model"])
def test_missing_model_path_is_not_found_at_once(no_model_load, spec):
    with pytest.raises(FileNotFoundError, match="not found"):
        models.load_model(spec)


def test_missing_target_on_the_command_line(tmp_path, prompts, no_model_load, capsys):
    assert main(["generate", "--target", str(tmp_path / "nowhere"), "--prompts", str(prompts)]) == 2
    assert "not found" in _one_error_line(capsys, "generate")


def test_models_and_tokenizers_load_from_local_files_only(dirs, monkeypatch):
    from transformers import AutoTokenizer

    seen = []
    for cls in (models.AutoModelForCausalLM, AutoTokenizer):
        original = cls.from_pretrained
        def record(*a, _original=original, **k):
            seen.append(k.get("local_files_only"))
            return _original(*a, **k)

        monkeypatch.setattr(cls, "from_pretrained", record)
    llm = batchspec.LLM(str(dirs[0]), draft=str(dirs[1]))
    assert llm.tokenizer is not None and len(seen) == 3 and all(seen), seen


# ------------------------------------------------------------------------------------------------ user objects


def _fresh(dtype):
    return tiny._build("llama", 0, dtype, "sdpa")


def test_user_models_keep_dtype_device_and_training_flag():
    target64, draft32 = _fresh(torch.float64), _fresh(torch.float32).train()
    llm = batchspec.LLM(target64, draft=draft32, num_draft_tokens=3, batch_size=2)
    assert draft32.dtype == torch.float32 and draft32.training
    assert all(p.dtype == torch.float32 for p in draft32.parameters())
    assert llm.draft.dtype == torch.float64 and not llm.draft.training
    ps = tiny.prompts(3, seed=4)
    outs = llm.generate(ps, batchspec.SamplingParams(max_tokens=8))
    assert [o.token_ids for o in outs] == [tiny.oracle(tiny.target("llama"), p, 8) for p in ps]
    assert draft32.training and draft32.dtype == torch.float32

    batchspec.LLM(target64, dtype=torch.float32)
    assert target64.dtype == torch.float64 and all(p.dtype == torch.float64 for p in target64.parameters())


def test_training_mode_model_runs_as_an_eval_copy_sharing_its_tensors():
    target = _fresh(torch.float64).train()
    llm = batchspec.LLM(target, num_draft_tokens=3)
    assert target.training and all(m.training for m in target.modules())
    assert llm.target is not target and not llm.target.training
    for mine, theirs in ((llm.target.parameters(), target.parameters()), (llm.target.buffers(), target.buffers())):
        assert all(a is b for a, b in zip(mine, theirs))
    p = tiny.prompts(1, seed=5)[0]
    out = llm.generate([p], batchspec.SamplingParams(max_tokens=6))[0]
    assert out.token_ids == tiny.oracle(tiny.target("llama"), p, 6)
    eval_model = tiny.target("llama")
    assert batchspec.LLM(eval_model).target is eval_model  # nothing to change: the model itself


# ------------------------------------------------------------------------------------------------ SamplingParams


@pytest.mark.parametrize("kwargs,match", [
    ({"max_tokens": True}, "max_tokens must be an integer"),
    ({"max_tokens": 5.0}, "max_tokens must be an integer"),
    ({"max_tokens": 5.9}, "max_tokens must be an integer"),
    ({"top_k": False}, "top_k must be an integer"),
    ({"top_k": 5.0}, "top_k must be an integer"),
    ({"seed": True}, "seed must be an integer"),
    ({"seed": 3.0}, "seed must be an integer"),
    ({"temperature": "0.7"}, "temperature must be >= 0"),
    ({"temperature": True}, "temperature must be >= 0"),
    ({"top_p": "0.9"}, r"top_p must be in \(0, 1\]"),
    ({"top_p": True}, r"top_p must be in \(0, 1\]"),
    ({"stop_token_ids": [True]}, "stop_token_ids must be a list of integer token ids >= 0"),
    ({"stop_token_ids": [-1]}, "stop_token_ids must be a list of integer token ids >= 0"),
    ({"stop_token_ids": [2.0]}, "stop_token_ids must be a list of integer token ids >= 0"),
    ({"stop_token_ids": 2}, "stop_token_ids must be a list of integer token ids >= 0"),
    ({"stop_token_ids": "2"}, "stop_token_ids must be a list of integer token ids >= 0"),
])
def test_sampling_params_refuse_bools_floats_and_strings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        batchspec.SamplingParams(**kwargs)


def test_sampling_params_accept_numpy_numbers():
    sp = batchspec.SamplingParams(max_tokens=np.int64(7), temperature=np.float32(0.5), top_k=np.int32(3),
                                  top_p=np.float64(0.9), seed=np.uint64(11), stop_token_ids=np.array([2, 5]))
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.stop_token_ids) == (7, 3, 11, [2, 5])
    assert all(type(v) is int for v in (sp.max_tokens, sp.top_k, sp.seed, *sp.stop_token_ids))
    assert type(sp.temperature) is float and type(sp.top_p) is float
    out = batchspec.LLM(tiny.target("llama")).generate([[5, 6, 7]], sp)[0]
    assert len(out.token_ids) <= 7
