"""Every relative link in the README and the docs pages points at a file in the tree, and a
link to a heading (`page.md#heading`) at a heading that page has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from procs import ROOT

PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The page without code blocks and code spans, where `](` is code, not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (lowercase, punctuation dropped, spaces as
    hyphens, a repeated heading numbered)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        heading = re.match(r"#{1,6} (.+)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    return [target for target in LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not ours


def test_the_docs_pages_exist_and_the_readme_is_a_short_front_page():
    names = {page.name for page in PAGES if page.parent == ROOT / "docs"}
    assert {"README.md", "flags.md", "security.md", "deployment.md", "gpu.md", "kernels.md",
            "benchmarks.md", "design.md", "operations.md", "api.md"} <= names
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 300
    assert "make run" in readme and "make test" in readme


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(page: Path):
    links = relative_links(page)
    assert links, "a page without links to the others"
    for target in links:
        path_part, _, anchor = target.partition("#")
        path = (page.parent / path_part).resolve() if path_part else page
        assert path.exists(), f"{target}: no such file"
        if anchor and path.suffix == ".md":
            assert anchor in anchors(path), f"{target}: no such heading"


def test_the_link_check_sees_a_broken_link(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## A `code` heading, here\n\n[ok](#title) [gone](missing.md)\n"
                    "`[not](a-link.md)`\n```\n[nor](this.md)\n```\n")
    assert relative_links(page) == ["#title", "missing.md"]
    assert anchors(page) == {"title", "a-code-heading-here"}
