"""The benchmark records and the pages that quote them.

``benchmarks/results.json`` holds the current figure of each thing measured (the most recent measurement, with the
command that reproduces it); ``benchmarks/history.jsonl`` holds every earlier write-up verbatim, one JSON object a
section. The tables between ``<!-- results:KIND -->`` and ``<!-- /results -->`` in docs/benchmarks.md (KIND ``all``)
and README.md (KIND ``headline``) are rendered from results.json, so a figure is changed in one place:

    python scripts/results.py --check     # exit 1 when a page's table and results.json disagree
    python scripts/results.py --write     # re-render the tables in place
    python scripts/results.py history [WORD]   # date, page and title of each past record (mentioning WORD)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results.json"
HISTORY = ROOT / "benchmarks" / "history.jsonl"
PAGES = {"all": ROOT / "docs" / "benchmarks.md", "headline": ROOT / "README.md"}
FIELDS = ("id", "group", "measured", "value", "range", "unit", "command", "date", "machine", "record", "headline")
BLOCK = re.compile(r"(<!-- results:(\w+) -->\n)(.*?)(<!-- /results -->)", re.S)
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def load_results(path: Path = RESULTS) -> list[dict]:
    """The current figures, checked for the fields every one must carry and for unique ids."""
    results = json.loads(path.read_text())["results"]
    seen = set()
    for r in results:
        missing = [f for f in FIELDS if f not in r]
        if missing:
            raise ValueError(f"result {r.get('id')!r} lacks {', '.join(missing)}")
        if r["id"] in seen:
            raise ValueError(f"result id {r['id']!r} appears twice")
        if not DATE.fullmatch(r["date"]):
            raise ValueError(f"result {r['id']!r}: date {r['date']!r} is not YYYY-MM-DD")
        seen.add(r["id"])
    return results


def load_history(path: Path = HISTORY) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def result_text(r: dict) -> str:
    """A figure as a table reads it: value with its unit, the range in brackets, then any note."""
    value = r["value"]
    text = str(value)
    if isinstance(value, float) and len(text.split(".")[1]) < 2:
        text = f"{value:.2f}"  # 1.2 reads 1.20: ratios carry two decimals
    unit = r["unit"] or ""
    if unit.startswith("x "):
        text, unit = f"{text}x", unit[2:]
    if unit:
        text = f"{text} {unit}"
    if r["range"]:
        text += f" ({r['range'][0]:.2f}-{r['range'][1]:.2f})"
    if r.get("note"):
        text += f"; {r['note']}"
    return text


def render(results: list[dict], kind: str) -> str:
    """The markdown table of one page's block: every figure by group, or the README's headline figures."""
    if kind == "headline":
        rows = ["| measured | result | command |", "|---|---|---|"]
        rows += [f"| {_cell(r['measured'])} | {_cell(result_text(r))} | `{_cell(r['command'])}` |"
                 for r in results if r["headline"]]
        return "\n".join(rows) + "\n"
    out, group = [], None
    order = {g: i for i, g in reversed(list(enumerate(r["group"] for r in results)))}  # a group's first place
    for r in sorted(results, key=lambda r: order[r["group"]]):
        if r["group"] != group:
            group = r["group"]
            out += ["" if out else None, f"**{group}**", "", "| id | measured | result | command | date | machine |",
                    "|---|---|---|---|---|---|"]
        out.append(f"| `{r['id']}` | {_cell(r['measured'])} | {_cell(result_text(r))} | `{_cell(r['command'])}` "
                   f"| {r['date']} | {_cell(r['machine'])} |")
    return "\n".join(line for line in out if line is not None) + "\n"


def rendered_page(text: str, results: list[dict]) -> str:
    """The page with each results block replaced by its rendering."""
    return BLOCK.sub(lambda m: m.group(1) + render(results, m.group(2)) + m.group(4), text)


def check(results: list[dict] | None = None) -> list[str]:
    """What disagrees between results.json, history.jsonl and the pages; empty when all agree."""
    results = load_results() if results is None else results
    problems = []
    for kind, page in PAGES.items():
        text = page.read_text()
        kinds = [m.group(2) for m in BLOCK.finditer(text)]
        if kinds != [kind]:
            problems.append(f"{page.name}: expected one results:{kind} block, found {kinds}")
        elif rendered_page(text, results) != text:
            problems.append(f"{page.name}: its results table differs from {RESULTS.name} "
                            "(run scripts/results.py --write)")
    records = {(h["title"], h["date"]) for h in load_history()}
    for r in results:
        if (r["record"], r["date"]) not in records:
            problems.append(f"result {r['id']!r}: no history record {r['record']!r} dated {r['date']}")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when a page disagrees with results.json")
    parser.add_argument("--write", action="store_true", help="re-render the pages' results tables")
    parser.add_argument("history", nargs="*", help="'history [WORD]': list past records (mentioning WORD)")
    args = parser.parse_args(argv)
    if args.history:
        if args.history[0] != "history":
            parser.error(f"unknown command {args.history[0]!r}")
        word = " ".join(args.history[1:]).lower()
        for h in load_history():
            if word in h["markdown"].lower():
                print(f"{h['date'] or '-':10}  {h['source']}  {h['title']}")
        return 0
    if args.write:
        results = load_results()
        for page in PAGES.values():
            page.write_text(rendered_page(page.read_text(), results))
    problems = check()
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
