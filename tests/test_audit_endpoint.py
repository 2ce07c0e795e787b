"""The endpoint audit: an OpenAI-compatible server audited against the local batch-size-1 oracle at several levels of
concurrency; clean for batchspec's server, not clean (exit status 1) for a server with an injected fault."""

import json

import pytest
import servekit
import tiny

from batchspec.audit.endpoint import RETOKENIZED, TOKEN_IDS, EndpointClient, audit_endpoint, endpoint_markdown
from batchspec.cli import main

PROMPTS = tiny.prompts(8, seed=11, lo=2, hi=30)


@pytest.fixture(scope="module")
def broken():
    with servekit.faulty("dsd-draft-token-accepted") as s:
        yield s


def test_endpoint_audit_clean(good):
    report = audit_endpoint(good.url, tiny.target(), PROMPTS, concurrency=[1, 4], max_tokens=12, cache_dir=False)
    assert [(r.engine, r.batch_size) for r in report.rows] == [("endpoint:tiny", 1), ("endpoint:tiny", 4)]
    for r in report.rows:
        assert r.clean and r.signature == "clean" and r.exact_match == 1.0
        assert r.outputs == [tiny.oracle(tiny.target(), p, 12) for p in PROMPTS]
    levels = report.meta["endpoint"]["levels"]
    assert [lv["token_source"] for lv in levels] == [TOKEN_IDS, TOKEN_IDS]
    assert all(lv["failed"] == 0 and lv["prompt_mismatches"] == 0 for lv in levels)
    assert "| concurrency |" in endpoint_markdown(report)


def test_endpoint_audit_catches_a_broken_server(broken):
    report = audit_endpoint(broken.url, tiny.target(), PROMPTS, concurrency=[1, 4], model="tiny", max_tokens=12,
                            cache_dir=False)
    assert all(not r.clean and r.signature != "clean" and r.synchronization > 0 for r in report.rows)


def test_endpoint_audit_sees_a_bug_that_needs_concurrency(padding_bug):
    """Padding visible to attention only corrupts rows that share a batch: clean alone, caught under concurrency."""
    report = audit_endpoint(padding_bug.url, tiny.target(), PROMPTS, concurrency=[1, 4], max_tokens=12,
                            cache_dir=False)
    alone, together = report.rows
    assert alone.clean and not together.clean and together.synchronization > 0


def test_endpoint_audit_cli(good, broken, tmp_path):
    prompts = tmp_path / "p.jsonl"
    texts = ["w5 w9 w14", "w22 w41 w7 w7 w8", "w60", "w33 w34 w35 w36"]
    prompts.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n" for i, t in enumerate(texts)))
    model_dir = tmp_path / "model"  # the same target, saved with the tokenizer, so the CLI loads what the server runs
    tiny.target().save_pretrained(model_dir)
    servekit.tokenizer().save_pretrained(model_dir)
    common = ["audit", "--target", str(model_dir), "--prompts", str(prompts), "--concurrency", "1,4",
              "--max-tokens", "10", "--dtype", "float64"]
    out = tmp_path / "good"
    assert main([*common, "--endpoint", good.url, "--out", str(out)]) == 0
    data = json.loads((out / "audit.json").read_text())
    assert [r["signature"] for r in data["rows"]] == ["clean", "clean"]
    assert data["meta"]["endpoint"]["api"] == "completions"
    assert (out / "audit.png").stat().st_size > 1000 and "concurrency" in (out / "audit.md").read_text()
    out = tmp_path / "chat"  # the server applies the chat template, answers streamed
    assert main([*common, "--endpoint", good.url, "--api", "chat", "--stream", "--out", str(out)]) == 0
    levels = json.loads((out / "audit.json").read_text())["meta"]["endpoint"]["levels"]
    assert all(lv["prompt_mismatches"] == 0 and lv["token_source"] == TOKEN_IDS for lv in levels)
    assert main([*common, "--endpoint", broken.url, "--out", str(tmp_path / "bad")]) == 1


def test_retokenized_text_is_flagged(good):
    """A server that returns only text: its text is encoded again locally, and the source says so."""
    tok = servekit.tokenizer()

    class TextOnly(EndpointClient):
        def _body(self, ids):
            body = super()._body(ids)
            body.pop("return_token_ids")
            return body

    client = TextOnly(good.url, "tiny", tok, max_tokens=6)
    try:
        for stream in (False, True):
            client.stream = stream
            a = client.one([5, 9, 14])
            assert a.source == RETOKENIZED and a.ids == tiny.oracle(tiny.target(), [5, 9, 14], 6)
    finally:
        client.close()
