"""Checkpoints of ``muonscale train --parallel``: ``torch.distributed.checkpoint`` folders.

Layout under ``<out_dir>/checkpoints/``::

    latest                       {"folder": "step-00000040-<id>", "step": 40,
                                  "manifest_sha256": "<hex>"}   (replaced atomically)
    step-00000040-<id>/          DCP files of the model and optimizer (get_state_dict),
                                 trainer.pt (step, config, scheduler, RNG), manifest.json
                                 (sha256 of every file)

A save writes into ``.step-<N>-<id>.tmp`` (every rank its DCP shards), then, after DCP's final
collective, rank 0 writes ``trainer.pt`` and ``manifest.json`` (each ``fsync``ed), renames the
folder to its final name, and only then replaces ``latest`` (temporary file, ``fsync``,
``os.replace``, ``fsync`` of the folder). ``latest`` therefore only ever names a whole
checkpoint; a save killed at any point leaves the previous one as ``latest``. Stale
temporaries and superseded step folders are removed by rank 0. Loading checks the manifest's
digest (held by ``latest``) and every file's digest on rank 0, and every rank raises the same
:class:`~muonscale.train.checkpoint.CheckpointError` naming the file. DCP reshards on load, so a
checkpoint written at one world size loads at another.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from muonscale.train.checkpoint import CheckpointError, fsync_folder, write_durably
from muonscale.train.parallel import Parallelism

__all__ = [
    "FOLDER",
    "LATEST",
    "has_checkpoint",
    "load_sharded",
    "verify_sharded",
    "write_sharded",
]

FOLDER = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer.pt"
FORMAT = 1
"""Version of this folder layout."""


def has_checkpoint(root: Path) -> bool:
    """Whether ``root`` (``<out_dir>/checkpoints``) names a checkpoint through ``latest``."""
    return (root / LATEST).is_file()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _replace_durably(path: Path, data: bytes) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write_durably(temporary, data)
        os.replace(temporary, path)
        fsync_folder(path.parent)
    finally:
        temporary.unlink(missing_ok=True)


def _agree_on_error(parallel: Parallelism, error: str | None, kind: type[Exception]) -> None:
    """Raise ``kind(rank 0's error)`` on every rank when rank 0 failed."""
    error = parallel.broadcast_object(error)
    if error is not None:
        raise kind(error)


def _finish_on_rank0(
    temporary: Path, final: Path, root: Path, step: int, trainer_state: dict[str, Any]
) -> None:
    buffer = io.BytesIO()
    torch.save(trainer_state, buffer)
    write_durably(temporary / TRAINER_STATE, buffer.getvalue())
    files = {p.name: _sha256(p) for p in sorted(temporary.iterdir()) if p.is_file()}
    manifest = json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1).encode()
    write_durably(temporary / MANIFEST, manifest)
    fsync_folder(temporary)
    os.rename(temporary, final)
    fsync_folder(root)
    pointer = {
        "folder": final.name,
        "step": step,
        "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
    }
    _replace_durably(root / LATEST, json.dumps(pointer).encode() + b"\n")
    for old in root.glob("step-*"):
        if old.is_dir() and old.name != final.name:
            shutil.rmtree(old, ignore_errors=True)


def _last_good(root: Path) -> str:
    try:
        pointer = json.loads((root / LATEST).read_text())
        return f"{root / LATEST} still names the last good checkpoint, step {pointer['step']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"no earlier checkpoint in {root} ({LATEST} absent or unreadable)"


def _save_failure(temporary: Path, root: Path, exc: CheckpointException) -> str:
    """Rank 0: the message for a failed ``dcp.save`` (the first failure's reason; "No space
    left on device" also when torch's writer hid it: a probe write in the folder fails so),
    after removing the partial folder to give the space back."""
    failures = [failure for failure, _ in exc.failures.values()]
    reasons = [f.strerror for f in failures if isinstance(f, OSError) and f.strerror]
    if not reasons:
        try:
            write_durably(temporary / ".space-probe", bytes(1 << 16))
        except OSError as probe:
            reasons = [probe.strerror or str(probe)]
    reason = reasons[0] if reasons else f"{type(failures[0]).__name__}: {failures[0]}"
    shutil.rmtree(temporary, ignore_errors=True)
    ranks = ", ".join(map(str, sorted(exc.failures)))
    on = f"on rank{'s' if len(exc.failures) > 1 else ''} {ranks}"
    return (
        f"could not write checkpoint {temporary} ({on}): {reason}; the partial "
        f"folder was removed, and {_last_good(root)}"
    )


