"""The built wheel, installed alone with torch into a fresh virtual environment, runs the main
jobs: ``muonscale --version``, a 10-step ``train`` and a 10-step ``bench``; and its documentation
is there: ``muonscale docs`` lists the site's pages and prints them as the repository has them.

``slow``: it builds a venv and installs torch (from the local wheel cache or the index), then
trains twice, about a minute and a half on two shared CPU cores. ``make dist`` runs it on the
wheel it built (``MUONSCALE_WHEEL``); without that variable the wheel is built here with
``pip wheel``.
"""

import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCH = os.environ.get("TORCH_VERSION", "2.13.0")
TINY_MODEL = "--n-layer 1 --d-model 32 --n-head 2 --steps 10 --device cpu".split()

pytestmark = pytest.mark.slow


def _run(argv, *, cwd, timeout=300) -> subprocess.CompletedProcess:
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    print(f"{time.perf_counter() - start:5.1f} s  {' '.join(map(str, argv))[:100]}")
    assert done.returncode == 0, f"{argv}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def _wheel(tmp_path: Path) -> Path:
    given = os.environ.get("MUONSCALE_WHEEL")
    if given:
        return Path(given).resolve()
    out = tmp_path / "wheelhouse"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, ROOT], cwd=tmp_path)
    (wheel,) = out.glob("muonscale-*.whl")
    return wheel


def test_the_wheel_runs_version_train_and_bench_in_a_fresh_venv(tmp_path):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel = _wheel(tmp_path)
    assert wheel.name.startswith(f"muonscale-{version}-")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp_path)
    # this interpreter's pip installs into the new venv (--python): no pip bootstrap there
    pip = [sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "-q"]
    # --no-compile: byte-compiling torch's sources would take most of this test's time
    _run([*pip, "--no-compile", f"torch=={TORCH}", wheel], cwd=tmp_path, timeout=600)
    muonscale = venv / "bin" / "muonscale"

    shown = _run([muonscale, "--version"], cwd=tmp_path).stdout.strip()
    assert shown == f"muonscale {version}"
    typed = _run(
        [venv / "bin" / "python", "-c", "import muonscale, pathlib; print(muonscale.__file__)"],
        cwd=tmp_path,
    ).stdout.strip()
    assert (Path(typed).parent / "py.typed").is_file()
    # the CPU loop of 8-bit state ships as C source and compiles from the installed package
    kernel_check = (
        "import os; os.environ['MUONSCALE_CACHE_DIR'] = 'kernel-cache'; "
        "from muonscale.kernels.cpu_quantization import SOURCE, compiled_library; "
        "assert SOURCE.is_file() and compiled_library() is not None"
    )
    _run([venv / "bin" / "python", "-W", "error::RuntimeWarning", "-c", kernel_check], cwd=tmp_path)

    listed = _run([muonscale, "docs"], cwd=tmp_path).stdout
    for name, title in (("options", "Options"), ("benchmarks", "Benchmarks"), ("home", "Home")):
        assert f"  {name} " in listed and listed.rstrip().count("\n") > 10, listed
        assert title in listed
    for asked, source in (
        ("options", "docs/options.md"),
        ("Newton–Schulz", "docs/newton_schulz.md"),
    ):
        printed = _run([muonscale, "docs", asked], cwd=tmp_path).stdout
        assert printed == (ROOT / source).read_text(encoding="utf-8"), asked

    train = _run(
        [muonscale, "train", *TINY_MODEL, "--micro-batch-size", "2", "--eval-every", "5"]
        + ["--eval-batches", "1", "--out-dir", tmp_path / "train"],
        cwd=tmp_path,
    )
    last = train.stdout.strip().splitlines()[-1]
    assert last.startswith("muonscale train: 10 steps,") and "val loss" in last, train.stdout
    assert "train: 10/10 steps" in train.stderr  # progress without tqdm
    assert (tmp_path / "train" / "checkpoint.pt").is_file()

    bench = _run(
        [muonscale, "bench", *TINY_MODEL, "--tokens-per-step", "256", "--eval-batches", "1"]
        + ["--memory-probe-steps", "0", "--timing-warmup-steps", "0", "--workers", "1"]
        + ["--out", tmp_path / "bench"],
        cwd=tmp_path,
    )
    assert 'pip install "muonscale[bench]"' in bench.stderr  # no matplotlib: named, not fatal
    assert (tmp_path / "bench" / "report.md").is_file()
    assert (tmp_path / "bench" / "report.json").is_file()
    assert "report:" in bench.stdout
    assert "- note: 10 steps are too short for this comparison" in bench.stdout
