"""``muonscale docs [PAGE]`` in a source checkout: it lists the site's Markdown pages and prints
each, and every "*Title* in the docs" of a docstring names a page it prints.
(tests/test_wheel_install.py runs it from the built wheel, where setup.py put the pages.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from muonscale.cli import doc_pages, main, nav_pages, page_name

ROOT = Path(__file__).resolve().parent.parent


def test_the_list_names_every_page_of_the_site(capsys):
    assert main(["docs"]) == 0
    listed = capsys.readouterr().out
    nav = nav_pages((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    pages = [(title, path) for title, path in nav if (ROOT / path).is_file()]
    assert len(pages) >= 10 and len({page_name(t) for t, _ in pages}) == len(pages)
    for title, _ in pages:
        assert re.search(rf"^  {re.escape(page_name(title))} +{re.escape(title)}$", listed, re.M)


@pytest.mark.parametrize("asked", ["options", "Options", "BENCHMARKS", "tuning-on-the-bench"])
def test_a_page_is_printed_by_name_title_or_file(asked, capsys):
    assert main(["docs", asked]) == 0
    printed = capsys.readouterr().out
    wanted = {p["name"]: p["path"] for p in doc_pages()}
    expected = wanted["benchmarks" if asked == "BENCHMARKS" else page_name(asked)]
    assert printed == Path(expected).read_text(encoding="utf-8")


def test_every_page_a_docstring_names_is_printed(capsys):
    titles = set()
    for path in (ROOT / "muonscale").rglob("*.py"):
        titles |= set(re.findall(r"\*([^*\n]+)\* in the docs", path.read_text(encoding="utf-8")))
    assert titles
    for title in sorted(titles):
        assert main(["docs", title]) == 0, title
        assert capsys.readouterr().out.startswith("# "), title


def test_an_unknown_page_is_refused_naming_the_pages(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["docs", "no-such-page"])
    assert stop.value.code == 2
    assert "no page 'no-such-page'; the pages: home, " in capsys.readouterr().err
