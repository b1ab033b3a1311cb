"""``--workers``: contenders in worker processes, steps in lockstep, against the one-process
bench (steps interleaved): the same losses bitwise, the same sweep; a failing worker is
reported with its traceback and leaves no process behind."""

from __future__ import annotations

import dataclasses
import multiprocessing

import pytest
from bench_tiny import TINY_CONFIG

from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig
from muonscale.bench.lockstep import (
    BenchWorkerError,
    deal,
    run_in_lockstep,
    sweep_workers,
    training_workers,
)


def tiny(tmp_path, **overrides) -> BenchConfig:
    options = dict(TINY_CONFIG, steps=4, eval_interval=0.5, out=str(tmp_path))
    options.update(overrides)
    return BenchConfig(**options)


def test_deal_is_round_robin_and_never_makes_empty_workers():
    names = ["adamw", "muon", "torch-muon", "cwd"]
    assert deal(names, 2) == [["adamw", "torch-muon"], ["muon", "cwd"]]
    assert deal(names[:2], 8) == [["adamw"], ["muon"]]
    assert deal(names, 1) == [names]
    with pytest.raises(ValueError, match="workers"):
        deal(names, 0)


def test_workers_flag_is_validated_and_bounds_the_default(tmp_path):
    with pytest.raises(ValueError, match="--workers must be >= 1"):
        tiny(tmp_path, workers=0)
    assert training_workers(tiny(tmp_path, workers=8), 2) == 2
    assert training_workers(tiny(tmp_path), 2) == 1  # timed runs: one process unless asked
    assert sweep_workers(tiny(tmp_path, workers=1), 8) == 1
    assert sweep_workers(tiny(tmp_path, threads=None), 8) == 1  # torch's threads: all cores


def curves(report: dict) -> dict:
    return {
        name: (c["curves"]["val_loss"], c["curves"]["train_loss"], c["optimizer_state_bytes"])
        for name, c in report["contenders"].items()
    }


def test_lockstep_losses_equal_the_interleaved_bench_bitwise(tmp_path):
    # both halves at muon's rate: in 4 steps the AdamW half at the bench's 1e-3 barely moves, and
    # muon would not yet lead AdamW (the last check)
    options = dict(variants=["cwd=cautious_weight_decay:true"], muon_adamw_lr=None)
    one = run_bench(tiny(tmp_path / "one", workers=1, **options))
    two = run_bench(tiny(tmp_path / "two", workers=2, **options))
    assert list(two["contenders"]) == ["adamw", "muon", "cwd"]
    assert curves(two) == curves(one)
    # the runs trained and were not all alike (the comparison can fail)
    finals = {name: c["final_val_loss"] for name, c in two["contenders"].items()}
    assert len(set(finals.values())) == 3
    assert finals["muon"] < finals["adamw"]


def test_parallel_sweep_equals_the_sequential_sweep(tmp_path):
    options = dict(sweep=True, sweep_factors=[0.5, 2.0], steps=8, sweep_fraction=0.25)
    one = run_bench(tiny(tmp_path / "one", workers=1, **options))
    two = run_bench(tiny(tmp_path / "two", workers=2, **options))
    assert two["sweep"]["results"] == one["sweep"]["results"]
    assert len({r["final_val_loss"] for rows in one["sweep"]["results"].values() for r in rows}) > 1
    assert curves(two) == curves(one)


def test_a_failing_worker_is_reported_with_its_traceback(tmp_path):
    config = tiny(tmp_path, data=str(tmp_path / "missing.txt"))
    before = set(multiprocessing.active_children())
    with pytest.raises(
        BenchWorkerError,
        match=r"(?s)worker [01] \((adamw|muon)\) failed.*missing\.txt does not exist",
    ):
        run_in_lockstep(
            dataclasses.replace(config, seed=0),
            ["adamw", "muon"],
            {"adamw": 2e-3, "muon": 1.6e-2},
            [0, 4],
            workers=2,
        )
    assert set(multiprocessing.active_children()) <= before
