"""Check the Markdown the docs site renders for list indentation that MkDocs gets wrong.

MkDocs renders Markdown with Python-Markdown, which wants a block inside a list item (a second
paragraph, a nested list) indented 4 spaces past the item's marker. GitHub accepts 2, so a file
can read well in the repository and break on the site:

- a paragraph after a blank line, indented 1-3 spaces, leaves the list; the next ``- `` bullet
  then continues that paragraph and shows as a literal ``- **Name**``;
- a nested ``- `` indented 1-3 spaces becomes a sibling of its parent: the nesting is lost;
- a list right under a paragraph line, with no blank line between, stays part of the
  paragraph (a wrapped line that starts with ``+ `` or ``- `` does the same).

Usage: ``python tools/check_markdown_lists.py [FILE ...]`` (default: the site's pages,
``README.md``, ``BENCHMARKS.md``, ``docs/*.md``); exits 1 and prints ``file:line: why`` for
each defect. ``make lint`` runs it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"( *)([-*+]|\d+\.) +\S")
FENCE = re.compile(r" *(```|~~~)")
NEEDED = 4  # Python-Markdown's indent for a block inside a list item


def site_pages() -> list[Path]:
    """The Markdown files the docs site builds (mkdocs.yml: the root documents and docs/)."""
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def list_defects(text: str) -> list[tuple[int, str]]:
    """``[(line number, why)]`` for every block under a list item indented less than
    :data:`NEEDED` spaces past the item's marker."""
    defects = []
    items: list[int] = []  # indents of the open list items' markers, outermost first
    blank_before = False
    paragraph = False  # the previous line is paragraph text outside any list
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        fenced = FENCE.match(line)
        if fence is not None:  # inside a code block: nothing is Markdown
            if fenced and fenced.group(1) == fence:
                fence = None
            continue
        if not line.strip():
            blank_before, paragraph = True, False
            continue
        indent = _indent(line)
        marker = MARKER.match(line)
        if marker and paragraph and indent < NEEDED:
            defects.append(
                (
                    number,
                    "a list item right under a paragraph line: MkDocs needs a blank line "
                    "before a list, else it shows the bullet as text",
                )
            )
        if items and (marker or blank_before):
            # the innermost open item this line can belong to: its marker starts left of it
            while items and indent <= items[-1] and not (marker and indent == items[-1]):
                items.pop()
            if items and not (marker and indent == items[-1]):
                past = indent - items[-1]
                if 0 < past < NEEDED:
                    what = "a nested list" if marker else "a paragraph after a blank line"
                    effect = (
                        "becomes a sibling item on the site (the nesting is lost)"
                        if marker
                        else "leaves the list on the site, and a bullet after it shows literally"
                    )
                    defects.append(
                        (
                            number,
                            f"{what} indented {past} space(s) under a list item; "
                            f"MkDocs needs {NEEDED}: it {effect}",
                        )
                    )
        if marker:
            items = [i for i in items if i < indent] + [indent]
        elif blank_before and indent == 0:
            items = []
        if fenced:
            fence = fenced.group(1)
        paragraph = not items and not fenced and not line.lstrip().startswith(("#", "<", "|"))
        blank_before = False
    return defects


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or site_pages()
    found = 0
    for path in paths:
        for number, why in list_defects(path.read_text(encoding="utf-8")):
            shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
            print(f"{shown}:{number}: {why}")
            found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
