"""``muonscale train --tensorboard``: the logged figures against a replay of the same run.

Oracle: training on CPU is seeded and bitwise reproducible, so a second ``TrainingRun`` of the
same config, stepped by hand, gives each step's loss and parameter change; the update RMS is
recomputed from those in float64 and compared with the logged (float32) scalars.
"""

import math

import pytest
import torch

from muonscale.cli import build_parser, main
from muonscale.train.config import TrainConfig, dataclass_from_args
from muonscale.train.trainer import TrainingRun

pytest.importorskip("tensorboard")

ARGV = (
    "--n-layer 1 --d-model 32 --n-head 2 --steps 3 --micro-batch-size 2 --eval-every 3 "
    "--eval-batches 1 --device cpu --log-every 1 --no-progress --out-dir none"
).split()


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def _replay(optimizer_name):
    config = dataclass_from_args(
        TrainConfig, build_parser().parse_args(["train", *ARGV, "--optimizer", optimizer_name])
    )
    run = TrainingRun(config)
    rms, losses = {}, {}
    for _ in range(config.steps):
        before = [
            (g.get("algorithm", "adamw"), g["lr"], p, p.detach().clone())
            for g in run.optimizer.param_groups
            for p in g["params"]
        ]
        result = run.step()
        losses[result.step] = result.loss
        sums, counts = {}, {}
        for algorithm, lr, p, old in before:
            change = (p.detach().double() - old.double()) / lr
            sums[algorithm] = sums.get(algorithm, 0.0) + float(change.square().sum())
            counts[algorithm] = counts.get(algorithm, 0) + change.numel()
        for algorithm in sums:
            rms.setdefault(algorithm, {})[result.step] = math.sqrt(
                sums[algorithm] / counts[algorithm]
            )
    return rms, losses, run.evaluate()


@pytest.mark.parametrize("optimizer_name", ["muon", "adamw"])
def test_tensorboard_logs_losses_and_the_optimizers_figures(tmp_path, optimizer_name):
    board = tmp_path / "tb"
    assert main(["train", *ARGV, "--optimizer", optimizer_name, "--tensorboard", str(board)]) == 0
    scalars = _scalars(board)
    rms, losses, val_loss = _replay(optimizer_name)
    tol = 8 * torch.finfo(torch.float32).eps  # event files hold float32
    assert scalars["train_loss"] == pytest.approx(losses, rel=tol)
    assert scalars["val_loss"] == pytest.approx({3: val_loss}, rel=tol)
    assert set(scalars["optimizer_ms"]) == {1, 2, 3}
    assert all(v > 0 for v in scalars["optimizer_ms"].values())
    assert set(scalars["lr"]) == {1, 2, 3}
    for algorithm, by_step in rms.items():
        # the replay's lr is the group's at each step; a step at lr 0 is not logged
        logged = scalars[f"update_rms/{algorithm}"]
        assert logged == pytest.approx(by_step, rel=1e-5), algorithm
    if optimizer_name == "muon":
        assert set(rms) == {"muon", "adamw"}
        assert scalars["skipped_steps"] == {1: 0.0, 2: 0.0, 3: 0.0}
        # match_rms_adamw: Muon's update RMS is 0.2 for an exactly orthogonal update; the
        # Newton-Schulz iteration leaves singular values within about [0.7, 1.2] of 1
        assert all(0.2 * 0.7 <= v <= 0.2 * 1.2 for v in scalars["update_rms/muon"].values())


def test_tensorboard_without_the_package_names_the_install(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name)
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["train", *ARGV, "--tensorboard", "tb"])
    assert exit_info.value.code == 2
    assert 'pip install "muonscale[bench]"' in capsys.readouterr().err
