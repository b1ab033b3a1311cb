"""``muonscale train --tensorboard``: the logged figures against a replay of the same run.

Oracle: training on CPU is seeded and bitwise reproducible, so a second ``TrainingRun`` of the
same config, stepped by hand, gives each step's loss and parameter change; the update RMS is
recomputed from those in float64 and compared with the logged (float32) scalars, which come
from the optimizer's step metrics.
"""

import dataclasses
import errno
import json
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
    """Each step's loss and each group's update RMS per unit lr, (W₁ − W₀(1 − ηλ)) / η in
    float64, under the name the step metrics give it."""
    config = dataclass_from_args(
        TrainConfig, build_parser().parse_args(["train", *ARGV, "--optimizer", optimizer_name])
    )
    run = TrainingRun(config)
    prefix = "muon/" if optimizer_name == "muon" else "adamw/"
    rms, losses = {}, {}
    for _ in range(config.steps):
        before = [
            (f"group{i}_{g.get('algorithm', 'adamw')}", dict(g), p, p.detach().double().clone())
            for i, g in enumerate(run.optimizer.param_groups)
            for p in g["params"]
        ]
        result = run.step()
        losses[result.step] = result.loss
        sums, counts = {}, {}
        for label, group, p, old in before:  # the group as the step saw it (lr scheduled)
            decayed = old * (1 - group["lr"] * group["weight_decay"])
            change = (p.detach().double() - decayed) / group["lr"]
            sums[label] = sums.get(label, 0.0) + float(change.square().sum())
            counts[label] = counts.get(label, 0) + change.numel()
        for label in sums:
            name = f"{prefix}update_rms/{label}"
            rms.setdefault(name, {})[result.step] = math.sqrt(sums[label] / counts[label])
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
    for name, by_step in rms.items():
        # float32 parameters: the replay's change W₁ − W₀ is resolved to ~eps32 · |W|, a
        # relative error of eps32 · |W| / (lr · rms) ≲ 1e-3 at these sizes; event files: float32
        assert scalars[name] == pytest.approx(by_step, rel=1e-3), name
    if optimizer_name == "muon":
        assert {n.split("_")[-1] for n in rms} == {"muon", "adamw"}
        assert scalars["muon/skipped_steps"] == {1: 0.0, 2: 0.0, 3: 0.0}
        assert set(scalars["muon/ns_elements"]) == {1, 2, 3}
        # match_rms_adamw: Muon's update RMS is 0.2 for an exactly orthogonal update; the
        # Newton-Schulz iteration leaves singular values within about [0.7, 1.2] of 1
        (muon,) = [n for n in rms if n.endswith("_muon")]
        assert all(0.2 * 0.7 <= v <= 0.2 * 1.2 for v in scalars[muon].values())


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


def _no_space_after(monkeypatch, budget: int) -> None:
    """TensorBoard's event files on a filesystem with ``budget`` bytes left: once its records
    fill them, each write raises ``OSError(ENOSPC)``, in TensorBoard's writer thread, as on a
    full disk (checkpoints and metrics go to another folder, which has room)."""
    from tensorboard.summary.writer import record_writer

    left = [budget]
    real = record_writer.RecordWriter.write

    def write(self, data):
        left[0] -= len(data) + 16  # a record: length, its CRC, the data, the data's CRC
        if left[0] < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(record_writer.RecordWriter, "write", write)


# TensorBoard's writer thread ends with the error (and prints it) before the run sees it
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_full_disk_for_tensorboard_stops_logging_not_the_run(tmp_path, monkeypatch, capsys):
    """The logging failure is reported and logging stops; training, its checkpoints and the
    final save go on: the last checkpoint holds the whole run, bitwise the run without
    TensorBoard, and resumes as the uninterrupted run continues."""
    _no_space_after(monkeypatch, 1000)  # the first steps' scalars fit
    run_dir = tmp_path / "run"
    argv = [*ARGV[: ARGV.index("--out-dir")], "--optimizer", "muon", "--steps", "6"]
    argv += ["--checkpoint-every", "4", "--out-dir", str(run_dir)]
    assert main(["train", *argv, "--tensorboard", str(tmp_path / "tb")]) == 0
    err = capsys.readouterr().err
    assert "TensorBoard logging" in err and "No space left on device" in err, err
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["event"] == "tensorboard_failed"]
    assert len(failures) == 1 and 1 <= failures[0]["step"] < 6, failures
    assert "No space left on device" in failures[0]["message"]
    assert max(e["step"] for e in events if e["event"] == "train") == 6  # metrics went on

    config = dataclass_from_args(TrainConfig, build_parser().parse_args(["train", *argv]))
    straight = TrainingRun(dataclasses.replace(config, steps=7, out_dir=None))
    for _ in range(6):
        straight.step()
    resumed = TrainingRun(dataclasses.replace(config, steps=7, out_dir=None))
    resumed.load_checkpoint(run_dir / "checkpoint.pt")
    assert resumed.step_count == 6
    for steps in (6, 7):
        if steps == 7:
            straight.step()
            resumed.step()
        for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
            assert torch.equal(a, b), (steps, name)
