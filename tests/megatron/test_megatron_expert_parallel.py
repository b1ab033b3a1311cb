"""Megatron-Core expert parallelism on CPU (all-gather token dispatcher; the all-to-all one
creates a CUDA stream in its constructor): a GPT with 4 ``SequentialMLP`` experts at (TP, ETP,
EP) layouts against the layout (1, 1, 1), with identical gradients injected by global name
(ep_workers.py).

Oracle: the parameters after the steps equal those of the reference layout to float32
rounding, and so does the global gradient norm (each expert's gradient counted once across
expert-parallel ranks)."""

from __future__ import annotations

import ep_workers as E
import megatron_workers as W
import pytest
import torch

OPTIONS = dict(
    lr=0.02, weight_decay=0.1, muon_momentum=0.9, muon_nesterov=True, scale="unit_rms", adam_lr=0.01
)
STEPS = 2
# Identical gradients; layouts differ only in where whole matrices are summed and in which
# batches Newton–Schulz runs: float32 rounding (eps 1.2e-7) amplified ≲ 10 by 5 iterations,
# on 2 updates of size lr · 0.2 · sqrt(max dim) ≲ 0.05 → 1e-6.
ATOL = 1e-6


def _run(pool, layout, **spec):
    spec = dict(
        layout=layout, steps=STEPS, options=dict(OPTIONS, **spec.pop("options", {})), **spec
    )
    return pool.run(E.run, spec, timeout=600)[0]


@pytest.fixture(scope="module")
def reference(pool2):
    return _run(pool2, (1, 1, 1))


def _check(reference, got, label):
    moved = max(float((reference["initial"][n] - t).abs().max()) for n, t in got["params"].items())
    assert moved > 1e-2  # the steps moved the weights
    assert sorted(got["params"]) == sorted(reference["params"])
    delta = max(float((reference["params"][n] - t).abs().max()) for n, t in got["params"].items())
    print(f"\n{label}: max|dW| vs (1, 1, 1) = {delta:.3g}; grad norms {got['norms']}")
    assert delta <= ATOL, label
    for rank, split in enumerate(got.get("wire_by_kind", [])):
        print(f"{label} rank {rank} optimizer bytes: experts {split['experts']}")
        print(f"{label} rank {rank} optimizer bytes: dense {split['dense']}")
    for want, norm in zip(reference["norms"], got["norms"]):
        assert abs(norm - want) <= 1e-6 * want, (label, reference["norms"], got["norms"])


def test_expert_parallel_two_ranks(pool2, reference):
    """TP 1, ETP 1, EP 2 on 2 ranks (DP 2, expert DP 1): each rank holds 2 of the 4 experts;
    a resume after one step at the same layout is bitwise the uninterrupted run."""
    got = _run(pool2, (1, 1, 2), wire=True, resume_at=1)
    assert got["dp_mode"] == "replicated"
    _check(reference, got, "TP1 ETP1 EP2")
    for split in got["wire_by_kind"]:  # experts whole on their rank, expert DP 1: the norm only
        assert set(split["experts"]) == {"grad_norm/all_reduce"}, split
        assert split["experts"]["grad_norm/all_reduce"] <= 8
    for name, tensor in got["params"].items():
        assert torch.equal(got["resumed"][name], tensor), name


def test_expert_parallel_with_expert_tensor_parallel(pool4, reference):
    """TP 2, ETP 2, EP 2 on 4 ranks (DP 2, expert DP 1): experts sharded over the
    expert-tensor group inside each expert-parallel rank."""
    got = _run(pool4, (2, 2, 2), wire=True)
    _check(reference, got, "TP2 ETP2 EP2")


def test_zero1_experts_in_the_expert_data_group(pool4, reference):
    """TP 1, ETP 1, EP 2 on 4 ranks (DP 4, expert DP 2) with ``dp_mode="zero1"``: dense matrices
    are owned within the data-parallel group, expert matrices within the expert-data group;
    the same parameters and global gradient norm as (1, 1, 1); a resume after one step at the
    same layout is bitwise the uninterrupted run."""
    got = _run(pool4, (1, 1, 2), options=dict(dp_mode="zero1"), resume_at=1, wire=True)
    assert got["dp_mode"] == "zero1"
    dense_ranks, dense_names = got["parts"]["dense"]
    expert_ranks, expert_names = got["parts"]["experts"]
    assert dense_ranks == got["dp_ranks"] and len(dense_ranks) == 4
    assert expert_ranks == got["expert_dp_ranks"] and len(expert_ranks) == 2
    assert expert_names and all("experts" in n for n in expert_names)
    assert dense_names and not any("local_experts" in n for n in dense_names)
    _check(reference, got, "TP1 ETP1 EP2 ZeRO-1")
    # each half reduces and gathers its own buckets: the experts' within the expert-data group
    assert all(sum(split["experts"].values()) > 0 for split in got["wire_by_kind"])
    for name, tensor in got["params"].items():
        assert torch.equal(got["resumed"][name], tensor), name


