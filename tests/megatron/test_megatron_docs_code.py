"""The Python blocks of ``docs/megatron.md`` marked ``env: megatron`` (``tests/docs_blocks.py``)
run as written on a tiny Megatron-Core GPT on CPU: under torchrun on gloo, or in one process on
a world of one rank; the optimizer a block builds then takes a step.

A one-rank block runs in a fresh interpreter, not in pytest's: Megatron's parallel state built
and destroyed in the parent would be inherited by the worker pools forked later in the suite,
whose ``initialize_model_parallel`` then waits forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import ROOT, blocks, blocks_for, one_rank_world, run_under_torchrun

HERE = Path(__file__).resolve().parent


def run_in_one_rank(block_id: str) -> None:
    """Run the block ``block_id`` (``path:line``) on a world of one rank, then one step."""
    from docs_stand_ins import build
    from docs_stand_ins_megatron import STAND_INS, _data

    block = next(b for b in blocks() if b.id == block_id)
    with one_rank_world():
        ns = build(block.path, block.stand_ins, STAND_INS)
        try:
            exec(compile(block.code, block.id, "exec"), ns)
            if "opt" in ns:
                model, opt = ns["model"], ns["opt"]
                tokens, positions, mask, labels = _data(ns, steps=1)[0]
                model(tokens, positions, mask, labels=labels).mean().backward()
                before = [p.detach().clone() for p in model.parameters()]
                opt.step()
                moved = [not p.equal(b) for p, b in zip(model.parameters(), before)]
                assert all(moved), "the block's optimizer left parameters unchanged"
            if "config" in ns:
                assert ns["config"].muon_tp_mode in ("exact", "approximate_blockwise")
                assert ns["config"].lr == ns["optimizer_config"].lr
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
    print("docs block done")


@pytest.mark.parametrize("block", blocks_for("megatron"))
def test_block_runs(block, tmp_path):
    if block.torchrun:
        out = run_under_torchrun(block, tmp_path, "docs_stand_ins_megatron", HERE)
        assert "muon" in out.lower()  # the printed summary
        return
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", HERE))
    code = f"import test_megatron_docs_code as t; t.run_in_one_rank({block.id!r})"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"{block.id}\n{done.stdout}\n{done.stderr}"
    assert "docs block done" in done.stdout, done.stdout
