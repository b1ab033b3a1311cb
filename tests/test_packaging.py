"""Packaging facts other files rely on."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def test_megatron_extra_matches_the_ci_pins():
    """``pip install muonscale[megatron]`` accepts exactly the versions CI tests against."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["megatron"]
    wanted = {Requirement(r).name: Requirement(r).specifier for r in extra}
    script = (ROOT / ".ci" / "megatron_env.sh").read_text()
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][^"]*)"', script))
    assert set(wanted) == {"megatron-core", "emerging-optimizers"}
    for name, specifier in wanted.items():
        assert name in pins, f"{name} is not pinned in .ci/megatron_env.sh"
        assert specifier.contains(pins[name]), (
            f"CI pins {name}=={pins[name]}, the extra says {specifier}"
        )


INTEGRATION_EXTRAS = {
    "hf": {"transformers", "accelerate"},
    "lightning": {"lightning"},
    "torchtitan": {"torchtitan"},
}


def test_integration_extras_match_the_ci_pins():
    """``pip install muonscale[hf|lightning|torchtitan]`` accepts the versions CI tests."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    script = (ROOT / ".ci" / "integrations_env.sh").read_text()
    pins = dict(re.findall(r'"([A-Za-z0-9_.-]+)==([0-9][^"]*)"', script))
    for extra, names in INTEGRATION_EXTRAS.items():
        wanted = {Requirement(r).name: Requirement(r).specifier for r in extras[extra]}
        assert set(wanted) == names, extra
        for name, specifier in wanted.items():
            assert name in pins, f"{name} is not pinned in .ci/integrations_env.sh"
            assert str(specifier), f"extra {extra}: {name} has no version range"
            assert specifier.contains(pins[name]), (
                f"CI pins {name}=={pins[name]}, the extra {extra} says {specifier}"
            )


def _python_blocks(markdown: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", markdown, flags=re.M | re.S)


def test_the_long_description_runs_and_stands_alone(capsys):
    """PYPI.md is read on the package index: install comes first, its Python runs as
    written, and it has no relative links (nothing of the repository is there)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    text = (ROOT / project["readme"]).read_text()
    headings = re.findall(r"^## (.+)$", text, flags=re.M)
    assert headings[0] == "Install"
    links = re.findall(r"\]\(([^)]+)\)", text) + re.findall(r'(?:src|href)="([^"]+)"', text)
    assert not links, f"links in {project['readme']}: {links}"
    blocks = _python_blocks(text)
    assert blocks
    for block in blocks:
        exec(compile(block, project["readme"], "exec"), {"__name__": "__pypi__"})
    assert "hidden.weight" in capsys.readouterr().out


def test_version_license_and_changelog():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert (ROOT / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    changelog = (ROOT / "CHANGELOG.md").read_text()
    # fixes not yet released gather under "## Unreleased", above the latest release
    latest = re.search(r"^## (?!Unreleased$)(\S+)", changelog, flags=re.M).group(1)
    assert latest == project["version"], "CHANGELOG.md's latest release is the version"
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "muonscale" / "py.typed").is_file()


def test_sdist_holds_docs_examples_and_license(tmp_path, monkeypatch):
    """The source distribution carries what its readers need beside the package."""
    import tarfile

    from setuptools import build_meta

    monkeypatch.chdir(ROOT)  # setuptools builds the project in the working directory
    name = build_meta.build_sdist(str(tmp_path))
    with tarfile.open(tmp_path / name) as sdist:
        members = {m.split("/", 1)[1] for m in sdist.getnames() if "/" in m}
        info = sdist.extractfile(f"{name.removesuffix('.tar.gz')}/PKG-INFO").read().decode()
    for path in ("LICENSE", "CHANGELOG.md", "PYPI.md", "muonscale/py.typed", "MANIFEST.in"):
        assert path in members, path
    docs = {p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")}
    examples = {p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").glob("*.py")}
    assert docs and docs <= members and examples and examples <= members
    assert "License-Expression: Apache-2.0" in info
    assert "Classifier: Typing :: Typed" in info
