"""Checkpoint files of ``muonscale train``: atomic, durable, and checked on load.

A checkpoint is ``torch.save``'s bytes followed by a one-line trailer holding their sha256
(``\\nmuonscale-checkpoint sha256=<64 hex>\\n``). :func:`write_checkpoint` writes a temporary
file in the same folder, ``fsync``s it, ``os.replace``s it over the target and ``fsync``s the
folder, so a crash or a full disk leaves the previous checkpoint intact; temporaries left by a
killed save are removed by the next one. :func:`read_checkpoint` turns every way a file can be
unusable (empty, foreign, truncated, bytes flipped, keys missing) into a
:class:`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Any

import torch

__all__ = ["FORMAT", "CheckpointError", "read_checkpoint", "write_checkpoint"]

FORMAT = 2
"""Version of the checkpoint layout (2: sha256 trailer)."""
REQUIRED_KEYS = ("format", "step", "config", "model", "optimizer", "scheduler", "rng")
_MAGIC = b"\nmuonscale-checkpoint sha256="
_TRAILER_BYTES = len(_MAGIC) + 64 + 1


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used; the message names the file and the problem."""


def _temporary_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete ``.<name>.tmp-<pid>`` files next to ``path`` whose writer is no longer alive."""
    removed = []
    prefix = _temporary_prefix(path)
    for candidate in path.parent.glob(prefix + "*"):
        suffix = candidate.name[len(prefix) :]
        pid = int(suffix) if suffix.isdigit() else None
        if pid is not None and (pid == os.getpid() or _pid_alive(pid)):
            continue
        candidate.unlink(missing_ok=True)
        removed.append(candidate)
    return removed


def write_durably(path: Path, *chunks: bytes | memoryview) -> None:
    """Write ``chunks`` to ``path`` and fsync the file."""
    with open(path, "wb") as file:
        for chunk in chunks:
            file.write(chunk)
        file.flush()
        os.fsync(file.fileno())


def fsync_folder(folder: Path) -> None:
    """Fsync ``folder`` (a rename in it is then durable)."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_checkpoint(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Serialize ``state`` to ``path`` atomically and durably, with its sha256 appended."""
    path = Path(path)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getbuffer()
    trailer = _MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    temporary = path.with_name(f"{_temporary_prefix(path)}{os.getpid()}")
    try:
        write_durably(temporary, payload, trailer)
        os.replace(temporary, path)
        fsync_folder(path.parent)
    except OSError as error:
        reason = error.strerror or str(error)
        raise OSError(
            error.errno,
            f"could not write checkpoint {path}: {reason}; the previous {path.name} in "
            f"{path.parent} (if any) is unchanged",
        ) from error
    finally:
        temporary.unlink(missing_ok=True)
    return path


def read_checkpoint(path: str | os.PathLike, *, map_location: Any = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`write_checkpoint` after checking its digest, its
    format and its keys; raise :class:`CheckpointError` (or ``FileNotFoundError``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.is_dir():
        raise CheckpointError(f"checkpoint {path} is a folder, expected a file")
    data = path.read_bytes()
    if not data:
        raise CheckpointError(
            f"checkpoint {path} is empty (0 bytes): a copy or save that never finished"
        )
    start = len(data) - _TRAILER_BYTES
    if start < 0 or data[start : start + len(_MAGIC)] != _MAGIC:
        if data[:4] == b"PK\x03\x04":
            problem = (
                "has no muonscale digest trailer: it is truncated, or was written by "
                "torch.save directly or by a muonscale before checkpoint format 2"
            )
        else:
            problem = (
                f"is not a muonscale checkpoint (it starts with {data[:16]!r}; expected a "
                "file written by muonscale train)"
            )
        raise CheckpointError(f"checkpoint {path} {problem}")
    payload = memoryview(data)[:start]
    stored = data[start + len(_MAGIC) : -1].decode("ascii", errors="replace")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != stored:
        raise CheckpointError(
            f"checkpoint {path} is corrupted: the sha256 of its {start:,} data bytes is "
            f"{actual}, but {stored} was stored when it was saved"
        )
    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as error:  # torch raises many kinds for malformed archives
        raise CheckpointError(f"checkpoint {path} could not be unpickled: {error}") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a dict")
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {state.get('format')!r}, expected {FORMAT}"
        )
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks the entries {missing}")
    return state
