"""The Megatron NorMuon assets (``tests/assets/compat/megatron/``, written by an earlier
version with ``compat_asset.py``: TP 2, and TP 2 × DP 2 ZeRO-1) load into today's adapter:
every state tensor as saved, and the continued step as recorded (bitwise on the recording's
torch and CPU kernels, within 1e-6 relative elsewhere)."""

from __future__ import annotations

import compat_asset
import pytest
from test_compat_assets import state_mismatches, step_mismatches

pytestmark = pytest.mark.timeout(300)


def _check(results) -> None:
    for rank, out in enumerate(results):
        assert state_mismatches(out["saved"], out["loaded"]) == [], rank
        assert step_mismatches(out["recorded"], out["computed"], out["platform"]) == [], rank
        assert any("row_second_moment" in s for s in out["loaded"].values()), rank


def test_megatron_tp2_normuon_asset_loads_and_continues(pool2):
    _check(pool2.run(compat_asset.resume, "tp2"))


def test_megatron_zero1_tp2_dp2_normuon_asset_loads_and_continues(pool4):
    _check(pool4.run(compat_asset.resume, "zero1"))
