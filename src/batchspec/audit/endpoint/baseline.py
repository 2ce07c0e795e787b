"""Baselines of a server: every prompt sent at every level of concurrency, its tokens, finish_reason and top
log-probabilities recorded with the server's fingerprint (``record``, saved as JSON); later the same requests sent
again and compared with them (``record(..., saved=...)`` then ``cases``), so a restart, an upgrade or a config change
is checked in one command. Each prompt x setting is one case: ``clean``, ``drift`` (its tokens or finish_reason
changed: the first divergent position, and from the baseline's log-probabilities whether the two tokens were a
near-tie), ``logprobs`` (the log-probability checks of ``logprob_checks`` failed) or ``failed``."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .answer import first_difference, short
from .client import ConcurrentRun, EndpointClient, model_name
from .flows import EndpointAudit, prompt_items, reference_tokenizer
from .logprob_checks import answer_faults, level_drift, positions

FORMAT = "batchspec endpoint baseline"
VERSION = 1
CLEAN, DRIFT, LOGPROBS, FAILED = "clean", "drift", "logprobs", "failed"
NEAR_TIE, NOT_NEAR_TIE, UNATTRIBUTED = "near-tie", "not a near-tie", "unattributed"
_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "return_tokens_as_token_ids")


def _key(item) -> str:
    return json.dumps(item)


@dataclass
class ReplayClient(EndpointClient):
    """A client that sends, for each prompt, the body recorded in a baseline (``bodies``: ``_key(prompt)`` -> body)
    instead of building one; the log-probability fields are dropped once the server has refused them."""

    bodies: dict | None = None

    def _body(self, ids) -> dict:
        if self.bodies is None:
            return super()._body(ids)
        body = dict(self.bodies[_key(ids)])
        if not self.logprobs:
            for name in _LOGPROB_FIELDS:
                body.pop(name, None)
        return body


def fingerprint(url: str, api_key: str | None, timeout: float, settings: dict) -> dict:
    """What the server says of itself: its ``/v1/models`` answer and its version headers (``server``, any header
    naming a version), with the ``settings`` the audit used."""
    import httpx

    from ...serve.client import api_base, auth_headers

    try:
        r = httpx.get(api_base(url) + "/models", headers=auth_headers(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise ConnectionError(f"cannot reach {url}: {type(e).__name__}") from None
    try:
        models = r.json()
    except ValueError:
        models = r.text[:2000]
    headers = {k.lower(): v for k, v in r.headers.items() if k.lower() == "server" or "version" in k.lower()}
    return {"models": models, "headers": headers, "settings": settings}


def record(audit: EndpointAudit, names=None, saved: dict | None = None) -> dict:
    """Send every prompt of ``audit`` at each of its levels, asking for ``top_logprobs`` as token ids, and return the
    baseline (``FORMAT``): its fingerprint and per level each answer with its request and what ran concurrently with
    it. ``saved``: a baseline whose requests are sent again, exactly (its prompts, levels and bodies)."""
    audit = audit.checked()
    model = model_name(audit.url, audit.model, audit.api_key, audit.timeout)
    tok, bodies = reference_tokenizer(audit.target, audit.tokenizer), None
    if saved is not None:
        items, texts = saved["prompts"], {}
        bodies = {_key(a["prompt"]): a["request"] for run in saved["runs"] for a in run["answers"]}
    else:
        items, texts = prompt_items(audit.prompts, tok, audit.api, audit.chat_template)
    client = audit.client(audit.url, model, tokenizer=tok, stop_token_ids=[int(s) for s in audit.stop_token_ids],
                          texts=texts, logprobs=audit.top_logprobs, bodies=bodies, kind=ReplayClient)
    settings = {"url": audit.url, "model": model, "api": audit.api, "stream": audit.stream,
                "max_tokens": audit.max_tokens, "concurrency": list(audit.concurrency),
                "top_logprobs": audit.top_logprobs, "stop_token_ids": [int(s) for s in audit.stop_token_ids]}
    try:
        print_ = fingerprint(audit.url, audit.api_key, audit.timeout, settings)
        runs = [_level(client, items, c) for c in audit.concurrency]
    finally:
        client.close()
    names = [str(n) for n in names] if names is not None else (saved or {}).get("names") or [
        str(i) for i in range(len(items))]
    return {"format": FORMAT, "version": VERSION, "fingerprint": print_, "names": names, "prompts": items,
            "logprobs_refused": client.logprobs_refused, "runs": runs}


def _level(client: ReplayClient, items: list, concurrency: int) -> dict:
    run = ConcurrentRun(client, items, concurrency)
    answers = run.run()
    out = []
    for i, a in enumerate(answers):
        with_it = run.concurrent_with(i)
        ids = a.ids if a.source is not None else None
        out.append({"prompt": run.prompts[i], "request": client._body(run.prompts[i]), "concurrent": with_it,
                    "token_ids": ids, "finish_reason": a.finish_reason,
                    "error": a.error or a.protocol_error, "logprobs": positions(a.raw_logprobs, ids)})
    return {"concurrency": concurrency, "api": client.api, "stream": client.stream, "seconds": run.seconds,
            "answers": out}


def load(path) -> dict:
    """A baseline written by ``save``; ``ValueError`` when the file is not one."""
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the baseline {path}: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version") != VERSION:
        raise ValueError(f"{path} is not a baseline written by batchspec audit --save (format {VERSION})")
    for run in data["runs"]:  # JSON keys are strings: the top log-probabilities' token ids again
        for a in run["answers"]:
            for p in a["logprobs"] or []:
                p[2] = {int(t): v for t, v in p[2].items()}
    return data


def save(path, data: dict) -> None:
    from ...files import write_atomic

    write_atomic(path, lambda f: f.write(json.dumps(data, indent=1)))


def _entry(pos: list | None, j: int) -> dict | None:
    """The baseline's ``{token id: log-probability}`` at position ``j``: the listed ones and the returned token's."""
    if pos is None or j >= len(pos):
        return None
    t, v, top = pos[j]
    entry = {int(a): b for a, b in top.items()}
    if v is not None:
        entry[t] = v
    return entry


def _drift(i: int, new: dict, old: dict, rel_tol: float) -> dict | None:
    """Prompt ``i``'s drift from the baseline's answer ``old`` (None: the same tokens and finish_reason)."""
    from .judges import UNATTRIBUTED as NOT_LISTED, logprob_divergence

    a, b = new["token_ids"], old["token_ids"]
    if a == b:
        if new["finish_reason"] == old["finish_reason"]:
            return None
        return {"index": None, "class": None, "margin": None,
                "summary": f"finish_reason {new['finish_reason']!r} where the baseline has {old['finish_reason']!r}"}
    j = first_difference(a, b)
    d = logprob_divergence(i, a, b, _entry(old["logprobs"], j), j, rel_tol)
    cls = NEAR_TIE if d.cls == "numerical" else UNATTRIBUTED if d.cls == NOT_LISTED else NOT_NEAR_TIE
    now = a[j] if j < len(a) else "the end"
    was = b[j] if j < len(b) else "the end"
    margin = "" if d.margin is None else f", margin {d.margin:.4g}"
    return {"index": j, "class": cls, "margin": d.margin,
            "summary": f"token {j} is {now} where the baseline has {was} ({cls}{margin})"}


def cases(new: dict, saved: dict | None, rel_tol: float) -> list[dict]:
    """One case per prompt x setting of ``new``: its status and a one-line summary; with ``saved``, compared with
    the same request's answer there (``drift``). Log-probabilities are checked when the server returned any."""
    returned = any(p[1] is not None for run in new["runs"] for a in run["answers"] for p in a["logprobs"] or [])
    base = new["runs"][min(range(len(new["runs"])), key=lambda k: new["runs"][k]["concurrency"])]
    out = []
    for k, run in enumerate(new["runs"]):
        for i, a in enumerate(run["answers"]):
            case = {"prompt": i, "name": new["names"][i], "concurrency": run["concurrency"], "api": run["api"],
                    "stream": run["stream"], "run": k, "status": CLEAN, "summary": None, "drift": None,
                    "faults": [], "near_ties": [], "length": len(a["token_ids"] or [])}
            old = saved["runs"][k]["answers"][i] if saved is not None else None
            if a["error"] or a["token_ids"] is None or (old is not None and old["token_ids"] is None):
                why = a["error"] or (old or {}).get("error") or "no token ids"
                case.update(status=FAILED, summary=f"could not audit: {why}" if a["error"] else f"baseline: {why}")
                out.append(case)
                continue
            if returned:
                pos, first = a["logprobs"] or [], base["answers"][i]["logprobs"]
                faults, case["near_ties"] = answer_faults(pos, rel_tol)
                drift = level_drift(pos, first) if run is not base and first is not None else None
                case["faults"] = faults + ([f"at concurrency {run['concurrency']}: {drift}"] if drift else [])
            case["drift"] = _drift(i, a, old, rel_tol) if old is not None else None
            if case["drift"] is not None:
                case.update(status=DRIFT, summary=case["drift"]["summary"])
            elif case["faults"]:
                case.update(status=LOGPROBS, summary="; ".join(case["faults"]))
            out.append(case)
    return out


