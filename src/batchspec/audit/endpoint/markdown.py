"""The endpoint audit's verdict (``endpoint_verdict``: exit status and a line) and its Markdown report
(``endpoint_markdown``)."""

from __future__ import annotations

import statistics

from .features import TABLE_HEAD, table_rows
from .judges import COULD_NOT_AUDIT

# The median reference output, in tokens, below which a clean audit proved little: an output of a token or two (a
# lone EOS) ends before the decode steps where batching goes wrong (padded rows, requests joining a running batch,
# speculation's verify steps), so agreeing on it says next to nothing.
MIN_MEDIAN_TOKENS = 4


def endpoint_verdict(report) -> tuple[int, str]:
    """The endpoint audit's exit status and verdict in a line, the feature matrix's (``meta["features"]``, when it
    ran) joined to the levels': 1 when either is 1, else the larger."""
    status, verdict = _levels_verdict(report)
    features = report.meta.get("features")
    if features is None:
        return status, verdict
    joined = 1 if 1 in (status, features["status"]) else max(status, features["status"])
    return joined, f"{verdict}; {features['verdict']}"


def _levels_verdict(report) -> tuple[int, str]:
    """The levels' exit status and verdict: 1 when a level is not clean (anything but ``clean`` and ``could not
    audit``), else 2 when a level could not be audited or the reference outputs are too short to prove anything
    (median under ``MIN_MEDIAN_TOKENS``: ``proved little``), else 0."""
    broken = [f"concurrency {r.batch_size} ({r.signature})" for r in report.rows
              if not r.clean and r.signature != COULD_NOT_AUDIT]
    if broken:
        return 1, f"not clean: {', '.join(broken)}"
    unaudited = [f"concurrency {r.batch_size}" for r in report.rows if r.signature == COULD_NOT_AUDIT]
    if unaudited:
        ref = report.meta.get("reference")
        why = "no reference answer" if ref is not None and not ref["answers"] else "every request failed"
        return 2, f"could not audit: {', '.join(unaudited)} ({why})"
    lengths = [len(o) for o in report.oracle if o is not None]
    median = statistics.median(lengths) if lengths else 0
    if median < MIN_MEDIAN_TOKENS:
        return 2, (f"proved little: the median output is {median:g} tokens (under {MIN_MEDIAN_TOKENS}), too short to "
                   "exercise batching; not clean (give prompts that ask for longer answers, or --api chat)")
    return 0, f"clean at concurrency {', '.join(str(r.batch_size) for r in report.rows)}"


def endpoint_markdown(report, repros: dict | None = None) -> str:
    """The audit's Markdown plus a table per level of concurrency of what was sent, what failed or was malformed, and
    how the tokens were read, then the first problems of each level (and of the reference's answers). ``repros``:
    (prompt, concurrency) -> the path of a divergence's reproducer, linked."""
    ep = report.meta["endpoint"]
    lines = [*_levels_table(report, ep), *_reference_lines(report), *_divergence_table(report),
             *_repro_lines(repros or {}), *_feature_lines(report.meta.get("features"))]
    for lv in ep["levels"]:
        if lv["problems"]:
            lines += ["", f"Concurrency {lv['concurrency']}, first problems:", ""]
            lines += _problem_lines(lv["problems"])
    if ep["retokenized"]:
        lines += ["", "**Warning:** the server returned no token ids; its text was re-tokenized locally, so a "
                      "divergence may come from the text round trip rather than from the server."]
    return "\n".join(lines) + "\n"


def _problem_lines(problems) -> list[str]:
    return [f"- prompt {p['prompt']}: {p['kind']}: {p['detail']}" for p in problems[:5]]


def _levels_table(report, ep: dict) -> list[str]:
    """The verdict, the audit's table, and what was sent and read back at each level."""
    path = "/v1/chat/completions" if ep["api"] == "chat" else "/v1/completions"
    lines = [f"**Verdict: {endpoint_verdict(report)[1]}**", "",
             report.to_markdown().replace("| batch |", "| concurrency |", 1), "",
             f"Endpoint {ep['url']} (model {ep['model']}, {path}{', streamed' if ep['stream'] else ''}); "
             "concurrency: the number of requests under way at once"
             + (f" ({ep['capped']})." if ep.get("capped") else "."),
             "", "| concurrency | requests | failed | protocol errors | finish_reason mismatches | prompt mismatches "
                 "| overruns | no reference | token source | seconds |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for lv in ep["levels"]:
        lines.append(f"| {lv['concurrency']} | {lv['requests']} | {lv['failed']} | {lv['protocol_errors']} | "
                     f"{lv['finish_mismatches']} | {lv['prompt_mismatches']} | {lv['overruns']} | "
                     f"{lv.get('unreferenced', 0)} | {lv['token_source'] or '-'} | {lv['seconds']:.1f} |")
    return lines


def _reference_lines(report) -> list[str]:
    """A reference server: what it was, how many of its answers served, the first left out."""
    ref = report.meta.get("reference")
    if ref is None:
        return []
    lines = ["", f"Reference: {report.meta['oracle']}; {ref['answers']} of {ref['requests']} answers usable "
                 f"({ref['seconds']:.1f} s)."]
    if ref["problems"]:
        lines += ["", "Reference answers left out:", "", *_problem_lines(ref["problems"])]
    return lines


def _divergence_table(report) -> list[str]:
    """The first 20 divergences that are not numerical."""
    divs = [(r.batch_size, d) for r in report.rows for d in r.divergences if d.cls != "numerical"]
    if not divs:
        return []
    return ["", "First divergences (not numerical):", "",
            "| concurrency | prompt | index | class | reference token | endpoint token | margin | tolerance |",
            "|---|---|---|---|---|---|---|---|",
            *(f"| {c} | {d.prompt} | {d.index} | {d.cls} | {d.oracle_token} | {d.engine_token} | "
              f"{'-' if d.margin is None else f'{d.margin:.4g}'} | "
              f"{'-' if d.tolerance is None else f'{d.tolerance:.3g}'} |" for c, d in divs[:20])]


def _repro_lines(repros: dict) -> list[str]:
    """A link to the first 20 reproducers."""
    if not repros:
        return []
    lines = ["", "Reproducers (each request with those under way with it; `python repro/<name>.py [URL]` sends them "
                 "again and says whether the divergence shows):", ""]
    lines += [f"- concurrency {c}, prompt {i}: [{path}]({path})" for (i, c), path in list(repros.items())[:20]]
    if len(repros) > 20:
        lines.append(f"- ... {len(repros) - 20} more in repro/")
    return lines


def _feature_lines(features: dict | None) -> list[str]:
    """The feature matrix: a row per feature and level, then the first problems of each cell."""
    if features is None:
        return []
    lines = ["", f"Features (chat requests; reference: {features['reference']}): {features['verdict']}.", "",
             "| " + " | ".join(TABLE_HEAD) + " |", "|" + "---|" * len(TABLE_HEAD)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in table_rows(features)]
    if any(c["feature"] == "seed" for c in features["cells"]):
        lines += ["", "seed: sampled with a fixed seed, each prompt sent twice; a server need not honour a seed across "
                      "concurrency, so `not deterministic` is reported, not failed."]
    for c in features["cells"]:
        if c["problems"]:
            lines += ["", f"Feature {c['feature']} at concurrency {c['concurrency']}, first problems:", ""]
            lines += _problem_lines(c["problems"])
    return lines
