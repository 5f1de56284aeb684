"""The documentation: the site builds without a warning (no broken link or anchor), and the tree's text speaks
of the project, not of how it was made (no issue numbers, work-log entries or before/after timing stories)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
THIS_FILE = Path(__file__).resolve()

# What is scanned: prose and code a reader of the tree sees.
TEXT_SUFFIXES = {".md", ".py", ".cpp", ".h", ".yml", ".yaml", ".pbtxt", ".toml", ".txt"}
TEXT_NAMES = {"Makefile", "Dockerfile", "Dockerfile.locust", "run"}
SKIPPED_DIRS = {"build", "results", "site", "node_modules", "__pycache__"}

# Work-log wording, each with what it is.
WORK_LOG = [
    (re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE), "an issue number"),
    (re.compile(r"#\d+'s\b|\bPR\s*#?\d+"), "an issue or pull-request number"),
    (re.compile(r"\bclosing\s+notes?\b", re.IGNORECASE), "a work-log note (closing)"),
    (re.compile(r"\breview[e]rs?\b", re.IGNORECASE), "a review credit"),
    (re.compile(r"\bsessions?\b", re.IGNORECASE), "a work session"),
    (re.compile(r"\b\d+(?:\.\d+)?\s*(?:->|→)\s*\d+(?:\.\d+)?\s*(?:ms|us|s|GB/s|tokens/s)\b"),
     "a before/after timing"),
]

# Legitimate uses of "session", removed from a line before it is checked: pytest's fixture scope, a POSIX process
# session (setsid, start_new_session), HTTP client session classes.
ALLOWED_SESSION = re.compile(
    r"scope\s*=\s*[\"']session[\"']"
    r"|start_new_session"
    r"|\b(?:new|process|POSIX|login) session\b"
    r"|\bsession of (?:its|their) own\b"
    r"|\b(?:pytest|test|HTTP|TLS|gRPC) sessions?\b"
    r"|\b\w*\.Session\b|\b[A-Z]\w+Session\b",
    re.IGNORECASE,
)


def _text_files() -> list[Path]:
    files = []
    for root, dirs, names in os.walk(REPO_ROOT):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
                         and (not d.startswith(".") or d == ".ci"))
        for name in sorted(names):
            path = Path(root) / name
            if (path.suffix in TEXT_SUFFIXES or name in TEXT_NAMES) and path.resolve() != THIS_FILE:
                files.append(path)
    return files


def work_log_findings(path: Path, root: Path = REPO_ROOT) -> list[str]:
    """``file:line: what`` (``file`` relative to ``root``) for each line of ``path`` that carries work-log wording."""
    findings = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), start=1):
        cleaned = ALLOWED_SESSION.sub("", line)
        for pattern, what in WORK_LOG:
            match = pattern.search(cleaned)
            if match:
                findings.append(f"{path.relative_to(root)}:{number}: {what} ({match.group(0)!r})")
    return findings


def test_lint_finds_each_kind_of_work_log_wording(tmp_path):
    sample = tmp_path / "sample.md"
    # Assembled from parts, so that this file does not read as a work log itself.
    sample.write_text("as iss" "ue 13 asked\nsee the clos" "ing note\nthe eleventh sess" "ion measured it\n"
                      "a revie" "wer found it\nsession 11: 41.5 -> 38.1 ms\n"
                      "@pytest.fixture(scope=\"session\")\nPopen(argv, start_new_session=True)\n"
                      "requests.Session() and aiohttp.ClientSession()\nchildren run in a session of their own\n")
    findings = work_log_findings(sample, root=tmp_path)
    lines = sorted({int(f.split(":")[1]) for f in findings})
    assert lines == [1, 2, 3, 4, 5]
    assert any("before/after timing" in f and "'41.5 -> 38.1 ms'" in f for f in findings)


def test_tree_has_no_work_log_wording():
    files = _text_files()
    assert any(p.name == "README.md" for p in files) and any(p.suffix == ".cpp" for p in files)
    findings = [finding for path in files for finding in work_log_findings(path)]
    assert not findings, "work-log wording (say what the code does and why; history belongs in git):\n" + "\n".join(
        findings)


@pytest.mark.slow
def test_site_builds_strict_with_no_broken_links(tmp_path):
    mkdocs = Path(sys.executable).with_name("mkdocs")
    if not mkdocs.exists():
        pytest.fail(f"{mkdocs} is missing: `make test-slow` installs requirements-slow.txt (mkdocs-material)")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's notice about its successor, not a finding
    result = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    site = tmp_path / "site"
    assert "Quick start" in (site / "index.html").read_text()
    for page in ("architecture", "configuration", "openai", "deploy", "kernels", "performance"):
        assert (site / page / "index.html").is_file(), page


def test_performance_page_is_generated_from_the_kept_results():
    """docs/performance.md is what ``benchmarks.docs_page`` makes of its template and docs/results/*.json, and
    every kept result is shown on it: no figure without the run that produced it, no run left unshown."""
    from benchmarks.docs_page import MARKER, PAGE, RESULTS, TEMPLATE, generate

    assert PAGE.read_text() == generate(), "run: python -m benchmarks.docs_page"
    shown = set(MARKER.findall(TEMPLATE.read_text()))
    assert shown == {p.stem for p in RESULTS.glob("*.json")}
