"""The audit as a JUnit XML report for CI: one test case per prompt x setting, a failure (or an error, when it could
not be audited) carrying the case's one-line summary."""

from __future__ import annotations


def junit_xml(cases: list[dict], suite: str = "batchspec audit") -> str:
    """``cases``: dicts with ``name``, ``concurrency``, ``api``, ``stream``, ``status`` (``clean``, ``failed``: could
    not audit, anything else: a failure) and ``summary``."""
    import xml.etree.ElementTree as ET

    failures = sum(c["status"] not in ("clean", "failed") for c in cases)
    errors = sum(c["status"] == "failed" for c in cases)
    root = ET.Element("testsuites", tests=str(len(cases)), failures=str(failures), errors=str(errors))
    node = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)), failures=str(failures),
                         errors=str(errors))
    for c in cases:
        setting = f"concurrency {c['concurrency']}, {c['api']}{', streamed' if c['stream'] else ''}"
        case = ET.SubElement(node, "testcase", classname=f"{suite}.{setting}", name=f"prompt {c['name']} ({setting})")
        if c["status"] != "clean":
            tag = "error" if c["status"] == "failed" else "failure"
            ET.SubElement(case, tag, message=c["summary"] or c["status"], type=c["status"]).text = c["summary"]
    return ET.tostring(root, encoding="unicode") + "\n"
