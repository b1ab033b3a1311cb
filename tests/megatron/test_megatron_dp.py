"""TP = 2 × DP = 2 on 4 gloo ranks against TP = 1 × DP = 4: data-parallel gradient averaging
over Megatron's DP group plus the exact TP exchange give the TP = 1 result."""

from __future__ import annotations

import megatron_workers as W
import pytest
import test_megatron_low_bit as low_bit

OPTIONS = dict(
    lr=0.002,
    weight_decay=0.1,
    muon_momentum=0.9,
    muon_nesterov=True,
    scale="unit_rms",
    adam_lr=0.001,
)


def _run(pool, **spec):
    spec.setdefault("steps", 3)
    spec.setdefault("options", OPTIONS)
    return pool.run(W.run, spec, timeout=600)[0]


@pytest.fixture(scope="module")
def tp1_dp4(pool4):
    return _run(pool4, tp=1, grads="inject", options=dict(OPTIONS, dp_mode="replicated"))


@pytest.mark.parametrize("dp_mode", ["zero1", "replicated"])
def test_tp2_dp2_equals_tp1_dp4_with_identical_gradients(pool4, tp1_dp4, dp_mode):
    mixed = _run(pool4, tp=2, grads="inject", options=dict(OPTIONS, dp_mode=dp_mode))
    delta = W.max_abs_diff(tp1_dp4["params"], mixed["params"])
    print(
        f"\nTP1xDP4 vs TP2xDP2 ({dp_mode}), identical gradients: max|dW| = {delta:.3g}; "
        f"{mixed['breakdown']}"
    )
    assert delta <= 1e-6
    assert mixed["dp_mode"] == dp_mode
    assert "muon_tp/all_to_all" in mixed["breakdown"]
    if dp_mode == "replicated":  # DP gradient all-reduce, TP all-to-alls, one 8-byte norm
        assert set(mixed["breakdown"]) == {
            "grads/all_reduce",
            "muon_tp/all_to_all",
            "grad_norm/all_reduce",
        }
        assert mixed["breakdown"]["grad_norm/all_reduce"] <= 8 * 2  # ring all-reduce of 1 fp64


@pytest.mark.parametrize("dp_mode", ["zero1"])
def test_tp2_dp2_batch_split_across_ranks(pool4, dp_mode):
    """Each DP rank gets its slice of the global batch (TP 1: 4 slices of 1 sequence, TP 2:
    2 slices of 2), so gradients are averaged in a different order; design target <= 1e-3."""
    ref = _run(pool4, tp=1, grads="split_batch", options=dict(OPTIONS, dp_mode=dp_mode))
    mixed = _run(pool4, tp=2, grads="split_batch", options=dict(OPTIONS, dp_mode=dp_mode))
    muon_delta = W.max_abs_diff(ref["params"], mixed["params"], ref["muon_names"])
    delta = W.max_abs_diff(ref["params"], mixed["params"])
    print(
        f"\nTP1xDP4 vs TP2xDP2, batch split: Muon matrices max|dW| = {muon_delta:.3g}, "
        f"all = {delta:.3g}"
    )
    assert muon_delta <= 1e-5
    assert delta <= 1e-3


def test_zero1_tp2_dp2_quantized_row_parallel_equals_replicated(pool4):
    """int8 / int4 state at TP 2 × DP 2: the ZeRO-1 owners of a row-parallel weight (the same
    data-parallel rank on both TP ranks) share its cut blocks' scales over the TP group, so
    weights and state equal the replicated run's bitwise (:func:`test_megatron_low_bit.
    check_zero1_tp2`)."""
    per_rank = pool4.run(low_bit.run_zero1_tp2, timeout=600)
    assert len(per_rank) == 4
    low_bit.check_zero1_tp2(per_rank)
