"""The README is the front door and docs/ holds the rest: every relative link in README.md and docs/*.md leads to a
file that exists (its #anchor aside), every page under docs/ can be reached from the README, the README stays short,
and its test command is exactly the one .ci/run runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def relative_links(page: Path) -> list[str]:
    """The link targets of a markdown page outside its code blocks, web addresses left out."""
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def resolve(page: Path, target: str) -> Path:
    return (page.parent / target.split("#", 1)[0]).resolve()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file(page):
    broken = []
    for target in relative_links(page):
        path = resolve(page, target)
        if not path.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)} links to nothing: {broken}"


def test_the_link_check_finds_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[fine](page.md#top) [gone](missing.md) ![img](x.png) [web](https://example.org)\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert relative_links(page) == ["page.md#top", "missing.md", "x.png"]
    assert [t for t in relative_links(page) if not resolve(page, t).exists()] == ["missing.md", "x.png"]


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        for target in relative_links(page):
            path = resolve(page, target)
            if path.suffix == ".md" and path.parent == REPO / "docs" and path.exists() and path not in seen:
                seen.add(path)
                todo.append(path)
    assert set((REPO / "docs").glob("*.md")) <= seen


def test_the_readme_is_short_and_names_the_command_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "the front door: details belong in docs/"
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    test_command = ci[-1]
    assert test_command == ".venv/bin/python -m pytest -q -n auto --dist loadgroup"
    section = readme.split("\n## Test\n", 1)[1].split("\n## ", 1)[0]
    assert test_command in section
    install = next(line for line in ci if line.startswith("./install.sh"))
    assert install in readme.split("\n## Install\n", 1)[1].split("\n## ", 1)[0] or install in section
