"""Every Python block of the README and ``docs/`` runs as written, on small stand-in models
(``tests/docs_stand_ins.py``), in the suite its marker names (``tests/docs_blocks.py``): here
those of the main environment, one process or under torchrun on gloo, and under ``-m gpu`` the
ones that need CUDA. ``tests/integrations`` and ``tests/megatron`` run theirs."""

from __future__ import annotations

import pytest
import torch
from docs_blocks import ENVS, blocks, blocks_for, run_under_torchrun
from docs_stand_ins import build


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


@pytest.mark.parametrize("block", blocks_for("main"))
def test_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if block.torchrun:
        run_under_torchrun(block, tmp_path, "docs_stand_ins")
    else:
        torch.manual_seed(0)
        _check_trained(_run(block))


@pytest.mark.gpu
@pytest.mark.parametrize("block", blocks_for("main", gpu=True))
def test_gpu_block_runs(block, tmp_path, monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.chdir(tmp_path)
    _check_trained(_run(block))
