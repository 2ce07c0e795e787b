"""Baselines of a server (``batchspec audit --endpoint URL --save FILE``, then ``--against FILE``): a restart that
changes one token is named at its position with its class and a reproducer that shows it on its own; the same server
unchanged is clean; planted log-probability faults are each named; the JUnit report parses with the right counts.

The fake server answers each prompt with tokens that follow from its ids alone, and log-probabilities that are
consistent (the returned token the most likely, ``CHOSEN - 0.01 k`` at token k, two alternatives 1 and 2 nats below)
unless a test plants a fault."""

import json
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET

import pytest
import servekit

from batchspec.audit.endpoint.logprob_checks import CONCURRENCY_TOLERANCE, answer_faults, level_drift
from batchspec.cli import main

PROMPTS = [[5, 9, 14], [22, 41, 7, 7, 8], [60], [33, 34, 35, 36], [3, 1, 4, 1, 5], [70, 71], [9, 2, 6], [44, 45, 46]]
NAMES = [f"q{i}" for i in range(len(PROMPTS))]
PLANTED, AT = 3, 4  # the restarted server changes prompt 3's token 4
MAX_TOKENS, CHOSEN = 8, -0.1
NUDGE = 0.01  # the noise added to one weight matrix of the tiny target: it moves some greedy outputs, not all


def tokens(prompt):
    return [(sum(prompt) * 7 + 13 * k) % 90 + 4 for k in range(MAX_TOKENS)]


class Fake(servekit.FakeServer):
    """``/v1/models`` and ``/v1/completions`` (text prompts ``"w5 w9"`` or ids), streamed or not, with logprobs as
    token ids. ``changed``: prompt 3's token 4 is its first alternative, listed as the most likely (a restart that
    changed one token); ``tie``: that alternative is listed 1e-6 below the returned token; ``fault``: ``"zeros"``
    (every value 0.0), ``"swap"`` (token 2's alternative listed as more likely than the token), ``"drift"`` (values
    1e-2 lower while another request is under way), ``"missing"`` (token 1 has none), ``"down"`` (HTTP 500),
    ``"hostile"`` (prompt 0 gets HTTP 500 with ``model`` as its message, the ``Server`` header and the text are
    ``model`` too). ``model``: the model id listed."""

    def __init__(self, changed=False, tie=False, fault=None, model="fake"):
        self.changed, self.tie, self.fault, self.model = changed, tie, fault, model
        self.running, self.lock = 0, threading.Lock()
        super().__init__(_Handler)

    def answer(self, prompt, together: bool):
        out, listed = tokens(prompt), []
        for k, t in enumerate(out):
            lp = CHOSEN - 0.01 * k
            alts = [((t + 1) % 96, lp - 1.0), ((t + 2) % 96, lp - 2.0)]
            if prompt == PROMPTS[PLANTED] and k == AT and self.tie:
                alts[0] = (alts[0][0], lp - 1e-6)
            if prompt == PROMPTS[PLANTED] and k == AT and self.changed:
                out[k], alts[0] = alts[0][0], (t, alts[0][1])
                t = out[k]
            if self.fault == "swap" and k == 2:
                lp, alts[0] = alts[0][1], (alts[0][0], lp)
            if self.fault == "drift" and together:
                lp, alts = lp - 1e-2, [(a, v - 1e-2) for a, v in alts]
            if self.fault == "zeros":
                lp, alts = 0.0, [(a, 0.0) for a, _ in alts]
            listed.append((t, None if self.fault == "missing" and k == 1 else lp, alts))
        return out, listed


def _logprobs(listed):
    return {"tokens": [f"token_id:{t}" for t, _, _ in listed], "token_logprobs": [v for _, v, _ in listed],
            "top_logprobs": [{f"token_id:{a}": v for a, v in [(t, lp), *alts] if v is not None}
                             for t, lp, alts in listed]}


