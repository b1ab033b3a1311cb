"""The docs site (``make docs``): it builds with ``--strict``, its API reference lists every public
name of muonscale and its integrations (``Muon`` first, long constant tables folded, no private
base classes), and, served on 127.0.0.1, it opens in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium) with a working index, API page and search, and with no
heading or sidebar entry running out of its box or over another one. Without the ``[docs]``
extra or the browser the tests skip, and fail under CI=true.
"""

from __future__ import annotations

import ast
import functools
import http.server
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1280,900",  # wide enough that the navigation bar is not collapsed
)
# (API page, module whose __all__ it lists)
API_MODULES = (
    ("muonscale", "muonscale"),
    ("distributed", "muonscale.distributed"),
    ("hf", "muonscale.integrations.hf"),
    ("lightning", "muonscale.integrations.lightning"),
    ("torchtitan", "muonscale.integrations.torchtitan"),
    ("megatron", "muonscale.integrations.megatron"),
)


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must build and open the docs site: {what}")
    pytest.skip(what)


def _all_of(module: str) -> list[str]:
    path = ROOT.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:  # computed: the module says
                return list(importlib.import_module(module).__all__)
    raise AssertionError(f"{path} has no __all__")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            _missing(f"{module} is not installed (make docs installs the [docs] extra)")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out


