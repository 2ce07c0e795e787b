"""``batchspec loadtest`` against a real tiny server: the report (JSON + PNG), its percentiles and its counts, and
load shedding (429) that loses no accepted request."""

import json

import pytest
import servekit

from batchspec.cli import main
from batchspec.serve.app import create_app
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
    for key in ("ttft_s", "tpot_s", "e2e_s", "in_flight_at_arrival"):
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
