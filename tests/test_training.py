"""``batchspec train-draft`` end to end on a tiny float32 Llama target saved with its tokenizer: each kind of draft
(feature-reading head, small draft model) trains from a prompt file into a folder ``batchspec.LLM`` loads as a draft,
whose greedy output is the target's own batch-size-1 output (HF generate, the oracle) and whose training lowered its
loss; the gen stage resumes without generating what is on disk; an interrupted train stage resumes to the very
weights of an uninterrupted run; bad input fails with one line and exit status 2 before any model loads."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import tiny
import torch

import batchspec
from batchspec.cli import main
from batchspec.drafters import EagleDrafter
from batchspec.drafters.eagle import is_checkpoint
from batchspec.drafters.model import ModelDrafter
from batchspec.training import data, draft_model, head

GEN = ["--max-new-tokens", "16", "--chunk", "8"]
HEAD = ["--kind", "head", "--vocab", "64", "--max-steps", "20", "--eval-every", "10"]
MODEL = ["--kind", "model", "--hidden", "16", "--intermediate", "32", "--batch-tokens", "256", "--epochs", "30",
         "--no-heldout"]  # 30 epochs: the tiny draft agrees with the target ~40% of the time (6: <1%)


def _cli(*argv) -> int:
    return main(["train-draft", *map(str, argv)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny float32 target with its tokenizer, and a file of 24 prompts (words of its vocabulary)."""
    base = tmp_path_factory.mktemp("training")
    target = base / "target"
    tiny.target(dtype=torch.float32).save_pretrained(target)
    tiny.tokenizer().save_pretrained(target)
    g = torch.Generator().manual_seed(3)
    lines = [" ".join(f"w{int(x)}" for x in torch.randint(4, tiny.VOCAB, (3 + i % 9,), generator=g)) for i in range(24)]
    (base / "prompts.txt").write_text("\n".join(lines) + "\n")
    return SimpleNamespace(base=base, target=target, prompts=base / "prompts.txt")


@pytest.fixture(scope="module")
def head_run(files):
    work = files.base / "head"
    assert _cli("--target", files.target, "--prompts", files.prompts, "--work", work, *GEN, *HEAD) == 0
    return work


@pytest.fixture(scope="module")
def model_run(files):
    work = files.base / "model"
    assert _cli("--target", files.target, "--prompts", files.prompts, "--work", work, *GEN, *MODEL) == 0
    return work


def _exact(files, draft, kind):
    """The draft folder drafts for the target (a drafter of ``kind``, with drafts accepted) and the output is the
    oracle's."""
    llm = batchspec.LLM(str(files.target), draft=str(draft), num_draft_tokens=3, batch_size=4, speculation="fixed")
    assert isinstance(llm.drafter, kind)
    prompts = tiny.prompts(8, seed=2)
    outs = llm.generate(prompts, batchspec.SamplingParams(max_tokens=20))
    oracle = tiny.target(dtype=torch.float32)
    assert [o.token_ids for o in outs] == [tiny.oracle(oracle, p, 20) for p in prompts]
    assert llm.stats.drafted > 0 and llm.stats.accepted > 0


# ------------------------------------------------------------------------------------------------ end to end


