"""``--tensorboard DIR``: the curves as TensorBoard event files, or a clear refusal."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from bench_tiny import BENCH_TINY, LinearRun

from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig
from muonscale.cli import main


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


def _config(tmp_path, tensorboard) -> BenchConfig:
    return BenchConfig(
        steps=4,
        tokens_per_step=256,
        memory_probe_steps=0,
        progress=False,
        plots=False,
        out=str(tmp_path / "out"),
        tensorboard=str(tensorboard),
    )


def test_tensorboard_folder_is_checked_before_any_training(tmp_path, monkeypatch, capsys):
    """``--tensorboard afile/tb`` (``afile`` a file) is refused as ``--out`` is: by the CLI
    with a usage error, by ``run_bench`` with an ``OSError``, both naming the flag."""
    pytest.importorskip("tensorboard")
    import muonscale.bench.runner as runner

    def no_training(*args, **kwargs):
        raise AssertionError("a training run was built before --tensorboard was checked")

    monkeypatch.setattr(runner, "make_run", no_training)
    blocker = tmp_path / "afile"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                *BENCH_TINY,
                "--out",
                str(tmp_path / "out"),
                "--tensorboard",
                str(blocker / "tb"),
            ]
        )
    assert exit_info.value.code == 2
    assert f"--tensorboard {blocker / 'tb'} is not a writable folder" in capsys.readouterr().err
    with pytest.raises(OSError, match="--tensorboard .* is not a writable folder"):
        run_bench(_config(tmp_path, blocker / "tb"), make_run=no_training)


def test_a_late_tensorboard_failure_keeps_the_report(tmp_path, capsys):
    """The folder was fine when checked, and is a file by the time the curves are written: the
    failure is reported and the report is written all the same."""
    pytest.importorskip("tensorboard")
    board = tmp_path / "tb"

    def make_run(config, contender, lr, steps=None):
        if not board.is_file():  # taken away while the bench trains
            shutil.rmtree(board, ignore_errors=True)
            board.write_text("")
        return LinearRun({"adamw": 0.05, "muon": 0.1}[contender])

    report = run_bench(_config(tmp_path, board), make_run=make_run)
    err = capsys.readouterr().err
    assert f"--tensorboard {board}" in err and "the report is written without them" in err
    saved = json.loads((tmp_path / "out" / "report.json").read_text())
    assert saved["contenders"].keys() == report["contenders"].keys() == {"adamw", "muon"}
    assert (tmp_path / "out" / "report.md").is_file()


def test_event_files_hold_every_steps_optimizer_figures(tmp_path):
    """A real tiny bench with --tensorboard: Muon's step metrics (counted from the step) and
    AdamW's update RMS at every step, in each contender's run folder."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    main(
        [
            "bench",
            *BENCH_TINY,
            "--out",
            str(tmp_path / "out"),
            "--tensorboard",
            str(tmp_path / "tb"),
        ]
    )
    figures = {}
    for name in ("adamw", "muon"):
        events = EventAccumulator(str(tmp_path / "tb" / name / "seed0"))
        events.Reload()
        figures[name] = {t: events.Scalars(t) for t in events.Tags()["scalars"]}
    muon = figures["muon"]
    assert [e.step for e in muon["muon/ns_elements"]] == [1, 2]
    assert all(e.value > 0 for e in muon["muon/ns_elements"])
    assert any(t.startswith("muon/update_rms/") for t in muon)
    adamw = [t for t in figures["adamw"] if t.startswith("adamw/update_rms/")]
    assert adamw and all(len(figures["adamw"][t]) == 2 for t in adamw)
