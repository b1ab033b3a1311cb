"""Step metrics of megatron_muon in what Megatron's logging writes (its TensorBoard and W&B
writers' calls, and the log string): counted over whole matrices, so TP = 2 reports what
TP = 1 does, and the update RMS summed over TP pieces equals the unsharded one (exact TP)."""

from __future__ import annotations

import pytest
import step_metrics_workers as SW
import torch

OPTIONS = dict(lr=0.02, weight_decay=0.1, scale="unit_rms", adam_lr=0.01, ns_dtype=torch.float32)


@pytest.mark.parametrize("precision", ["param", "int8"])
def test_step_metrics_in_megatron_writers_at_tp1_and_tp2(pool2, precision):
    """``int8``: at TP 2 the row-parallel weights and the TP-sharded biases hold columns of
    their rows (scales shared over the TP group); AdamW's update RMS is read from the stored
    8-bit moments' values, the same state as TP 1's."""
    runs = {}
    for tp in (1, 2):
        spec = dict(tp=tp, steps=2, options=dict(OPTIONS, state_precision=precision))
        runs[tp] = pool2.run(SW.run, spec, timeout=600)
        ns_full = runs[tp][0]["ns_full"]
        assert runs[tp][0]["scalars"]["muon/ns_elements"] == {1: ns_full, 2: ns_full}
        assert runs[tp][0]["wandb"][2]["muon/ns_elements"] == ns_full
        assert f" muon/ns_elements: {ns_full:.6g} |" in runs[tp][0]["lines"][-1]
    one, two = runs[1][0]["metrics"], runs[2][0]["metrics"]
    assert runs[2][1]["metrics"] == two  # every rank reads the combined figures
    for name in ("ns_tensors", "ns_elements", "adamw_elements", "skipped_elements"):
        assert two[f"muon/{name}"] == one[f"muon/{name}"], name
    for name, value in one.items():
        if "/update_rms/" in name:
            # float32 Newton–Schulz on whole matrices either way; the squares are summed in
            # another order (pieces): relative ~ 1e-6
            assert two[name] == pytest.approx(value, rel=1e-5), name
