"""One self-contained HTML page per audit: the verdict first, then the tables and the plots, inline (PNG as base64
``data:`` URIs, the style in the page), so the file reads offline and fetches nothing.

``audit_html(report)``: an ``AuditReport`` (the local audit or the endpoint audit); ``determinism_html(report)``: a
``DeterminismReport``. Both return the page as a string.
"""

from __future__ import annotations

import base64
import io
from datetime import datetime, timezone
from html import escape

from .endpoint import endpoint_verdict
from .endpoint.features import DETERMINISTIC, TABLE_HEAD, UNSUPPORTED, table_rows

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px;
       padding: 0 1em; color: #1a202c; }
h1 { font-size: 1.5em; margin-bottom: 0.3em; }
h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #e2e8f0; padding-bottom: 0.2em; }
.verdict { font-size: 1.35em; font-weight: 600; padding: 0.8em 1em; border-radius: 6px; margin: 1em 0; }
.verdict .status { font-size: 1.3em; letter-spacing: 0.04em; display: block; }
.ok { background: #e6ffed; border: 2px solid #2f855a; color: #22543d; }
.bad { background: #fff5f5; border: 2px solid #c53030; color: #742a2a; }
.none { background: #fffaf0; border: 2px solid #c05621; color: #7b341e; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.6em 0; }
th, td { border: 1px solid #cbd5e0; padding: 0.25em 0.6em; text-align: right; }
th { background: #edf2f7; }
td.text, th.text { text-align: left; }
td.good { color: #2f855a; font-weight: 600; }
td.fail { color: #c53030; font-weight: 600; }
img { max-width: 100%; border: 1px solid #e2e8f0; }
.meta { color: #4a5568; font-size: 0.9em; }
code { font-size: 0.92em; }
"""

STATUS = {0: ("ok", "PASS"), 1: ("bad", "FAIL"), 2: ("none", "COULD NOT AUDIT")}


def png(fig) -> str:
    """A matplotlib figure as a ``data:image/png;base64,...`` URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _cell(value, cls: str = "") -> str:
    return f"<td class=\"{cls}\">{escape(str(value))}</td>" if cls else f"<td>{escape(str(value))}</td>"


def table(head: list[str] | None, rows: list[list], text_columns=(), status_column: int | None = None,
          good=("clean",)) -> str:
    """An HTML table (``head`` None: no header row); ``text_columns`` left-aligned; the ``status_column`` cell green
    when its value is in ``good``, else red."""
    out = ["<table>"]
    if head is not None:
        out.append("<thead><tr>")
        out += [f"<th class=\"{'text' if k in text_columns else ''}\">{escape(h)}</th>" for k, h in enumerate(head)]
        out.append("</tr></thead>")
    out.append("<tbody>")
    for row in rows:
        cells = []
        for k, v in enumerate(row):
            cls = "text" if k in text_columns else ""
            if k == status_column:
                cls += " good" if v in good else " fail"
            cells.append(_cell(v, cls.strip()))
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def page(title: str, status: int, verdict: str, sections: list[tuple[str, str]], summary: str = "") -> str:
    """The whole document: ``title``, the verdict box (``status`` 0 pass, 1 fail, 2 could not audit), a summary
    paragraph, then each ``(heading, html)`` section."""
    cls, word = STATUS[status]
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = [f"<h1>{escape(title)}</h1>",
            f"<div class=\"verdict {cls}\" id=\"verdict\"><span class=\"status\">{word}</span>{escape(verdict)}</div>"]
    if summary:
        body.append(f"<p class=\"meta\">{summary}</p>")
    for heading, html in sections:
        body.append(f"<h2>{escape(heading)}</h2>{html}")
    body.append(f"<p class=\"meta\">Written {when} by batchspec.</p>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{escape(title)}: {escape(verdict)}</title><style>{STYLE}</style></head>"
            f"<body>{''.join(body)}</body></html>\n")


def _divergences(report) -> str:
    rows = []
    for r in report.rows:
        for d in r.divergences:
            rows.append([r.engine, r.batch_size, d.prompt, d.index, d.cls, _tok(d.oracle_token), _tok(d.engine_token),
                         "-" if d.margin is None else f"{d.margin:.4g}",
                         "-" if d.tolerance is None else f"{d.tolerance:.3g}", getattr(d, "basis", None) or "-"])
    if not rows:
        return "<p>No divergence: every output compared equals the reference's.</p>"
    shown = sorted(rows, key=lambda x: x[4] == "numerical")[:100]
    note = f"<p class=\"meta\">{len(shown)} of {len(rows)} shown, numerical last.</p>" if len(rows) > len(shown) else ""
    return table(["engine", "batch / concurrency", "prompt", "first divergent index", "class", "reference token",
                  "engine token", "margin", "tolerance", "basis"], shown, text_columns=(0, 4, 9),
                 status_column=4, good=("numerical",)) + note


def _tok(t) -> str:
    return "-" if t is None else str(t)


def audit_html(report) -> str:
    """The page of an ``AuditReport``: the verdict, the rows with their signatures, the endpoint's levels and the
    reference (an endpoint audit), the first divergences with their class, the problems, and the plot."""
    from .report import COLUMNS

    meta = report.meta
    ep = meta.get("endpoint")
    status, verdict = endpoint_verdict(report) if ep else report.verdict()
    head = list(COLUMNS)
    if ep:
        head[1] = "concurrency"
    rows = [report._cells(r) for r in report.rows]
    sections = [("Results", table(head, rows, text_columns=(0, 7, 8), status_column=7))]
    if ep:
        path = "/v1/chat/completions" if ep["api"] == "chat" else "/v1/completions"
        levels = [[lv["concurrency"], lv["requests"], lv["compared"], lv["failed"], lv["protocol_errors"],
                   lv["finish_mismatches"], lv["prompt_mismatches"], lv["overruns"], lv.get("unreferenced", 0),
                   lv["token_source"] or "-", f"{lv['seconds']:.1f}"] for lv in ep["levels"]]
        sections.append(("Requests per level", table(
            ["concurrency", "requests", "compared", "failed", "protocol errors", "finish_reason mismatches",
             "prompt mismatches", "overruns", "no reference", "token source", "seconds"], levels, text_columns=(9,))
            + f"<p class=\"meta\">{escape(ep['url'])}, model {escape(str(ep['model']))}, {path}"
              f"{', streamed' if ep['stream'] else ''}; concurrency: the number of requests under way at once"
              f"{' (' + escape(ep['capped']) + ')' if ep.get('capped') else ''}.</p>"))
        problems = [[lv["concurrency"], p["prompt"], p["kind"], p["detail"]] for lv in ep["levels"]
                    for p in lv["problems"]]
        if problems:
            sections.append(("Problems", table(["concurrency", "prompt", "kind", "detail"], problems[:200],
                                               text_columns=(2, 3))))
        if ep.get("retokenized"):
            sections.append(("Warning", "<p>The server returned no token ids: its text was re-tokenized locally, so a "
                                        "divergence may come from the text round trip rather than from the server."
                                        "</p>"))
    ref = meta.get("reference")
    if ref is not None:
        info = [["kind", ref["kind"]], ["url", ref["url"]], ["model", ref["model"]], ["logprobs", ref["logprobs"]],
                ["answers usable", f"{ref['answers']} of {ref['requests']}"],
                ["token source", ref["token_source"] or "-"],
                ["tolerance", f"{meta['tolerance']['relative']:g} relative ({meta['tolerance']['dtype']})"],
                ["stop tokens", ", ".join(map(str, meta["stop_ids"])) or "-"], ["seconds", f"{ref['seconds']:.1f}"]]
        html = table(None, info, text_columns=(0, 1))
        if ref["problems"]:
            html += "<p>Reference answers left out (their prompts are not compared):</p>" + table(
                ["prompt", "kind", "detail"], [[p["prompt"], p["kind"], p["detail"]] for p in ref["problems"]],
                text_columns=(1, 2))
        sections.append(("Reference", html))
    if meta.get("features") is not None:
        sections.append(("Features", _features(meta["features"])))
    sections.append(("First divergence of each output", _divergences(report)))
    if report.rows:
        sections.append(("Plot", f"<img alt=\"agreement per row\" src=\"{png(report.figure())}\">"))
    title = "batchspec endpoint audit" if ep else "batchspec audit"
    summary = (f"{meta.get('n_prompts')} prompts, max_tokens {meta.get('max_tokens')}; compared with "
               f"{escape(report.reference_line())}.")
    return page(title, status, verdict, sections, summary)


def _features(features: dict) -> str:
    """The feature matrix: a row per feature and level, its status green when clean (or unsupported, or seed
    deterministic), then the cells' problems."""
    html = (f"<p class=\"meta\">Chat requests; reference: {escape(features['reference'])}; "
            f"{escape(features['verdict'])}. seed: a server need not honour a seed across concurrency, so "
            "<code>not deterministic</code> is reported, not failed.</p>")
    html += table(TABLE_HEAD, table_rows(features), text_columns=(0, 2), status_column=2,
                  good=("clean", DETERMINISTIC, UNSUPPORTED))
    problems = [[c["feature"], c["concurrency"], p["prompt"], p["kind"], p["detail"]] for c in features["cells"]
                for p in c["problems"]]
    if problems:
        html += table(["feature", "concurrency", "prompt", "kind", "detail"], problems[:200], text_columns=(0, 3, 4))
    return html


def determinism_html(report) -> str:
    """The page of a ``DeterminismReport``: the verdict, one row per prompt, and the plot of unique outputs."""
    m = report.meta
    status, verdict = report.verdict()
    rows = []
    for p in report.prompts:
        top = p["outputs"][0] if p["outputs"] else None
        rows.append([p["name"], p["requests"], p["answered"], p["failed"] + p["protocol_errors"], p["unique"],
                     "-" if p["first_divergence"] is None else p["first_divergence"],
                     f"{top['count']} answers, {top['length']} tokens" if top else "-",
                     "; ".join(f"{o['count']}x: c={'/'.join(o['by_concurrency'])}" for o in p["outputs"][:4]) or "-"])
    plot = f"<img alt=\"unique outputs per prompt\" src=\"{png(report.figure())}\">"
    sections = [("Unique outputs per prompt", plot),
                ("Prompts", table(["prompt", "requests", "answered", "failed", "unique outputs", "first divergence",
                                   "most common output", "outputs (count: concurrency levels)"], rows,
                                  text_columns=(0, 6, 7), status_column=4, good=(1,)))]
    problems = [[p["name"], q] for p in report.prompts for q in p["problems"]]
    if problems:
        sections.append(("Problems", table(["prompt", "problem"], problems[:200], text_columns=(0, 1))))
    summary = (f"{escape(m['url'])} (model {escape(str(m['model']))}): {m['n_prompts']} prompts, each sent "
               f"{m['repeat']} times, greedy, max_tokens {m['max_tokens']}, in {m['repeat']} rounds at concurrency "
               f"{', '.join(map(str, m['levels']))} in turn; {m['requests']} requests in {m['seconds']:.1f} s.")
    return page("batchspec determinism run", status, verdict, sections, summary)



def baseline_html(cases: list[dict], new: dict, saved: dict | None, repros: dict) -> str:
    """The page of ``batchspec audit --save`` / ``--against`` (``batchspec.audit.endpoint.baseline``): the verdict,
    the cases per status and drift class, the two fingerprints side by side, and each case that is not clean with its
    first divergent position and its reproducer. ``repros``: (prompt, run) -> the reproducer's path."""
    from .endpoint import baseline as bl
    from .endpoint.answer import short

    status, verdict = bl.status(cases)
    counts: dict[tuple[str, str], int] = {}
    for c in cases:
        cls = "-" if c["drift"] is None else c["drift"]["class"] or "finish_reason"
        counts[(c["status"], cls)] = counts.get((c["status"], cls), 0) + 1
    order = (bl.DRIFT, bl.LOGPROBS, bl.FAILED, bl.CLEAN)
    rows = [[s, cls, n] for (s, cls), n in sorted(counts.items(), key=lambda x: (order.index(x[0][0]), x[0][1]))]
    sections = [("Cases per status and drift class", table(["status", "drift class", "cases"], rows,
                                                           text_columns=(0, 1), status_column=0))]
    if saved is not None:
        prints = [[name, short(now, 200), short(was, 200), "same" if now == was else "changed"]
                  for name, now, was in bl.fingerprint_rows(new, saved)]
        sections.append(("Fingerprints compared", table(["field", "now", "baseline", ""], prints,
                                                        text_columns=(0, 1, 2, 3), status_column=3, good=("same",))))
    sections.append(("Cases not clean", _baseline_cases(cases, new, saved, repros)))
    s = new["fingerprint"]["settings"]
    what = "compared with the baseline" if saved is not None else "recorded as a baseline"
    summary = (f"{s['url']} (model {s['model']}, {s['api']}{', streamed' if s['stream'] else ''}, concurrency "
               f"{', '.join(map(str, s['concurrency']))}, max_tokens {s['max_tokens']}): {len(cases)} cases {what}. "
               + bl.logprob_line(cases, new))
    return page("batchspec endpoint baseline", status, verdict, sections, escape(summary))


def _baseline_cases(cases: list[dict], new: dict, saved: dict | None, repros: dict) -> str:
    """A row per case that is not clean: its first divergent token with both tokens there, its class and margin, its
    summary and its reproducer (the first 200 cases)."""
    rows = []
    for c in [c for c in cases if c["status"] != "clean"]:
        d, j = c["drift"] or {}, (c["drift"] or {}).get("index")
        now = new["runs"][c["run"]]["answers"][c["prompt"]]["token_ids"] or []
        was = (saved["runs"][c["run"]]["answers"][c["prompt"]]["token_ids"] or []) if saved is not None else []
        rows.append([c["name"], c["concurrency"], c["status"], _tok(j), d.get("class") or "-",
                     "-" if d.get("margin") is None else f"{d['margin']:.4g}",
                     _tok(None if j is None or j >= len(now) else now[j]),
                     _tok(None if j is None or j >= len(was) else was[j]), c["summary"] or "-",
                     repros.get((c["prompt"], c["run"]), "-")])
    if not rows:
        return "<p>Every case is clean.</p>"
    note = f"<p class=\"meta\">200 of {len(rows)} shown.</p>" if len(rows) > 200 else ""
    return table(["prompt", "concurrency", "status", "first divergent token", "class", "margin", "token now",
                  "baseline token", "summary", "reproducer"], rows[:200], text_columns=(0, 2, 4, 8, 9),
                 status_column=2) + note
