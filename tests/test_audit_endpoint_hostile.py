"""The endpoint audit against hostile servers on loopback: answers that trickle in or never end, answers too large to
hold, model ids written as markup or mathtext, token ids far beyond the vocabulary, outputs too short to prove
anything, and more concurrency than prompts. Each ends in a verdict (not a crash, not a hang), with one clear line."""

import json
import time

import pytest
import servekit

import batchspec.serve.client as serve_client
from batchspec.audit.endpoint import EndpointClient, model_name
from batchspec.cli import main

EOS = 45
MAX_TOKENS = 8
PROMPTS = [f"w{5 + i} w{9 + i} w{14 + i}" for i in range(6)]
EVIL = "evil[/red][bold]$\\frac{1}{$x<script>alert(1)</script>"


def answer_ids(prompt) -> list[int]:
    """The fake's greedy output: MAX_TOKENS ids that follow from the prompt (no EOS among them)."""
    seed = sum(map(ord, json.dumps(prompt)))
    return [3 + (seed + 7 * k) % 40 for k in range(MAX_TOKENS)]


class Hostile(servekit.FakeServer):
    """``mode``: "ok" (right answers, the same at any concurrency), "trickle" (a body sent a byte at a time, forever),
    "no-newline" (a stream of bytes with no line end, forever), "huge" (an answer of ``size`` bytes), "huge-line" (a
    stream whose one line is ``size`` bytes), "giant-ids" (token ids of 10**30), "lone-eos" (completions answer a
    lone EOS; chat answers right). ``models``: the model id listed; ``models_trickle``: /v1/models trickles."""

    def __init__(self, mode="ok", models="fake", models_trickle=False, size=0):
        self.mode, self.models, self.models_trickle, self.size = mode, models, models_trickle, size
        super().__init__(_Handler)


class _Handler(servekit.JsonHandler):
    protocol_version = "HTTP/1.0"

    def trickle(self, first: bytes):
        fake = self.server.fake
        self.wfile.write(first)
        while not fake.release.wait(0.2):
            try:
                self.wfile.write(b" ")
                self.wfile.flush()
            except OSError:
                return

    def do_GET(self):
        fake = self.server.fake
        if fake.models_trickle:
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            return self.trickle(b'{"data": [')
        self.send_json(200, {"object": "list", "data": [{"id": fake.models, "object": "model"}]})

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        ids, reason = answer_ids(prompt), "length"
        if fake.mode == "lone-eos" and not chat:
            ids, reason = [EOS], "stop"
        if fake.mode == "giant-ids":
            ids = [10 ** 30 + t for t in ids]
        choice = {"index": 0, "token_ids": ids, "finish_reason": reason,
                  **({"message": {"role": "assistant", "content": "x"}} if chat else {"text": "x"})}
        if fake.mode in ("trickle", "huge") or not body.get("stream"):
            data = json.dumps({"choices": [choice]}).encode()
            if fake.mode == "huge":
                data = json.dumps({"choices": [choice], "pad": "x" * fake.size}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data) + 10 ** 6 * (fake.mode == "trickle")))
            self.end_headers()
            return self.trickle(data[:5]) if fake.mode == "trickle" else self.wfile.write(data)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if fake.mode == "no-newline":
            return self.trickle(b"data: {")
        if fake.mode == "huge-line":
            return self.wfile.write(b"data: " + b"x" * fake.size + b"\n\n")
        self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": f"q{i}", "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


def audit(prompts, url, tmp_path, capsys, *flags):
    """``batchspec audit --endpoint url`` against the server itself: (exit status, stdout, audit.json or None)."""
    out = tmp_path / "out"
    rc = main(["audit", "--endpoint", url, "--prompts", str(prompts), "--concurrency", "3", "--max-tokens",
               str(MAX_TOKENS), "--out", str(out), *flags])
    std = capsys.readouterr()
    data = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else None
    return rc, std.out + std.err, data


def test_the_hostile_fake_is_right_in_ok_mode(prompts, tmp_path, capsys):
    with Hostile() as fake:
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys)
    assert rc == 0 and data["rows"][0]["signature"] == "clean", out
    assert data["meta"]["endpoint"]["api"] == "chat"  # no tokenizer here: the server's template, through chat


# ------------------------------------------------------------------------------------- a total deadline


@pytest.mark.parametrize("mode,stream", [("trickle", False), ("no-newline", True)])
def test_timeout_is_a_total_limit_per_request(mode, stream):
    """A byte every 0.2 s never trips a per-read timeout; the wall-clock deadline ends the request."""
    with Hostile(mode) as fake:
        client = EndpointClient(fake.url, "fake", stream=stream, timeout=1.0)
        t = time.monotonic()
        a = client.one([5, 9, 14])
        seconds = time.monotonic() - t
        client.close()
    assert seconds < 2.0 and a.source is None and a.error == "no answer within 1 s (the timeout)", (seconds, a)


def test_timeout_is_a_total_limit_for_the_model_list():
    with Hostile(models_trickle=True) as fake:
        t = time.monotonic()
        with pytest.raises(ConnectionError, match="no answer from /v1/models within 1 s"):
            model_name(fake.url, None, None, 1.0)
        assert time.monotonic() - t < 2.0


