"""The endpoint audit without local weights: against the server itself at concurrency 1 (``reference="self"``) or
another server, with divergences attributed from the reference's log-probabilities (or ``unattributed`` without
them).

The servers under test are real ``batchspec serve`` apps on the tiny target (clean, or with an injected fault). A
planted reference is a fake on loopback that answers with the tiny target's batch-size-1 greedy output (``tiny.oracle``,
HF ``generate``) and its log-probabilities (a float64 forward of the same model, ``torch.log_softmax``), both computed
here independently of the audit, with one token changed and the log-probabilities at that position edited as a test
asks."""

import json
import math
import subprocess
import sys
import threading

import pytest
import servekit
import tiny
import torch

import batchspec.model.loading as loading
from batchspec.audit import attribution as attr
from batchspec.audit.endpoint import (MAX_LOGIT_SCALE, SELF, TOKEN_IDS, UNATTRIBUTED, audit_endpoint,
                                      endpoint_markdown, endpoint_verdict, logprob_divergence, logprob_entries)
from batchspec.cli import main

MAX_TOKENS = 10
PROMPTS = tiny.prompts(32, seed=11, lo=2, hi=30)
FEW = PROMPTS[:8]
PLANTED, AT = 3, 4  # the planted reference differs from the right output in prompt 3's token 4
BF16 = attr.relative_tolerance(torch.bfloat16)
F32 = attr.relative_tolerance(torch.float32)  # the default without a local model


def oracle(prompt):
    return tiny.oracle(tiny.target(), list(prompt), MAX_TOKENS)


@pytest.fixture(autouse=True)
def no_weights(monkeypatch):
    """No model is loaded by any audit in this file: the reference is a server."""
    def refuse(*args, **kwargs):
        raise AssertionError("the audit loaded a model")

    monkeypatch.setattr(loading, "load_model", refuse)


# ----------------------------------------------------------------------------------- the server against itself


def test_a_clean_server_is_clean_against_itself_at_1_8_32(good):
    report = audit_endpoint(good.url, prompts=PROMPTS, concurrency=[1, 8, 32], max_tokens=MAX_TOKENS)
    ref = report.meta["reference"]
    assert ref["kind"] == SELF and ref["url"] == good.url and ref["answers"] == len(PROMPTS) and not ref["problems"]
    assert report.oracle == [oracle(p) for p in PROMPTS]  # the reference is right (checked independently)
    assert [r.batch_size for r in report.rows] == [1, 8, 32]
    for r, lv in zip(report.rows, report.meta["endpoint"]["levels"]):
        assert r.clean and r.signature == "clean" and r.exact_match == 1.0 and r.n == len(PROMPTS)
        assert r.outputs == report.oracle and lv["token_source"] == TOKEN_IDS and lv["compared"] == len(PROMPTS)
    assert endpoint_verdict(report) == (0, "clean at concurrency 1, 8, 32")


def test_a_padding_bug_is_caught_and_named_against_the_server_itself(padding_bug):
    """Padding visible to attention corrupts only rows that share a batch: the server alone (the reference) is right,
    the server under concurrency is not, and the signature names the bug class."""
    report = audit_endpoint(padding_bug.url, prompts=FEW, concurrency=[1, 4, 8], max_tokens=MAX_TOKENS)
    assert report.oracle == [oracle(p) for p in FEW]  # at concurrency 1 the faulty server is still right
    alone, *together = report.rows
    assert alone.clean
    for r in together:
        assert not r.clean and r.exact_match < 1.0
        assert r.signature == "padding leakage", r.signature
        assert r.synchronization + r.unattributed > 0 and r.reference == 0
    status, verdict = endpoint_verdict(report)
    assert status == 1 and "concurrency 4 (padding leakage)" in verdict


# ------------------------------------------------------------------------------------------ the logprob rule


