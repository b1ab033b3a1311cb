"""The distributed side-by-side bench (muonscale.bench.distributed) on 2 real gloo processes.

Each run sets the bench's flags apart from their defaults and is checked against the
single-process bench's own runs of the same flags (muonscale.bench.runner.make_run): a dp or
FSDP contender is the same algorithm on the same global batch, so its losses equal the
single-process ones up to float32 rounding. ``test_each_flag_changes_the_single_process_run``
shows that every such flag moves those losses by more than that tolerance, so a distributed
worker that ignored one would fail the comparison.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from muonscale.bench.config import BenchConfig
from muonscale.bench.distributed import run_distributed_bench
from muonscale.bench.runner import bundled_corpus_text, make_run

pytestmark = pytest.mark.timeout(900)

# 2 layers: two matrices of each shape, so the 2 owners get equal Muon streams
TINY = dict(n_layer=2, d_model=64, n_head=2, steps=4, progress=False, plots=False)
FLAGS = dict(
    tokens_per_step=512,  # 4 windows of 128 per step, 2 per rank
    micro_batch_size=2,  # 2 micro-batches: gradient accumulation
    schedule="wsd",
    lr_warmup_steps=1,
    lr_muon=0.02,
    lr_adamw=3e-3,
    weight_decay=0.3,
    muon_weight_decay=0.5,
    momentum=0.8,
    muon_adamw_lr=5e-3,
    eval_batches=2,
    eval_interval=0.5,
    seed=1,
    timing_warmup_steps=1,
    corpus="web",
)
"""Flags apart from their defaults in every run below (each one's effect: see the test
``test_each_flag_changes_the_single_process_run``)."""
DP_FLAGS = dict(
    corpus=None,  # data= instead: a text file, BPE-tokenized
    tokenizer="bpe",
    bpe_vocab_size=320,
    variants=["pe=coefficients:polar_express,lr:0.01", "clip=qk_clip:0.12"],
    track_max_logit=True,
)
"""Flags of the dp run only (QK-clip and the max-logit probe are refused under tp)."""
SINGLE_NAME = {"adamw-ddp": "adamw", "adamw-zero1": "adamw", "muon-bf16reduce": "muon"}


def _tolerance(losses) -> float:
    """float32 rounding of the loss, grown by one rounding of the update per step: the split
    batch reduces in another order than one process does (dp: mean of two half-batch
    gradients; fsdp: reduce-scatter)."""
    eps = torch.finfo(torch.float32).eps
    return 4 * len(losses) * eps * max(abs(x) for x in losses)


def _single_process(config: BenchConfig, contender: str):
    """(train losses, validation losses at the eval steps, max logits) of the single-process
    bench's run of ``contender``."""
    single = dataclasses.replace(config, nproc=1, parallel="dp")
    run = make_run(single, contender, single.lr_for(contender))
    losses, val, logits = [], [run.evaluate()], []
    for step in range(1, single.steps + 1):
        result = run.step()
        losses.append(result.loss)
        logits.append(result.max_attention_logit)
        if step in (2, 4):  # eval_interval 0.5 of 4 steps
            val.append(run.evaluate())
    return losses, val, logits


def _state_bytes(config: BenchConfig) -> int:
    """Optimizer-state bytes of the single-process muon run after one step."""
    run = make_run(config, "muon", config.lr_muon)
    run.step()
    return run.optimizer_state_bytes()


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "plays.txt"
    path.write_text(bundled_corpus_text("shakespeare")[:200_000])
    return str(path)


@pytest.fixture(scope="module")
def dp_config(text_file):
    return BenchConfig(nproc=2, parallel="dp", **TINY, **{**FLAGS, **DP_FLAGS, "data": text_file})


