"""A reproducer per drift found against a baseline, or per divergence found by the endpoint audit:
``repro/<prompt>-<concurrency>.json`` (the request exactly as sent, those that ran concurrently with it, the two token
sequences, the first divergent position and the margin there) and ``.py`` next to it, a self-contained script
(standard library only) that sends them again and says whether the divergence shows."""

from __future__ import annotations

import json
import re

SCRIPT = '''"""Replays one divergence that {found} found: sends the request together with those that ran
concurrently with it and says whether its tokens still differ from the {against}'s. Usage: python {name} [URL]
(default: the server audited; $BATCHSPEC_API_KEY is sent as the bearer key when set). Exit status 1: the divergence
shows; 0: it does not; 2: the request failed."""
import json
import os
import sys
import threading
import urllib.request

CASE = json.loads({case!r})


def send(url, body):
    key = os.environ.get("BATCHSPEC_API_KEY")
    headers = {{"Content-Type": "application/json", **({{"Authorization": "Bearer " + key}} if key else {{}})}}
    base = url.rstrip("/") if url.rstrip("/").endswith("/v1") else url.rstrip("/") + "/v1"
    req = urllib.request.Request(base + CASE["path"], json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=600) as r:
        if not body.get("stream"):
            return json.load(r)["choices"][0]["token_ids"]
        ids = []
        for line in r:
            data = line.decode().strip()[5:].strip() if line.startswith(b"data:") else "[DONE]"
            if data != "[DONE]":
                ids += sum((c.get("token_ids") or [] for c in json.loads(data).get("choices", [])), [])
        return ids


def once(url):
    """The request's tokens (or its error), sent at the same moment as those that ran concurrently with it."""
    bodies = [CASE["request"], *CASE["concurrent"]]
    gate, got = threading.Barrier(len(bodies)), {{}}

    def go(k, body):
        gate.wait()
        try:
            got[k] = send(url, body)
        except Exception as e:
            got[k] = e

    threads = [threading.Thread(target=go, args=(k, b)) for k, b in enumerate(bodies)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got[0]


def main():
    url = sys.argv[1] if len(sys.argv) > 1 else CASE["url"]
    base, against, tries = CASE["baseline_tokens"], CASE.get("against", "baseline"), CASE.get("tries", 1)
    for attempt in range(1, tries + 1):  # a fault that needs a batch shows only when the requests meet in one
        got = once(url)
        if isinstance(got, Exception):
            print("the request failed:", got)
            return 2
        if CASE.get("max_tokens") is not None:  # as the audit compared it: cut after the first stop token
            got = got[:CASE["max_tokens"]]
            got = got[:next((k + 1 for k, t in enumerate(got) if t in CASE["stops"]), len(got))]
        if got != base:
            j = next((k for k, (a, b) in enumerate(zip(got, base)) if a != b), min(len(got), len(base)))
            print(f"divergence shows at token {{j}}: {{got[j:j + 1]}} where the {{against}} has {{base[j:j + 1]}}"
                  f" (the audit saw it at token {{CASE['first_divergence']}}; try {{attempt}} of {{tries}})")
            return 1
    print(f"no divergence in {{tries}} tries: the tokens are the {{against}}'s")
    return 0

if __name__ == "__main__":
    sys.exit(main())
'''


TRIES = 5  # replays of a divergence seen under concurrency: whether the requests meet in one batch is up to the server


def file_stem(name: str, concurrency: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', str(name))[:60] or 'prompt'}-{concurrency}"


def write_repros(out, cases: list[dict], new: dict, saved: dict) -> dict:
    """A reproducer (``.json`` and ``.py``) in ``out/repro`` for each drifted case of ``cases``; returns
    (prompt, run) -> its ``.json`` path relative to ``out``."""
    from ...serve.client import api_path

    settings = new["fingerprint"]["settings"]
    made = {}
    for c in [c for c in cases if c["status"] == "drift"]:
        run, i = new["runs"][c["run"]], c["prompt"]
        a, old = run["answers"][i], saved["runs"][c["run"]]["answers"][i]
        case = {"url": settings["url"], "path": api_path(run["api"]), "prompt": c["name"],
                "concurrency": run["concurrency"], "request": a["request"],
                "concurrent": [run["answers"][j]["request"] for j in a["concurrent"]],
                "tokens": a["token_ids"], "baseline_tokens": old["token_ids"],
                "first_divergence": c["drift"]["index"], "margin": c["drift"]["margin"],
                "class": c["drift"]["class"], "summary": c["summary"]}
        made[(i, c["run"])] = _write(out, case, "batchspec audit --against")
    return made


def divergence_cases(run, divergences, judge) -> list[dict]:
    """What a reproducer of each of ``divergences`` (one level's, ``run``: its ``ConcurrentRun``) needs: the request
    as sent and those under way with it, the endpoint's tokens and the reference's (``judge.refs``), the first
    divergent index, the margin there (None when not known) and the stops and max_tokens the audit cut outputs at."""
    from ...serve.client import api_path

    client, out = run.client, []
    for d in divergences:
        i = d.prompt
        out.append({"url": client.url, "path": api_path(client.api), "prompt": i, "concurrency": run.concurrency,
                    "request": client._body(run.prompts[i]),
                    "concurrent": [client._body(run.prompts[j]) for j in run.concurrent_with(i)],
                    "tokens": run.answers[i].ids, "baseline_tokens": judge.refs[i], "against": "reference",
                    "tries": TRIES if run.concurrent_with(i) else 1,
                    "first_divergence": d.index, "margin": d.margin, "class": d.cls,
                    "stops": list(judge.stops), "max_tokens": judge.max_tokens,
                    "summary": f"token {d.index} is {d.engine_token} where the reference has {d.oracle_token} "
                               f"({d.cls})"})
    return out


def write_audit_repros(out, levels: list[dict], names) -> dict:
    """A reproducer in ``out/repro`` for each divergence of an endpoint audit: the ``repro_cases`` of each level's
    summary (taken out of it, so that audit.json stays small); returns (prompt, concurrency) -> its ``.json`` path
    relative to ``out``."""
    made = {}
    for lv in levels:
        for c in lv.pop("repro_cases", []):
            made[(c["prompt"], c["concurrency"])] = _write(out, {**c, "prompt": names[c["prompt"]]}, "batchspec audit")
    return made


def _write(out, case: dict, found: str) -> str:
    """``case`` as ``repro/<prompt>-<concurrency>.json`` and its replay script next to it; the ``.json``'s path
    relative to ``out``. ``found``: the command that found the divergence."""
    from ...files import write_atomic

    stem = file_stem(case["prompt"], case["concurrency"])
    text = json.dumps(case, indent=1)
    (out / "repro").mkdir(exist_ok=True)
    write_atomic(out / "repro" / f"{stem}.json", lambda f, t=text: f.write(t))
    script = SCRIPT.format(name=f"{stem}.py", case=json.dumps(case), found=found,
                           against=case.get("against", "baseline"))
    write_atomic(out / "repro" / f"{stem}.py", lambda f, t=script: f.write(t))
    return f"repro/{stem}.json"