def test_logprob_rule():
    ref, out = [7, 8, 9], [7, 8, 5]
    tol = BF16 * 2.0  # the largest |log-probability| listed is 2.0
    cases = {  # entry at index 2 -> (class, margin, basis)
        "tie": ({9: -0.69, 5: -0.70, 1: -2.0}, "numerical", 0.01, "logprobs"),
        "sure": ({9: -0.01, 5: -1.5, 1: -2.0}, "synchronization", 1.49, "logprobs"),
        "prefers-the-endpoint": ({9: -1.5, 5: -0.01, 1: -2.0}, "reference", -1.49, "logprobs"),
        "unlisted-far": ({9: -0.01, 1: -2.0}, "synchronization", 1.99, "bound"),
        "unlisted-close": ({9: -0.69, 1: -0.70}, UNATTRIBUTED, None, None),
        "no-reference-token": ({5: -0.1, 1: -2.0}, UNATTRIBUTED, None, None),
        "none": (None, UNATTRIBUTED, None, None),
    }
    for name, (entry, cls, margin, basis) in cases.items():
        d = logprob_divergence(0, out, ref, entry, 2, BF16)
        assert (d.cls, d.basis, d.oracle_token, d.engine_token) == (cls, basis, 9, 5), name
        assert (d.margin is None) if margin is None else d.margin == pytest.approx(margin), name
        if entry and name != "no-reference-token":  # the tolerance scales with the largest |log-probability| listed
            assert d.tolerance == pytest.approx(BF16 * max(1.0, max(abs(v) for v in entry.values()))), name
    assert logprob_divergence(0, out, ref, cases["tie"][0], 2, BF16).tolerance == pytest.approx(tol)
    short = logprob_divergence(0, [7, 8], ref, {9: -0.1}, 2, BF16)  # a length difference has no token to weigh
    assert short.cls == "synchronization" and short.margin is None
    assert logprob_divergence(0, out, ref, {9: -0.1, 5: -0.1000001}, 2, 1e-9).cls == "synchronization"


def test_far_tail_log_probabilities_do_not_widen_the_tolerance():
    """A listed -9999 (or -1e308) stands in for no logit scale: the tolerance stays under its ceiling, so a margin of
    0.5 between the top two is a synchronization divergence, not a near tie."""
    ref, out = [7, 8, 9], [7, 8, 5]
    for tail in (-9999.0, -1e308):
        d = logprob_divergence(0, out, ref, {9: -0.2, 5: -0.7, 1: tail}, 2, F32)
        assert d.cls == "synchronization" and d.tolerance == pytest.approx(F32 * MAX_LOGIT_SCALE), tail


@pytest.mark.parametrize("bad", [1e308, 0.5, float("inf"), float("-inf"), float("nan")])
def test_numbers_that_are_no_log_probabilities_leave_the_divergence_unattributed(bad):
    """Positive, infinite or NaN: the reference's numbers cannot be trusted, so nothing is called numerical."""
    ref, out = [7, 8, 9], [7, 8, 5]
    d = logprob_divergence(0, out, ref, {9: -0.69, 5: -0.70, 1: bad}, 2, BF16)
    assert d.cls == UNATTRIBUTED and d.margin is None
    raw = {"tokens": ["token_id:9"], "token_logprobs": [-0.69],
           "top_logprobs": [{"token_id:9": -0.69, "token_id:5": -0.70, "token_id:1": bad}]}
    assert logprob_divergence(0, out, ref, logprob_entries(raw)[0], 2, BF16).cls == UNATTRIBUTED


def test_logprob_entries_read_both_forms_and_only_token_ids():
    completions = {"tokens": ["token_id:5", "token_id:9", "w7"], "token_logprobs": [-0.1, -0.2, -0.3],
                   "top_logprobs": [{"token_id:5": -0.1, "token_id:6": -2.5}, {"token_id:9": -0.2, "oops": -1.0},
                                    None]}
    assert logprob_entries(completions) == [{5: -0.1, 6: -2.5}, {9: -0.2}, {}]
    chat = {"content": [{"token": "token_id:5", "logprob": -0.1, "bytes": None,
                         "top_logprobs": [{"token": "token_id:5", "logprob": -0.1},
                                          {"token": "token_id:6", "logprob": float("nan")},
                                          {"token": "token_id:7", "logprob": True}]}]}
    (entry,) = logprob_entries(chat)  # a NaN is kept, for the rule to refuse the entry; a bool is no number
    assert entry.keys() == {5, 6} and entry[5] == -0.1 and math.isnan(entry[6])
    assert logprob_entries(None) is None and logprob_entries({"tokens": "x"}) is None


