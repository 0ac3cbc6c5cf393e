"""MkDocs hook (mkdocs.yml `hooks:`): the pages are written as GitHub renders Markdown, the site reads them alike.

    GitHub (CommonMark)                     Python-Markdown (MkDocs)
    a list right after a paragraph line     needs a blank line before it
    nested items indented by 2 spaces       need 4 spaces per level (2 are read as the same level)

`on_page_markdown` rewrites only those two things, outside fenced code, so one source reads the same in both places
and no page has to be written for one renderer. The files on disk are not changed.
"""
from __future__ import annotations

import re

_ITEM = re.compile(r"^( *)(?:[-*]|\d+\.) \S")
_FENCE = re.compile(r"^ *(```|~~~)")


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
    return normalize(markdown)
