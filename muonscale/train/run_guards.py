"""Checks a ``muonscale train`` run makes before its first step, so no run ends unsaved.

Each function raises an error naming the paths involved, or returns: the out-dir's checkpoint
belongs to this run or may be replaced (:func:`check_not_overwriting`), it can be written
(:func:`check_writable`), ``--resume auto`` finds a checkpoint of this run's kind
(:func:`auto_resume_path`), and a loaded state holds only finite values
(:func:`first_nonfinite`). :func:`resume_changes` lists what a resumed run changes.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from muonscale.train.checkpoint import CheckpointError
from muonscale.train.config import TrainConfig
from muonscale.train.dcp_checkpoint import has_checkpoint
from muonscale.train.optimizers import HybridOptimizer

__all__ = [
    "CheckpointExistsError",
    "NonFiniteLossError",
    "auto_resume_path",
    "check_not_overwriting",
    "check_writable",
    "first_nonfinite",
    "nonfinite_checkpoint_error",
    "resume_changes",
]

RESUMABLE_CHANGES = (
    "lr",
    "adamw_lr",
    "weight_decay",
    "adamw_betas",
    "momentum",
    "ns_steps",
    "momentum_dtype",  # the buffers are cast to it (muonscale.Muon.load_state_dict)
)
"""Hyperparameters a resumed run may change; they are applied (the checkpoint's are replaced)."""
DATA_CHANGES = ("seed", "data", "tokens_per_step")
"""Settings a resumed run may change that steer the data: the data order is a function of
(seed, step), so a new seed, corpus or batch takes effect at the next step."""


class CheckpointExistsError(FileExistsError):
    """A run would replace another run's checkpoint (no ``--overwrite``)."""


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or inf; no optimizer step was taken for it."""


def _kind(parallel: bool) -> str:
    return "--parallel" if parallel else "single-process"


def _has(path: Path, parallel: bool) -> bool:
    """Whether ``path`` holds a checkpoint of the kind ``parallel`` names."""
    return has_checkpoint(path) if parallel else path.exists()


def auto_resume_path(checkpoint_path: Path | None, other_path: Path | None, *, parallel: bool):
    """``checkpoint_path`` when it holds a checkpoint, None when the out-dir holds none; raise
    :class:`CheckpointError` when it holds only a checkpoint of the other kind
    (``other_path``: ``checkpoint.pt`` of a single-process run, ``checkpoints/`` of a
    ``--parallel`` run), which this run cannot continue."""
    if checkpoint_path is None:
        return None
    if _has(checkpoint_path, parallel):
        return checkpoint_path
    if other_path is not None and _has(other_path, not parallel):
        fix = (
            "rerun without --parallel"
            if parallel
            else "rerun under torchrun with the --parallel mode it was saved with"
        )
        raise CheckpointError(
            f"--resume auto found {other_path}, the checkpoint of a {_kind(not parallel)} run, "
            f"and no {checkpoint_path}: this {_kind(parallel)} run cannot continue it; {fix}, "
            "or choose another --out-dir to start a new run"
        )
    return None


def _same_checkpoint(resume_path: Path, checkpoint_path: Path, *, parallel: bool) -> bool:
    """Whether resuming from ``resume_path`` continues the checkpoint at ``checkpoint_path``
    (under --parallel also one of its step folders)."""
    resume, target = resume_path.resolve(), checkpoint_path.resolve()
    return resume == target or (parallel and resume.parent == target)


def check_not_overwriting(
    checkpoint_path: Path | None,
    resume_path: Path | None,
    *,
    resume: str | None,
    overwrite: bool,
    parallel: bool,
) -> None:
    """Refuse (:class:`CheckpointExistsError`) a run whose saves would replace the checkpoint
    at ``checkpoint_path`` although it neither resumes from it nor has ``overwrite``."""
    if checkpoint_path is None or overwrite or not _has(checkpoint_path, parallel):
        return
    if resume_path is not None and _same_checkpoint(
        resume_path, checkpoint_path, parallel=parallel
    ):
        return
    if resume is None or resume_path is None:
        raise CheckpointExistsError(
            f"{checkpoint_path} holds an earlier run's checkpoint; pass --resume auto to "
            "continue that run, another --out-dir to start a new one next to it, or "
            "--overwrite to replace it"
        )
    # its run's out-dir (under --parallel a step folder sits in <out-dir>/checkpoints/)
    home = resume_path.parent
    if parallel and not has_checkpoint(resume_path):
        home = home.parent
    raise CheckpointExistsError(
        f"--resume {resume_path} would save its continuation over {checkpoint_path}, which "
        f"holds another run's checkpoint; pass --out-dir {home} to continue "
        f"{resume_path.name} where it is, another --out-dir to keep both, or --overwrite to "
        f"replace {checkpoint_path}"
    )


def check_writable(checkpoint_path: Path, *, folder: bool) -> None:
    """Create the folder that will hold ``checkpoint_path`` and write a file in it; raise
    ``OSError`` naming the path when a checkpoint could not be saved there (``folder``: the
    checkpoint is a folder, as under --parallel, else a file)."""
    where = checkpoint_path if folder else checkpoint_path.parent
    if checkpoint_path.exists() and checkpoint_path.is_dir() != folder:
        expected = "a folder" if folder else "a file"
        found = "a folder" if checkpoint_path.is_dir() else "a file"
        raise OSError(
            f"checkpoint target {checkpoint_path} is {found}, expected {expected}: no "
            "checkpoint could be saved there; move it away or choose another --out-dir"
        )
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as error:
        raise OSError(
            error.errno,
            f"checkpoints cannot be written to {where} ({error.strerror or error}); "
            "choose another --out-dir",
        ) from error


def _floating(values: Iterable) -> Iterable[tuple[str, torch.Tensor]]:
    for name, value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            yield name, value.to_local() if hasattr(value, "to_local") else value


def first_nonfinite(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[str, int, int] | None:
    """(name, non-finite entries, entries) of the first parameter or optimizer state tensor
    holding NaN or inf (this process's shards under FSDP2; every optimizer of a
    ``HybridOptimizer``), or None when all are finite."""
    names = {p: name for name, p in model.named_parameters()}
    tensors = list(_floating(model.named_parameters()))
    inner = optimizer.optimizers.values() if isinstance(optimizer, HybridOptimizer) else [optimizer]
    for p, state in (entry for opt in inner for entry in opt.state.items()):
        owner = names.get(p, "a parameter")
        tensors += _floating((f"optimizer state {key!r} of {owner}", v) for key, v in state.items())
    for name, tensor in tensors:
        bad = int((~torch.isfinite(tensor)).sum())
        if bad:
            return name, bad, tensor.numel()
    return None


def nonfinite_checkpoint_error(path: Path, name: str, count: int, total: int) -> CheckpointError:
    """The refusal of a checkpoint whose tensor ``name`` holds ``count`` NaN/inf entries."""
    return CheckpointError(
        f"checkpoint {path} holds NaN/inf in {name} ({count:,} of {total:,} entries); refusing "
        "to resume from it, since non-finite parameters are never saved. Resume from an "
        "earlier checkpoint, or start anew with --overwrite"
    )


def resume_changes(saved: TrainConfig, now: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Settings (:data:`RESUMABLE_CHANGES`, :data:`DATA_CHANGES`) of ``now`` that differ from
    the checkpoint's ``saved``: name -> (saved, now); tokens_per_step compared as the tokens
    each step really takes."""
    changes = {
        name: (getattr(saved, name), getattr(now, name))
        for name in RESUMABLE_CHANGES + DATA_CHANGES
        if getattr(saved, name) != getattr(now, name)
    }
    effective = (
        saved.tokens_per_micro_batch * saved.gradient_accumulation_steps,
        now.tokens_per_micro_batch * now.gradient_accumulation_steps,
    )
    changes.pop("tokens_per_step", None)
    if effective[0] != effective[1]:
        changes["tokens_per_step"] = effective
    return changes