# ------------------------------------------------------------------------------------- a planted reference


def true_logprobs(prompt, out):
    """The tiny target's log-probabilities at each output position (float64 forward, batch size 1)."""
    ids = torch.tensor([list(prompt) + list(out)])
    with torch.no_grad():
        logits = tiny.target()(input_ids=ids).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return [lp[len(prompt) - 1 + k] for k in range(len(out))]


class Reference(servekit.FakeServer):
    """A reference server on loopback: ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` (the tiny
    server's chat template: ``w1 {content} w2 w3``), streamed or not, with logprobs in OpenAI's forms and tokens as
    ``"token_id:N"``.

    The planted prompt's token ``AT`` is the target's second choice; ``mode`` sets the log-probabilities listed there:
    ``"true"`` (the target's own), ``"sure"`` (the planted token far ahead), ``"tie"`` (the two tied), ``"unlisted"``
    (the right token left out, the planted one far ahead of the rest), ``"off"`` (no logprobs at all), ``"refuse"``
    (HTTP 400 when logprobs are asked). ``fail``: prompts whose request fails (HTTP 500)."""

    def __init__(self, mode="true", plant=True, top=5, fail=()):
        self.mode, self.plant, self.top, self.fail = mode, plant, top, [list(p) for p in fail]
        self.asked = []  # the logprobs asked for in each request
        self.lock = threading.Lock()
        super().__init__(_Handler)

    def answer(self, prompt, sent):
        """(output ids, per position: [(token, log-probability)] listed, best first) for the ids ``sent`` (``prompt``:
        the prompt before the chat template)."""
        with self.lock:
            out = oracle(sent)
            lps = true_logprobs(sent, out)
        listed = []
        for k, lp in enumerate(lps):
            top = torch.topk(lp, self.top)
            listed.append([(int(t), float(v)) for v, t in zip(top.values, top.indices)])
        if self.plant and list(prompt) == list(PROMPTS[PLANTED]):
            right, second = listed[AT][0][0], listed[AT][1][0]
            out = [*out[:AT], second, *out[AT + 1:]]
            rest = [(t, -6.0 - j) for j, (t, _) in enumerate(listed[AT][2:])]
            listed[AT] = {
                "true": listed[AT],
                "sure": [(second, -0.01), (right, -5.0), *rest],
                "tie": [(second, math.log(0.5)), (right, math.log(0.5) - 1e-6), *rest],
                "unlisted": [(second, -0.01), *rest],
            }.get(self.mode, listed[AT])
        return out, listed


def _tok(t):
    return f"token_id:{t}"


def _completion_logprobs(out, listed):
    return {"tokens": [_tok(t) for t in out], "token_logprobs": [dict(lst).get(t) for t, lst in zip(out, listed)],
            "top_logprobs": [{_tok(t): v for t, v in lst} for lst in listed], "text_offset": list(range(len(out)))}


def _chat_logprobs(out, listed):
    return {"content": [{"token": _tok(t), "logprob": dict(lst).get(t, -30.0), "bytes": None,
                         "top_logprobs": [{"token": _tok(a), "logprob": v, "bytes": None} for a, v in lst]}
                        for t, lst in zip(out, listed)]}


