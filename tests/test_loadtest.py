"""``batchspec loadtest`` against a real tiny server: the report (JSON + PNG), its percentiles and its counts, load
shedding (429) that loses no accepted request, and conversations replayed turn by turn (``--multi-turn``)."""

import json
import time

import httpx
import pytest
import servekit

from batchspec.cli import main
from batchspec.cli.loadtest import pick_prompts
from batchspec.serve.app import create_app
from batchspec.serve.client import MAX_ANSWER_BYTES
from batchspec.serve.loadtest import LoadConfig, in_flight_at_arrival, percentiles, run_load, write_report
from batchspec.serve.server import ServerThread

PROMPTS = ["w5 w9 w14 w3", "w22 w41", "w60 w61 w62 w63 w64 w65 w66", "w7"]


@pytest.fixture(scope="module")
def server():
    with servekit.served() as s:
        yield s


def test_percentiles():
    p = percentiles([4.0, 1.0, 3.0, 2.0, None])
    assert p["n"] == 4 and p["p50"] == pytest.approx(2.5) and p["mean"] == pytest.approx(2.5)
    assert p["p90"] == pytest.approx(3.7) and p["p99"] == pytest.approx(3.97)
    assert p["max"] == 4.0 and percentiles([])["p50"] is None


def test_in_flight_at_arrival():
    recs = [{"status": "ok", "start": s, "e2e": d} for s, d in ((0.0, 1.0), (0.5, 1.0), (1.2, 0.1), (2.0, 0.5))]
    recs.append({"status": "429", "start": 0.7, "e2e": None})
    assert in_flight_at_arrival(recs) == [1, 2, 2, 1]


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_poisson_load_report(server, tmp_path, api):
    cfg = LoadConfig(url=server.url, prompts=PROMPTS, rate=40.0, requests=10, max_tokens=8, api=api, seed=3)
    summary = run_load(cfg)
    c = summary["requests"]
    assert c == {"sent": 10, "ok": 10, "rejected_429": 0, "rejected_503": 0, "errors": 0, "accepted": 10,
                 "accepted_not_completed": 0}
    assert summary["model"] == "tiny"  # found through /v1/models
    assert summary["throughput"]["output_tokens"] == 80  # the usage the server reported: 8 tokens each
    for key in ("ttft_s", "tpot_s", "gap_s", "e2e_s", "in_flight_at_arrival"):
        s = summary[key]
        assert s["n"] == 10 and 0 < s["p50"] <= s["p90"] <= s["p99"]
    assert all(r["ttft"] <= r["e2e"] for r in summary["records"])
    js, png = write_report(summary, tmp_path)
    assert json.loads(js.read_text())["requests"]["ok"] == 10
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_loadtest_cli(server, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out"
    rc = main(["loadtest", "--url", server.url + "/v1", "--concurrency", "3", "--requests", "6", "--prompts",
               str(prompts), "--max-tokens", "5", "--api", "completions", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "loadtest.json").read_text())
    assert data["requests"]["ok"] == 6 and data["config"]["concurrency"] == 3
    assert data["ttft_s"]["p99"] is not None and data["tpot_s"]["p50"] is not None
    assert (out / "loadtest.png").stat().st_size > 1000
    assert "TTFT" in capsys.readouterr().out


def test_overload_is_shed_and_accepted_requests_complete(tmp_path):
    """One row and no queue: concurrent clients get 429s, and every accepted request still completes."""
    app = create_app(servekit.llm(batch_size=1), model_name="tiny", max_queue=0)
    with ServerThread(app) as s:
        servekit.slow(app.state.worker, 0.01)
        summary = run_load(LoadConfig(url=s.url, prompts=PROMPTS, concurrency=4, requests=12, max_tokens=6,
                                      api="completions"))
    c = summary["requests"]
    assert c["rejected_429"] > 0 and c["errors"] == 0 and c["accepted_not_completed"] == 0
    assert c["ok"] + c["rejected_429"] == 12 and c["ok"] >= 1


def test_unreachable_server_is_an_error(tmp_path, capsys):
    rc = main(["loadtest", "--url", "http://127.0.0.1:9", "--rate", "5", "--requests", "2", "--model", "m",
               "--out", str(tmp_path)])
    assert rc == 2  # connection refused before any load: one line with the fix, no report
    assert "is the server running?" in capsys.readouterr().err
    assert not (tmp_path / "loadtest.json").exists()


class Recording:
    """An ASGI app around ``app`` that keeps the JSON body of every chat request it passes on."""

    def __init__(self, app):
        self.app, self.bodies = app, []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
            return await self.app(scope, receive, send)
        chunks = []

        async def recorded():
            msg = await receive()
            if msg["type"] == "http.request":
                chunks.append(msg.get("body", b""))
            if msg["type"] == "http.request" and not msg.get("more_body"):
                self.bodies.append(json.loads(b"".join(chunks)))
            return msg

        await self.app(scope, recorded, send)


def prefix_counters(url) -> dict:
    text = httpx.get(url + "/metrics").text
    return {name: float(line.split()[-1]) for line in text.splitlines()
            for name in ("hits", "tokens") if line.startswith(f"batchspec_prefix_cache_{name}_total ")}


def test_multi_turn_sends_the_history_and_hits_the_prefix_cache():
    """Turn 2 goes with turn 1 and the server's own answer as history; its prompt starts with turn 1's, whose cached
    blocks it reuses; the report splits TTFT, TPOT and throughput by turn."""
    tok = servekit.tokenizer()
    # 20 words: turn 1's templated prompt holds a whole 16-token block, a different one in each conversation
    convs = [[" ".join(f"w{10 + c + i}" for i in range(20)), f"w{50 + c} w{60 + c}"] for c in range(3)]
    app = Recording(create_app(servekit.llm(), model_name="tiny"))
    with ServerThread(app) as s:
        before = prefix_counters(s.url)
        summary = run_load(LoadConfig(url=s.url, prompts=convs, concurrency=2, requests=3, max_tokens=6,
                                      multi_turn=True))
        after = prefix_counters(s.url)
        answers = [httpx.post(s.url + "/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": t1}]},
            timeout=60).json()["choices"][0]["message"]["content"] for t1, _ in convs]
    assert summary["requests"]["sent"] == summary["requests"]["ok"] == 6
    assert [(r["index"], r["turn"]) for r in summary["records"]] == [(i, t) for i in range(3) for t in (1, 2)]
    sent = {b["messages"][0]["content"]: b["messages"] for b in app.bodies if len(b["messages"]) == 3}
    for (t1, t2), answer in zip(convs, answers):
        assert sent[t1] == [{"role": "user", "content": t1}, {"role": "assistant", "content": answer},
                            {"role": "user", "content": t2}]
    for rec in summary["records"]:  # the prompt the server templated: the conversation so far
        t1 = convs[rec["index"]][0]
        messages = sent[t1] if rec["turn"] == 2 else [{"role": "user", "content": t1}]
        assert rec["prompt_tokens"] == len(tok.apply_chat_template(messages, add_generation_prompt=True,
                                                                   return_dict=False))
    assert after["hits"] - before["hits"] == 3  # each second turn, and no first one
    assert after["tokens"] - before["tokens"] == 3 * 16
    assert set(summary["turns"]) == {"1", "2"}
    for turn in summary["turns"].values():
        assert turn["sent"] == 3 and turn["throughput"]["output_tokens"] == 18
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            assert turn[key]["n"] == 3 and 0 < turn[key]["p50"] <= turn[key]["max"]
    assert summary["throughput"]["output_tokens"] == 36


