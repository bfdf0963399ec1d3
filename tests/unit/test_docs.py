"""The docs speak of the project: the site builds with every link and anchor resolved, and no page
names an issue number or counts the attempts a result took."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]

# "issue 17", "issue 16's", "#21", "(issues 13-15)"; "the tenth session", "third attempt", "3rd try"
ISSUE = re.compile(r"\bissues?[ -]\d+|(?<![\w/&])#\d+\b", re.IGNORECASE)
ORDINAL = r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\d+(?:st|nd|rd|th))"
ATTEMPT = re.compile(
    rf"\b{ORDINAL}[ -](?:session|attempt|try)\b|\b\d+ (?:attempts|tries)\b", re.IGNORECASE
)


def _offences(text: str) -> list[str]:
    return [m.group(0) for pattern in (ISSUE, ATTEMPT) for m in pattern.finditer(text)]


def test_the_patterns_catch_what_they_are_for():
    assert _offences(
        "issue 17, #21, (#anchor-issue-16s-tenth-session), the fifth session, 3 attempts"
    ) == [
        "issue 17",
        "#21",
        "issue-16",
        "tenth-session",
        "fifth session",
        "3 attempts",
    ]
    assert _offences("`#include`, rank #, a [link](#anchor), 1F1B, 61 rounds, 2 sessions'") == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_an_issue_or_counts_attempts(page):
    offences = _offences(page.read_text())
    assert not offences, (
        f"{page.relative_to(ROOT)} says {offences}: say what is true of the project"
    )


@pytest.mark.timeout(180)
def test_the_docs_site_builds_with_every_link_and_anchor_resolved(tmp_path):
    """mkdocs.yml's `validation:` makes a missing page or anchor a warning; --strict fails on it."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


def test_the_readme_and_changelog_link_to_files_that_exist():
    """GitHub renders these outside the site: their relative links must name files that exist."""
    for page in (ROOT / "README.md", ROOT / "CHANGELOG.md"):
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target:
                assert (ROOT / target).exists(), f"{page.name} links to missing {target}"
