"""The distributed side-by-side bench (muonscale.bench.distributed) on 2 real gloo processes."""

from __future__ import annotations

import json

import pytest

from muonscale.bench.distributed import run_distributed_bench

# 2 layers: two matrices of each shape, so the 2 owners get equal Muon streams
TINY = dict(n_layer=2, d_model=64, n_head=2, context_length=32)
ROW_KEYS = {
    "final_train_loss",
    "val_loss",
    "tokens_per_s",
    "optimizer_step_ms",
    "wire_bytes_per_step",
    "optimizer_state_bytes",
}


@pytest.fixture(scope="module")
def dp_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    report = run_distributed_bench(
        nproc=2, parallel="dp", steps=3, model_overrides=TINY, out_dir=out, print_table=False
    )
    return report, out


@pytest.fixture(scope="module")
def fsdp_report():
    return run_distributed_bench(
        nproc=2, parallel="fsdp", steps=3, model_overrides=TINY, print_table=False
    )


def test_dp_report_keys_and_files(dp_report):
    report, out = dp_report
    rows = report["rows"]
    assert set(rows) == {
        "muon",
        "muon-bf16reduce",
        "adamw-zero1",
        "adamw-ddp",
        "zero-redundancy-optimizer",
    }
    for name, row in rows.items():
        assert {"mean", "max"} <= set(row["wire_bytes_per_step"])
        if row["modelled"]:
            assert name == "zero-redundancy-optimizer"
            continue
        assert ROW_KEYS <= set(row), name
        assert row["tokens_per_s"] > 0 and row["optimizer_step_ms"] > 0
        assert row["final_train_loss"] == pytest.approx(row["train_losses"][-1])
        assert row["wire_steps_equal"], name  # same bytes every step
    assert json.loads((out / "report.json").read_text())["rows"].keys() == rows.keys()
    table = (out / "report.md").read_text()
    assert "| muon |" in table and "(modelled)" in table


def test_dp_wire_bytes(dp_report):
    rows = dp_report[0]["rows"]
    wire = {name: row["wire_bytes_per_step"]["mean"] for name, row in rows.items()}
    ratio = dp_report[0]["ratios"]["muon_wire_vs_adamw_zero1"]
    assert 0.99 <= ratio <= 1.01 and wire["muon"] <= wire["adamw-zero1"] * 1.01
    assert wire["muon-bf16reduce"] < wire["muon"]
    # ring model: reduce-scatter + all-gather == all-reduce (up to padding and control flags)
    assert wire["adamw-ddp"] == pytest.approx(wire["adamw-zero1"], rel=0.01)
    assert wire["zero-redundancy-optimizer"] == pytest.approx(1.5 * wire["adamw-ddp"], rel=0.01)


def test_dp_state_bytes_sharded(dp_report):
    report = dp_report[0]
    single = report["single_process_muon_state_bytes"]
    rows = report["rows"]
    assert rows["muon"]["optimizer_state_bytes"]["max"] < single
    assert (
        rows["adamw-zero1"]["optimizer_state_bytes"]["max"]
        < rows["adamw-ddp"]["optimizer_state_bytes"]["max"]
    )


def test_dp_same_algorithm_same_losses(dp_report):
    rows = dp_report[0]["rows"]
    # ZeRO-1 AdamW is torch's AdamW (same hyperparameters) on shards: same trajectory as DDP
    assert rows["adamw-zero1"]["train_losses"] == pytest.approx(
        rows["adamw-ddp"]["train_losses"], abs=1e-4
    )
    assert rows["adamw-zero1"]["val_loss"] == pytest.approx(rows["adamw-ddp"]["val_loss"], abs=1e-4)


def test_dp_bf16_reduce_effect_reported(dp_report):
    row = dp_report[0]["rows"]["muon-bf16reduce"]
    assert abs(row["final_train_loss_minus_muon"]) < 0.1  # measured, small after 3 steps
    assert "val_loss_minus_muon" in row


def test_fsdp_matches_dp(dp_report, fsdp_report):
    rows = fsdp_report["rows"]
    assert set(rows) == {"muon", "adamw"}
    assert rows["muon"]["wire_bytes_per_step"]["mean"] > 0  # DTensorMuon's all-to-all
    assert rows["adamw"]["wire_bytes_per_step"]["mean"] == 0  # AdamW on shards sends nothing
    single = fsdp_report["single_process_muon_state_bytes"]
    assert rows["muon"]["optimizer_state_bytes"]["max"] < single
    # exact distributed Muon / the same torch AdamW, same data: same losses as under dp
    dp = dp_report[0]["rows"]
    for fsdp_name, dp_name in (("muon", "muon"), ("adamw", "adamw-ddp")):
        assert rows[fsdp_name]["train_losses"] == pytest.approx(
            dp[dp_name]["train_losses"], abs=1e-4
        )


def test_tp_matches_dp(dp_report):
    report = run_distributed_bench(
        nproc=2, parallel="tp", steps=3, model_overrides=TINY, print_table=False
    )
    rows = report["rows"]
    assert report["mesh"] == {"dp": 1, "tp": 2}
    assert rows["muon"]["wire_bytes_per_step"]["mean"] > 0
    assert rows["adamw"]["wire_bytes_per_step"]["mean"] == 0
    dp = dp_report[0]["rows"]
    for tp_name, dp_name in (("muon", "muon"), ("adamw", "adamw-ddp")):
        assert rows[tp_name]["train_losses"] == pytest.approx(dp[dp_name]["train_losses"], abs=1e-4)


@pytest.mark.slow
def test_fsdp_tp_matches_dp(dp_report):
    report = run_distributed_bench(
        nproc=4, parallel="fsdp+tp", steps=3, model_overrides=TINY, print_table=False
    )
    assert report["mesh"] == {"dp": 2, "tp": 2}
    dp = dp_report[0]["rows"]
    for name, dp_name in (("muon", "muon"), ("adamw", "adamw-ddp")):
        assert report["rows"][name]["train_losses"] == pytest.approx(
            dp[dp_name]["train_losses"], abs=1e-4
        )


def test_argument_errors():
    with pytest.raises(ValueError, match="divisible"):
        run_distributed_bench(nproc=3, steps=1)
    with pytest.raises(ValueError, match="parallel"):
        run_distributed_bench(nproc=2, parallel="pp", steps=1)
    with pytest.raises(ValueError, match="2 x 2"):
        run_distributed_bench(nproc=2, parallel="fsdp+tp", steps=1)
    with pytest.raises(ValueError, match="key/value"):
        run_distributed_bench(nproc=4, parallel="tp", steps=1, model_overrides=TINY)
