"""MkDocs hooks for the docs site (``make docs``).

The site mirrors the repository's layout, so that the relative links that work when reading the
Markdown files in the repository work on the site too: ``README.md`` is the home page,
``BENCHMARKS.md`` sits beside it and ``docs/*.md`` under ``docs/``. The API reference pages
(``docs/api/*.md``) are generated here from the ``__all__`` of each public module, read from the
source without importing it, so that the integrations whose frameworks are not installed are
documented too and no public name can be left out.
"""

from __future__ import annotations

import ast
import html
import re
import tomllib
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
ROOT_PAGES = ("README.md", "BENCHMARKS.md")  # the repository's top-level documents

# (page under docs/api/, module, title, one line on what it needs); a page opens on its LEADS
# names, then its classes, functions and constants, each alphabetical.
API_PAGES = (
    ("muonscale.md", "muonscale", "muonscale", "`import muonscale` needs only torch."),
    (
        "distributed.md",
        "muonscale.distributed",
        "muonscale.distributed",
        "torch.distributed; `muonscale.distributed_muon` picks the class.",
    ),
    (
        "hf.md",
        "muonscale.integrations.hf",
        "Hugging Face Trainer",
        "Needs `transformers` (see *Integrations*).",
    ),
    (
        "lightning.md",
        "muonscale.integrations.lightning",
        "Lightning",
        "Needs `lightning` (see *Integrations*).",
    ),
    (
        "torchtitan.md",
        "muonscale.integrations.torchtitan",
        "torchtitan",
        "Needs `torchtitan` (see *Integrations*).",
    ),
    (
        "megatron.md",
        "muonscale.integrations.megatron",
        "Megatron-Core",
        'Needs `pip install "muonscale[megatron]"` (see *Megatron-Core*).',
    ),
)


LEADS = {
    "muonscale": ("Muon",),
    "muonscale.distributed": ("distributed_muon", "DistributedMuon", "DTensorMuon"),
}
LONG_VALUE_LINES = 4  # a constant whose value's source is longer shows it folded


def entry_order(module: str, name: str) -> tuple:
    """Sort key of a public name on its API page: the module's leads first, then classes,
    functions and constants (``UPPER_CASE``), alphabetical within each."""
    leads = LEADS.get(module, ())
    if name in leads:
        return (0, leads.index(name), "")
    kind = 3 if name.isupper() else 1 if name[:1].isupper() else 2
    return (kind, 0, name.lower())


def folded_value(path: str) -> str | None:
    """For a module constant whose value runs over :data:`LONG_VALUE_LINES` source lines (a
    table such as ``COEFFICIENT_PRESETS``): the assignments that build it, comments dropped,
    as a folded HTML block to show under its entry; ``None`` for anything else."""
    module, name = path.rsplit(".", 1)
    source = module_file(module).read_text(encoding="utf-8")
    tree = ast.parse(source)
    pieces, long = [], False
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            base = [t.value if isinstance(t, ast.Subscript) else t for t in targets]
            if not any(isinstance(b, ast.Name) and b.id == name for b in base):
                continue
            if isinstance(node, ast.AnnAssign) and node.value is None:
                continue
            text = ast.get_source_segment(source, node) or ""
            long |= node.end_lineno - node.lineno + 1 > LONG_VALUE_LINES
            lines = [ln for ln in text.splitlines() if not ln.strip().startswith("#")]
            pieces.append("\n".join(lines))
    if not long:
        return None
    code = html.escape("\n".join(pieces))
    return (
        f"<details><summary>The value of <code>{name}</code> "
        f"({sum(p.count(chr(10)) + 1 for p in pieces)} lines of source)</summary>"
        f"<pre><code>{code}</code></pre></details>"
    )


def module_file(module: str) -> Path:
    """The source file of a ``muonscale`` module (a package's ``__init__.py``)."""
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def public_names(module: str) -> list[str]:
    """The module's ``__all__``, read from its source (or, where it is computed, by importing
    the module)."""
    tree = ast.parse(module_file(module).read_text(encoding="utf-8"))
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                break
    import importlib

    names = getattr(importlib.import_module(module), "__all__", None)
    if names is None:
        raise ValueError(f"{module_file(module)}: no __all__ to build the API reference from")
    return list(names)


