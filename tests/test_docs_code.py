"""Every Python block of the README and ``docs/`` runs as written, on small stand-in models
(``tests/docs_stand_ins.py``), in the suite its marker names (``tests/docs_blocks.py``): here
those of the main environment, one process or under torchrun on gloo, and under ``-m gpu`` the
ones that need CUDA. ``tests/integrations`` and ``tests/megatron`` run theirs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed_harness import free_port
from docs_blocks import ENVS, ROOT, blocks, blocks_for
from docs_stand_ins import build

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "docs_block_runner.py"


def _run(block) -> dict:
    ns = build(block.path, block.stand_ins)
    exec(compile(block.code, f"{block.path}:{block.line}", "exec"), ns)
    return ns


def _check_trained(ns) -> None:
    """A block that builds an optimizer and steps it leaves state behind."""
    for value in ns.values():
        if isinstance(value, torch.optim.Optimizer):
            assert value.state, "the block's optimizer never stepped"


def test_every_block_is_marked_for_a_suite_or_a_fragment():
    found = blocks()  # raises on an unknown or malformed marker
    assert found, "no Python blocks found in the README and docs/"
    for block in found:
        assert block.fragment or block.env in ENVS, block.id
        if block.fragment:
            assert "import" not in block.code, f"{block.id}: a fragment with imports is code to run"


@pytest.mark.parametrize("block", blocks_for("main"), ids=lambda b: b.id)
def test_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if block.torchrun:
        (tmp_path / "block.py").write_text(block.code, encoding="utf-8")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
        cmd += [str(block.torchrun), "--master-addr", "127.0.0.1"]
        cmd += ["--master-port", str(free_port()), str(RUNNER), block.path, "block.py"]
        cmd += list(block.stand_ins)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{block.id}\n{done.stdout}\n{done.stderr}"
        assert done.stdout.count("docs block done") == block.torchrun, done.stdout
    else:
        torch.manual_seed(0)
        _check_trained(_run(block))


@pytest.mark.gpu
@pytest.mark.parametrize("block", blocks_for("main", gpu=True), ids=lambda b: b.id)
def test_gpu_block_runs(block, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.chdir(tmp_path)
    _check_trained(_run(block))
