"""``batchspec generate`` end to end on a tiny model saved to disk (no downloads)."""

import json

import pytest
import tiny
import torch

import batchspec
from batchspec.cli import main
from batchspec.prompts import read_prompts


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny.save_dir(tmp_path_factory.mktemp("models"))


def _words(n, seed):
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(t)}" for t in torch.randint(4, tiny.VOCAB, (n,), generator=g))


def test_read_prompts_formats(tmp_path):
    j = tmp_path / "q.jsonl"
    j.write_text('{"question_id": 7, "category": "qa", "turns": ["hello there", "second"]}\n\n{"prompt": "p2"}\n')
    assert read_prompts(j) == [("7", "hello there"), ("1", "p2")]
    t = tmp_path / "q.txt"
    t.write_text("first line\n\nsecond line\n")
    assert read_prompts(t) == [("0", "first line"), ("1", "second line")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match='bad.jsonl line 1: no "turns" or "prompt" field'):
        read_prompts(bad)
    with pytest.raises(FileNotFoundError):
        read_prompts(tmp_path / "missing.txt")


@pytest.mark.parametrize("layout,draft", [("slotmask", "draft"), ("eqspec", "prompt-lookup"), ("slotmask", "none")])
def test_generate_cli_matches_api(dirs, tmp_path, layout, draft, capsys):
    target_dir, draft_dir = dirs
    prompts = tmp_path / "p.jsonl"
    texts = [_words(n, i) for i, n in enumerate([3, 17, 40, 1, 9])]
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    out = tmp_path / "out.jsonl"
    d = str(draft_dir) if draft == "draft" else draft
    rc = main(["generate", "--target", str(target_dir), "--draft", d, "--prompts", str(prompts), "--batch-size", "3",
               "--num-draft-tokens", "3", "--layout", layout, "--max-tokens", "12", "--out", str(out)])
    assert rc == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == [f"q{i}" for i in range(5)]
    tok = tiny.tokenizer()
    model = tiny.target("llama")
    for r, text in zip(rows, texts):
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True, return_dict=False)
        assert r["token_ids"] == tiny.oracle(model, list(ids), 12)
        assert r["finish_reason"] == "length" and isinstance(r["text"], str)
    assert "tok/s" in capsys.readouterr().out


def test_generate_cli_plain_text_no_template(dirs, tmp_path):
    target_dir, _ = dirs
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6 w7\nw9\n")
    out = tmp_path / "o.jsonl"
    assert main(["generate", "--target", str(target_dir), "--draft", "prompt-lookup", "--prompts", str(prompts),
                 "--no-chat-template", "--max-tokens", "5", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[1]["token_ids"] == tiny.oracle(tiny.target("llama"), [9], 5)


def test_generate_cli_sampling_is_seeded_and_scheduler_independent(dirs, tmp_path, capsys):
    target_dir, draft_dir = dirs
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(_words(n, i) + "\n" for i, n in enumerate([4, 11, 2, 7])))
    runs = []
    for sched, bs in (("static", "1"), ("exspec", "2"), ("continuous", "3")):
        out = tmp_path / f"{sched}.jsonl"
        assert main(["generate", "--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
                     "--scheduler", sched, "--batch-size", bs, "--max-tokens", "9", "--temperature", "0.8",
                     "--top-k", "20", "--top-p", "0.95", "--seed", "5", "--out", str(out)]) == 0
        runs.append([json.loads(line)["token_ids"] for line in out.read_text().splitlines()])
    assert runs[0] == runs[1] == runs[2]
    assert main(["generate", "--target", str(target_dir), "--prompts", str(prompts), "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


def test_generate_cli_bad_input(dirs, tmp_path, capsys):
    target_dir, _ = dirs
    assert main(["generate", "--target", str(target_dir), "--prompts", str(tmp_path / "missing.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--target", str(tmp_path / "nowhere"), "--prompts", "x"]) == 2


def test_string_prompts_through_api(dirs):
    target_dir, draft_dir = dirs
    llm = batchspec.LLM(str(target_dir), draft=str(draft_dir), num_draft_tokens=2)
    assert llm.tokenizer is not None and llm.draft is not None
    out = llm.generate(["w5 w6 w7 w8"], batchspec.SamplingParams(max_tokens=6))[0]
    assert out.prompt_token_ids == [5, 6, 7, 8]
    assert out.token_ids == tiny.oracle(tiny.target("llama"), [5, 6, 7, 8], 6)
    assert out.text == tiny.tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_profile_command_measures_once_then_reads_the_cache(dirs, capsys, monkeypatch):
    """``batchspec profile`` shows the cost profile (measured on first use, then read from the cache; ``--refresh``
    measures again), one row per batch size measured."""
    from batchspec.speculation import costs

    target, draft = dirs
    monkeypatch.setattr(costs, "_loaded", {})
    args = ["profile", "--target", str(target), "--draft", str(draft), "--batch-size", "4", "--num-draft-tokens", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "plain step" in out and "verify 3" in out and "profiles" in out
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.count("|") > 5]
    assert rows == ["rows", "---:", "1", "2", "4"]  # a Markdown table: stdout is no terminal here
    measured = []
    real = costs.measure
    monkeypatch.setattr(costs, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))
    monkeypatch.setattr(costs, "_loaded", {})
    assert main(args) == 0 and measured == []  # read from the cache
    assert main(args + ["--refresh"]) == 0 and measured == [1]
