"""The endpoint audit's verdict on servers that are wrong in one precise way, right in an unusual way, or cannot be
audited, through ``batchspec audit --endpoint`` over real HTTP: exit status 0 clean, 1 not clean, 2 could not audit.

The server is a fake on loopback: it answers ``/v1/completions`` with the batch-size-1 greedy output of the tiny
target with an EOS token, computed by ``tiny.oracle`` (HF ``generate``, independent of the audit), and a test edits
that answer (or breaks the request) before it is sent."""

import copy
import functools
import json
import socket
import threading
import time

import pytest
import servekit
import tiny

from batchspec.audit.endpoint import RETOKENIZED
from batchspec.cli import main

EOS = 45  # ends 5 of the 8 greedy outputs within MAX_TOKENS (after 2 to 12 tokens); the other 3 end at MAX_TOKENS
MAX_TOKENS = 12
PROMPTS = tiny.prompts(8, seed=11, lo=2, hi=30)


@functools.cache
def target():
    model = copy.deepcopy(tiny.target())
    model.generation_config.eos_token_id = EOS
    return model


def tokenizer():
    tok = servekit.tokenizer()
    tok.add_special_tokens({"eos_token": f"w{EOS}"})  # a special token, as in real tokenizers
    return tok


def oracle(prompt, stops=()):
    return tiny.oracle(target(), prompt, MAX_TOKENS, [EOS, *stops])


class Fake(servekit.FakeServer):
    """An OpenAI-compatible server on loopback (``/v1/models``, ``/v1/completions``, streamed or not).

    ``edit(prompt, choice)`` returns the choice to send (edited in place or not), or one of ``"500"``, ``"garbage"``
    (not JSON), ``"close"`` (hang up without answering), ``"hang"`` (answer nothing until the test ends), ``"no-done"``
    (a stream that ends without ``[DONE]``). ``models_hang``: ``/v1/models`` answers nothing until the test ends."""

    def __init__(self, edit=None, models_hang=False):
        self.edit, self.models_hang = edit or (lambda prompt, choice: choice), models_hang
        self.lock = threading.Lock()
        super().__init__(_Handler)

    def choice(self, body: dict) -> dict:
        prompt = body["prompt"]
        with self.lock:
            ids = oracle(prompt, body.get("stop_token_ids") or ())
        choice = {"index": 0, "text": _text(ids), "logprobs": None,
                  "finish_reason": "stop" if ids and ids[-1] == EOS else "length"}
        if body.get("return_token_ids"):
            choice.update(prompt_token_ids=list(prompt), token_ids=ids)
        return self.edit(prompt, choice)


class _Handler(servekit.JsonHandler):

    def do_GET(self):
        fake = self.server.fake
        if fake.models_hang:
            fake.release.wait(10)
            return
        self.send(200, json.dumps({"object": "list", "data": [{"id": "fake", "object": "model"}]}).encode())

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        choice = fake.choice(body)
        if choice == "hang":
            fake.release.wait(10)
        if choice in ("close", "hang"):
            return
        if choice == "500":
            return self.send(500, b'{"error": {"message": "the engine fell over", "type": "server_error"}}')
        if choice == "garbage":
            return self.send(200, b"<html>gateway error</html>", "text/html")
        if not body.get("stream"):
            return self.send(200, json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "fake",
                                               "choices": [choice]}).encode())
        self.send_response(200)  # HTTP/1.0: the stream ends when the connection closes
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for part in _chunks(choice):
            self.wfile.write(f"data: {json.dumps({'object': 'text_completion', 'choices': [part]})}\n\n".encode())
        if choice.get("end") != "no-done":
            self.wfile.write(b"data: [DONE]\n\n")


def _text(ids) -> str:
    """The text of token ids as a server writes it: without the EOS token."""
    return " ".join(f"w{t}" for t in ids if t != EOS)


