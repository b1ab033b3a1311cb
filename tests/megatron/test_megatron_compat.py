"""The Megatron NorMuon assets (``tests/assets/compat/megatron/``, written by an earlier
version with ``compat_asset.py``: TP 2, and TP 2 × DP 2 ZeRO-1; a row-split matrix's row
moment held its local rows) load into today's adapter: the row moment in memory is the whole
matrix's, equal on both TP ranks; every state tensor saves as it was saved (a TP rank's own
rows of the row moment); the continued step is the recorded one within rounding (NorMuon now
runs at the owner of each whole matrix and sums its rows in another order)."""

from __future__ import annotations

import compat_asset
import pytest
import torch
from test_compat_assets import state_mismatches

pytestmark = pytest.mark.timeout(300)

LARGEST_DIM = 2 * compat_asset.SHAPE["ffn_hidden_size"]
"""The longest side of an asset's matrix (gated fc1): the longest row or column sum."""


def step_mismatches(saved: dict, recorded: dict, computed: dict) -> list[str]:
    """Parameters whose continued step differs from the recorded one by more than the
    rounding of NorMuon's row sums in another order: a relative error of √k·eps (k terms,
    random-walk rounding) in a row's factor, on rows and columns, relative to the step's
    largest change of that tensor, with a factor 4 of margin."""
    tol = 4 * 2 * LARGEST_DIM**0.5 * torch.finfo(torch.float32).eps
    out = []
    for name, want in recorded.items():
        moved = (want - saved[name]).abs().max().clamp_min(torch.finfo(want.dtype).tiny)
        err = (computed[name] - want).abs().max() / moved
        if err > tol:
            out.append(f"{name}: max |dW| {err.item():.3g} of the step, tol {tol:.3g}")
    return out


def _check(results, tp: int = 2) -> None:
    for rank, out in enumerate(results):
        assert state_mismatches(out["saved"], out["loaded"]) == [], rank
        assert step_mismatches(out["params"], out["recorded"], out["computed"]) == [], rank
        assert any("row_second_moment" in s for s in out["loaded"].values()), rank
        assert out["replicas"], rank
        for name, (dim, size, local_rows, replica) in out["replicas"].items():
            whole_rows = local_rows * (size if dim == 0 else 1)  # rows split over TP: all of them
            assert replica.shape == (whole_rows,), name
        assert any(dim == 0 and size == tp for dim, size, *_ in out["replicas"].values())
    for first, second in zip(results[::tp], results[1::tp]):  # the ranks of one TP group
        for name, replica in first["replicas"].items():
            assert torch.equal(replica[-1], second["replicas"][name][-1]), name


def test_megatron_tp2_normuon_asset_loads_and_continues(pool2):
    _check(pool2.run(compat_asset.resume, "tp2"))


def test_megatron_zero1_tp2_dp2_normuon_asset_loads_and_continues(pool4):
    _check(pool4.run(compat_asset.resume, "zero1"))
