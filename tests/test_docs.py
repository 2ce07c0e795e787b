"""The documentation agrees with the code and the benchmark records: sizes, links, the figures' tables, and every
``batchspec <command> --flag`` a page shows."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from batchspec.cli.commands import COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
KB = 1024


def _results_module():
    spec = importlib.util.spec_from_file_location("results", ROOT / "scripts" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


results = _results_module()


def test_sizes():
    assert (DOCS / "benchmarks.md").stat().st_size <= 40 * KB
    assert sum(p.stat().st_size for p in DOCS.iterdir() if p.is_file()) <= 120 * KB
    assert (ROOT / "README.md").stat().st_size <= 12 * KB


def test_pages_agree_with_results_json():
    assert results.check() == []


def test_a_changed_figure_is_caught():
    figures = results.load_results()
    figures[0] = {**figures[0], "value": "changed"}
    assert any("differs" in p for p in results.check(figures))


def test_a_figure_without_its_record_is_caught():
    figures = results.load_results()
    figures[0] = {**figures[0], "record": "no such section"}
    assert any("no history record" in p for p in results.check(figures))


def test_results_carry_their_fields(tmp_path):
    path = tmp_path / "results.json"
    path.write_text('{"results": [{"id": "x", "value": 1}]}')
    with pytest.raises(ValueError, match="lacks"):
        results.load_results(path)


# Links ------------------------------------------------------------------------------------------------------------

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.*)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    assert broken_links(page) == []


def test_a_broken_anchor_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](#title) [bad](#no-such-heading) [gone](missing.md)\n")
    assert broken_links(page) == ["#no-such-heading", "missing.md"]


# CLI flags --------------------------------------------------------------------------------------------------------

COMMAND = re.compile(r"\bbatchspec (" + "|".join(map(re.escape, COMMANDS)) + r")\b([^`|;&#\n]*)")


def code_of(text: str) -> list[str]:
    """The code a page shows: fenced blocks (continued lines joined) and inline code spans."""
    blocks = [m.group(0).replace("\\\n", " ") for m in FENCE.finditer(text)]
    spans = re.findall(r"`([^`\n]+)`", FENCE.sub("", text))
    return blocks + spans


def accepted_flags(command: str) -> set[str]:
    parser = argparse.ArgumentParser()
    COMMANDS[command].add_arguments(parser)
    return set(parser._option_string_actions)


def unknown_flags(text: str) -> list[str]:
    """``command --flag`` for each flag shown after ``batchspec <command>`` that its parser does not accept."""
    unknown = []
    for code in code_of(text):
        for command, rest in COMMAND.findall(code):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", rest):
                if flag not in accepted_flags(command):
                    unknown.append(f"{command} {flag}")
    return unknown


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cli_flags_in_docs_exist(page):
    assert unknown_flags(page.read_text()) == []


def test_an_unknown_flag_is_caught():
    text = "`batchspec bench --truncate 32`\n\n```bash\nbatchspec audit --limit 8 \\\n    --no-such-flag\n```\n"
    assert unknown_flags(text) == ["audit --no-such-flag"]


def test_the_docs_show_flags_of_every_command():
    shown = {command for page in PAGES for code in code_of(page.read_text()) for command, _ in COMMAND.findall(code)}
    assert shown == set(COMMANDS)