@pytest.fixture(scope="module")
def dp_report(dp_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    config = dataclasses.replace(dp_config, out=str(out))
    return run_distributed_bench(config, print_table=False), out


@pytest.fixture(scope="module")
def fsdp_config():
    return BenchConfig(nproc=2, parallel="fsdp", **TINY, **FLAGS)


@pytest.fixture(scope="module")
def fsdp_report(fsdp_config):
    return run_distributed_bench(fsdp_config, print_table=False)


def test_dp_report_keys_and_files(dp_report):
    report, out = dp_report
    rows = report["rows"]
    assert set(rows) == {
        "muon",
        "muon-bf16reduce",
        "pe",
        "clip",
        "adamw-zero1",
        "adamw-ddp",
        "zero-redundancy-optimizer",
    }
    for name, row in rows.items():
        assert {"mean", "max"} <= set(row["wire_bytes_per_step"])
        if row["modelled"]:
            assert name == "zero-redundancy-optimizer"
            continue
        assert row["tokens_per_s"] > 0 and row["optimizer_step_ms"] > 0
        assert row["final_train_loss"] == row["train_losses"][-1]
        assert row["wire_steps_equal"], name  # same bytes every step
        assert row["eval_steps"] == [0, 2, 4]  # --eval-interval 0.5
    model = report["model"]  # --n-layer, --d-model, --n-head; vocab: --bpe-vocab-size 320
    assert (model["n_layer"], model["d_model"], model["n_head"], model["vocab_size"]) == (
        2,
        64,
        2,
        320,
    )
    assert json.loads((out / "report.json").read_text())["rows"].keys() == rows.keys()
    table = (out / "report.md").read_text()
    assert "| muon |" in table and "(modelled)" in table and "--schedule wsd" in table


def test_dp_matches_the_single_process_bench(dp_config, dp_report):
    rows = dp_report[0]["rows"]
    for name in ("muon", "pe", "clip", "adamw-zero1", "adamw-ddp"):
        losses, val, logits = _single_process(dp_config, SINGLE_NAME.get(name, name))
        tol = _tolerance(losses)
        assert rows[name]["train_losses"] == pytest.approx(losses, abs=tol, rel=0), name
        assert rows[name]["val_losses"] == pytest.approx(val, abs=tol, rel=0), name
        # --track-max-logit (and QK-clip): the largest logit of the global batch, per step
        rel = 2 * _tolerance(logits) / max(logits)  # the same rounding, relative, two roundings
        assert rows[name]["max_attention_logits"] == pytest.approx(logits, rel=rel), name


def test_dp_qk_clip_variant_clipped(dp_report):
    rows = dp_report[0]["rows"]
    assert max(rows["muon"]["max_attention_logits"]) > 0.12  # tau: the clip variant rescaled
    assert rows["clip"]["train_losses"][-1] != rows["muon"]["train_losses"][-1]


def test_dp_wire_bytes(dp_report):
    rows = dp_report[0]["rows"]
    wire = {name: row["wire_bytes_per_step"]["mean"] for name, row in rows.items()}
    ratio = dp_report[0]["ratios"]["muon_wire_vs_adamw_zero1"]
    assert 0.99 <= ratio <= 1.01 and wire["muon"] <= wire["adamw-zero1"] * 1.01
    assert wire["pe"] == wire["muon"]  # a variant changes the update, not the traffic
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


def test_dp_bf16_reduce_effect_reported(dp_report):
    row = dp_report[0]["rows"]["muon-bf16reduce"]
    # bf16 rounding of each reduced gradient element, at most one step's worth of lr per step
    bound = len(row["train_losses"]) * torch.finfo(torch.bfloat16).eps * row["train_losses"][0]
    assert abs(row["final_train_loss_minus_muon"]) < bound
    assert "val_loss_minus_muon" in row


def test_fsdp_matches_the_single_process_bench(fsdp_config, fsdp_report):
    rows = fsdp_report["rows"]
    assert set(rows) == {"muon", "adamw"}
    assert rows["muon"]["wire_bytes_per_step"]["mean"] > 0  # DTensorMuon's all-to-all
    assert rows["adamw"]["wire_bytes_per_step"]["mean"] == 0  # AdamW on shards sends nothing
    assert (
        rows["muon"]["optimizer_state_bytes"]["max"]
        < fsdp_report["single_process_muon_state_bytes"]
    )
    for name in ("muon", "adamw"):
        losses, val, _ = _single_process(fsdp_config, name)
        tol = _tolerance(losses)
        assert rows[name]["train_losses"] == pytest.approx(losses, abs=tol, rel=0), name
        assert rows[name]["val_losses"] == pytest.approx(val, abs=tol, rel=0), name


def test_tp_matches_fsdp(fsdp_config, fsdp_report):
    config = dataclasses.replace(fsdp_config, parallel="tp")
    report = run_distributed_bench(config, print_table=False)
    rows = report["rows"]
    assert report["mesh"] == {"dp": 1, "tp": 2}
    assert rows["muon"]["wire_bytes_per_step"]["mean"] > 0
    assert rows["adamw"]["wire_bytes_per_step"]["mean"] == 0
    for name in ("muon", "adamw"):
        losses = fsdp_report["rows"][name]["train_losses"]
        # TP's row-sharded matmuls sum in another order: rounding of the forward, per step
        assert rows[name]["train_losses"] == pytest.approx(losses, abs=_tolerance(losses), rel=0)


@pytest.mark.slow
def test_fsdp_tp_matches_fsdp(fsdp_config, fsdp_report):
    config = dataclasses.replace(fsdp_config, nproc=4, parallel="fsdp+tp", tokens_per_step=1024)
    report = run_distributed_bench(config, print_table=False)
    assert report["mesh"] == {"dp": 2, "tp": 2}
    for name in ("muon", "adamw"):
        losses, _, _ = _single_process(config, name)
        assert report["rows"][name]["train_losses"] == pytest.approx(
            losses, abs=_tolerance(losses), rel=0
        )


def test_seeds_sweep_tensorboard_plots(tmp_path, capfd):
    """--seeds, --sweep (single-process runs pick the lrs), --tensorboard, --plots,
    --progress, --threads, --ns-dtype and --momentum-dtype."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("matplotlib")
    from muonscale.bench import run_bench
    from muonscale.bench.sweep import run_sweep

    config = BenchConfig(
        nproc=2,
        **{**TINY, "steps": 2, "plots": True, "progress": True},
        threads=2,
        tokens_per_step=256,
        eval_batches=1,
        seeds=2,
        ns_dtype="bfloat16",
        momentum_dtype="bfloat16",
        sweep=True,
        sweep_factors=[0.5, 4.0],
        sweep_fraction=0.5,
        tensorboard=str(tmp_path / "tb"),
        out=str(tmp_path / "out"),
    )
    report = run_bench(config)
    assert "2/2" in capfd.readouterr().err  # rank 0's progress bar: 2 of 2 steps
    assert report["torch_threads"] == 2
    single = dataclasses.replace(config, nproc=1, sweep=True)
    assert report["lrs"] == {**run_sweep(single, make_run, log=lambda _: None)["best"]}
    assert set(report["seeds"]) == {0, 1}
    assert report["seeds"][0]["muon"]["train_losses"] != report["seeds"][1]["muon"]["train_losses"]
    spread = report["seed_spread"]["muon"]["val_loss"]
    assert spread["n"] == 2 and math.isclose(
        spread["mean"],
        (report["seeds"][0]["muon"]["val_loss"] + report["seeds"][1]["muon"]["val_loss"]) / 2,
    )
    assert (tmp_path / "out" / "val_loss.png").stat().st_size > 0
    bf16 = {"ns_dtype": "torch.bfloat16", "momentum_dtype": "torch.bfloat16"}
    assert report["rows"]["muon"]["muon_dtypes"] == bf16
    # bf16 momentum: the ranks' Muon state adds up to the single-process run's with the same
    # flags, far from the float32 momentum's
    held = report["rows"]["muon"]["optimizer_state_bytes"]["mean"] * config.nproc
    same = _state_bytes(single)
    assert (
        abs(held - same)
        < abs(_state_bytes(dataclasses.replace(single, momentum_dtype=None)) - same) / 4
    )
    for seed in (0, 1):
        assert list((tmp_path / "tb" / "muon" / f"seed{seed}").glob("events.out.tfevents.*"))


SENSITIVITY_SKIPPED = ("eval_interval", "timing_warmup_steps", "track_max_logit", "corpus")
"""Flags shown by the report instead (eval steps, timed steps, max-logit rows); --corpus: in
its own case below (the dp run reads --data)."""


@pytest.mark.parametrize(
    "flag",
    [name for name in {**FLAGS, **DP_FLAGS} if name not in SENSITIVITY_SKIPPED] + ["corpus"],
)
def test_each_flag_changes_the_single_process_run(flag, text_file):
    """Setting ``flag`` back to its default moves the single-process losses (training, and
    validation at the eval steps) by more than the tolerance of the distributed comparisons
    above, so those comparisons would see a distributed run that ignored it."""
    config = BenchConfig(**TINY, **{**FLAGS, **DP_FLAGS, "data": text_file})
    if flag not in ("tokenizer", "bpe_vocab_size", "variants"):  # byte-level: no BPE to train
        config = dataclasses.replace(config, tokenizer="byte")
    if flag == "corpus":
        config = dataclasses.replace(config, data=None, corpus="web")
    if flag == "variants":  # pe and clip against muon itself
        pairs = [(config, name, config, "muon") for name in ("pe", "clip")]
    else:
        field = BenchConfig.__dataclass_fields__[flag]
        default = dataclasses.replace(config, **{flag: field.default})
        pairs = [(config, name, default, name) for name in ("muon", "adamw")]
    moved = []
    for first, first_name, second, second_name in pairs:
        train, val, _ = _single_process(first, first_name)
        other_train, other_val, _ = _single_process(second, second_name)
        tol = _tolerance(train)
        moved.append(train + val != pytest.approx(other_train + other_val, abs=tol, rel=0))
    assert any(moved) if flag != "variants" else all(moved), flag


def test_timing_warmup_steps_reported(dp_report):
    """--timing-warmup-steps 1: the first of the 4 steps is left out of the timings."""
    for name, row in dp_report[0]["rows"].items():
        if not row["modelled"]:
            assert row["timed_steps"] == 3 and len(row["step_seconds"]) == 4, name


REFUSED = [
    ("baselines", ["torch-muon"], "no distributed form"),
    ("lr_torch_muon", 0.05, "torch-muon baselines"),
    ("workers", 2, "every rank trains every contender"),
    ("device", "auto", "gloo processes on the CPU"),
    ("memory_probe_steps", 5, "optimizer-state bytes instead"),
]


@pytest.mark.parametrize("flag, value, why", REFUSED)
def test_refused_flags_name_the_flag_and_why(flag, value, why):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')}.*{why}"):
        BenchConfig(nproc=2, **{flag: value})
    BenchConfig(nproc=1, **{flag: value})  # accepted by the single-process bench


@pytest.mark.parametrize("parallel, nproc", [("tp", 2), ("fsdp+tp", 4)])
def test_max_logit_refused_under_tp(parallel, nproc):
    with pytest.raises(ValueError, match="--track-max-logit.*own heads"):
        BenchConfig(nproc=nproc, parallel=parallel, track_max_logit=True)
    with pytest.raises(ValueError, match="--variants c: qk_clip.*own heads"):
        BenchConfig(nproc=nproc, parallel=parallel, variants=["c=qk_clip:10"])
    BenchConfig(nproc=nproc, parallel=parallel, variants=["pe=coefficients:polar_express"])


def test_argument_errors():
    with pytest.raises(ValueError, match="divisible"):
        run_distributed_bench(BenchConfig(nproc=3, steps=1))
    with pytest.raises(ValueError, match="parallel"):
        BenchConfig(nproc=2, parallel="pp", steps=1)
    with pytest.raises(ValueError, match="2 x 2"):
        run_distributed_bench(BenchConfig(nproc=2, parallel="fsdp+tp", steps=1))
    with pytest.raises(ValueError, match="--variants x: unknown option 'no_such'"):
        run_distributed_bench(BenchConfig(nproc=2, variants=["x=no_such:1"]))
    with pytest.raises(ValueError, match="key/value"):
        run_distributed_bench(BenchConfig(nproc=4, parallel="tp", n_layer=2, d_model=64, n_head=2))