class _Handler(servekit.JsonHandler):

    def do_GET(self):
        self.send_json(200, {"object": "list", "data": [{"id": "reference", "object": "model"}]})

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        chat = self.path.endswith("/chat/completions")
        asked = body.get("top_logprobs") if chat else body.get("logprobs")
        fake.asked.append((asked, body.get("return_tokens_as_token_ids")))
        if chat:
            words = body["messages"][0]["content"].split()
            prompt, sent = [int(w[1:]) for w in words], [1, *[int(w[1:]) for w in words], 2, 3]
        else:
            prompt = sent = [int(w[1:]) for w in body["prompt"].split()] if isinstance(body["prompt"], str) \
                else body["prompt"]
        if fake.mode == "refuse" and asked:
            return self.send_json(400, {"error": {"message": "logprobs are not supported by this server",
                                              "type": "invalid_request_error", "param": "logprobs"}})
        if prompt in fake.fail or sent in fake.fail:
            return self.send_json(500, {"error": {"message": "the engine fell over", "type": "server_error"}})
        out, listed = fake.answer(prompt, sent)
        lps = None
        if asked and fake.mode != "off":
            lps = (_chat_logprobs if chat else _completion_logprobs)(out, listed)
        text = " ".join(f"w{t}" for t in out)
        choice = {"index": 0, "finish_reason": "length", "token_ids": out, "prompt_token_ids": sent, "logprobs": lps}
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        if not body.get("stream"):
            return self.send_json(200, {"object": "chat.completion" if chat else "text_completion", "choices": [choice]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        parts = [{"index": 0, "token_ids": [], "prompt_token_ids": sent, "logprobs": None, "finish_reason": None,
                  **({"delta": {"role": "assistant", "content": ""}} if chat else {"text": ""})}]
        for k, t in enumerate(out):
            part_lps = None
            if lps is not None:
                part_lps = (_chat_logprobs if chat else _completion_logprobs)([t], [listed[k]])
            parts.append({"index": 0, "token_ids": [t], "logprobs": part_lps, "finish_reason": None,
                          **({"delta": {"content": f" w{t}"}} if chat else {"text": f" w{t}"})})
        parts.append({"index": 0, "token_ids": [], "logprobs": None, "finish_reason": "length",
                      **({"delta": {}} if chat else {"text": ""})})
        for part in parts:
            self.wfile.write(f"data: {json.dumps({'choices': [part]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def _planted(report):
    """The one divergence of each level: at the planted prompt and position."""
    for r in report.rows:
        assert [(d.prompt, d.index) for d in r.divergences] == [(PLANTED, AT)], r.divergences
        assert r.exact_match == (len(FEW) - 1) / len(FEW)
    return [r.divergences[0] for r in report.rows]


def test_the_reference_fake_is_right_without_the_plant(good):
    with Reference(plant=False) as ref:
        report = audit_endpoint(good.url, prompts=FEW, concurrency=[1, 4], max_tokens=MAX_TOKENS, reference=ref.url)
    assert all(r.clean and r.divergences == [] for r in report.rows)
    assert report.meta["reference"]["logprobs"] == "returned" and report.meta["reference"]["model"] == "reference"


@pytest.mark.parametrize("api,stream,tokenizer", [("completions", False, False), ("completions", True, False),
                                                  ("chat", False, True), ("chat", True, False)])
def test_a_planted_reference_token_is_found_with_its_position_and_class(good, api, stream, tokenizer):
    """The reference is sure of its own (planted) token: the server's token is a synchronization divergence, found
    at the planted prompt and position, with the margin from the reference's log-probabilities. Chat prompts go as
    text, templated by both servers (with a tokenizer, the local template's ids are checked against theirs)."""
    prompts = [" ".join(f"w{t}" for t in p) for p in FEW] if api == "chat" else FEW
    with Reference("sure") as ref:
        report = audit_endpoint(good.url, servekit.tokenizer() if tokenizer else None, prompts, [1, 4],
                                reference=ref.url, max_tokens=MAX_TOKENS, api=api, stream=stream)
        asked = set(ref.asked)
    assert asked == {(5, True)}  # every reference request asked for 5 logprobs as token ids
    right = oracle([1, *FEW[PLANTED], 2, 3] if api == "chat" else FEW[PLANTED])
    for d in _planted(report):
        assert d.cls == "synchronization" and d.basis == "logprobs" and d.engine_token == right[AT]
        assert d.margin == pytest.approx(5.0 - 0.01) and d.tolerance == pytest.approx(F32 * 8.0)  # listed: -8 last
    assert all(not r.clean for r in report.rows) and endpoint_verdict(report)[0] == 1
    md = endpoint_markdown(report)
    assert f"| 4 | {PLANTED} | {AT} | synchronization |" in md


@pytest.mark.parametrize("mode,cls,signature", [
    ("tie", "numerical", "clean"),
    ("true", "reference", "stale or wrong reference"),
    ("unlisted", "synchronization", None),
    ("off", UNATTRIBUTED, UNATTRIBUTED),
    ("refuse", UNATTRIBUTED, UNATTRIBUTED),
])
def test_the_class_of_a_planted_token_follows_the_reference_logprobs(good, mode, cls, signature):
    with Reference(mode) as ref:
        report = audit_endpoint(good.url, prompts=FEW, concurrency=[1, 4], max_tokens=MAX_TOKENS, reference=ref.url)
    for r, d in zip(report.rows, _planted(report)):
        assert d.cls == cls, (mode, d)
        if signature is not None:
            assert r.signature == signature
        assert r.clean == (cls == "numerical")
    if mode == "unlisted":
        assert report.rows[0].divergences[0].basis == "bound"
    status = report.meta["reference"]["logprobs"]
    assert status.startswith({"off": "not returned", "refuse": "refused: HTTP 400"}.get(mode, "returned")), status
    if mode == "refuse":
        assert report.meta["reference"]["answers"] == len(FEW)  # asked again without logprobs, and answered


def test_reference_answers_that_fail_leave_their_prompts_out(good):
    with Reference(plant=False, fail=[FEW[2]]) as ref:
        report = audit_endpoint(good.url, prompts=FEW, concurrency=[4], max_tokens=MAX_TOKENS, reference=ref.url)
    row, ref_meta = report.rows[0], report.meta["reference"]
    assert row.signature == "incomplete" and row.n == len(FEW) - 1 and row.divergences == []
    assert ref_meta["answers"] == len(FEW) - 1 and [(p["prompt"], p["kind"]) for p in ref_meta["problems"]] == [
        (2, "failed")]
    assert report.meta["endpoint"]["levels"][0]["unreferenced"] == 1 and endpoint_verdict(report)[0] == 1
    with Reference(plant=False, fail=FEW) as ref:
        report = audit_endpoint(good.url, prompts=FEW, concurrency=[4], max_tokens=MAX_TOKENS, reference=ref.url)
    assert report.rows[0].signature == "could not audit"
    assert endpoint_verdict(report) == (2, "could not audit: concurrency 4 (no reference answer)")


# ------------------------------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The prompts spelled as words (the tiny tokenizer's), and a folder with only the tokenizer."""
    d = tmp_path_factory.mktemp("reference")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"question_id": f"q{i}", "turns": [" ".join(f"w{t}" for t in p)]}) + "\n"
                               for i, p in enumerate(FEW)))
    servekit.tokenizer().save_pretrained(d / "tokenizer")
    return prompts, d / "tokenizer"