def _chunks(choice: dict) -> list[dict]:
    """The choice as stream chunks: the prompt's ids first, then one token (and its text) a chunk, then the
    finish_reason; text-only when the choice has no token ids."""
    ids = choice.get("token_ids")
    if ids is None:
        words = choice["text"].split()
        parts = [{"index": 0, "text": (" " if k else "") + w, "finish_reason": None} for k, w in enumerate(words)]
    else:
        parts = [{"index": 0, "text": "", "token_ids": [], "prompt_token_ids": choice["prompt_token_ids"],
                  "finish_reason": None}]
        parts += [{"index": 0, "text": (" " if k else "") + _text([t]), "token_ids": [t],
                   "finish_reason": None} for k, t in enumerate(ids)]
    return parts + [{"index": 0, "text": "", "finish_reason": choice["finish_reason"]}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The target saved with its tokenizer (what the server runs) and the prompts spelled as words, so that encoding
    them without a chat template gives PROMPTS."""
    d = tmp_path_factory.mktemp("endpoint")
    target().save_pretrained(d / "model")
    tokenizer().save_pretrained(d / "model")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "turns": [" ".join(f"w{t}" for t in p)]}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    return d / "model", prompts


def audit(files, url, tmp_path, capsys, *flags):
    """``batchspec audit --endpoint url`` at concurrency 4: (exit status, stdout, stderr, audit.json or None)."""
    model, prompts = files
    out = tmp_path / "out"
    rc = main(["audit", "--endpoint", url, "--target", str(model), "--prompts", str(prompts), "--no-chat-template",
               "--concurrency", "4", "--max-tokens", str(MAX_TOKENS), "--dtype", "float64", "--out", str(out),
               *flags])
    std = capsys.readouterr()
    data = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else None
    return rc, std.out, std.err, data


def test_the_fake_server_is_right(files, tmp_path, capsys):
    """The control: the fake's answers are the oracle's, outputs end both at EOS and at max_tokens."""
    ends = [oracle(p)[-1] == EOS for p in PROMPTS]
    assert 0 < sum(ends) < len(PROMPTS)
    for stream in ([], ["--stream"]):
        with Fake() as fake:
            rc, out, _, data = audit(files, fake.url, tmp_path, capsys, *stream)
        assert rc == 0 and data["rows"][0]["signature"] == "clean", out
        assert data["rows"][0]["outputs"] == [oracle(p) for p in PROMPTS]


# ---------------------------------------------------------------------------------------------- wrong servers


def _extra_token(prompt, choice):
    choice["token_ids"] = [*choice["token_ids"], 7]
    choice["text"] += " w7"
    return choice


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_token_past_eos_or_max_tokens_is_an_overrun(files, tmp_path, capsys, stream):
    """One token more than the oracle's output, after its EOS or at max_tokens + 1: exact before this check."""
    with Fake(_extra_token) as fake:
        rc, out, _, data = audit(files, fake.url, tmp_path, capsys, *(["--stream"] if stream else []))
    row, level = data["rows"][0], data["meta"]["endpoint"]["levels"][0]
    assert rc == 1 and row["signature"] == "overrun" and row["overrun"] == len(PROMPTS) and "overrun" in out
    assert [(d["prompt"], d["index"], d["engine_token"]) for d in row["divergences"]] == [
        (i, len(oracle(p)), 7) for i, p in enumerate(PROMPTS)]
    assert row["exact_match"] == 0 and row["synchronization"] == 0
    after = {p["detail"].split(",")[0] for p in level["problems"] if p["kind"] == "overrun"}
    assert after == {"1 extra token after the stop token 45", "1 extra token after max_tokens"}


BAD_IDS = {0: lambda t: t + 0.7, 1: str, 2: lambda t: True, 3: lambda t: -1, 4: lambda t: tiny.VOCAB, 5: float}


def test_token_ids_must_be_integers_of_the_vocabulary(files, tmp_path, capsys):
    """A float (504.7 or 5.0), a string, a bool, a negative id or one past the vocabulary is never made a token: the
    answer is a protocol error, named with its prompt."""
    def edit(prompt, choice):
        i = PROMPTS.index(prompt)
        if i in BAD_IDS:
            choice["token_ids"][1] = BAD_IDS[i](choice["token_ids"][1])
        return choice

    with Fake(edit) as fake:
        rc, out, _, data = audit(files, fake.url, tmp_path, capsys)
    row, level = data["rows"][0], data["meta"]["endpoint"]["levels"][0]
    assert rc == 1 and row["signature"] == "protocol error" and level["protocol_errors"] == len(BAD_IDS)
    assert [(p["prompt"], p["kind"]) for p in level["problems"]] == [(i, "protocol error") for i in BAD_IDS]
    for i, p in zip(BAD_IDS, level["problems"]):
        assert p["detail"].startswith(f"token_ids[1] is {BAD_IDS[i](oracle(PROMPTS[i])[1])!r}, not a token id")
    assert row["n"] == len(PROMPTS) - len(BAD_IDS) and row["exact_match"] == 1.0  # the rest are compared
    assert "protocol error" in out and "q0" in out


def test_prompt_mismatches_are_not_clean_with_completions(files, tmp_path, capsys):
    """The server echoes other prompt ids than were sent (here: with a BOS) yet answers right: not clean."""
    def edit(prompt, choice):
        if prompt in PROMPTS[:2]:
            choice["prompt_token_ids"] = [1, *prompt]
        return choice

    with Fake(edit) as fake:
        rc, out, _, data = audit(files, fake.url, tmp_path, capsys)
    row, level = data["rows"][0], data["meta"]["endpoint"]["levels"][0]
    assert rc == 1 and row["signature"] == "prompt mismatch" and level["prompt_mismatches"] == 2
    assert [(p["prompt"], p["kind"]) for p in level["problems"]] == [(0, "prompt mismatch"), (1, "prompt mismatch")]
    assert "prompt mismatch" in out


def test_a_finish_reason_that_disagrees_with_the_tokens_is_not_clean(files, tmp_path, capsys):
    ends = [("stop" if o[-1] == EOS else "length", len(o)) for o in map(oracle, PROMPTS)]
    assert [ends[i] for i in (0, 1, 2, 6)] == [("length", MAX_TOKENS), ("stop", 2), ("stop", MAX_TOKENS),
                                               ("length", MAX_TOKENS)]
    # prompt 2 ends with EOS as its last allowed token, so "length" is right too; every other change is wrong
    now = {0: "stop", 1: "length", 2: "length", 3: None, 5: "abort", 6: "stop", 7: "content_filter"}

    def edit(prompt, choice):
        i = PROMPTS.index(prompt)
        if i in now:
            choice["finish_reason"] = now[i]
        return choice

    with Fake(edit) as fake:
        rc, out, _, data = audit(files, fake.url, tmp_path, capsys)
    row, level = data["rows"][0], data["meta"]["endpoint"]["levels"][0]
    assert rc == 1 and row["signature"] == "protocol error" and row["exact_match"] == 1.0
    assert [(p["prompt"], p["kind"]) for p in level["problems"]] == [(i, "finish_reason") for i in (0, 1, 3, 5, 6, 7)]
    assert level["finish_mismatches"] == 6 and "finish_reason" in out


# -------------------------------------------------------------------------------------- a right text-only server


def _text_only(prompt, choice):
    choice.pop("token_ids", None)
    choice.pop("prompt_token_ids", None)
    return choice


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_right_text_only_server_is_clean(files, tmp_path, capsys, stream):
    """Its text leaves out the EOS token; finish_reason "stop" says it was there."""
    with Fake(_text_only) as fake:
        rc, out, _, data = audit(files, fake.url, tmp_path, capsys, *(["--stream"] if stream else []))
    row, level = data["rows"][0], data["meta"]["endpoint"]["levels"][0]
    assert rc == 0 and row["signature"] == "clean" and level["token_source"] == RETOKENIZED, out
    assert row["outputs"] == [oracle(p) for p in PROMPTS]
    assert "re-tokenized" in out


# ------------------------------------------------------------------------------------------- failed requests


FAILURES = {  # how the request fails -> what the console must show of it
    "500": ("HTTP 500", "the engine fell over"),
    "garbage": ("not JSON", "gateway error"),
    "close": ("disconnected",),
    "hang": ("no answer within 0.5 s",),
    "no-done": ("[DONE]",),
}


@pytest.mark.parametrize("how", list(FAILURES))
def test_when_every_request_fails_the_level_could_not_be_audited(files, tmp_path, capsys, how):
    def edit(prompt, choice):
        if how == "no-done":
            choice["end"] = how
            return choice
        return how

    flags = ["--timeout", "0.5"] + (["--stream"] if how == "no-done" else [])
    with Fake(edit) as fake:
        rc, out, err, data = audit(files, fake.url, tmp_path, capsys, *flags)
    row, level = data["rows"][0], data["meta"]["endpoint"]["levels"][0]
    assert rc == 2 and row["signature"] == "could not audit" and row["divergences"] == [], out
    assert level["failed"] == len(PROMPTS) and "position-id" not in out
    assert "could not audit" in out and all(s in out for s in FAILURES[how]), out


def test_some_failed_requests_make_the_level_incomplete(files, tmp_path, capsys):
    with Fake(lambda prompt, choice: "500" if prompt == PROMPTS[5] else choice) as fake:
        rc, out, _, data = audit(files, fake.url, tmp_path, capsys)
    row, level = data["rows"][0], data["meta"]["endpoint"]["levels"][0]
    assert rc == 1 and row["signature"] == "incomplete" and row["divergences"] == [] and row["n"] == 7
    assert level["failed"] == 1 and [(p["prompt"], p["kind"]) for p in level["problems"]] == [(5, "failed")]
    assert "incomplete" in out and "HTTP 500" in out


# ------------------------------------------------------------------------------------ unreachable, timeouts


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("where", ["closed-port", "unknown-host"])
@pytest.mark.parametrize("model", [[], ["--model", "fake"]], ids=["first-model", "named-model"])
def test_an_unreachable_endpoint_is_one_line_and_exit_2(files, tmp_path, capsys, where, model):
    url = f"http://127.0.0.1:{_closed_port()}" if where == "closed-port" else "http://no-such-host.invalid:8000"
    rc, out, err, data = audit(files, url, tmp_path, capsys, "--timeout", "5", *model)
    assert rc == 2 and data is None
    assert err.count("\n") == 1 and err.startswith("batchspec audit: error: cannot reach") and url in err, err


def test_timeout_applies_to_the_model_list(files, tmp_path, capsys):
    with Fake(models_hang=True) as fake:
        t = time.monotonic()
        rc, out, err, data = audit(files, fake.url, tmp_path, capsys, "--timeout", "0.5")
        seconds = time.monotonic() - t
    assert rc == 2 and seconds < 5 and err.count("\n") == 1 and "0.5 s" in err, err


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_timeout_must_be_positive(files, tmp_path, capsys, value):
    with pytest.raises(SystemExit) as e:
        audit(files, f"http://127.0.0.1:{_closed_port()}", tmp_path, capsys, "--timeout", value)
    assert e.value.code == 2 and "--timeout" in capsys.readouterr().err