def test_head_trains_into_a_draft_folder(files, head_run):
    out = head_run / "draft"
    assert is_checkpoint(out) and (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    card = json.loads((out / "eagle.json").read_text())
    assert card["steps"] == 20 and card["head_tokens"] == 64 and card["sequences"] == 24
    assert card["args"]["kind"] == "head" and card["args"]["prompts"] == str(files.prompts)
    assert sorted(p.name for p in head_run.glob("chunk*.pt")) == ["chunk000.pt", "chunk001.pt", "chunk002.pt"]
    _exact(files, out, EagleDrafter)

    # training lowered the loss on its data, against a fresh head built the same way (noise off)
    target = tiny.target(dtype=torch.float32)
    ck = torch.load(head_run / "head.pt")
    seqs, feats, starts = data.load_chunks([head_run])
    where = torch.full((tiny.VOCAB,), -100, dtype=torch.long)
    where[ck["token_map"]] = torch.arange(len(ck["token_map"]))
    batch = data.collate(list(range(len(seqs))), seqs, feats, starts, where)
    head_w = target.lm_head.weight[ck["token_map"]].detach()

    def loss(state):
        torch.manual_seed(0)
        model, fc = head.build_head(target, ck["token_map"], -1)
        if state is not None:
            model.load_state_dict(state["model"])
            fc.load_state_dict(state["fc"])
        with torch.no_grad():
            return float(head.head_loss(model, fc, target.get_input_embeddings(), head_w, batch, 1, 0.0, 1.0, 0.1,
                                        0.5)[0])

    before, after = loss(None), loss(ck)
    assert after < 0.95 * before, (before, after)


def test_model_trains_into_a_draft_folder(files, model_run):
    out = model_run / "draft"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file() and not is_checkpoint(out)
    assert sorted(p.name for p in model_run.glob("records*.pt")) == ["records000.pt", "records001.pt",
                                                                     "records002.pt"]
    _exact(files, out, ModelDrafter)

    # training changed the draft and lowered its loss, against its exact initialisation (full softmax)
    target = tiny.target(dtype=torch.float32)
    records = draft_model.load_records(model_run)
    assert len(records) == 24 and all(len(r["answer"]) == 16 for r in records)
    init = draft_model.build_draft(target, SimpleNamespace(seed=0, model_init="layers", from_layers="0,1", hidden=16,
                                                           intermediate=32), records)
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(model_run / "model", dtype=torch.float32)
    batch = draft_model.collate_records(records, list(range(len(records))), 0)
    with torch.no_grad():
        before, after = (float(draft_model.loss_fn(m, batch, 0.5, 0, torch.Generator())[0]) for m in (init, trained))
    assert after < 0.95 * before, (before, after)
    assert not torch.equal(init.model.layers[0].mlp.up_proj.weight, trained.model.layers[0].mlp.up_proj.weight)


# ------------------------------------------------------------------------------------------------ resuming


def test_gen_resumes_without_generating_what_is_on_disk(files, head_run, tmp_path, monkeypatch):
    work = tmp_path / "work"
    shutil.copytree(head_run, work)
    calls = {"load": 0, "generate": 0}
    real_init, real_generate = batchspec.LLM.__init__, batchspec.LLM.generate

    def init(self, *a, **kw):
        calls["load"] += 1
        real_init(self, *a, **kw)

    def generate(self, prompts, *a, **kw):
        calls["generate"] += len(prompts)
        return real_generate(self, prompts, *a, **kw)

    monkeypatch.setattr(batchspec.LLM, "__init__", init)
    monkeypatch.setattr(batchspec.LLM, "generate", generate)
    chunks = sorted(work.glob("chunk*.pt"))
    stamps = {p.name: p.stat().st_mtime_ns for p in chunks}
    gen = ["--target", files.target, "--prompts", files.prompts, "--work", work, "--stages", "gen", *GEN]
    assert _cli(*gen) == 0
    assert calls == {"load": 0, "generate": 0}
    assert {p.name: p.stat().st_mtime_ns for p in chunks} == stamps

    # one chunk lost: only its 8 prompts are answered again, to the same data
    lost = torch.load(chunks[1])
    chunks[1].unlink()
    assert _cli(*gen) == 0
    assert calls == {"load": 1, "generate": 8}
    again = torch.load(chunks[1])
    assert again["ids"] == lost["ids"] and all(torch.equal(a, b) for a, b in zip(again["hidden"], lost["hidden"]))
    assert {p.name: p.stat().st_mtime_ns for p in chunks if p != chunks[1]} == {
        k: v for k, v in stamps.items() if k != chunks[1].name}


def test_gen_stops_at_its_time_limit_and_a_later_run_does_the_rest(files, head_run, tmp_path, capsys):
    """``--gen-seconds``: past the limit no chunk starts (the first always runs), and the same command without it
    answers only the chunks left, to the data an unlimited run wrote; ``--device cpu`` names the default."""
    work = tmp_path / "work"
    gen = ["--target", files.target, "--prompts", files.prompts, "--work", work, "--stages", "gen", *GEN,
           "--device", "cpu"]
    assert _cli(*gen, "--gen-seconds", "0") == 0
    assert [p.name for p in sorted(work.glob("chunk*.pt"))] == [sorted(head_run.glob("chunk*.pt"))[0].name]
    assert "chunks left for a later run" in capsys.readouterr().out
    assert _cli(*gen) == 0
    done, want = sorted(work.glob("chunk*.pt")), sorted(head_run.glob("chunk*.pt"))
    assert [p.name for p in done] == [p.name for p in want] and len(done) == 3
    for a, b in zip(done, want):
        a, b = torch.load(a), torch.load(b)
        assert a["ids"] == b["ids"] and all(torch.equal(x, y) for x, y in zip(a["hidden"], b["hidden"]))


class Interrupt:
    """Raises KeyboardInterrupt (a user's Ctrl-C) on the ``at``-th call of ``fn``."""

    def __init__(self, fn, at: int):
        self.fn, self.at, self.calls = fn, at, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls == self.at:
            raise KeyboardInterrupt
        return self.fn(*a, **kw)


def test_interrupted_head_training_resumes_to_the_same_weights(files, head_run, tmp_path, monkeypatch, capsys):
    train = ["--target", files.target, "--work", tmp_path, "--data", head_run, "--stages", "train", "--vocab", "64",
             "--max-steps", "6", "--eval-every", "2"]
    assert _cli(*train, "--save", tmp_path / "whole.pt") == 0
    # calls: steps 0, 1, held-out, steps 2, 3, held-out (state at step 4 kept), step 4 interrupted
    monkeypatch.setattr(head, "head_loss", Interrupt(head.head_loss, 7))
    assert _cli(*train, "--save", tmp_path / "split.pt") == 130
    assert head.resume_path(tmp_path / "split.pt").is_file()
    assert "the same command resumes" in capsys.readouterr().err
    monkeypatch.undo()
    assert _cli(*train, "--save", tmp_path / "split.pt") == 0
    assert "resuming from step 4" in capsys.readouterr().out
    assert not head.resume_path(tmp_path / "split.pt").exists()
    whole, split = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "split.pt")
    assert split["info"]["steps"] == 6
    for part in ("model", "fc"):
        assert all(torch.equal(whole[part][k], split[part][k]) for k in whole[part])