def status(all_cases: list[dict]) -> tuple[int, str]:
    """The exit status and verdict, as the endpoint audit's: 2 no case could be audited; else 1 a case drifted,
    failed its log-probability checks or could not be sent; else 2 the median output is under ``MIN_MEDIAN_TOKENS``
    (``proved little``: too short to exercise batching); else 0, every case clean."""
    import statistics

    from .markdown import MIN_MEDIAN_TOKENS

    bad = [c for c in all_cases if c["status"] != CLEAN]
    if all_cases and all(c["status"] == FAILED for c in all_cases):
        return 2, f"could not audit: {all_cases[0]['summary']}"
    if bad:
        kinds = {s: sum(c["status"] == s for c in bad) for s in (DRIFT, LOGPROBS, FAILED)}
        return 1, "not clean: " + ", ".join(f"{n} {s}" for s, n in kinds.items() if n) + f" of {len(all_cases)} cases"
    median = statistics.median([c["length"] for c in all_cases]) if all_cases else 0
    if median < MIN_MEDIAN_TOKENS:
        return 2, (f"proved little: the median output is {median:g} tokens (under {MIN_MEDIAN_TOKENS}), too short to "
                   "exercise batching; not clean")
    return 0, f"clean: {len(all_cases)} cases"


def _models(models):
    """``/v1/models`` without its ``created`` times, which every restart renews."""
    if not isinstance(models, dict) or not isinstance(models.get("data"), list):
        return models
    return {**models, "data": [{k: v for k, v in m.items() if k != "created"} if isinstance(m, dict) else m
                               for m in models["data"]]}


