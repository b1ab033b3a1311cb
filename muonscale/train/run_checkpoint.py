"""Checkpoints of a :class:`~muonscale.train.trainer.TrainingRun`: what it saves (model,
optimizer, scheduler, step, RNG states, config), how it loads one (this run's hyperparameters
win, the differences are kept), and where ``--resume`` finds one. Files are written by
:mod:`muonscale.train.checkpoint`, DCP folders under ``--parallel`` by
:mod:`muonscale.train.dcp_checkpoint`. Each function takes the ``TrainingRun`` first (typed
``Any``: the trainer imports this module)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from muonscale.train.checkpoint import FORMAT as CHECKPOINT_FORMAT
from muonscale.train.checkpoint import read_checkpoint, write_checkpoint
from muonscale.train.config import TrainConfig
from muonscale.train.dcp_checkpoint import FOLDER as SHARDED_FOLDER
from muonscale.train.dcp_checkpoint import load_sharded, verify_sharded, write_sharded
from muonscale.train.run_guards import (
    NonFiniteLossError,
    auto_resume_path,
    check_not_overwriting,
    check_writable,
    nonfinite_checkpoint_error,
    resume_changes,
)

CHECKPOINT_NAME = "checkpoint.pt"
"""The checkpoint file in a single-process run's out-dir."""


def trainer_state(run: Any) -> dict[str, Any]:
    return {
        "format": CHECKPOINT_FORMAT,
        "step": run.step_count,
        "config": run.config.to_dict(),
        "scheduler": run.scheduler.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        },
    }


def save(run: Any, path: str | os.PathLike) -> Path:
    """Write model, optimizer, scheduler, step, RNG states and config to ``path`` with
    :func:`muonscale.train.checkpoint.write_checkpoint` (atomic, fsynced, digest). Refuses
    to write non-finite parameters or optimizer state (a resume would refuse them), so the
    last good checkpoint is never overwritten."""
    path = Path(path)
    run.land_parameters()
    bad = run.first_nonfinite()
    if bad is not None:
        name, count, total = bad
        raise NonFiniteLossError(
            f"{name} holds NaN/inf at step {run.step_count} ({count:,} of {total:,} "
            f"entries); not overwriting {path}"
        )
    if run.parallel is not None:  # path: the checkpoints folder; every rank writes
        written = write_sharded(
            run.parallel,
            path,
            step=run.step_count,
            model=run.model,
            optimizer=run.optimizer,
            trainer_state=trainer_state(run),
        )
        run.last_checkpoint = (str(path), run.step_count)
        return written
    state = trainer_state(run)
    state["model"] = run.model.state_dict()
    state["optimizer"] = run.optimizer.state_dict()
    write_checkpoint(state, path)
    run.last_checkpoint = (str(path), run.step_count)
    return path


def load(run: Any, path: str | os.PathLike) -> None:
    """Restore a checkpoint written by :func:`save` (same model shape and
    optimizer required). This run's hyperparameters replace the checkpoint's; the
    differences (:func:`~muonscale.train.run_guards.resume_changes`) are kept in
    ``run.resume_changes``."""
    path = Path(path)
    # Group hyperparameters and peak lrs as this run's config builds them; the
    # checkpoint's groups would otherwise win silently.
    fresh_groups = [
        {key: value for key, value in group.items() if key != "params"}
        for group in run.optimizer.param_groups
    ]
    fresh_base_lrs = list(run.scheduler.base_lrs)
    if run.parallel is not None:
        folder, state = verify_sharded(run.parallel, path)
        _check_compatible(run, folder, TrainConfig.from_dict(state["config"]))
        load_sharded(folder, model=run.model, optimizer=run.optimizer)
    else:
        state = read_checkpoint(path, map_location=run.device)
        _check_compatible(run, path, TrainConfig.from_dict(state["config"]))
        run.model.load_state_dict(state["model"])
        run.optimizer.load_state_dict(state["optimizer"])
    _check_loaded_finite(run, path)
    saved = TrainConfig.from_dict(state["config"])
    if len(run.optimizer.param_groups) != len(fresh_groups):
        raise ValueError(
            f"checkpoint {path} has {len(run.optimizer.param_groups)} parameter groups, "
            f"this run builds {len(fresh_groups)}"
        )
    for group, fresh in zip(run.optimizer.param_groups, fresh_groups):
        group.update(fresh)
    _load_scheduler_state(run, state["scheduler"], fresh_base_lrs)
    torch.set_rng_state(state["rng"]["torch"].cpu())
    if state["rng"]["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["rng"]["cuda"]])
    run.step_count = int(state["step"])
    run.last_checkpoint = (str(path), run.step_count)
    run.resume_changes = resume_changes(saved, run.config)


def _check_loaded_finite(run: Any, path: Path) -> None:
    """Refuse a checkpoint holding NaN/inf (every rank raises the same error)."""
    bad = run.first_nonfinite()
    if bad is not None:
        raise nonfinite_checkpoint_error(path, *bad)


def _check_compatible(run: Any, path: Path, saved: TrainConfig) -> None:
    """Same model shape, optimizer and parallel mode as the checkpoint's, else ValueError.
    (Under --parallel DCP has already refused a shape mismatch; this names the cause.)"""
    if (
        saved.model_config() != run.model_config
        or saved.optimizer != run.config.optimizer
        or saved.parallel != run.config.parallel
    ):
        raise ValueError(
            f"checkpoint {path} was written for model {saved.model_config()} with optimizer "
            f"{saved.optimizer!r} and --parallel {saved.parallel}; this run has "
            f"{run.model_config} with {run.config.optimizer!r} and --parallel "
            f"{run.config.parallel}"
        )


def _load_scheduler_state(run: Any, scheduler_state: dict[str, Any], base_lrs: list[float]) -> None:
    """Restore the scheduler's position but keep this run's schedule and peak lrs (so
    ``--steps`` and ``--lr`` can change on resume); the learning rates are recomputed
    exactly as LambdaLR does."""
    scheduler_state = dict(scheduler_state)
    scheduler_state["lr_lambdas"] = [None] * len(run.scheduler.lr_lambdas)
    scheduler_state["base_lrs"] = list(base_lrs)
    run.scheduler.load_state_dict(scheduler_state)
    epoch = run.scheduler.last_epoch
    for group, base_lr in zip(run.optimizer.param_groups, run.scheduler.base_lrs):
        group["lr"] = base_lr * run.schedule(epoch)
    run.scheduler._last_lr = [group["lr"] for group in run.optimizer.param_groups]


def resume_path(run: Any, out_dir: Path | None, checkpoint_path: Path | None) -> Path | None:
    resume = run.config.resume
    if resume is None:
        return None
    if resume == "auto":
        other = SHARDED_FOLDER if run.parallel is None else CHECKPOINT_NAME
        return auto_resume_path(
            checkpoint_path,
            out_dir / other if out_dir else None,
            parallel=run.parallel is not None,
        )
    return Path(resume)


def check_out_dir(run: Any, checkpoint_path: Path | None, resume_path: Path | None) -> None:
    """Before training: the run may save to ``checkpoint_path`` and can (rank 0 checks;
    every rank raises the same error)."""
    if checkpoint_path is None:
        return
    error = None
    if run.rank == 0:
        try:
            check_writable(checkpoint_path, folder=run.parallel is not None)
            check_not_overwriting(
                checkpoint_path,
                resume_path,
                resume=run.config.resume,
                overwrite=run.config.overwrite,
                parallel=run.parallel is not None,
            )
        except OSError as exc:
            error = exc
    if run.parallel is not None:
        error = run.parallel.broadcast_object(error)
    if error is not None:
        raise error