class _Handler(servekit.JsonHandler):

    def version_string(self):
        return self.server.fake.model if self.server.fake.fault == "hostile" else super().version_string()

    def do_GET(self):
        self.send_json(200, {"object": "list", "data": [{"id": self.server.fake.model, "object": "model"}]})

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        p = body["prompt"]
        prompt = [int(w[1:]) for w in p.split()] if isinstance(p, str) else p
        if fake.fault == "down" or (fake.fault == "hostile" and prompt == PROMPTS[0]):
            message = fake.model if fake.fault == "hostile" else "the engine fell over"
            return self.send_json(500, {"error": {"message": message, "type": "server_error"}})
        with fake.lock:
            fake.running += 1
        time.sleep(0.05)  # requests sent together overlap
        with fake.lock:
            together = fake.running > 1
        out, listed = fake.answer(prompt, together)
        with fake.lock:
            fake.running -= 1
        asked = body.get("logprobs")
        text = fake.model if fake.fault == "hostile" else " ".join(f"w{t}" for t in out)
        choice = {"index": 0, "text": text, "token_ids": out, "prompt_token_ids": prompt,
                  "finish_reason": "length", "logprobs": _logprobs(listed) if asked else None}
        if not body.get("stream"):
            return self.send_json(200, {"object": "text_completion", "choices": [choice]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for k, t in enumerate(out):
            part = {"index": 0, "text": f" w{t}", "token_ids": [t], "finish_reason": None,
                    "logprobs": _logprobs(listed[k:k + 1]) if asked else None}
            self.wfile.write(f"data: {json.dumps({'choices': [part]})}\n\n".encode())
        end = {"index": 0, "text": "", "token_ids": [], "finish_reason": "length", "logprobs": None}
        self.wfile.write(f"data: {json.dumps({'choices': [end]})}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("baseline") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": n, "turns": [" ".join(f"w{t}" for t in p)]}) + "\n"
                            for n, p in zip(NAMES, PROMPTS)))
    return path


def audit(url, prompts, out, *flags):
    rc = main(["audit", "--endpoint", url, "--prompts", str(prompts), "--concurrency", "1,8", "--max-tokens",
               str(MAX_TOKENS), "--out", str(out), *flags])
    return rc, json.loads((out / "audit.json").read_text())["cases"]


def not_clean(cases):
    return [(c["name"], c["concurrency"], c["status"]) for c in cases if c["status"] != "clean"]


