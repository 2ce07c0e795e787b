"""The front door as a new user meets it: tables and summaries readable in a pipe or a log, outputs on stdout, vLLM's
prompt and chat conventions in ``LLM``, and every mistake (a flag out of range, a misspelt choice, a server URL or a
port) refused in one line with its fix, exit status 2, before any model loads or any load is sent."""

import io
import json
import socket

import pytest
import tiny
from rich.console import Console
from rich.table import Table

import batchspec
import batchspec.model.loading as models
from batchspec.cli import main
from batchspec.prompts import read_prompts


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny.save_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", refuse)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("w5 w6 w7\nw9 w10\n")
    return path


def _one_line(err: str, command: str) -> str:
    err = err.strip()
    assert err.startswith(f"batchspec {command}: error: ") and "\n" not in err and "usage:" not in err, err
    return err


def _flag_error(capsys, command: str, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return _one_line(capsys.readouterr().err, command)


# ------------------------------------------------------------------------------------------------ tables and lines


def _wide_table() -> Table:
    t = Table(title="wide")
    for name in ("engine", "slots per row", "speed-up (range)", "signature"):
        t.add_column(name, justify="right")
    t.add_row("slotmask-lookup:adaptive@continuous", "8", "1.23 (1.10-1.30)", "exact-match-greedy-everywhere")
    return t


def test_a_table_fits_a_narrow_terminal_without_cutting_a_cell():
    from batchspec.cli.common import show_table

    f = io.StringIO()
    show_table(Console(file=f, force_terminal=True, width=40, color_system=None), _wide_table())
    lines = f.getvalue().splitlines()
    assert "…" not in f.getvalue() and max(map(len, lines)) <= 40
    first = "".join(line.split("│")[1].strip() for line in lines if line.startswith("│"))
    assert first == "slotmask-lookup:adaptive@continuous"  # wrapped over lines, whole


def test_a_table_off_a_terminal_is_plain_markdown():
    from batchspec.cli.common import show_table

    f = io.StringIO()
    show_table(Console(file=f, width=80), _wide_table())
    assert f.getvalue().splitlines()[2:] == [
        "| engine | slots per row | speed-up (range) | signature |", "|---:|---:|---:|---:|",
        "| slotmask-lookup:adaptive@continuous | 8 | 1.23 (1.10-1.30) | exact-match-greedy-everywhere |"]


def test_bench_table_and_summary_whole_in_a_pipe(dirs, prompts, tmp_path, capsys):
    out = tmp_path / "a-folder-with-a-rather-long-name-so-that-the-summary-line-runs-past-eighty-columns"
    assert main(["bench", "--target", str(dirs[0]), "--draft", "none", "--prompts", str(prompts), "--engines", "plain",
                 "--batch-sizes", "1", "--max-tokens", "3", "--repeats", "1", "--no-hf", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "…" not in text
    assert (out / "bench.md").read_text().strip() in text  # the Markdown table as written, cell for cell
    assert any(line.startswith(f"wrote {out}/bench.json") and line.endswith(".png") for line in text.splitlines())


# ------------------------------------------------------------------------------------------------ generate's outputs


def test_generate_without_out_writes_the_rows_to_stdout(dirs, prompts, tmp_path, capsys):
    args = ["generate", "--target", str(dirs[0]), "--draft", "prompt-lookup", "--prompts", str(prompts),
            "--max-tokens", "5"]
    out = tmp_path / "o.jsonl"
    assert main(args + ["--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert summary.count("\n") == 1 and "tok/s" in summary and f"wrote {out}" in summary  # one line, not wrapped
    assert main(args) == 0
    captured = capsys.readouterr()
    assert captured.out == out.read_text()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [r["prompt_id"] for r in rows] == ["0", "1"] and all(r["token_ids"] and r["text"] for r in rows)
    assert "tok/s" in captured.err and "tok/s" not in captured.out


def test_library_progress_bars_are_silenced_and_restored(dirs, prompts, tmp_path, capsys):
    from transformers.utils import logging

    logging.enable_progress_bar()
    assert main(["generate", "--target", str(dirs[0]), "--draft", "none", "--prompts", str(prompts),
                 "--max-tokens", "2", "--out", str(tmp_path / "o.jsonl")]) == 0
    assert "Loading weights" not in capsys.readouterr().err
    assert logging.is_progress_bar_enabled()


# ------------------------------------------------------------------------------------------------ LLM


@pytest.fixture(scope="module")
def llm(dirs):
    return batchspec.LLM(str(dirs[0]), draft="prompt-lookup", num_draft_tokens=2)


def test_a_string_or_one_list_of_token_ids_is_one_prompt(llm):
    sp = batchspec.SamplingParams(max_tokens=4)
    want = tiny.oracle(tiny.target("llama"), [5, 6, 7], 4)
    for prompt in ("w5 w6 w7", [5, 6, 7], (5, 6, 7)):
        outs = llm.generate(prompt, sp)
        assert len(outs) == 1 and outs[0].prompt_token_ids == [5, 6, 7] and outs[0].token_ids == want
    outs = llm.generate([[5, 6, 7], [9]], sp)
    assert [o.prompt_token_ids for o in outs] == [[5, 6, 7], [9]]
    assert [o.prompt_token_ids for o in llm.generate(["w5 w6 w7", "w9"], sp)] == [[5, 6, 7], [9]]


def test_chat_applies_the_template(llm):
    sp = batchspec.SamplingParams(max_tokens=4)
    talk = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7"},
            {"role": "user", "content": "w9"}]
    ids = list(tiny.tokenizer().apply_chat_template(talk, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False))
    one = llm.chat(talk, sp)
    assert len(one) == 1 and one[0].prompt_token_ids == ids
    assert one[0].token_ids == tiny.oracle(tiny.target("llama"), ids, 4)
    two = llm.chat([talk, talk[:1]], sp)
    assert [o.token_ids for o in two[:1]] == [one[0].token_ids] and len(two) == 2
    with pytest.raises(ValueError, match="conversation 0 must be"):
        llm.chat([{"role": "user"}], sp)


def test_chat_without_a_template_is_a_clear_error(dirs):
    plain = batchspec.LLM(str(dirs[0]))
    plain.tokenizer.chat_template = None
    with pytest.raises(ValueError, match="the tokenizer has no chat template"):
        plain.chat([{"role": "user", "content": "w5"}])


# ------------------------------------------------------------------------------------------------ loadtest and serve


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url,message", [
    ("127.0.0.1:8000", "did you mean http://127.0.0.1:8000?"),
    ("http://127.0.0.1:8000/v1/chat/completions", "names an endpoint"),
    ("http://127.0.0.1:99999", "no valid port"),
    (None, "is the server running?"),
])
def test_loadtest_url_mistakes_are_one_line_before_any_load(tmp_path, capsys, url, message):
    url = url or f"http://127.0.0.1:{_closed_port()}"
    assert main(["loadtest", "--url", url, "--concurrency", "1", "--out", str(tmp_path / "lt")]) == 2
    err = _one_line(capsys.readouterr().err, "loadtest")
    assert message in err and "http://127.0.0.1:8000" in err
    assert not (tmp_path / "lt" / "loadtest.json").exists()


def test_serve_port_in_use_is_refused_before_the_model_loads(no_model_load, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--target", "anything", "--port", str(port)]) == 2
    assert "Address already in use" in _one_line(capsys.readouterr().err, "serve")


# ------------------------------------------------------------------------------------------------ flags


@pytest.mark.parametrize("argv,message", [
    (["generate", "--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got '0'"),
    (["serve", "--port", "99999"], "argument --port: must be an integer in 1..65535, got '99999'"),
    (["serve", "--max-queue", "-1"], "argument --max-queue: must be an integer >= 0, got '-1'"),
    (["generate", "--top-k", "-2"], "argument --top-k: must be an integer >= 0, got '-2'"),
    (["generate", "--layout", "slotmsk"], "invalid choice 'slotmsk': did you mean 'slotmask'?"),
    (["generat"], "invalid choice 'generat': did you mean 'generate'?"),
    (["generate", "--max_tokens", "3"], "unrecognized arguments: --max_tokens 3 (did you mean --max-tokens?)"),
])
def test_a_bad_flag_is_one_line_naming_it(capsys, argv, message):
    command = "batchspec" if argv == ["generat"] else argv[0]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and "usage:" not in err and message in err, err
    assert err.startswith(f"{command if command == 'batchspec' else 'batchspec ' + command}: error: ")


@pytest.mark.parametrize("flag,value,meant", [("--draft", "prompt_lookup", "prompt-lookup"),
                                              ("--target", "smollm2-135", "smollm2-135m"),
                                              ("--target", "gemma3-27m", "gemma3-270m")])
def test_a_misspelt_model_name_gets_the_name_meant(prompts, no_model_load, capsys, flag, value, meant):
    assert main(["generate", "--prompts", str(prompts), flag, value]) == 2
    assert f"did you mean {meant!r}?" in _one_line(capsys.readouterr().err, "generate")


@pytest.mark.parametrize("command,shown", [("generate", ["--max-tokens MAX_TOKENS (default: 64)",
                                                         "--batch-size BATCH_SIZE (default: 8)"]),
                                           ("bench", ["--max-tokens MAX_TOKENS (default: 128)"]),
                                           ("serve", ["--port PORT", "(default: 8000)", "(smollm2-135m, the default, or "
                                                      "gemma3-270m)"])])
def test_help_shows_defaults(capsys, command, shown):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and all(s in text for s in shown), text


# ------------------------------------------------------------------------------------------------ prompt ids


def test_prompt_ids_are_unique(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"id": "0", "prompt": "b"}\n{"prompt": "c"}\n{"question_id": "0-2", '
                    '"prompt": "d"}\n')
    pairs = read_prompts(path)
    assert [t for _, t in pairs] == ["a", "b", "c", "d"]
    assert [i for i, _ in pairs] == ["0-3", "0", "2", "0-2"]
    path.write_text('{"id": 1, "prompt": "a"}\n\n{"id": "1", "prompt": "b"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl line 3: id '1' is also the id of .*p.jsonl line 1"):
        read_prompts(path)