def test_pick_prompts(tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [{"category": c, "turns": [f"{c}{i} first", f"{c}{i} second"][: 1 + (i > 0)]}  # a0, b0: one turn
            for c in "ab" for i in range(3)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert pick_prompts(path, [], 0, False) == ["a0 first", "a1 first", "a2 first", "b0 first", "b1 first", "b2 first"]
    assert pick_prompts(path, [], 2, False) == ["a2 first", "b2 first"]  # the first 2 of each category left out
    assert pick_prompts(path, ["b"], 1, False) == ["b1 first", "b2 first"]
    assert pick_prompts(path, ["a"], 0, True) == [["a1 first", "a1 second"], ["a2 first", "a2 second"]]  # one turn: out
    with pytest.raises(ValueError, match="no prompt record of category c"):
        pick_prompts(path, ["a", "c"], 0, False)
    with pytest.raises(ValueError, match="no prompt record with two turns or more left"):
        pick_prompts(path, [], 3, True)
    text = tmp_path / "p.txt"
    text.write_text("one\ntwo\nthree\n")
    assert pick_prompts(text, [], 1, False) == ["two", "three"]


def test_multi_turn_cli(server, tmp_path, capsys):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"category": c, "turns": [f"w{i} w{i + 1}", f"w{i + 2}"]}) + "\n"
                            for c in ("x", "y") for i in range(4)))
    out = tmp_path / "out"
    rc = main(["loadtest", "--url", server.url, "--concurrency", "2", "--requests", "3", "--prompts", str(path),
               "--categories", "y", "--skip", "2", "--multi-turn", "--max-tokens", "4", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "loadtest.json").read_text())
    assert data["config"]["multi_turn"] and data["config"]["prompts"] == 2  # y's last two records
    assert data["requests"]["ok"] == 6 and data["turns"]["2"]["ttft_s"]["n"] == 3
    shown = capsys.readouterr().out
    assert "TTFT turn 2" in shown and "output tok/s turn 2" in shown
    rc = main(["loadtest", "--url", server.url, "--concurrency", "1", "--prompts", str(path), "--multi-turn",
               "--api", "completions", "--out", str(out)])
    assert rc == 2 and "--multi-turn" in capsys.readouterr().err