@pytest.mark.parametrize("tie,cls", [(False, "not a near-tie"), (True, "near-tie")])
def test_a_restart_that_changed_one_token_is_named_with_a_reproducer(prompts, tmp_path, tie, cls):
    base = tmp_path / "base.json"
    with Fake(tie=tie) as before:
        rc, cases = audit(before.url, prompts, tmp_path / "save", "--save", str(base))
        assert rc == 0 and not_clean(cases) == [] and len(cases) == 2 * len(PROMPTS)
        rc, cases = audit(before.url, prompts, tmp_path / "same", "--against", str(base))
        assert rc == 0 and not_clean(cases) == []  # the same server unchanged: clean
    with Fake(changed=True) as after:
        out = tmp_path / "after"
        junit = tmp_path / "junit.xml"
        rc, cases = audit(after.url, prompts, out, "--against", str(base), "--junit", str(junit))
        assert rc == 1
        assert not_clean(cases) == [(f"q{PLANTED}", 1, "drift"), (f"q{PLANTED}", 8, "drift")]
        drifts = [c["drift"] for c in cases if c["status"] == "drift"]
        assert all(d["index"] == AT and d["class"] == cls for d in drifts), drifts
        assert drifts[0]["margin"] == pytest.approx(1e-6 if tie else 1.0)
        md = (out / "audit.md").read_text()
        assert md.startswith("**Verdict: not clean: 2 drift of 16 cases**")
        assert f"| q{PLANTED} | 8 | drift | {AT} | {cls} |" in md and f"(repro/q{PLANTED}-8.json)" in md
        page = (out / "audit.html").read_text()
        assert 'id="verdict"><span class="status">FAIL</span>not clean: 2 drift of 16 cases' in page
        assert f'<td class="text fail">drift</td><td class="text">{cls}</td><td>2</td>' in page  # per drift class
        assert f"<td>{AT}</td><td class=\"text\">{cls}</td>" in page and f"repro/q{PLANTED}-8.json" in page
        assert "Fingerprints compared" in page and '<td class="text good">same</td>' in page
        for level in (1, 8):  # (c) each reproducer, on its own, shows the divergence
            case = json.loads((out / "repro" / f"q{PLANTED}-{level}.json").read_text())
            want = tokens(PROMPTS[PLANTED])
            assert case["baseline_tokens"] == want and case["tokens"][AT] != want[AT] and case["first_divergence"] == AT
            assert case["request"]["prompt"] == f"w{' w'.join(map(str, PROMPTS[PLANTED]))}"
            assert (len(case["concurrent"]) > 0) == (level == 8)
            run = subprocess.run([sys.executable, str(out / "repro" / f"q{PLANTED}-{level}.py")], capture_output=True,
                                 text=True, timeout=60)
            assert run.returncode == 1 and f"divergence shows at token {AT}" in run.stdout, run.stdout + run.stderr
        # (d) the JUnit report: one case per prompt x level, the two drifts failing with their summary
        root = ET.parse(junit).getroot()
        suite = root.find("testsuite")
        assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("16", "2", "0")
        assert len(suite.findall("testcase")) == 16
        failed = [f.get("message") for f in suite.iter("failure")]
        assert len(failed) == 2 and all(m.startswith(f"token {AT} is ") and cls in m for m in failed)
    with Fake() as again:  # a reproducer replayed against the unchanged server: it does not show
        run = subprocess.run([sys.executable, str(out / "repro" / f"q{PLANTED}-1.py"), again.url],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0 and "no divergence" in run.stdout


@pytest.mark.parametrize("fault,message", [
    ("zeros", "constant log-probabilities (all 0)"),
    ("swap", "token 2 is"),
    ("drift", "at concurrency 8: log-probabilities differ by 0.01 at token 0"),
    ("missing", "log-probabilities missing for 1 of 8 tokens (first: token 1)"),
])
def test_planted_logprob_faults_are_named(prompts, tmp_path, fault, message):
    with Fake(fault=fault) as server:
        rc, cases = audit(server.url, prompts, tmp_path / "out", "--save", str(tmp_path / "b.json"), "--stream")
    bad = [c for c in cases if c["status"] != "clean"]
    assert rc == 1 and bad and all(c["status"] == "logprobs" and message in c["summary"] for c in bad), bad
    assert {c["concurrency"] for c in bad} == ({8} if fault == "drift" else {1, 8})
    assert message in (tmp_path / "out" / "audit.md").read_text()


def test_the_project_server_passes_the_checks_and_is_clean_against_itself(good, prompts, tmp_path):
    base = tmp_path / "base.json"
    for stream in ([], ["--stream"]):
        rc, cases = audit(good.url, prompts, tmp_path / "save", "--save", str(base), "--concurrency", "1,4", *stream)
        assert rc == 0 and not_clean(cases) == [] and len(cases) == 2 * len(PROMPTS)
        saved = json.loads(base.read_text())
        assert saved["fingerprint"]["headers"]["server"] and saved["fingerprint"]["models"]["data"][0]["id"] == "tiny"
        assert all(len(a["logprobs"]) == len(a["token_ids"]) and all(p[1] is not None for p in a["logprobs"])
                   for run in saved["runs"] for a in run["answers"])
        rc, cases = audit(good.url, prompts, tmp_path / "again", "--against", str(base))
        assert rc == 0 and not_clean(cases) == []


def test_logprob_checks():
    good = [[5, -0.1, {5: -0.1, 6: -1.2}], [7, -0.5, {7: -0.5, 8: -0.5000001}]]
    assert answer_faults(good, 1e-3) == ([], [1])  # a near-tie is recorded, not a fault
    assert "> 0" in answer_faults([[5, 0.3, {5: 0.3}]], 1e-3)[0][0]
    assert "but -0.2 in its top_logprobs" in answer_faults([[5, -0.1, {5: -0.2, 6: -1.0}]], 1e-3)[0][0]
    assert "which leave it out" in answer_faults([[5, -0.1, {6: -0.2, 7: -1.0}]], 1e-3)[0][0]
    assert level_drift(good, good) is None
    shifted = [[t, v - 2 * CONCURRENCY_TOLERANCE, top] for t, v, top in good]
    assert "differ by 0.002 at token 0" in level_drift(shifted, good)


def test_junit_of_the_audit_against_the_server_itself(padding_bug, prompts, tmp_path):
    """Without a baseline too: a padding bug fails the cases of its divergent prompts under concurrency only."""
    junit = tmp_path / "junit.xml"
    rc = main(["audit", "--endpoint", padding_bug.url, "--prompts", str(prompts), "--concurrency", "1,4",
               "--max-tokens", "10", "--out", str(tmp_path / "out"), "--junit", str(junit)])
    data = json.loads((tmp_path / "out" / "audit.json").read_text())
    divergent = {(r["batch_size"], d["prompt"]) for r in data["rows"] for d in r["divergences"]
                 if d["class"] != "numerical"}
    suite = ET.parse(junit).getroot().find("testsuite")
    failed = {(int(c.get("classname").split("concurrency ")[1].split(",")[0]), NAMES.index(c.get("name").split()[1]))
              for c in suite.findall("testcase") if c.find("failure") is not None}
    assert rc == 1 and divergent and failed == divergent and {c for c, _ in failed} == {4}
    assert (suite.get("tests"), suite.get("failures")) == (str(2 * len(PROMPTS)), str(len(divergent)))


def test_a_baseline_that_cannot_be_audited_exits_2(prompts, tmp_path, capsys):
    with Fake(fault="down") as server:
        rc, cases = audit(server.url, prompts, tmp_path / "out", "--save", str(tmp_path / "b.json"))
        assert rc == 2 and all(c["status"] == "failed" and "HTTP 500" in c["summary"] for c in cases)
        (tmp_path / "other.json").write_text("{}")
        assert main(["audit", "--endpoint", server.url, "--against", str(tmp_path / "other.json")]) == 2
    assert "is not a baseline written by batchspec audit --save" in capsys.readouterr().err


def test_the_html_report_escapes_what_the_server_says(prompts, tmp_path):
    """A model id, a ``Server`` header, an error message and answer text written as markup reach audit.html as text:
    no tag of theirs, their characters escaped, both when recording and when comparing."""
    from html import escape
    from html.parser import HTMLParser

    class Tags(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tags = []

        def handle_starttag(self, tag, attrs):
            self.tags.append(tag)

    evil = "evil<script>alert(1)</script><img src=x onerror=alert(2)>"
    base = tmp_path / "base.json"
    with Fake(fault="hostile", model=evil) as before:
        rc, cases = audit(before.url, prompts, tmp_path / "save", "--save", str(base))
    assert rc == 1 and {c["name"] for c in cases if c["status"] == "failed"} == {"q0"}
    with Fake(fault="hostile", model=evil, changed=True) as after:
        rc, cases = audit(after.url, prompts, tmp_path / "after", "--against", str(base))
    assert rc == 1 and {(c["name"], c["status"]) for c in cases if c["status"] != "clean"} == {
        ("q0", "failed"), (f"q{PLANTED}", "drift")}
    for out in ("save", "after"):
        page = (tmp_path / out / "audit.html").read_text()
        parser = Tags()
        parser.feed(page)
        assert "script" not in parser.tags and "img" not in parser.tags and "<script" not in page
        assert escape(f"(model {evil}, completions") in page  # the summary
        assert escape(f'could not audit: HTTP 500: {{"error": {{"message": "{evil}"') in page  # prompt 0's row
    assert page.count(escape(evil)) >= 4  # and in the fingerprints compared: /v1/models and the server header


def test_a_restart_from_saved_weights_is_clean_and_changed_weights_drift(prompts, tmp_path):
    """The tiny target and its draft saved with ``save_pretrained``, served from their directories: a baseline, then
    a new server from the same directories is clean (its fingerprint too, the ``created`` time aside); then one whose
    target has one matrix nudged and saved again drifts on exactly the prompts whose HF greedy output the nudge
    moves, at the token where it moves, and each drift's reproducer, replayed against that server, shows it."""
    import copy

    import tiny
    import torch

    import batchspec

    target, draft = tiny.save_dir(tmp_path / "weights")
    nudged = copy.deepcopy(tiny.target())
    with torch.no_grad():
        w = nudged.model.layers[1].mlp.down_proj.weight
        w += NUDGE * torch.randn(w.shape, generator=torch.Generator().manual_seed(0), dtype=w.dtype)
    moved = {}
    for name, p in zip(NAMES[:6], PROMPTS):
        was, now = tiny.oracle(tiny.target(), p, 16), tiny.oracle(nudged, p, 16)
        if was != now:
            moved[name] = next(k for k, (a, b) in enumerate(zip(now, was)) if a != b)
    assert 0 < len(moved) < 6, moved  # a slight change: some prompts move, not all

    def restarted():
        llm = batchspec.LLM(str(target), draft=str(draft), scheduler="continuous", batch_size=4, num_draft_tokens=3)
        return servekit.served(llm)

    base = tmp_path / "base.json"
    with restarted() as first:
        rc, cases = audit(first.url, prompts, tmp_path / "save", "--save", str(base), "--max-tokens", "16",
                          "--limit", "6")
    assert rc == 0 and not_clean(cases) == [] and len(cases) == 12
    with restarted() as second:
        rc, cases = audit(second.url, prompts, tmp_path / "same", "--against", str(base))
    assert rc == 0 and not_clean(cases) == []
    assert "Fingerprint: unchanged." in (tmp_path / "same" / "audit.md").read_text()
    nudged.save_pretrained(target)
    out = tmp_path / "changed"
    with restarted() as changed:
        rc, cases = audit(changed.url, prompts, out, "--against", str(base))
        drifts = [c for c in cases if c["status"] != "clean"]
        assert rc == 1 and all(c["status"] == "drift" for c in drifts)
        assert {(c["name"], c["drift"]["index"]) for c in drifts} == set(moved.items())
        assert len(drifts) == 2 * len(moved)  # at each level
        for c in drifts:
            run = subprocess.run([sys.executable, str(out / "repro" / f"{c['name']}-{c['concurrency']}.py")],
                                 capture_output=True, text=True, timeout=120)
            assert run.returncode == 1 and f"divergence shows at token {c['drift']['index']}:" in run.stdout, (
                run.stdout + run.stderr)
    page = (out / "audit.html").read_text()
    assert all(f"<td class=\"text\">{c['drift']['class']}</td>" in page for c in drifts)


def test_the_baseline_verdict_keeps_the_endpoint_audits_exit_statuses():
    """0 clean, 1 a case not clean, 2 nothing audited or outputs too short to exercise batching (``proved little``)."""
    from batchspec.audit.endpoint.baseline import status

    def case(kind, length=8):
        return {"status": kind, "length": length, "summary": f"{kind} here"}

    assert status([case("clean")] * 4) == (0, "clean: 4 cases")
    assert status([case("clean"), case("drift"), case("failed")]) == (1, "not clean: 1 drift, 1 failed of 3 cases")
    assert status([case("failed")] * 2) == (2, "could not audit: failed here")
    code, verdict = status([case("clean", 2)] * 3 + [case("clean", 9)])
    assert code == 2 and verdict.startswith("proved little: the median output is 2 tokens (under 4)")
    assert status([case("drift", 1)] * 2)[0] == 1  # a drift on short outputs is still a drift
