"""The determinism run: each prompt sent N times at mixed concurrency; one unique greedy output per prompt from
batchspec's server, more than one (exit status 1) from a server that is not deterministic."""

import json
import threading

import pytest
import servekit
import tiny

import batchspec.model.loading as loading
from batchspec.audit.determinism import determinism_run, first_divergence
from batchspec.cli import main

MAX_TOKENS = 8
PROMPTS = tiny.prompts(8, seed=5, lo=2, hi=24)


def oracle(prompt):
    return tiny.oracle(tiny.target(), list(prompt), MAX_TOKENS)


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the determinism run loaded a model")

    monkeypatch.setattr(loading, "load_model", refuse)


def test_first_divergence():
    assert first_divergence([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == 2
    assert first_divergence([[1, 2], [1, 2, 3]]) == 2
    assert first_divergence([[5, 6], [5, 6]]) is None and first_divergence([]) is None


def test_batchspec_serve_gives_one_output_per_prompt(good):
    report = determinism_run(good.url, PROMPTS, repeat=3, concurrency=[1, 4, 8], max_tokens=MAX_TOKENS)
    assert report.meta["rounds"] == [1, 4, 8] and report.meta["requests"] == 3 * len(PROMPTS)
    for p, prompt in zip(report.prompts, PROMPTS):
        assert p["requests"] == p["answered"] == 3 and p["unique"] == 1 and p["first_divergence"] is None
        assert p["outputs"][0]["token_ids"] == oracle(prompt)  # the one output is the right one
        assert p["outputs"][0]["by_concurrency"] == {"1": 1, "4": 1, "8": 1}
    assert report.verdict()[0] == 0 and report.verdict()[1].startswith("deterministic")


def test_levels_above_the_number_of_prompts_are_capped_and_said_so():
    with Flaky() as fake:
        report = determinism_run(fake.url, PROMPTS[:3], repeat=3, concurrency=[1, 8, 32], max_tokens=MAX_TOKENS)
        most = fake.most
    assert report.meta["levels"] == [1, 3] and report.meta["rounds"] == [1, 3, 1] and most <= 3
    assert report.meta["capped"] == "concurrency 8, 32 capped at 3, the number of prompts"
    assert "(concurrency 8, 32 capped at 3, the number of prompts)." in report.to_markdown()
    assert report.verdict()[0] == 0


def test_outputs_too_short_prove_little(good):
    """Outputs of a token or two agree whatever the batching does: exit status 2, not deterministic."""
    report = determinism_run(good.url, PROMPTS, repeat=2, concurrency=[1, 4], max_tokens=2)
    assert all(p["unique"] == 1 for p in report.prompts)
    status, verdict = report.verdict()
    assert status == 2 and verdict.startswith("proved little: the median output is 2 tokens (under 4)"), verdict


class Flaky(servekit.FakeServer):
    """A server on loopback that answers the tiny target's greedy output, except that every other request for the
    prompts in ``flaky`` gets token ``AT`` changed; ``fail``: prompts whose requests fail (HTTP 500). It records the
    prompts in the order they arrive and the most requests it had under way at once."""

    AT = 5

    def __init__(self, flaky=(), fail=()):
        self.flaky, self.fail = [list(p) for p in flaky], [list(p) for p in fail]
        self.seen, self.counts, self.busy, self.most = [], {}, 0, 0
        self.lock = threading.Lock()
        super().__init__(_Handler)


class _Handler(servekit.JsonHandler):

    def do_GET(self):
        self.send_json(200, {"object": "list", "data": [{"id": "flaky", "object": "model"}]})

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["prompt"]
        with fake.lock:
            fake.seen.append(PROMPTS.index(prompt))
            k = fake.counts[tuple(prompt)] = fake.counts.get(tuple(prompt), 0) + 1
            fake.busy += 1
            fake.most = max(fake.most, fake.busy)
            out = oracle(prompt)
        try:
            threading.Event().wait(0.02)  # long enough for requests to overlap
            if prompt in fake.fail:
                return self.send_json(500, {"error": {"message": "the engine fell over", "type": "server_error"}})
            if prompt in fake.flaky and k % 2 == 0:
                out = [*out[:Flaky.AT], (out[Flaky.AT] + 1) % tiny.VOCAB, *out[Flaky.AT + 1:]]
            self.send_json(200, {"choices": [{"index": 0, "text": "", "finish_reason": "length", "token_ids": out,
                                          "prompt_token_ids": prompt, "logprobs": None}]})
        finally:
            with fake.lock:
                fake.busy -= 1


def test_a_server_that_is_not_deterministic_is_caught(tmp_path):
    with Flaky(flaky=[PROMPTS[2]]) as fake:
        report = determinism_run(fake.url, PROMPTS, repeat=4, concurrency=[1, 4], max_tokens=MAX_TOKENS, seed=3)
        seen, most = fake.seen, fake.most
    # the schedule: four rounds, each sending every prompt once, in a shuffled order, some at 4 under way at once
    rounds = [seen[r * len(PROMPTS):(r + 1) * len(PROMPTS)] for r in range(4)]
    assert all(sorted(r) == list(range(len(PROMPTS))) for r in rounds) and len({tuple(r) for r in rounds}) > 1
    assert most > 1 and report.meta["rounds"] == [1, 4, 1, 4]
    spread = [p for p in report.prompts if p["unique"] > 1]
    assert [p["name"] for p in spread] == [2]
    assert spread[0]["unique"] == 2 and spread[0]["first_divergence"] == Flaky.AT
    assert sorted(o["count"] for o in spread[0]["outputs"]) == [2, 2]
    assert all(p["unique"] == 1 for p in report.prompts if p["name"] != 2)
    status, verdict = report.verdict()
    assert status == 1 and verdict.startswith("not deterministic: 1 of 8 prompts")
    assert "| 2 | 4 | 4 | 2 | 5 |" in report.to_markdown()
    assert report.plot(tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failed_requests_make_the_run_incomplete_or_unauditable():
    with Flaky(fail=[PROMPTS[0]]) as fake:
        report = determinism_run(fake.url, PROMPTS, repeat=2, concurrency=[2], max_tokens=MAX_TOKENS)
    assert report.prompts[0]["answered"] == 0 and report.prompts[0]["failed"] == 2
    assert report.verdict()[0] == 1 and report.verdict()[1].startswith("incomplete: 2 of 16 requests failed")
    with Flaky(fail=PROMPTS) as fake:
        report = determinism_run(fake.url, PROMPTS, repeat=2, concurrency=[2], max_tokens=MAX_TOKENS)
    assert report.verdict() == (2, "could not audit: every request failed")


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("determinism") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": f"q{i}", "turns": [" ".join(f"w{t}" for t in p)]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


def _cli(url, prompt_file, tmp_path, capsys, *flags):
    out = tmp_path / "out"
    rc = main(["audit", "--endpoint", url, "--prompts", str(prompt_file), "--max-tokens", str(MAX_TOKENS),
               "--concurrency", "1,4", "--out", str(out), *flags])
    std = capsys.readouterr()
    data = json.loads((out / "determinism.json").read_text()) if (out / "determinism.json").exists() else None
    return rc, std.out, std.err, data, out


def test_the_command_runs_the_determinism_run(good, prompt_file, tmp_path, capsys):
    """Text prompts go as text (no --target); determinism.json, .md, .png, .html are written."""
    rc, out, _, data, folder = _cli(good.url, prompt_file, tmp_path, capsys, "--repeat", "2")
    assert rc == 0 and "deterministic: one output per prompt over 2 requests each" in out, out
    assert [p["name"] for p in data["prompts"]] == [f"q{i}" for i in range(len(PROMPTS))]
    assert [p["outputs"][0]["token_ids"] for p in data["prompts"]] == [oracle(p) for p in PROMPTS]
    assert all((folder / f"determinism.{ext}").stat().st_size > 500 for ext in ("json", "md", "png", "html"))
    assert not (folder / "audit.json").exists()


def test_the_command_exits_1_for_a_server_that_is_not_deterministic(prompt_file, tmp_path, capsys):
    with Flaky(flaky=[PROMPTS[6]]) as fake:
        rc, out, _, data, _ = _cli(fake.url, prompt_file, tmp_path, capsys, "--repeat", "2", "--target",
                                   _tokenizer_dir(tmp_path), "--no-chat-template")
    assert rc == 1 and "prompt q6: 2 unique outputs (1, 1 answers), first divergent token 5" in out, out
    assert data["verdict"].startswith("not deterministic")


def _tokenizer_dir(tmp_path) -> str:
    """The fake reads token-id prompts: --target gives the tokenizer that encodes the words."""
    d = tmp_path / "tokenizer"
    servekit.tokenizer().save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("flags,message", [
    (["--repeat", "1"], "--repeat must be an integer >= 2"),
    (["--repeat", "2", "--reference", "self"], "needs no reference: leave out --reference"),
    (["--repeat", "2", "--junit", "cases.xml"], "--junit writes the endpoint audit's cases: leave it out"),
])
def test_bad_repeat_flags_are_one_line_and_exit_2(good, prompt_file, tmp_path, capsys, flags, message):
    rc, _, err, data, _ = _cli(good.url, prompt_file, tmp_path, capsys, *flags)
    assert rc == 2 and data is None and err.count("\n") == 1 and message in err, err
