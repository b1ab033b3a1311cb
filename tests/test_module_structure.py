"""The package's module structure, read from the source with ``ast``: no import circle
(type-check-only imports included), and no module reads another muonscale module's private
names."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "muonscale"


@cache
def modules() -> dict[str, tuple[Path, ast.Module]]:
    """Dotted module name -> (file, parsed source), for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = (path, ast.parse(path.read_text(), filename=str(path)))
    return found


def imported_from(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from ... import`` ``node`` in module ``name``."""
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, wherever the import stands (functions and
    ``if TYPE_CHECKING:`` blocks included). ``from package import sub`` is an edge to ``sub``
    when ``sub`` is a module, else to ``package``."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, (path, tree) in mods.items():
        targets: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                source = imported_from(name, path, node)
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if sub in mods else source)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that ends where it starts, or None."""
    on_path: list[str] = []
    done: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in on_path:
            return on_path[on_path.index(node) :] + [node]
        if node in done:
            return None
        on_path.append(node)
        for target in sorted(graph[node]):
            cycle = visit(target)
            if cycle:
                return cycle
        on_path.pop()
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start)
        if cycle:
            return cycle
    return None


def test_import_graph_has_no_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_type_checking_circle():
    """The oracle itself: a circle through an ``if TYPE_CHECKING:`` import is found."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_reads_every_import_form(monkeypatch):
    """The oracle itself, on a stand-in package: relative, absolute, ``from package import
    module`` and type-check-only imports are edges."""
    source = {
        "muonscale": "from .a import A",
        "muonscale.a": "from muonscale.b import B",
        "muonscale.b": "from muonscale import c",
        "muonscale.c": "if TYPE_CHECKING:\n    import muonscale.a",
    }
    fake = {
        name: (
            PACKAGE / ("__init__.py" if name == "muonscale" else f"{name[10:]}.py"),
            ast.parse(s),
        )
        for name, s in source.items()
    }
    monkeypatch.setitem(globals(), "modules", lambda: fake)
    graph = import_graph()
    assert graph == {
        "muonscale": {"muonscale.a"},
        "muonscale.a": {"muonscale.b"},
        "muonscale.b": {"muonscale.c"},
        "muonscale.c": {"muonscale.a"},
    }
    assert find_cycle(graph) == ["muonscale.a", "muonscale.b", "muonscale.c", "muonscale.a"]


def is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def defined_private_names(tree: ast.Module) -> set[str]:
    """The ``_``-prefixed names a module defines: module-level names, methods and class
    attributes, and attributes it assigns (``self._x = ...``, ``obj._x = ...``)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
    return {n for n in names if is_private(n)}


def on_own_object(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object whose class this method belongs to."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def private_reads() -> list[str]:
    """Every place one muonscale module reads (or writes) a ``_``-prefixed name another
    muonscale module defines: ``from muonscale.m import _x`` (any form), and ``obj._x`` (or
    ``getattr(obj, "_x")``) where ``obj`` is not ``self``/``cls``/``super()`` and ``_x`` is
    defined in another module of the package. Names only outside libraries define (torch's
    ``_foreach_norm``, ``Tensor._version``) are not the package's."""
    mods = modules()
    defined = {name: defined_private_names(tree) for name, (_, tree) in mods.items()}
    found = []
    for name, (path, tree) in mods.items():
        elsewhere = set().union(*(d for other, d in defined.items() if other != name))
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = imported_from(name, path, node)
                if source.split(".")[0] != "muonscale":
                    continue
                found += [
                    f"{where}:{node.lineno}: from {source} import {alias.name}"
                    for alias in node.names
                    if is_private(alias.name)
                ]
            elif isinstance(node, ast.Attribute):
                if is_private(node.attr) and node.attr in elsewhere:
                    if not on_own_object(node.value):
                        found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and is_private(node.args[1].value)
                and node.args[1].value in elsewhere
                and not on_own_object(node.args[0])
            ):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_reads_another_modules_private_names():
    reads = private_reads()
    assert not reads, "private reads across modules:\n" + "\n".join(reads)


@pytest.mark.parametrize(
    "source, reads",
    [
        ("x = opt._name(p)", True),
        ("x = getattr(opt, '_name')", True),
        ("x = self._name(p)", False),
        ("x = super()._name(p)", False),
        ("x = p.grad._version", False),  # torch's, not the package's
        ("opt._name = None", True),
        ("from muonscale.optimizer import _hidden", True),
        ("from .optimizer import _hidden", True),
    ],
)
def test_private_read_finder(source, reads, monkeypatch):
    """The oracle itself, on a stand-in package: ``_name`` defined in one module, read in
    another."""
    fake = {
        "muonscale.optimizer": (
            PACKAGE / "optimizer.py",
            ast.parse("class Muon:\n    def _name(self, p): ..."),
        ),
        "muonscale.helper": (PACKAGE / "helper.py", ast.parse(source)),
    }
    monkeypatch.setitem(globals(), "modules", lambda: fake)
    assert bool(private_reads()) == reads
