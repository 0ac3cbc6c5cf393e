"""MkDocs hook (mkdocs.yml `hooks:`): the pages are written as GitHub renders Markdown, the site reads them alike.

    GitHub (CommonMark)                     Python-Markdown (MkDocs)
    a list right after a paragraph line     needs a blank line before it
    nested items indented by 2 spaces       need 4 spaces per level (2 are read as the same level)

`on_page_markdown` rewrites only those two things, outside fenced code, so one source reads the same in both places
and no page has to be written for one renderer. It also keeps one copy of what README.md and the site both show: a
line that is nothing but a link to a README section, `[text](../README.md#capabilities)`, is replaced on the site by
that section's body (its links into docs/ made relative to docs/); on GitHub it stays a link. The files on disk are
not changed.
"""
from __future__ import annotations

import re
from pathlib import Path

_ITEM = re.compile(r"^( *)(?:[-*]|\d+\.) \S")
_FENCE = re.compile(r"^ *(```|~~~)")
_README_LINK = re.compile(r"^\[[^\]]*\]\(\.\./README\.md#([a-z0-9-]+)\)$", re.M)
README = Path(__file__).resolve().parents[1] / "README.md"


def _slug(heading: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", heading.lower()).strip().replace(" ", "-")


def readme_section(readme: str, slug: str) -> str:
    """The body of README's `## ` section whose anchor is `slug` (up to the next `## `), with its links into docs/
    made relative to a page in docs/; ValueError naming the anchor if README has no such section."""
    parts = re.split(r"^## (.+)$", readme, flags=re.M)
    for heading, body in zip(parts[1::2], parts[2::2]):
        if _slug(heading) == slug:
            return re.sub(r"\]\(docs/", "](", body).strip("\n")
    raise ValueError(f"README.md has no section #{slug} (its sections: {[_slug(h) for h in parts[1::2]]})")


def include_readme(markdown: str, readme: str) -> str:
    """Each line that is only a link to a README section, replaced by that section (readme_section)."""
    return _README_LINK.sub(lambda m: readme_section(readme, m.group(1)), markdown)


def normalize(markdown: str) -> str:
    out: list[str] = []
    in_fence = in_list = False
    for line in markdown.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
            out.append(line)
            continue
        if in_fence:
            out.append(line)
            continue
        if not line.strip():
            in_list = False
            out.append(line)
            continue
        item = _ITEM.match(line)
        if item and not item.group(1):                    # a top-level item
            if not in_list and out and out[-1].strip():    # right after a paragraph line: start a new block
                out.append("")
            in_list = True
        elif item and in_list:                             # a nested item: 2 spaces a level -> 4
            line = " " * (2 * len(item.group(1))) + line[len(item.group(1)):]
        out.append(line)
    return "\n".join(out)


def on_page_markdown(markdown: str, **_kwargs) -> str:
    if _README_LINK.search(markdown):
        markdown = include_readme(markdown, README.read_text())
    return normalize(markdown)
