"""The endpoint audit's feature matrix (``--features``): against ``batchspec serve`` on the tiny target (with the
character-level JSON tokenizer, so that JSON and tool calls can be spelled) every feature is supported and clean at
concurrency 1 and 4; a proxy of that server that breaks one feature gets it reported invalid or inexact (exit
status 1), and one that answers 400 to tools gets them reported unsupported (not a failure)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import httpx
import pytest
import servekit
import test_tools
import tiny

import batchspec
from batchspec.audit.endpoint.features import (FEATURES, SCHEMA, Reply, matrix_verdict, parse_features, plan_of,
                                               schema_problem)
from batchspec.cli import main

PROMPTS = ["abc", "hello", "json", "xyz12"]
EVIL = '{"a": 1, "b": "<script>alert(1)</script>'  # not JSON, and markup that the HTML report must escape
MAX_TOKENS = 80  # a tool call spelled a character at a time needs about 60 tokens


@pytest.fixture(scope="module")
def server():
    llm = batchspec.LLM(tiny.target(), draft=tiny.draft(), scheduler="continuous", num_draft_tokens=3, batch_size=4,
                        tokenizer=test_tools.tokenizer())
    with servekit.served(llm) as s:
        yield s


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"question_id": f"q{i}", "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS)))
    return path


class Proxy(servekit.FakeServer):
    """Forwards every request to ``target`` (a real server), breaking one thing (``mode``): "ignore-stop" drops the
    stop strings, "bad-json" answers a response_format request with text that is not JSON, "refuse-tools" answers
    400 to a request with tools, "drop-penalties" drops the penalties, "drop-seed" drops the seed."""

    def __init__(self, target: str, mode: str):
        self.target, self.mode = target, mode
        super().__init__(_Forward)


class _Forward(servekit.JsonHandler):
    def do_GET(self):
        r = httpx.get(self.server.fake.target + self.path, timeout=60)
        self.send(r.status_code, r.content)

    def do_POST(self):
        fake = self.server.fake
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if fake.mode == "refuse-tools" and "tools" in body:
            return self.send_json(400, {"error": {"message": "tools are not supported", "type": "invalid_request"}})
        if fake.mode == "ignore-stop":
            body.pop("stop", None)
        if fake.mode == "drop-seed":
            body.pop("seed", None)
        if fake.mode == "drop-penalties":
            body.pop("presence_penalty", None)
            body.pop("frequency_penalty", None)
        r = httpx.post(fake.target + self.path, json=body, timeout=60)
        answer = r.json()
        if fake.mode == "bad-json" and "response_format" in body:
            answer["choices"][0]["message"]["content"] = EVIL
        if fake.mode == "cut-json" and "response_format" in body:  # what max_tokens leaves of a long answer
            answer["choices"][0].update(finish_reason="length")
            answer["choices"][0]["message"]["content"] = '{"a": 1, "b'
            answer["choices"][0].pop("token_ids", None)
        self.send_json(r.status_code, answer)


def audit(url, prompts, tmp_path, features, *flags):
    """``batchspec audit --endpoint url --features ...`` at concurrency 1 and 4: (exit status, the feature cells by
    (feature, level), the output folder)."""
    out = tmp_path / "out"
    rc = main(["audit", "--endpoint", url, "--prompts", str(prompts), "--concurrency", "1,4", "--max-tokens",
               str(MAX_TOKENS), "--features", features, "--out", str(out), *flags])
    data = json.loads((out / "audit.json").read_text())
    cells = {(c["feature"], c["concurrency"]): c for c in data["meta"]["features"]["cells"]}
    return rc, cells, out


def test_every_feature_is_clean_on_batchspec_serve(server, prompts, tmp_path):
    junit = tmp_path / "junit.xml"
    rc, cells, out = audit(server.url, prompts, tmp_path, "all", "--junit", str(junit))
    assert rc == 0, (out / "audit.md").read_text()
    assert set(cells) == {(f, c) for f in FEATURES for c in (1, 4)}
    for (feature, _), c in cells.items():
        assert c["status"] == ("deterministic" if feature == "seed" else "clean"), c
        assert c["exact_rate"] == 1.0 and c["compared"] == len(PROMPTS) and c["failed"] == c["refused"] == 0
        if feature != "penalties":  # the rest have a check of their own, and every answer met it
            assert c["checked"] == c["valid"] == len(PROMPTS) or c["pairs"] == c["agreeing"] == len(PROMPTS), c
    md, html = (out / "audit.md").read_text(), (out / "audit.html").read_text()
    assert "| logit_bias | 4 | clean | 4/4 | 4/4 |" in md and "features clean:" in md
    assert "<h2>Features</h2>" in html and "logit_bias" in html
    suite = ET.parse(junit).getroot().find("testsuite")
    features = [c for c in suite.findall("testcase") if c.get("name").startswith("feature ")]
    assert len(features) == 2 * len(FEATURES) and all(len(c) == 0 for c in features)


@pytest.mark.parametrize("mode,feature,status", [("ignore-stop", "stop", "invalid"),
                                                 ("bad-json", "json", "invalid")])
def test_a_broken_feature_is_invalid_and_fails_the_audit(server, prompts, tmp_path, mode, feature, status):
    with Proxy(server.url, mode) as proxy:
        rc, cells, out = audit(proxy.url, prompts, tmp_path, f"{feature},penalties")
    assert rc == 1
    assert [cells[feature, c]["status"] for c in (1, 4)] == [status, status]
    assert [cells["penalties", c]["status"] for c in (1, 4)] == ["clean", "clean"]
    assert cells[feature, 1]["valid"] < cells[feature, 1]["checked"] and cells[feature, 1]["exact_rate"] == 1.0
    assert f"| {feature} | 1 | {status} |" in (out / "audit.md").read_text()
    html = (out / "audit.html").read_text()
    assert "<script>" not in html and ("&lt;script&gt;alert(1)" in html) == (mode == "bad-json")


def test_json_cut_short_by_max_tokens_proves_little_and_is_not_invalid(server, prompts, tmp_path):
    """vLLM's server at --max-tokens 32 ended every JSON answer mid-object: the audit's own limit, not the server's
    fault, so the cell could not be audited (exit 2), with the reason, never "invalid" (exit 1)."""
    with Proxy(server.url, "cut-json") as proxy:
        rc, cells, out = audit(proxy.url, prompts, tmp_path, "json,stop")
    assert rc == 2
    assert [cells["json", c]["status"] for c in (1, 4)] == ["could not audit"] * 2
    assert cells["json", 1]["cut"] == len(PROMPTS) and cells["json", 1]["checked"] == 0
    assert [cells["stop", c]["status"] for c in (1, 4)] == ["clean", "clean"]
    assert "a larger --max-tokens may let it finish" in (out / "audit.md").read_text()


def test_ignored_penalties_are_inexact_against_a_reference(server, prompts, tmp_path):
    with Proxy(server.url, "drop-penalties") as proxy:
        rc, cells, _ = audit(proxy.url, prompts, tmp_path, "penalties,n", "--reference", server.url)
    assert rc == 1 and [cells["penalties", c]["status"] for c in (1, 4)] == ["inexact", "inexact"]
    assert cells["penalties", 4]["exact"] < cells["penalties", 4]["compared"]
    assert [cells["n", c]["status"] for c in (1, 4)] == ["clean", "clean"]


def test_a_refused_feature_is_unsupported_not_a_failure(server, prompts, tmp_path):
    junit = tmp_path / "junit.xml"
    with Proxy(server.url, "refuse-tools") as proxy:
        rc, cells, out = audit(proxy.url, prompts, tmp_path, "tools,json", "--junit", str(junit))
    assert rc == 0, (out / "audit.md").read_text()
    assert [cells["tools", c]["status"] for c in (1, 4)] == ["unsupported", "unsupported"]
    assert [cells["json", c]["status"] for c in (1, 4)] == ["clean", "clean"]
    suite = ET.parse(junit).getroot().find("testsuite")
    skipped = [c.get("name") for c in suite.findall("testcase") if c.find("skipped") is not None]
    assert skipped == ["feature tools (concurrency 1, chat)", "feature tools (concurrency 4, chat)"]
    assert suite.get("skipped") == "2" and suite.get("failures") == "0"


def test_an_ignored_seed_is_reported_not_failed(server, prompts, tmp_path):
    with Proxy(server.url, "drop-seed") as proxy:
        rc, cells, out = audit(proxy.url, prompts, tmp_path, "seed,n")
    assert rc == 0 and "not deterministic" in (out / "audit.md").read_text()
    assert [cells["seed", c]["status"] for c in (1, 4)] == ["not deterministic", "not deterministic"]
    assert cells["seed", 4]["agreeing"] < cells["seed", 4]["pairs"] == len(PROMPTS)


def test_settings_cut_from_the_reference_and_the_verdict():
    def plain(text, ids, reason="length"):
        return Reply(200, [{"message": {"content": text}, "token_ids": ids, "finish_reason": reason}])

    assert plan_of("stop", plain("abcdefgh", [1])) == {"stop": "efg"}
    assert "skip" in plan_of("stop", plain("a", [1])) and plan_of("stop", Reply(error="HTTP 500")) is None
    assert plan_of("logit_bias", plain("x", [7, 7, 9, 0], "stop")) == {"token": 9}  # not the first, not the EOS
    assert plan_of("logit_bias", plain("x", [7, 0], "stop")) == {"token": 7}
    assert "skip" in plan_of("logit_bias", plain("x", None)) and plan_of("json", None) == {}
    cells = [{"feature": "seed", "concurrency": 4, "status": s} for s in ("not deterministic", "could not audit")]
    assert matrix_verdict(cells)[0] == 0
    assert matrix_verdict(cells + [{"feature": "n", "concurrency": 1, "status": "could not audit"}])[0] == 2
    assert matrix_verdict(cells + [{"feature": "n", "concurrency": 4, "status": "inexact"}]) == (
        1, "features not clean: n at concurrency 4 (inexact)")


def test_feature_names_and_the_schema_check():
    assert parse_features("all") == list(FEATURES) and parse_features("stop, n,stop") == ["stop", "n"]
    for bad in ("", "json,xml"):
        with pytest.raises(ValueError, match="--features takes"):
            parse_features(bad)
    assert schema_problem({"a": 3, "b": "x"}) is None
    assert "not of type integer" in schema_problem({"a": "3", "b": "x"})
    assert "not of type integer" in schema_problem({"a": True, "b": "x"})
    assert "keys" in schema_problem({"a": 3}) and "keys" in schema_problem({"a": 3, "b": "x", "c": 1})
    assert "not a JSON object" in schema_problem([1]) and SCHEMA["required"] == ["a", "b"]


@pytest.mark.parametrize("flags,message", [
    (["--features", "json"], "--features applies to the endpoint audit"),
    (["--endpoint", "http://127.0.0.1:9", "--features", "xml"], "--features takes"),
    (["--endpoint", "http://127.0.0.1:9", "--features", "json", "--repeat", "2"], "leave out --repeat"),
])
def test_feature_flag_errors(flags, message, capsys):
    assert main(["audit", *flags]) == 2
    assert message in capsys.readouterr().err
