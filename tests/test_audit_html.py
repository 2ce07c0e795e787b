"""The HTML report: one self-contained page (plots inline as PNG, no external resource) with the verdict first, opened
in a real headless browser (Debian's chromium, which CI installs) whose rendered DOM must show the verdict."""

import base64
import shutil
import subprocess
from html.parser import HTMLParser

import servekit
import tiny

from batchspec.audit import audit
from batchspec.audit.determinism import determinism_run
from batchspec.audit.endpoint import audit_endpoint, endpoint_verdict
from batchspec.audit.html import audit_html, determinism_html

PROMPTS = tiny.prompts(8, seed=11, lo=2, hi=30)
MAX_TOKENS = 10
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class Page(HTMLParser):
    """What a test needs of a DOM: the verdict's text, every tag, every src/href, the images' data and all text."""

    def __init__(self, html: str):
        super().__init__()
        self.tags, self.links, self.images, self.text, self.verdict = [], [], [], [], []
        self._in_verdict = 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        self.links += [attrs[k] for k in ("src", "href") if k in attrs]
        if tag == "img":
            self.images.append(attrs.get("src", ""))
        if self._in_verdict:
            self._in_verdict += 1
        elif attrs.get("id") == "verdict":
            self._in_verdict = 1

    def handle_endtag(self, tag):
        if self._in_verdict:
            self._in_verdict -= 1

    def handle_data(self, data):
        self.text.append(data)
        if self._in_verdict:
            self.verdict.append(data)


def rendered(html: str, tmp_path) -> Page:
    """The DOM that headless chromium renders from ``html`` written to a file (no network, a fresh profile)."""
    assert shutil.which(CHROMIUM), "chromium is needed: apt-get install -y chromium (.ci/run installs it)"
    path = tmp_path / "report.html"
    path.write_text(html, encoding="utf-8")
    profile = tmp_path / "chromium-profile"
    run = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
         "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "<body" in run.stdout, run.stdout[:500]
    return Page(run.stdout)


def check_self_contained(page: Page, n_images: int) -> None:
    """Every image is an inline PNG, nothing points outside the page, and there is no script or stylesheet link."""
    assert len(page.images) == n_images
    for src in page.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n"
    assert all(link.startswith("data:") for link in page.links), page.links
    assert "script" not in page.tags and "link" not in page.tags


def test_the_verdict_of_a_broken_server_shows_in_the_browser(padding_bug, tmp_path):
    report = audit_endpoint(padding_bug.url, prompts=PROMPTS, concurrency=[1, 4], max_tokens=MAX_TOKENS)
    status, verdict = endpoint_verdict(report)
    assert status == 1 and "padding leakage" in verdict
    page = rendered(audit_html(report), tmp_path)
    assert " ".join(page.verdict).split() == ["FAIL", *verdict.split()]
    check_self_contained(page, 1)
    text = " ".join(page.text)
    assert "Reference" in text and "the same server at concurrency 1" in text
    first = next(d for d in report.rows[1].divergences)
    assert f"{first.prompt} {first.index} {first.cls}" in " ".join(text.split())  # the divergence table


def test_the_verdict_of_a_clean_server_shows_in_the_browser(good, tmp_path):
    report = audit_endpoint(good.url, prompts=PROMPTS, concurrency=[1, 4], max_tokens=MAX_TOKENS)
    page = rendered(audit_html(report), tmp_path)
    assert " ".join(page.verdict).split() == ["PASS", "clean", "at", "concurrency", "1,", "4"]
    check_self_contained(page, 1)


def test_the_determinism_run_shows_in_the_browser(good, tmp_path):
    report = determinism_run(good.url, PROMPTS, repeat=2, concurrency=[1, 4], max_tokens=MAX_TOKENS)
    page = rendered(determinism_html(report), tmp_path)
    assert " ".join(page.verdict).split() == ["PASS", *report.verdict()[1].split()]
    assert report.verdict()[1].startswith("deterministic")
    check_self_contained(page, 1)


def test_the_local_audit_shows_in_the_browser(tmp_path):
    engines = ["slotmask", "fault:dsd-draft-token-accepted:fixed"]
    report = audit(tiny.target(), tiny.draft(), PROMPTS[:4], engines=engines, batch_sizes=[1, 4], max_tokens=MAX_TOKENS,
                   num_draft_tokens=3, cache_dir=False)
    page = rendered(audit_html(report), tmp_path)
    status, verdict = report.verdict()
    assert (status, verdict) == (0, "clean (injected faults caught: 2 of 2 rows)")
    assert " ".join(page.verdict).split() == ["PASS", *verdict.split()]
    assert "acceptance-rule error" in " ".join(page.text)  # the fault's rows, with their signature
    check_self_contained(page, 1)


def test_the_local_audit_command_writes_the_page(tmp_path, monkeypatch, capsys):
    from batchspec.cli import main

    monkeypatch.setenv("BATCHSPEC_CACHE", str(tmp_path / "cache"))
    tiny.target().save_pretrained(tmp_path / "target")
    servekit.tokenizer().save_pretrained(tmp_path / "target")
    (tmp_path / "prompts.txt").write_text("\n".join(" ".join(f"w{t}" for t in p) for p in PROMPTS[:3]) + "\n")
    rc = main(["audit", "--target", str(tmp_path / "target"), "--draft", "none", "--prompts",
               str(tmp_path / "prompts.txt"), "--no-chat-template", "--dtype", "float64", "--max-tokens", "6",
               "--engines", "plain", "--batch-sizes", "1,2", "--out", str(tmp_path / "out")])
    assert rc == 0, capsys.readouterr().out
    assert "audit.html" in capsys.readouterr().out
    page = rendered((tmp_path / "out" / "audit.html").read_text(), tmp_path)
    assert " ".join(page.verdict).split() == ["PASS", "clean"]
    check_self_contained(page, 1)
