"""The benchmark runs every engine next to HF generate and reports exact match; no timing assertions."""

import json

import tiny

from batchspec.bench import bench, parse_engine, plot, to_markdown
from batchspec.cli import main


def test_bench_rows_and_exact_match(tmp_path):
    t, d = tiny.target("llama"), tiny.draft("llama")
    prompts = tiny.prompts(6, seed=4)
    engines = ["plain", "slotmask:fixed", "eqspec", "slotmask-lookup"]
    rows = bench(t, d, prompts, engines=engines, batch_sizes=[1, 4], max_tokens=16, num_draft_tokens=3, repeats=2)
    by = {(r.engine, r.batch_size): r for r in rows}
    assert set(by) == {("hf", 1), ("hf", 4)} | {(e, b) for e in engines for b in (1, 4)}
    for (eng, bs), r in by.items():
        assert r.exact_match == 1.0, (eng, bs)
        assert eng == "hf" or r.signature == "clean"
        assert r.tokens == 6 * 16 and r.tokens_per_second > 0
        if eng != "hf":
            assert set(r.stages) >= {"prefill", "draft", "verify", "align"}
            assert 0 <= r.alignment_overhead < 1
            # two interleaved runs: each engine's speed over plain's in the same run, median within the range
            assert r.repeats == 2 and r.vs_plain_range[0] <= r.vs_plain <= r.vs_plain_range[1]
            assert eng != "plain" or r.vs_plain == 1.0
        else:
            assert r.vs_plain is None
    assert by[("slotmask:fixed", 4)].mean_accepted_length > 1.0 and by[("plain", 4)].mean_accepted_length == 1.0
    assert by[("slotmask:fixed", 4)].efficiency is not None
    md = to_markdown(rows)
    assert md.count("\n") == len(rows) + 2
    assert [p.exists() for p in plot(rows, tmp_path)] == [True, True]


def test_bench_refuses_no_repeats():
    import pytest

    with pytest.raises(ValueError, match="repeats"):
        bench(tiny.target("llama"), None, tiny.prompts(2), engines=["plain"], batch_sizes=[1], repeats=0)


def test_bench_flags_a_faulty_engine():
    t, d = tiny.target("llama"), tiny.draft("llama")
    rows = bench(t, d, tiny.prompts(6, seed=4), engines=["slotmask@continuous", "eqspec@exspec",
                                                         "fault:bsp-keep-rejected-kv"],
                 batch_sizes=[2], max_tokens=16, num_draft_tokens=3, hf=False)
    by = {r.engine: r for r in rows}
    for eng in ("slotmask@continuous", "eqspec@exspec"):
        assert by[eng].exact_match == 1.0 and by[eng].signature == "clean"
    assert 0 <= by["eqspec@exspec"].grouping_rate <= 1 and by["eqspec@exspec"].stages["schedule"] > 0
    assert by["slotmask@continuous"].grouping_rate is None
    assert by["fault:bsp-keep-rejected-kv"].exact_match < 1.0
    assert by["fault:bsp-keep-rejected-kv"].signature == "kv-cache drift"


def test_parse_engine():
    assert parse_engine("plain", None)["draft"] is None
    assert parse_engine("eqspec-lookup@static", None) == {"draft": "prompt-lookup", "layout": "eqspec", "fault": None,
                                                           "scheduler": "static", "speculation": "adaptive"}
    assert parse_engine("slotmask-lookup:fixed@continuous", None)["speculation"] == "fixed"
    assert parse_engine("fault:bsp-stale-positions", "d")["speculation"] == "fixed"  # as the engines it reproduces
    assert parse_engine("fault:bsp-stale-positions:adaptive", "d")["fault"] == "bsp-stale-positions"
    import pytest

    with pytest.raises(ValueError, match="needs a draft"):
        parse_engine("slotmask", None)
    with pytest.raises(ValueError, match="unknown engine"):
        parse_engine("paged", None)


def test_bench_cli(tmp_path):
    target_dir, draft_dir = tiny.save_dir(tmp_path / "m")
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6 w7 w5 w6\nw9 w10\nw11 w12 w13 w14 w15 w16\n")
    out = tmp_path / "bench"
    rc = main(["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
               "--engines", "plain,slotmask,slotmask@exspec", "--batch-sizes", "1,2", "--max-tokens", "8",
               "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "bench.json").read_text())
    assert {r["engine"] for r in rows} == {"hf", "plain", "slotmask", "slotmask@exspec"}
    assert all(r["exact_match"] == 1.0 for r in rows)
    for png in ("throughput.png", "alignment_overhead.png", "grouping_rate.png"):
        assert (out / png).exists()


def test_bench_cli_truncate_makes_identical_lengths(tmp_path, capsys):
    target_dir, draft_dir = tiny.save_dir(tmp_path / "m")
    prompts = tmp_path / "p.txt"
    prompts.write_text("w5 w6 w7 w5 w6\nw9\nw11 w12 w13 w14 w15 w16\n")
    out = tmp_path / "bench"
    rc = main(["bench", "--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
               "--engines", "plain@exspec", "--batch-sizes", "2", "--max-tokens", "6", "--truncate", "4",
               "--no-hf", "--out", str(out)])
    assert rc == 0
    rows = {r["engine"]: r for r in json.loads((out / "bench.json").read_text())}
    assert rows["plain@exspec"]["grouping_rate"] == 1.0  # two prompts cut to 4 tokens, decoded in step
    assert main(["bench", "--target", str(target_dir), "--prompts", str(prompts), "--engines", "plain",
                 "--truncate", "400", "--out", str(out)]) == 2
    assert "no prompt has 400 tokens" in capsys.readouterr().err
