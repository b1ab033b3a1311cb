"""``muonscale train --parallel`` under real torchrun (gloo, CPU processes).

Oracles: the same run on 1 process (losses within a float32 tolerance), the uninterrupted run
(a resume at the same world size, and torchrun's elastic restart after a SIGKILLed rank, end
bitwise equal: model, optimizer state, every loss), and a checkpoint saved at 2 ranks loaded
at 1 (within the 1-vs-2 tolerance: the remaining steps reduce in another order).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
# A small model (2 layers, d 64, context 32) and 4 steps of 2 micro-batches of 8 rows: each
# step reduces 2 x 8 x 32 = 512 token positions. Constant schedule after 1 warm-up step, so a
# 2-step run is the first half of a 4-step run.
TOKENS_PER_STEP = 2 * 8 * 32
STEPS = 4
SMALL = [
    "--n-layer",
    "2",
    "--d-model",
    "64",
    "--n-head",
    "2",
    "--context-length",
    "32",
    "--micro-batch-size",
    "8",
    "--tokens-per-step",
    str(TOKENS_PER_STEP),
    "--schedule",
    "constant",
    "--warmup-steps",
    "1",
    "--eval-every",
    "0",
    "--log-every",
    "1",
    "--no-progress",
    "--pg-timeout-s",
    "30",
    "--resume",
    "auto",
]
# Losses of 1 and 2 ranks differ by the order of float32 sums only: a rank's mean over its
# half of the rows, then the mean over ranks, vs one mean over all rows. Each gradient entry
# sums n = 512 token contributions, so its relative rounding difference is at most about
# n * eps32 (eps32 = 2**-23 ~ 1.2e-7): 6e-5. One Muon step moves the parameters by lr times an
# orthogonalized update, whose relative change is of the order of the gradient's; the loss
# inherits it. Over STEPS steps the differences add: rtol = STEPS * n * eps32 ~ 2.4e-4.
LOSS_RTOL = STEPS * TOKENS_PER_STEP * torch.finfo(torch.float32).eps
# Same bound for a parameter or state entry after the 2 steps resumed at 1 rank, relative to
# the largest entry of its tensor.
STATE_RTOL = LOSS_RTOL

pytestmark = pytest.mark.timeout(300)


def _torchrun(
    nproc: int,
    out_dir: Path,
    *args: str,
    script: str | None = None,
    max_restarts: int = 0,
    env: dict | None = None,
) -> subprocess.CompletedProcess:
    target = [script] if script else ["-m", "muonscale"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        str(max_restarts),
        *target,
        "train",
        *SMALL,
        "--out-dir",
        str(out_dir),
        *args,
    ]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done


def _losses(out_dir: Path) -> dict[int, float]:
    """step -> loss of the last record written for it (a restart rewrites later steps)."""
    losses = {}
    for line in (out_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "train":
            losses[record["step"]] = record["loss"]
    return losses


def _final_state(out_dir: Path) -> dict:
    """The latest checkpoint as one torch.save dict (DCP's own converter)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = out_dir / "checkpoints"
    pointer = json.loads((root / "latest").read_text())
    target = out_dir / "final.pt"
    dcp_to_torch_save(str(root / pointer["folder"]), str(target))
    state = torch.load(target, weights_only=False)
    assert pointer["step"] == STEPS
    return state


def _flatten(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _flatten(value, f"{prefix}/{key}")
    elif isinstance(tree, list | tuple):
        for index, value in enumerate(tree):
            yield from _flatten(value, f"{prefix}/{index}")
    else:
        yield prefix, tree


def _assert_bitwise(got: dict, want: dict) -> None:
    got, want = dict(_flatten(got)), dict(_flatten(want))
    assert got.keys() == want.keys()
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def _max_relative(got: dict, want: dict) -> float:
    got, want = dict(_flatten(got)), dict(_flatten(want))
    worst = 0.0
    for key, value in want.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 1:
            scale = value.abs().max().item() or 1.0
            worst = max(worst, (got[key] - value).abs().max().item() / scale)
    return worst


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """2 ranks, STEPS steps, checkpoints every 2 steps: the reference run."""
    out = tmp_path_factory.mktemp("uninterrupted")
    _torchrun(2, out, "--parallel", "dp", "--steps", str(STEPS), "--checkpoint-every", "2")
    return out


@pytest.fixture(scope="module")
def half(tmp_path_factory) -> Path:
    """2 ranks, the first half of the reference run, checkpoint at step 2."""
    out = tmp_path_factory.mktemp("half")
    _torchrun(2, out, "--parallel", "dp", "--steps", str(STEPS // 2))
    return out


def test_two_ranks_give_the_losses_of_one(uninterrupted, tmp_path):
    _torchrun(1, tmp_path, "--parallel", "dp", "--steps", str(STEPS))
    one, two = _losses(tmp_path), _losses(uninterrupted)
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    worst = max(abs(one[s] - two[s]) / abs(one[s]) for s in one)
    print(f"\nmax relative loss difference, 1 vs 2 ranks: {worst:.3g} (rtol {LOSS_RTOL:.3g})")
    assert worst <= LOSS_RTOL


def test_resume_at_the_same_world_size_is_bitwise(uninterrupted, half, tmp_path):
    shutil.copytree(half, tmp_path, dirs_exist_ok=True)
    _torchrun(2, tmp_path, "--parallel", "dp", "--steps", str(STEPS))
    assert _losses(tmp_path) == _losses(uninterrupted)
    _assert_bitwise(_final_state(tmp_path), _final_state(uninterrupted))


@pytest.mark.slow
def test_checkpoint_saved_at_two_ranks_loads_at_one(uninterrupted, half, tmp_path):
    shutil.copytree(half, tmp_path, dirs_exist_ok=True)
    done = _torchrun(1, tmp_path, "--parallel", "dp", "--steps", str(STEPS))
    assert "resuming at step 2" not in done.stderr  # no hyperparameter changed
    got, want = _losses(tmp_path), _losses(uninterrupted)
    assert [got[s] for s in (1, 2)] == [want[s] for s in (1, 2)]  # written by the 2-rank run
    worst_loss = max(abs(got[s] - want[s]) / abs(want[s]) for s in (3, 4))
    worst_state = _max_relative(_final_state(tmp_path), _final_state(uninterrupted))
    print(f"\nsaved at 2, resumed at 1: loss {worst_loss:.3g}, state {worst_state:.3g}")
    assert worst_loss <= LOSS_RTOL and worst_state <= STATE_RTOL


@pytest.mark.slow
def test_elastic_restart_after_a_killed_rank_is_bitwise(uninterrupted, tmp_path):
    """Rank 1 is SIGKILLed right after step 3 (checkpoint at step 2); torchrun restarts both
    ranks, which resume from step 2 and finish equal to the uninterrupted run."""
    env = {"MUONSCALE_TEST_KILL_RANK": "1", "MUONSCALE_TEST_KILL_AFTER_STEP": "3"}
    done = _torchrun(
        2,
        tmp_path,
        "--parallel",
        "dp",
        "--steps",
        str(STEPS),
        "--checkpoint-every",
        "2",
        script=str(ROOT / "tests" / "torchrun_fault.py"),
        max_restarts=1,
        env=env,
    )
    starts = [
        json.loads(line)["step"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["event"] == "start"
    ]
    assert starts == [0, 2], done.stderr[-3000:]  # the restart resumed from step 2
    assert _losses(tmp_path) == _losses(uninterrupted)
    _assert_bitwise(_final_state(tmp_path), _final_state(uninterrupted))


def _max_logits(out_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["max_attention_logit"] for r in records if r["event"] == "train"}


@pytest.mark.parametrize("parallel", ["dp", "fsdp"])
def test_qk_clip_at_two_ranks_follows_one(tmp_path, parallel):
    """--qk-clip under --parallel dp or fsdp (the QKV weights row-sharded DTensors, each rank
    rescaling its rows): each rank probes its half of the batch, the maxima are MAX-reduced,
    so the logged maxima and the clipped training follow the 1-rank run (within the 1-vs-2
    float32 tolerance). tau is below the initial logits: every step clips."""
    args = ("--parallel", parallel, "--steps", str(STEPS), "--qk-clip", "0.05")
    _torchrun(1, tmp_path / "one", *args)
    _torchrun(2, tmp_path / "two", *args)
    one, two = _max_logits(tmp_path / "one"), _max_logits(tmp_path / "two")
    assert sorted(one) == sorted(two) == list(range(1, STEPS + 1))
    assert all(one[s] > 0.05 for s in one)  # the clip acted on every step
    for s in one:
        assert abs(one[s] - two[s]) <= LOSS_RTOL * abs(one[s]), (s, one[s], two[s])
    losses_one, losses_two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert all(abs(losses_one[s] - losses_two[s]) <= LOSS_RTOL * abs(losses_one[s]) for s in one)


def _update_rms(folder: Path) -> dict[str, dict[int, float]]:
    """Every Muon group's logged update RMS: {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    tags = [
        t
        for t in events.Tags()["scalars"]
        if t.startswith("muon/update_rms/") and "muon" in t.rsplit("/", 1)[-1]
    ]
    return {t: {e.step: e.value for e in events.Scalars(t)} for t in tags}


def test_tensorboard_update_rms_is_the_same_with_deferred_gathers(tmp_path):
    """``--tensorboard`` under ``--parallel dp`` logs the update RMS of the step whether its
    gathers are deferred (the default) or not: the figures come from the step, not from the
    parameters (which a deferred gather has not written yet). The two runs train bitwise
    alike, so the figures agree to float rounding."""
    args = ("--parallel", "dp", "--steps", str(STEPS))
    _torchrun(2, tmp_path / "deferred", *args, "--tensorboard", str(tmp_path / "tb_deferred"))
    _torchrun(
        2,
        tmp_path / "undeferred",
        *args,
        "--no-defer-gather",
        "--tensorboard",
        str(tmp_path / "tb_undeferred"),
    )
    deferred = _update_rms(tmp_path / "tb_deferred")
    undeferred = _update_rms(tmp_path / "tb_undeferred")
    assert deferred and sorted(deferred) == sorted(undeferred)
    for tag, curve in undeferred.items():
        assert sorted(deferred[tag]) == sorted(curve) == list(range(1, STEPS + 1))
        for s, want in curve.items():
            assert want > 0 and abs(deferred[tag][s] - want) <= 0.01 * want, (tag, s)