def test_interrupted_model_training_resumes_to_the_same_weights(files, model_run, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file

    work = tmp_path / "work"
    shutil.copytree(model_run, work, ignore=shutil.ignore_patterns("model", "draft"))
    train = ["--target", files.target, "--work", work, "--stages", "train", *MODEL, "--epochs", "3"]
    assert _cli(*train, "--save", tmp_path / "whole") == 0
    steps = json.loads((work / "train.json").read_text())["steps"]
    assert steps >= 6  # several steps an epoch: the interruption falls inside the second epoch
    monkeypatch.setattr(draft_model, "loss_fn", Interrupt(draft_model.loss_fn, steps // 3 + 2))
    assert _cli(*train, "--save", tmp_path / "split") == 130
    assert head.resume_path(tmp_path / "split").is_file()
    monkeypatch.undo()
    assert _cli(*train, "--save", tmp_path / "split") == 0
    assert f"resuming after epoch 1, step {steps // 3}" in capsys.readouterr().out
    whole, split = (load_file(tmp_path / d / "model.safetensors") for d in ("whole", "split"))
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)


# ------------------------------------------------------------------------------------------------ bad input


def _bad_cases(files, tmp):
    (tmp / "empty.txt").write_text("\n\n")
    (tmp / "a-file").write_text("x")
    (tmp / "full").mkdir()
    (tmp / "full" / "notes.txt").write_text("x")
    gpt2, _ = tiny.save_dir(tmp / "gpt2", "gpt2", draft_too=False)
    (tmp / "used").mkdir()
    (tmp / "used" / data.SETTINGS).write_text(json.dumps({"kind": "head", "prompts": "templates"}))
    t, p, w = files.target, files.prompts, tmp / "work"
    return {
        "missing target": (["--target", tmp / "nope", "--prompts", p, "--work", w], "not found"),
        "unsupported target": (["--target", gpt2, "--prompts", p, "--work", w],
                               "supported architectures are llama, qwen2, qwen3"),
        "empty prompt file": (["--target", t, "--prompts", tmp / "empty.txt", "--work", w], "no prompts in"),
        "missing prompt file": (["--target", t, "--prompts", tmp / "nope.txt", "--work", w], "does not exist"),
        "out is a file": (["--target", t, "--prompts", p, "--work", w, "--out", tmp / "a-file"], "is a file"),
        "out holds other files": (["--target", t, "--prompts", p, "--work", w, "--out", tmp / "full"], "not a draft"),
        "work is a file": (["--target", t, "--prompts", p, "--work", tmp / "a-file"], "is a file"),
        "flag of the other kind": (["--kind", "model", "--depth", "4", "--target", t, "--work", w],
                                   "--depth applies to --kind head"),
        "unknown stage": (["--target", t, "--work", w, "--stages", "gen,eval"], "--stages"),
        "train without data": (["--target", t, "--work", w, "--stages", "train"], "no gen chunks"),
        "missing init": (["--target", t, "--work", w, "--stages", "train", "--init", tmp / "h.pt"], "--init"),
        "export without training": (["--target", t, "--work", w, "--stages", "export"], "run --stages train first"),
        "gen over other data": (["--target", t, "--prompts", p, "--work", tmp / "used"], "other settings"),
        "a device this machine lacks": (["--target", t, "--work", w, "--device", "cuda:63"], "no such CUDA device"),
        "a device torch does not name": (["--target", t, "--work", w, "--device", "gpu"], "--device 'gpu'"),
        "a device for a draft model": (["--kind", "model", "--device", "cpu", "--target", t, "--work", w],
                                       "--device applies to --kind head"),
        "layers of a layer the target lacks": (["--kind", "model", "--from-layers", "0,5", "--target", t, "--work", w],
                                               "--from-layers"),
        "a draft wider than the target": (["--kind", "model", "--hidden", "64", "--intermediate", "32", "--target", t,
                                           "--work", w], "exceeds the target's hidden size 32"),
        "an MLP wider than the target's": (["--kind", "model", "--hidden", "16", "--target", t, "--work", w],
                                           "--intermediate 768 exceeds the target's MLP size 64"),
    }


def test_bad_input_fails_with_one_line_before_any_model_loads(files, tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    def no_model(*a, **kw):
        raise AssertionError("a model loaded")

    cases = _bad_cases(files, tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_model)
    for name, (argv, message) in cases.items():
        assert _cli(*argv) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("batchspec train-draft: error: ") and err.count("\n") == 1, (name, err)
        assert message in err, (name, err)


def test_only_the_command_line_imports_training():
    """Training is a leaf of the package: only ``cli`` (the train-draft command) and ``training`` itself import it."""
    from test_layout import import_graph

    graph = import_graph()
    users = {m for m, deps in graph.items() if any(d.startswith("batchspec.training") for d in deps)}
    assert "batchspec.cli.train_draft" in users  # the walk saw the command's imports
    assert {m for m in users if not m.startswith(("batchspec.cli", "batchspec.training"))} == set()