@pytest.fixture(scope="module")
def served(site):
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if importlib.util.find_spec("selenium") is None:
        _missing("selenium is not installed (the [docs] extra)")
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            _missing(f"{path} not found: apt-get install -y {package}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _nav_titles() -> dict[str, str]:
    """``{page: title}`` from ``mkdocs.yml``'s nav."""
    titles = {}
    for line in (ROOT / "mkdocs.yml").read_text(encoding="utf-8").splitlines():
        match = re.fullmatch(r"\s*- (.+?): (\S+\.md)\s*", line)
        if match:
            titles[match.group(2)] = match.group(1)
    return titles


def test_docstrings_name_pages_of_the_docs():
    """An installed package has no docs/ folder: its sources name the site's pages instead."""
    titles = set(_nav_titles().values())
    assert len(titles) == len(_nav_titles()), "two pages share a title"
    for path in sorted((ROOT / "muonscale").rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT)
        assert not re.search(r"docs/\w+\.md|BENCHMARKS\.md", text), f"{rel} names a docs file"
        for title in re.findall(r"\*([^*\n]+)\* in the docs", text):
            assert title in titles, f"{rel}: no page titled {title!r} in mkdocs.yml"


def test_api_reference_lists_every_public_name(site):
    for page, module in API_MODULES:
        html = (site / "docs" / "api" / page / "index.html").read_text(encoding="utf-8")
        html = html.replace("<wbr>", "")  # the break points after a heading's dots
        missing = [n for n in _all_of(module) if f"{module}.{n}" not in html]
        assert not missing, f"docs/api/{page}: no entry for {missing}"


def test_every_document_is_on_the_site(site):
    pages = ["README.md", "BENCHMARKS.md", *(f"docs/{p.name}" for p in ROOT.glob("docs/*.md"))]
    for page in pages:
        stem = page.removesuffix(".md")
        built = site / ("index.html" if stem == "README" else f"{stem}/index.html")
        if stem == "docs/README":
            built = site / "docs" / "index.html"
        assert built.is_file(), f"{page} is not on the site"


def test_site_links_nowhere_outside_itself(site):
    for page in site.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        for attr in ("href", "src"):
            for scheme in ("http://", "https://", "//"):
                assert f'{attr}="{scheme}' not in html, f"{page.relative_to(site)}: {attr} {scheme}"


def test_site_opens_in_chromium(served, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 30)
    browser.get(served + "/")
    assert browser.find_element(By.TAG_NAME, "h1").text.strip().startswith("muonscale")
    nav = [
        a.get_attribute("textContent").strip()
        for a in browser.find_elements(By.CSS_SELECTOR, ".navbar a")
    ]
    assert "Train" in nav and "muonscale.distributed" in nav, nav

    browser.get(served + "/docs/api/muonscale/")
    heading = wait.until(ec.presence_of_element_located((By.ID, "muonscale.optimizer.Muon")))
    assert "muonscale.Muon" in heading.text
    signature = browser.find_element(
        By.CSS_SELECTOR, "#muonscale\\.optimizer\\.Muon + .doc-signature"
    )
    assert "weight_decay" in signature.text

    # Search: the search box of the page, as a reader uses it (the index loads over HTTP).
    browser.find_element(By.CSS_SELECTOR, '[data-bs-target="#mkdocs_search_modal"]').click()
    query = wait.until(ec.visibility_of_element_located((By.ID, "mkdocs-search-query")))
    query.send_keys("orthogonalized")

    def results(driver):
        found = driver.find_elements(By.CSS_SELECTOR, "#mkdocs-search-results article a")
        if not found:  # the index may still have been loading: search again, as typing does
            query.send_keys(Keys.BACKSPACE, "d")
        return found

    hits = wait.until(results)
    targets = [a.get_attribute("href") for a in hits]
    assert all(t.startswith(served) for t in targets), targets
    browser.get(targets[0])
    # the hit's page, once loaded (under load the driver returned with the document still empty)
    wait.until(lambda driver: "orthogonaliz" in driver.page_source.lower())


def test_api_pages_open_on_their_lead_fold_long_tables_and_show_no_private_bases(site):
    html = (site / "docs" / "api" / "muonscale" / "index.html").read_text(encoding="utf-8")
    entries = re.findall(r'<h2 id="(muonscale\.[\w.]+)" class="doc doc-heading"', html)
    assert entries[0] == "muonscale.optimizer.Muon", entries[:3]
    table = html.index('id="muonscale.newton_schulz.COEFFICIENT_PRESETS"')
    folded = html.index("<details><summary>The value of <code>COEFFICIENT_PRESETS</code>", table)
    assert "polar_express" not in html[table:folded], "the preset table shows unfolded"
    for page in (site / "docs" / "api").glob("*/index.html"):
        for bases in re.findall(r"Bases: (.*?)</p>", page.read_text(encoding="utf-8")):
            names = re.findall(r"<code>(.*?)</code>", bases)
            shown = [re.sub(r"<[^>]+>", "", n) for n in names]
            assert not [n for n in shown if re.search(r"(^|\.)_|\(", n)], (page, shown)


# Every heading of the article and every entry of the sidebar, as the rectangle of its text
# (a Range over its contents: text that overflows its element is in it), with the box it must
# stay in (the article's column, the sidebar's card).
BOXES_JS = """
const rect = (r) => ({left: r.left, right: r.right, top: r.top, bottom: r.bottom});
const textRect = (el) => { const r = document.createRange(); r.selectNodeContents(el);
                           return rect(r.getBoundingClientRect()); };
const main = document.querySelector('[role="main"]');
const side = document.querySelector('#toc-collapse');
const out = [];
for (const el of main.querySelectorAll('h1, h2, h3, h4, h5, h6')) {
  out.push({kind: 'heading', text: el.textContent.trim().slice(0, 80), box: textRect(el),
            within: rect(main.getBoundingClientRect())});
}
for (const el of side.querySelectorAll('a')) {
  out.push({kind: 'sidebar', text: el.textContent.trim().slice(0, 80), box: textRect(el),
            within: rect(side.getBoundingClientRect())});
}
return {boxes: out, scrollWidth: document.documentElement.scrollWidth,
        innerWidth: window.innerWidth};
"""


def layout_defects(found: dict) -> list[str]:
    """What is wrong in :data:`BOXES_JS`'s answer: a text outside its box, two texts that
    overlap, a page wider than the window."""
    slack = 1.0  # CSS pixels of rounding
    defects = []
    if found["scrollWidth"] > found["innerWidth"] + slack:
        defects.append(f"the page scrolls sideways: {found['scrollWidth']} > {found['innerWidth']}")
    boxes = [b for b in found["boxes"] if b["box"]["right"] > b["box"]["left"]]
    for b in boxes:
        r, w = b["box"], b["within"]
        if r["left"] < w["left"] - slack or r["right"] > w["right"] + slack:
            defects.append(f"{b['kind']} {b['text']!r} runs out of its box: {r} not in {w}")
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            ra, rb = a["box"], b["box"]
            if (
                min(ra["right"], rb["right"]) - max(ra["left"], rb["left"]) > slack
                and min(ra["bottom"], rb["bottom"]) - max(ra["top"], rb["top"]) > slack
            ):
                defects.append(f"{a['kind']} {a['text']!r} overlaps {b['kind']} {b['text']!r}")
    return defects


def test_layout_defects_are_found_in_boxes():
    page = {"left": 0, "right": 1000, "top": 0, "bottom": 900}
    side = {"left": 0, "right": 250, "top": 0, "bottom": 900}
    fine = [
        {
            "kind": "sidebar",
            "text": "a",
            "box": {"left": 10, "right": 240, "top": 10, "bottom": 30},
            "within": side,
        },
        {
            "kind": "heading",
            "text": "b",
            "box": {"left": 280, "right": 990, "top": 10, "bottom": 40},
            "within": page,
        },
    ]
    ok = {"boxes": fine, "scrollWidth": 1000, "innerWidth": 1000}
    assert layout_defects(ok) == []
    spilled = [{**fine[0], "box": {**fine[0]["box"], "right": 300}}, fine[1]]
    found = layout_defects({**ok, "boxes": spilled})
    assert any("runs out of its box" in d for d in found)
    assert any("overlaps heading" in d for d in found)
    assert layout_defects({**ok, "scrollWidth": 1100}) == ["the page scrolls sideways: 1100 > 1000"]


@pytest.mark.parametrize(
    "page",
    ["/docs/integrations/", "/docs/api/muonscale/", "/docs/api/hf/", "/docs/api/distributed/"],
)
def test_no_heading_or_sidebar_entry_overflows_or_overlaps(served, browser, page):
    browser.get(served + page)
    found = browser.execute_script(BOXES_JS)
    assert len([b for b in found["boxes"] if b["kind"] == "sidebar"]) >= 3, found["boxes"][:3]
    defects = layout_defects(found)
    assert not defects, "\n".join(defects[:20])