def test_a_trickling_server_could_not_be_audited_within_the_timeout(prompts, tmp_path, capsys):
    with Hostile("trickle") as fake:
        t = time.monotonic()
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys, "--timeout", "1", "--limit", "1", "--api",
                              "completions", "--no-chat-template")
        seconds = time.monotonic() - t
    # the reference's request, then the level's: each ends at its deadline
    assert rc == 2 and data["rows"][0]["signature"] == "could not audit" and seconds < 2 * 1 + 2, (seconds, out)
    assert "no answer within 1 s" in out


# ---------------------------------------------------------------------------------------- bounded answers


@pytest.mark.parametrize("mode,stream", [("huge", False), ("huge-line", True)])
def test_an_answer_over_the_size_limit_is_a_failed_request(monkeypatch, mode, stream):
    monkeypatch.setattr(serve_client, "MAX_ANSWER_BYTES", 50_000)
    with Hostile(mode, size=200_000) as fake:
        client = EndpointClient(fake.url, "fake", stream=stream, timeout=10)
        a = client.one([5, 9, 14])
        client.close()
    assert a.source is None and a.error == "the answer is larger than 50000 bytes (the limit): not read", a
    with Hostile(mode, size=20_000) as fake:  # under the limit: read (and then refused for what it is)
        client = EndpointClient(fake.url, "fake", stream=stream, timeout=10)
        a = client.one([5, 9, 14])
        client.close()
    assert "larger than" not in (a.error or "")


def test_answers_over_the_size_limit_are_counted_as_failed(monkeypatch, prompts, tmp_path, capsys):
    monkeypatch.setattr(serve_client, "MAX_ANSWER_BYTES", 50_000)
    with Hostile("huge", size=200_000) as fake:
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys, "--limit", "2")
    assert rc == 2 and data["rows"][0]["signature"] == "could not audit"
    assert data["meta"]["reference"]["problems"][0]["detail"].startswith("the answer is larger than 50000 bytes")
    assert "larger than 50000 bytes" in out


# ------------------------------------------------------------------------------------------- inert strings


def test_a_hostile_model_id_is_shown_as_text_clipped(prompts, tmp_path, capsys):
    evil = EVIL + "y" * 100_000
    with Hostile(models=evil) as fake:
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys)
    assert rc == 0 and data["rows"][0]["signature"] == "clean", out
    shown = data["meta"]["endpoint"]["model"]
    assert shown.startswith(EVIL) and len(shown) == serve_client.DISPLAY_CHARS and shown.endswith("...")
    assert data["rows"][0]["engine"] == f"endpoint:{shown}"
    page = (tmp_path / "out" / "audit.html").read_text()
    assert "<script>" not in page and "evil[/red][bold]$\\frac{1}{$x&lt;script&gt;" in page
    assert (tmp_path / "out" / "audit.png").stat().st_size > 1000
    assert "evil[/red]" in out  # printed as it is, not read as markup


def test_a_hostile_model_id_in_the_loadtest_report(tmp_path):
    from rich.console import Console

    from batchspec.serve.loadtest import LoadConfig, rich_table, summarize, write_report

    summary = summarize(LoadConfig(url="http://127.0.0.1:1", prompts=["w1"], requests=1), EVIL + "y" * 100_000, [],
                        0, 1.0)
    _, png = write_report(summary, tmp_path)
    assert png.stat().st_size > 1000
    console = Console(record=True, width=200)
    console.print(rich_table(summary))
    assert "evil[/red][bold]$\\frac" in console.export_text()


# ------------------------------------------------------------------------------------ what proves something


def test_token_ids_beyond_the_vocabulary_are_not_clean(prompts, tmp_path, capsys):
    """10**30 + t from the reference and the server alike: equal, yet no token ids of the tokenizer's vocabulary."""
    model = servekit.model_dir(tmp_path)
    with Hostile("giant-ids") as fake:
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys, "--target", str(model), "--reference", "self",
                              "--no-chat-template")
    assert rc == 2 and data["rows"][0]["signature"] == "could not audit", out
    problems = data["meta"]["reference"]["problems"]
    assert len(problems) == len(PROMPTS) and all(p["kind"] == "protocol error" for p in problems)
    assert problems[0]["detail"].startswith("token_ids[0] is 1000000000000000000000000000")
    assert "not a token id (an integer in 0..95)" in problems[0]["detail"]


def test_outputs_too_short_prove_little(prompts, tmp_path, capsys):
    """Raw completions of untemplated prompts end at once (a lone EOS): equal everywhere, and proving nothing."""
    with Hostile("lone-eos") as fake:
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys, "--api", "completions")
        assert rc == 2 and data["rows"][0]["signature"] == "clean", out
        assert "proved little: the median output is 1 tokens" in out
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys)  # the default: chat, the server's template
        assert rc == 0 and data["meta"]["endpoint"]["api"] == "chat", out


def test_levels_above_the_number_of_prompts_are_capped_and_said_so(prompts, tmp_path, capsys):
    with Hostile() as fake:
        rc, out, data = audit(prompts, fake.url, tmp_path, capsys, "--limit", "4", "--concurrency", "1,8,32")
    assert rc == 0 and [r["batch_size"] for r in data["rows"]] == [1, 4], out
    assert data["meta"]["endpoint"]["capped"] == "concurrency 8, 32 capped at 4, the number of prompts"
    assert "capped at 4" in out