class Hostile(servekit.FakeServer):
    """``mode``: "trickle" (a stream sent a byte at a time, no line end, until the test ends), "huge" (a stream whose
    one line is larger than ``MAX_ANSWER_BYTES``), "models-trickle" (``/v1/models`` trickles its body)."""

    def __init__(self, mode):
        self.mode = mode
        super().__init__(_HostileHandler)


class _HostileHandler(servekit.JsonHandler):
    protocol_version = "HTTP/1.0"

    def trickle(self, first: bytes):
        self.wfile.write(first)
        while not self.server.fake.release.wait(0.1):
            try:
                self.wfile.write(b"x")
                self.wfile.flush()
            except OSError:
                return

    def do_GET(self):
        if self.server.fake.mode != "models-trickle":
            return self.send_json(200, {"object": "list", "data": [{"id": "m", "object": "model"}]})
        self.send_response(200)
        self.send_header("Content-Length", "1000000")
        self.end_headers()
        self.trickle(b'{"data": [')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if self.server.fake.mode == "huge":
            return self.wfile.write(b"data: " + b"x" * (MAX_ANSWER_BYTES + 1) + b"\n\n")
        self.trickle(b"data: {")


def _timed_load(url, timeout, *flags, tmp_path):
    start = time.monotonic()
    rc = main(["loadtest", "--url", url, "--concurrency", "2", "--requests", "2", "--prompts", str(tmp_path / "p.txt"),
               "--timeout", str(timeout), "--api", "completions", "--out", str(tmp_path / "out"), *flags])
    return rc, time.monotonic() - start


@pytest.mark.parametrize("mode,flags", [("trickle", ["--model", "m"]), ("models-trickle", [])])
def test_a_trickling_server_does_not_hold_the_load_test_past_its_timeout(tmp_path, capsys, mode, flags):
    """httpx's timeout bounds each read; a byte every 0.1 s never trips it, yet the run ends by --timeout."""
    (tmp_path / "p.txt").write_text("\n".join(PROMPTS) + "\n")
    with Hostile(mode) as fake:
        rc, seconds = _timed_load(fake.url, 1.5, *flags, tmp_path=tmp_path)
    err = capsys.readouterr().err
    if mode == "trickle":
        data = json.loads((tmp_path / "out" / "loadtest.json").read_text())
        assert rc == 1 and data["requests"]["errors"] == 2 and data["wall_s"] < 2.5, data
        assert "no whole answer within 1.5 s" in data["errors_sample"][0]
    else:
        assert rc == 2 and "sent no whole /v1/models within 1.5 s" in err and seconds < 2.5, err


def test_an_answer_over_the_size_limit_is_an_error_not_read():
    with Hostile("huge") as fake:
        summary = run_load(LoadConfig(url=fake.url, model="m", prompts=PROMPTS, concurrency=1, requests=1,
                                      api="completions", timeout=30))
    assert summary["requests"]["errors"] == 1 and "larger than" in summary["errors_sample"][0], summary