def fingerprint_rows(new: dict, saved: dict) -> list[tuple[str, object, object]]:
    """Two fingerprints side by side, ``(field, now, baseline)``: ``/v1/models`` (its ``created`` times aside), each
    header, each setting."""
    a, b = new["fingerprint"], saved["fingerprint"]
    rows = [("/v1/models", _models(a["models"]), _models(b["models"]))]
    rows += [(f"header {n}", a["headers"].get(n), b["headers"].get(n))
             for n in sorted(a["headers"].keys() | b["headers"].keys())]
    rows += [(f"setting {n}", a["settings"].get(n), b["settings"].get(n))
             for n in sorted(a["settings"].keys() | b["settings"].keys())]
    return rows


def fingerprint_changes(new: dict, saved: dict) -> list[str]:
    """What differs between two fingerprints, a line each (the URL aside)."""
    return [f"{name}: {short(now, 120)} (baseline: {short(was, 120)})"
            for name, now, was in fingerprint_rows(new, saved) if now != was and name != "setting url"]


def logprob_line(all_cases: list[dict], new: dict) -> str:
    """Whether log-probabilities were checked, refused or not returned, and how many near-ties were recorded."""
    ties = sum(len(c["near_ties"]) for c in all_cases)
    lps = "refused" if new.get("logprobs_refused") else "checked" if any(
        p[1] is not None for r in new["runs"] for a in r["answers"] for p in a["logprobs"] or []) else "not returned"
    return f"Log-probabilities: {lps}; near-ties recorded: {ties}."


def baseline_markdown(all_cases: list[dict], new: dict, saved: dict | None, repros: dict) -> str:
    """The summary table first (one row per prompt x setting that is not clean, or a line when all are), then the
    fingerprint. ``repros``: (prompt, run) -> the reproducer's relative path."""
    code, verdict = status(all_cases)
    s = new["fingerprint"]["settings"]
    what = "compared with the baseline" if saved is not None else "recorded as a baseline"
    lines = [f"**Verdict: {verdict}**", "",
             f"Endpoint {s['url']} (model {s['model']}, {s['api']}{', streamed' if s['stream'] else ''}, "
             f"concurrency {', '.join(map(str, s['concurrency']))}): {len(all_cases)} cases {what}.", "",
             "| prompt | concurrency | status | first divergent token | class | margin | summary | reproducer |",
             "|---|---|---|---|---|---|---|---|"]
    for c in [c for c in all_cases if c["status"] != CLEAN][:50]:
        d = c["drift"] or {}
        margin = "-" if d.get("margin") is None else f"{d['margin']:.4g}"
        path = repros.get((c["prompt"], c["run"]))
        link = f"[{path}]({path})" if path else "-"
        summary = (c["summary"] or "").replace("|", "\\|")
        lines.append(f"| {c['name']} | {c['concurrency']} | {c['status']} | "
                     f"{'-' if d.get('index') is None else d['index']} | {d.get('class') or '-'} | {margin} | "
                     f"{summary} | {link} |")
    lines += ["", logprob_line(all_cases, new)]
    if saved is not None:
        changes = fingerprint_changes(new, saved)
        lines += ["", "Fingerprint: " + ("unchanged." if not changes else "changed:"), *[f"- {x}" for x in changes]]
    return "\n".join(lines) + "\n"
