"""The audit as a JUnit XML report for CI: one test case per prompt x setting, a failure (or an error, when it could
not be audited) carrying the case's one-line summary."""

from __future__ import annotations


def junit_xml(cases: list[dict], suite: str = "batchspec audit") -> str:
    """``cases``: dicts with ``name``, ``concurrency``, ``api``, ``stream``, ``status`` (``clean``, ``failed``: could
    not audit, ``skipped``: not supported by the server, anything else: a failure) and ``summary``; ``label``, when
    given, names the case (default ``prompt <name>``)."""
    import xml.etree.ElementTree as ET

    failures = sum(c["status"] not in ("clean", "failed", "skipped") for c in cases)
    errors = sum(c["status"] == "failed" for c in cases)
    counts = dict(tests=str(len(cases)), failures=str(failures), errors=str(errors),
                  skipped=str(sum(c["status"] == "skipped" for c in cases)))
    root = ET.Element("testsuites", **counts)
    node = ET.SubElement(root, "testsuite", name=suite, **counts)
    for c in cases:
        setting = f"concurrency {c['concurrency']}, {c['api']}{', streamed' if c['stream'] else ''}"
        title = c.get("label") or f"prompt {c['name']}"
        case = ET.SubElement(node, "testcase", classname=f"{suite}.{setting}", name=f"{title} ({setting})")
        if c["status"] != "clean":
            tag = {"failed": "error", "skipped": "skipped"}.get(c["status"], "failure")
            ET.SubElement(case, tag, message=c["summary"] or c["status"], type=c["status"]).text = c["summary"]
    return ET.tostring(root, encoding="unicode") + "\n"


def report_cases(report, names) -> list[dict]:
    """The cases of an endpoint audit's ``AuditReport``: per level and prompt, ``failed`` when its request failed,
    a failure for its first divergence that is not numerical or its first problem, else ``clean``."""
    ep = report.meta["endpoint"]
    out = []
    for row, lv in zip(report.rows, ep["levels"]):
        for i, name in enumerate(names):
            case = {"name": name, "concurrency": row.batch_size, "api": ep["api"], "stream": ep["stream"],
                    "status": "clean", "summary": None}
            divs = [d for d in row.divergences if d.prompt == i and d.cls != "numerical"]
            problems = [p for p in lv["problems"] if p["prompt"] == i]
            if any(p["kind"] == "failed" for p in problems):
                case.update(status="failed", summary=f"could not audit: {problems[0]['detail']}")
            elif divs:
                d = divs[0]
                case.update(status=d.cls, summary=f"token {d.index} is {d.engine_token} where the reference has "
                                                  f"{d.oracle_token} ({d.cls})")
            elif problems:
                case.update(status=problems[0]["kind"], summary=f"{problems[0]['kind']}: {problems[0]['detail']}")
            out.append(case)
    return out


def feature_cases(features: dict) -> list[dict]:
    """The cases of the feature matrix (``meta["features"]``): one per feature and level, ``skipped`` when the
    server refused the feature, ``failed`` when it could not be audited, a failure (with the cell's first problem)
    when the feature is inexact, invalid or incomplete, else ``clean`` (seed whether deterministic or not, skipped
    when not audited: a server need not honour a seed across concurrency)."""
    from .features import COULD_NOT_AUDIT, FAILING, UNSUPPORTED

    out = []
    for c in features["cells"]:
        first = c["problems"][0] if c["problems"] else None
        detail = f"{c['status']}: {first['kind']}: {first['detail']}" if first else c["status"]
        if c["feature"] == "seed":  # reported, never failed
            status = "skipped" if c["status"] in (UNSUPPORTED, COULD_NOT_AUDIT) else "clean"
        else:
            status = ("skipped" if c["status"] == UNSUPPORTED else "failed" if c["status"] == COULD_NOT_AUDIT
                      else c["status"] if c["status"] in FAILING else "clean")
        out.append({"name": c["feature"], "label": f"feature {c['feature']}", "concurrency": c["concurrency"],
                    "api": features["api"], "stream": False, "status": status,
                    "summary": None if status == "clean" else detail})
    return out
