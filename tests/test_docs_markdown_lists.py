"""tools/check_markdown_lists.py (``make lint``): it finds the list indentation that MkDocs
renders wrongly, in the cases the site showed, passes what renders right, and the site's pages
pass it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from check_markdown_lists import list_defects, main  # noqa: E402

# A second paragraph indented 2 spaces: it leaves the list, and the next bullet continued it
# on the site as a literal "- **Checkpoints**".
CONTINUATION_2 = """\
- **FSDP2**: the optimizer is built before sharding.

  On CPU, accelerate keeps the plugin only for accelerator devices.
- **Checkpoints**: resuming continues bit-exactly.
"""
NESTED_2 = "- parent item\n  wrapped line\n  - child item\n"
UNDER_PARAGRAPH = "Failures, times measured from the fault:\n- SIGKILL of rank 1\n"
WRAPPED_PLUS = "needs 9 more (NorMuon\n+ CWD) or 17 fewer.\n"


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        (CONTINUATION_2, 3, "paragraph after a blank line indented 2"),
        (NESTED_2, 3, "nested list indented 2"),
        (UNDER_PARAGRAPH, 2, "right under a paragraph line"),
        (WRAPPED_PLUS, 2, "right under a paragraph line"),
    ],
)
def test_defects_are_found_with_their_line(text, line, words):
    ((number, why),) = list_defects(text)
    assert number == line and words in why


@pytest.mark.parametrize(
    "text",
    [
        CONTINUATION_2.replace("\n  On", "\n    On"),  # 4 spaces: a paragraph of the item
        NESTED_2.replace("  - child", "    - child"),
        UNDER_PARAGRAPH.replace(":\n-", ":\n\n-"),
        "- item\n  lazy continuation\n- next\n\nA paragraph after the list.\n",
        "### Heading\n- item right under a heading\n",
        "```text\n- not a list\n  text in a code block\n```\n",
        "- item\n\n    ```python\n    x = 1\n    ```\n",
        "1. first\n\n    Its second paragraph.\n2. second\n",
        "chunks of `MUONSCALE_UPDATE_CHUNK_MB` (default\n128) and the cache\n",  # not a marker
    ],
)
def test_what_renders_right_passes(text):
    assert list_defects(text) == []


def test_the_command_fails_on_a_defect_and_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.md"
    bad.write_text(CONTINUATION_2, encoding="utf-8")
    assert main([str(bad)]) == 1
    assert f"{bad}:3:" in capsys.readouterr().out
    good = tmp_path / "good.md"
    good.write_text(CONTINUATION_2.replace("\n  On", "\n    On"), encoding="utf-8")
    assert main([str(good)]) == 0


def test_the_site_pages_pass():
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "check_markdown_lists.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
