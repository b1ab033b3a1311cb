"""The Python blocks of ``docs/megatron.md`` marked ``env: megatron`` (``tests/docs_blocks.py``)
run as written on a tiny Megatron-Core GPT on CPU: under torchrun on gloo, or in one process on
a world of one rank; the optimizer a block builds then takes a step."""

from __future__ import annotations

from pathlib import Path

import pytest
from docs_blocks import blocks_for, one_rank_world, run_under_torchrun
from docs_stand_ins import build
from docs_stand_ins_megatron import STAND_INS, _data

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("block", blocks_for("megatron"))
def test_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if block.torchrun:
        out = run_under_torchrun(block, tmp_path, "docs_stand_ins_megatron", HERE)
        assert "muon" in out.lower()  # the printed summary
        return
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