def _cli(url, files, tmp_path, capsys, *flags):
    prompts, _ = files
    out = tmp_path / "out"
    rc = main(["audit", "--endpoint", url, "--prompts", str(prompts), "--concurrency", "1,4", "--max-tokens",
               str(MAX_TOKENS), "--out", str(out), *flags])
    std = capsys.readouterr()
    data = json.loads((out / "audit.json").read_text()) if (out / "audit.json").exists() else None
    return rc, std.out, std.err, data, out


def test_the_command_audits_without_a_target_against_the_server_itself(good, padding_bug, files, tmp_path, capsys):
    """No --target: the reference is the server at concurrency 1 and the prompts go as chat messages (no tokenizer
    here: the server's chat template is the one they get)."""
    rc, out, _, data, folder = _cli(good.url, files, tmp_path, capsys)
    assert rc == 0, out
    ref = data["meta"]["reference"]
    assert ref["kind"] == "self" and ref["tokenizer"] is False and ref["answers"] == len(FEW)
    assert data["meta"]["endpoint"]["api"] == "chat"
    assert data["oracle"] == [oracle([1, *p, 2, 3]) for p in FEW]  # the server templated the words as they say
    assert [r["signature"] for r in data["rows"]] == ["clean", "clean"]
    assert all((folder / f"audit.{ext}").stat().st_size > 500 for ext in ("json", "md", "png", "html"))
    assert "reference: the same server at concurrency 1" in out
    rc, out, _, data, _ = _cli(padding_bug.url, files, tmp_path, capsys)
    assert rc == 1 and "padding leakage" in out and "first divergence at token" in out, out
    assert [r["signature"] for r in data["rows"]] == ["clean", "padding leakage"]


