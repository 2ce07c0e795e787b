"""A reproducer per drift found against a baseline: ``repro/<prompt>-<concurrency>.json`` (the request exactly as
sent, those that ran concurrently with it, the two token sequences, the first divergent position and the margin
there) and ``.py`` next to it, a self-contained script (standard library only) that sends them again and says whether
the divergence shows."""

from __future__ import annotations

import json
import re

SCRIPT = '''"""Replays one divergence that batchspec audit --against found: sends the request together with those
that ran concurrently with it and says whether its tokens still differ from the baseline's. Usage: python {name} [URL]
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


def main():
    url = sys.argv[1] if len(sys.argv) > 1 else CASE["url"]
    others = [threading.Thread(target=send, args=(url, b)) for b in CASE["concurrent"]]
    for t in others:
        t.start()
    try:
        got = send(url, CASE["request"])
    except Exception as e:
        print("the request failed:", e)
        return 2
    for t in others:
        t.join()
    base = CASE["baseline_tokens"]
    j = next((k for k, (a, b) in enumerate(zip(got, base)) if a != b), min(len(got), len(base)))
    if got == base:
        print("no divergence: the tokens are the baseline's")
        return 0
    print(f"divergence shows at token {{j}}: {{got[j:j + 1]}} where the baseline has {{base[j:j + 1]}}"
          f" (the audit saw it at token {{CASE['first_divergence']}})")
    return 1


if __name__ == "__main__":
    sys.exit(main())
'''


def file_stem(name: str, concurrency: int) -> str:
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', str(name))[:60] or 'prompt'}-{concurrency}"


def write_repros(out, cases: list[dict], new: dict, saved: dict) -> dict:
    """A reproducer (``.json`` and ``.py``) in ``out/repro`` for each drifted case of ``cases``; returns
    (prompt, run) -> its ``.json`` path relative to ``out``."""
    from ...files import write_atomic
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
        stem = file_stem(c["name"], run["concurrency"])
        text = json.dumps(case, indent=1)
        (out / "repro").mkdir(exist_ok=True)
        write_atomic(out / "repro" / f"{stem}.json", lambda f, t=text: f.write(t))
        script = SCRIPT.format(name=f"{stem}.py", case=json.dumps(case))
        write_atomic(out / "repro" / f"{stem}.py", lambda f, t=script: f.write(t))
        made[(i, c["run"])] = f"repro/{stem}.json"
    return made