def _defined_at_top(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == name:
                return True
        elif isinstance(node, ast.Assign):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return True
        elif isinstance(node, ast.AnnAssign):
            if isinstance(node.target, ast.Name) and node.target.id == name:
                return True
    return False


def defining_path(module: str, name: str) -> str:
    """``package.module.name`` where ``name``, public in ``module``, is defined: followed
    through ``from .x import name`` statically, or, for a name loaded lazily, by import."""
    seen = []
    while True:
        seen.append(module)
        tree = ast.parse(module_file(module).read_text(encoding="utf-8"))
        if _defined_at_top(tree, name):
            return f"{module}.{name}"
        source = None
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and any(
                (a.asname or a.name) == name for a in node.names
            ):
                package = module.split(".")
                if module_file(module).name != "__init__.py":
                    package = package[:-1]
                if node.level:
                    package = package[: len(package) - node.level + 1]
                    source = ".".join(package + ([node.module] if node.module else []))
                else:
                    source = node.module
                break
        if source is None:
            source = _lazy_source(tree, module, name)
        if source is None or not source.startswith("muonscale") or source in seen:
            return _defining_path_by_search(module, name)
        module = source


def _lazy_source(tree: ast.Module, module: str, name: str) -> str | None:
    """The submodule a PEP 562 table (``{"Name": "submodule", ...}`` at top level) loads
    ``name`` from."""
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign | ast.AnnAssign) else None
        if not isinstance(value, ast.Dict):
            continue
        for key, sub in zip(value.keys, value.values):
            if isinstance(key, ast.Constant) and key.value == name:
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    return f"{module}.{sub.value.lstrip('.')}"
    return None


def _defining_path_by_search(module: str, name: str) -> str:
    # A name loaded lazily (PEP 562 ``__getattr__``): the one module of the package that
    # defines it at top level.
    found = []
    for path in sorted((ROOT / "muonscale").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        if _defined_at_top(tree, name):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    if len(found) != 1:
        raise ValueError(
            f"API reference: {module}.{name} is defined in {found or 'no module'}; "
            "expected exactly one muonscale module"
        )
    return f"{found[0]}.{name}"


def api_page(module: str, title: str, needs: str, documented: set[str]) -> str:
    """The Markdown of one API page: one mkdocstrings entry per public name; a name already
    documented on an earlier page (re-exported) links there."""
    lines = [f"# {title}", "", f"`{module}`: {needs}", ""]
    again = []
    for name in sorted(public_names(module), key=lambda n: entry_order(module, n)):
        path = defining_path(module, name)
        if path in documented:
            again.append(f"- [`{module}.{name}`][{path}]")
            continue
        documented.add(path)
        lines += [f"::: {path}", "    options:", f"      heading: {module}.{name}"]
        folded = folded_value(path) if name.isupper() else None
        if folded is not None:
            lines += ["      show_attribute_values: false", "", folded]
        lines.append("")
    if again:
        lines += ["## Documented on another page", "", *again, ""]
    return "\n".join(lines)


_HEADING = re.compile(r"(<h[1-6][^>]*>)(.*?)(</h[1-6]>)", re.S)
_DOTTED = re.compile(r"(?<=\w)\.(?=[A-Za-z_])")


def on_page_content(html_text: str, page, config, files) -> str:
    """A line may break after each dot of a dotted name in a heading (``muonscale.<wbr>...``),
    so long API paths wrap there rather than mid-word (the theme's CSS breaks anywhere as a last
    resort)."""

    def wrap(match: re.Match) -> str:
        parts = re.split(r"(<[^>]+>)", match.group(2))  # text outside the tags only
        inner = "".join(p if p.startswith("<") else _DOTTED.sub(".<wbr>", p) for p in parts)
        return match.group(1) + inner + match.group(3)

    return _HEADING.sub(wrap, html_text)


def on_config(config):
    """The version in the footer, from ``pyproject.toml`` (its one source)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        config.extra["version"] = tomllib.load(f)["project"]["version"]
    return config


def on_files(files: Files, config) -> Files:
    """Lay the site out as the repository is: root documents, then ``docs/`` under ``docs/``."""
    out = Files([])
    for name in ROOT_PAGES:
        out.append(File.generated(config, name, abs_src_path=str(ROOT / name)))
    docs_dir = Path(config["docs_dir"]).resolve()
    for f in files:
        if f.abs_src_path is None or not Path(f.abs_src_path).resolve().is_relative_to(docs_dir):
            out.append(f)  # the theme's assets
        elif not f.inclusion.is_excluded():
            out.append(File.generated(config, f"docs/{f.src_uri}", abs_src_path=f.abs_src_path))
    documented: set[str] = set()
    for page, module, title, needs in API_PAGES:
        content = api_page(module, title, needs, documented)
        out.append(File.generated(config, f"docs/api/{page}", content=content))
    return out
