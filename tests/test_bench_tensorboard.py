"""``--tensorboard DIR``: the curves as TensorBoard event files, or a clear refusal."""

from __future__ import annotations

import importlib.util

import pytest
from bench_tiny import LinearRun

from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig


def test_event_files_hold_the_curves(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def make_run(config, contender, lr, steps=None):
        return LinearRun({"adamw": 0.05, "muon": 0.1}[contender] + 0.01 * config.seed)

    config = BenchConfig(
        steps=20,
        tokens_per_step=256,
        memory_probe_steps=0,
        progress=False,
        plots=False,
        seeds=2,
        out=str(tmp_path / "out"),
        tensorboard=str(tmp_path / "tb"),
    )
    report = run_bench(config, make_run=make_run)
    for name in ("adamw", "muon"):
        for seed in (0, 1):
            run_dir = tmp_path / "tb" / name / f"seed{seed}"
            assert list(run_dir.glob("events.out.tfevents.*"))
            events = EventAccumulator(str(run_dir))
            events.Reload()
            val = events.Scalars("val_loss")
            train = events.Scalars("train_loss")
            rate = {"adamw": 0.05, "muon": 0.1}[name] + 0.01 * seed
            assert [e.step for e in val] == report["contenders"][name]["curves"]["eval_steps"]
            assert [e.value for e in val] == pytest.approx([5.0 - rate * e.step for e in val])
            assert [e.step for e in train] == list(range(1, 21))
            assert [e.value for e in train] == pytest.approx([5.0 - rate * e.step for e in train])
            assert len(events.Scalars("val_loss_vs_train_ms")) == len(val)
    # a resumed bench rewrites the curves instead of adding a second copy
    run_bench(config, make_run=make_run)
    assert len(list((tmp_path / "tb" / "muon" / "seed1").glob("events.out.tfevents.*"))) == 1


def test_refused_clearly_without_tensorboard(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(ValueError, match="--tensorboard needs the tensorboard package"):
        BenchConfig(tensorboard="tb")