def write_sharded(
    parallel: Parallelism,
    root: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
) -> Path:
    """Save model and optimizer (DCP, every rank its part) and ``trainer_state`` (rank 0) as
    ``root/step-<step>-<id>`` and point ``root/latest`` at it. Collective."""
    name = parallel.broadcast_object(f"step-{step:08d}-{uuid.uuid4().hex[:8]}")
    final, temporary = root / name, root / f".{name}.tmp"
    error = None
    if parallel.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".step-*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)
            temporary.mkdir()
        except OSError as exc:
            error = f"could not create checkpoint folder {temporary}: {exc}"
    _agree_on_error(parallel, error, OSError)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=str(temporary))
    except CheckpointException as exc:  # raised on every rank, naming the ranks that failed
        error = _save_failure(temporary, root, exc) if parallel.rank == 0 else None
    _agree_on_error(parallel, error, OSError)
    parallel.barrier()
    if parallel.rank == 0:
        try:
            _finish_on_rank0(temporary, final, root, step, trainer_state)
        except OSError as exc:
            shutil.rmtree(temporary, ignore_errors=True)
            reason = exc.strerror or str(exc)
            error = f"could not write checkpoint {final}: {reason}; {_last_good(root)}"
    _agree_on_error(parallel, error, OSError)
    return final


def _resolve(path: Path) -> tuple[Path, str | None]:
    """(step folder, expected manifest sha256 or None) for a checkpoints root or step folder."""
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not (path / LATEST).is_file():
        if (path / MANIFEST).is_file():
            return path, None
        raise CheckpointError(
            f"checkpoint {path} is neither a checkpoints folder (no {LATEST}) nor a step "
            f"folder (no {MANIFEST}) written by muonscale train --parallel"
        )
    try:
        pointer = json.loads((path / LATEST).read_text())
        folder, digest = path / pointer["folder"], pointer["manifest_sha256"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint pointer {path / LATEST} is damaged: {exc}") from exc
    if not folder.is_dir():
        raise CheckpointError(f"{path / LATEST} names {folder}, which does not exist")
    return folder, digest


def _verify(path: Path) -> tuple[Path, dict[str, Any]]:
    """Check the digests of the checkpoint at ``path``; return its folder and trainer state."""
    folder, expected = _resolve(path)
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {folder} lacks {MANIFEST}")
    manifest_bytes = manifest_path.read_bytes()
    actual = hashlib.sha256(manifest_bytes).hexdigest()
    if expected is not None and actual != expected:
        raise CheckpointError(
            f"checkpoint manifest {manifest_path} is corrupted: its sha256 is {actual}, but "
            f"{expected} was stored in {LATEST} when it was saved"
        )
    try:
        files = json.loads(manifest_bytes)["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is damaged: {exc}") from exc
    for name, digest in files.items():
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing")
        if _sha256(file) != digest:
            raise CheckpointError(
                f"checkpoint file {file} is corrupted: its sha256 differs from the one stored "
                "when it was saved"
            )
    try:
        state = torch.load(folder / TRAINER_STATE, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for malformed archives
        raise CheckpointError(f"checkpoint file {folder / TRAINER_STATE}: {exc}") from exc
    return folder, state


def verify_sharded(parallel: Parallelism, path: Path) -> tuple[Path, dict[str, Any]]:
    """Check the checkpoint at ``path`` (a checkpoints root or a step folder) on rank 0; return
    its step folder and trainer state on every rank, or raise the same error on every rank.
    Collective."""
    answer: tuple[str | None, str | None, str | None, Any] = (None, None, None, None)
    if parallel.rank == 0:
        try:
            folder, state = _verify(Path(path))
            answer = (None, None, str(folder), state)
        except (CheckpointError, FileNotFoundError) as exc:
            answer = (type(exc).__name__, str(exc), None, None)
    kind, message, folder_name, state = parallel.broadcast_object(answer)
    if kind is not None:
        raise (FileNotFoundError if kind == "FileNotFoundError" else CheckpointError)(message)
    return Path(folder_name), state


def load_sharded(folder: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the DCP files of ``folder`` into ``model`` and ``optimizer`` (resharded to this
    world size). Collective."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optim": optimizer_state}
    dcp.load(loaded, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
