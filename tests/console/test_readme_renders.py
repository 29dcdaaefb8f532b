"""The README and the docs pages as a CommonMark renderer (GitHub's) shows them, parsed with markdown-it-py: every
code fence closes where it should (a closing fence cannot carry text: "``` The embedded" once opened a block that
swallowed the "Using it" section), no heading sits inside a code block, and every relative link points at a file
that exists. The README is a front page: at most 200 lines, no tracker numbers, nothing undefined."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", ROOT / "infra" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def problems(text: str, folder: Path) -> list[str]:
    md = MarkdownIt("commonmark")
    tokens = md.parse(text)
    lines = text.splitlines()
    found = []
    for token in tokens:
        if token.type == "fence":
            begin, end = token.map
            if end >= len(lines) and not lines[-1].strip().startswith(token.markup):
                found.append(f"line {begin + 1}: a code fence that never closes")
            found += [f"line {begin + 1 + i}: a heading inside the code block opened at line {begin + 1}"
                      for i, line in enumerate(token.content.splitlines(), start=1) if line.startswith("## ")]
            if token.markup.startswith("`") and any(line.rstrip().startswith(token.markup) and line.strip() !=
                                                     token.markup for line in token.content.splitlines()):
                found.append(f"line {begin + 1}: a closing fence with text after it inside this block")
        for child in token.children or []:
            href = child.attrs.get("href") if child.type == "link_open" else None
            if href and not href.startswith(("http://", "https://", "#", "mailto:")):
                target = (folder / href.split("#")[0]).resolve()
                if not target.exists():
                    found.append(f"a link to {href}, which does not exist")
    return found


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_the_document_renders_as_written(path):
    assert problems(path.read_text(), path.parent) == []


def test_the_checks_catch_a_fence_closed_with_text_and_a_broken_link(tmp_path):
    broken = "# T\n\n[x](nowhere.md)\n\n```bash\nmake run\n``` The embedded\n\n## Using it\n"
    found = problems(broken, tmp_path)
    assert any("never closes" in p for p in found) and any("heading inside" in p for p in found)
    assert any("nowhere.md" in p for p in found)


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    # A reader cannot see our tracker, nor the seed papers' numbering; the docs pages carry the detail.
    assert not re.findall(r"(?i)\bissues? \d+|seed 00\d|section \d+", text)
    for page in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / page).exists(), page