def test_zero1_experts_with_expert_tensor_parallel(pool4, reference):
    """TP 2, ETP 2, EP 2 on 4 ranks with ``dp_mode="zero1"`` (DP 2, expert DP 1): the expert
    half's ZeRO-1 group is one rank; the TP exchange of experts runs in the expert-tensor group."""
    got = _run(pool4, (2, 2, 2), options=dict(dp_mode="zero1"))
    assert got["dp_mode"] == "zero1"
    assert len(got["parts"]["dense"][0]) == 2 and len(got["parts"]["experts"][0]) == 1
    _check(reference, got, "TP2 ETP2 EP2 ZeRO-1")


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_zero1_experts_quantized_state_equals_replicated(pool4, precision):
    """``state_precision`` int8 / int4 with ZeRO-1 at TP 1, ETP 1, EP 2 on 4 ranks (DP 4, expert
    DP 2): every matrix owned whole in its group (the experts' in the expert-data group), so
    the Muon momentum quantizes as the replicated run's, and the dense half's 8-bit AdamW
    shards share their cut blocks' scales: weights and full state equal the replicated run's
    with the same precision bitwise; a resume after one step is bitwise the uninterrupted
    run, weights and state."""
    options = dict(state_precision=precision)
    replicated = _run(pool4, (1, 1, 2), options=dict(options, dp_mode="replicated"), state=True)
    got = _run(pool4, (1, 1, 2), options=dict(options, dp_mode="zero1"), state=True, resume_at=1)
    assert replicated["dp_mode"] == "replicated" and got["dp_mode"] == "zero1"
    scale_key = "momentum_scale" if precision == "int8" else "momentum_absmax"
    experts = [n for n, s in got["state"].items() if "local_experts" in n and scale_key in s]
    assert len(experts) == 2 * 4 * 2  # fc1 and fc2 of 4 experts in 2 layers, quantized
    assert any("exp_avg_absmax" in s for s in got["state"].values())  # AdamW's 8-bit moments
    W.assert_same_state(got["params"], replicated["params"], "params")
    W.assert_same_state(got["state"], replicated["state"], "state")
    W.assert_same_state(got["resumed"], got["params"], "resumed params")
    W.assert_same_state(got["resumed_state"], got["state"], "resumed state")


def test_expert_tensor_parallel_int8_state_equals_one_layout(pool4):
    """``state_precision="int8"``, replicated, at TP 2, ETP 2, EP 2 against (1, 1, 1): the
    row-parallel ``linear_proj`` and expert ``linear_fc2`` pieces share their cut blocks'
    scales over the tensor-parallel and the expert-tensor group; the state depends on the
    gradients only, so every parameter's gathered codes and scales equal the (1, 1, 1) run's
    bitwise. ZeRO-1 at the same layout (DP 2, expert DP 1): the owners of those pieces (the
    same rank of each data-parallel group on every TP or ETP rank) share them as well, and the
    TP-sharded biases' AdamW segments over data parallel and TP: weights bitwise the
    replicated run's, state the (1, 1, 1) run's."""
    options = dict(state_precision="int8", dp_mode="replicated")
    whole = _run(pool4, (1, 1, 1), options=options, state=True)
    got = _run(pool4, (2, 2, 2), options=options, state=True)
    _check(whole, got, "TP2 ETP2 EP2 int8")
    assert any("local_experts" in n and "momentum_scale" in s for n, s in got["state"].items())
    W.assert_same_state(got["state"], whole["state"], "state")
    zero1 = _run(pool4, (2, 2, 2), options=dict(options, dp_mode="zero1"), state=True)
    assert zero1["dp_mode"] == "zero1"
    W.assert_same_state(zero1["params"], got["params"], "ZeRO-1 params")
    W.assert_same_state(zero1["state"], whole["state"], "ZeRO-1 state")