def test_every_divergence_has_a_reproducer_that_shows_it(padding_bug, files, tmp_path, capsys):
    """A reproducer per divergence found against the server itself: the request as sent with those under way with it,
    both token sequences, the margin; its script, run on its own against the still-running server, shows it (the
    fault needs a batch: the concurrent requests are sent again with it)."""
    _, tokenizer = files
    rc, out, _, data, folder = _cli(padding_bug.url, files, tmp_path, capsys, "--target", str(tokenizer),
                                    "--no-chat-template", "--reference", "self")
    divs = [(row["batch_size"], d) for row in data["rows"] for d in row["divergences"]]
    assert rc == 1 and divs and "reproducers in" in out, out
    md = (folder / "audit.md").read_text()
    for c, d in divs:
        case = json.loads((folder / "repro" / f"q{d['prompt']}-{c}.json").read_text())
        assert (case["first_divergence"], case["margin"], case["class"]) == (d["index"], d["margin"], d["class"])
        assert case["request"]["prompt"] == FEW[d["prompt"]] and case["concurrent"] and case["concurrency"] == c
        assert case["baseline_tokens"] == oracle(FEW[d["prompt"]]) != case["tokens"]
        assert d["engine_token"] is None or case["tokens"][d["index"]] == d["engine_token"]
        assert f"(repro/q{d['prompt']}-{c}.json)" in md
    assert "repro_cases" not in json.dumps(data)
    c, d = divs[0]
    run = subprocess.run([sys.executable, str(folder / "repro" / f"q{d['prompt']}-{c}.py")], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 1 and "divergence shows at token" in run.stdout, run.stdout + run.stderr
    assert "where the reference has" in run.stdout


def test_the_command_takes_the_tokenizer_from_target_with_a_reference(good, files, tmp_path, capsys):
    _, tokenizer = files
    with Reference("sure") as ref:
        rc, out, _, data, _ = _cli(good.url, files, tmp_path, capsys, "--reference", ref.url, "--target",
                                   str(tokenizer), "--no-chat-template")
    assert data["meta"]["reference"]["tokenizer"] is True and data["meta"]["reference"]["kind"] == "endpoint"
    assert rc == 1 and f"prompt {PLANTED} (q{PLANTED}): first divergence at token {AT}" in out, out
    assert all(lv["prompt_mismatches"] == 0 for lv in data["meta"]["endpoint"]["levels"])  # sent as ids, echoed
    d = data["rows"][1]["divergences"][0]
    assert (d["prompt"], d["index"], d["class"], d["basis"]) == (PLANTED, AT, "synchronization", "logprobs")


@pytest.mark.parametrize("flags,message", [
    (["--reference", "self"], "--reference applies to the endpoint audit"),
    (["--repeat", "3"], "--repeat applies to the endpoint audit"),
])
def test_reference_flags_need_an_endpoint(flags, message, capsys):
    assert main(["audit", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


@pytest.mark.parametrize("flags,message", [
    (["--reference", "localhost"], "--reference must be 'self' or a server's URL"),
    (["--reference-model", "m"], "--reference-model names the model of --reference URL"),
    (["--top-logprobs", "-1"], "--top-logprobs must be an integer >= 0"),
    (["--reference", "http://127.0.0.1:9"], "cannot reach http://127.0.0.1:9"),
])
def test_bad_reference_flags_are_one_line_and_exit_2(good, files, tmp_path, capsys, flags, message):
    rc, _, err, data, _ = _cli(good.url, files, tmp_path, capsys, "--timeout", "5", *flags)
    assert rc == 2 and data is None and err.count("\n") == 1 and message in err, err
