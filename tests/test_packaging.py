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
