"""Memory bounds of an optimizer step, and the one loop that packs work under a byte budget.

An update's transients (momentum directions, their Newton–Schulz copies, AdamW's denominators)
are produced in chunks of at most ``update_chunk_bytes``, and the Newton–Schulz scratch cache
holds at most ``ns_workspace_bytes``, so the step's peak memory does not grow with the model.
The environment can override both; it is read once, by :meth:`MemoryBudget.from_environment`
when an optimizer is built, and the math layer only ever receives plain numbers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Literal

import torch

UPDATE_CHUNK_ENV: Final = "MUONSCALE_UPDATE_CHUNK_MB"
"""Environment variable: bytes of transients per update chunk, in MiB (float)."""

NS_WORKSPACE_ENV: Final = "MUONSCALE_NS_WORKSPACE_MB"
"""Environment variable: bytes the Newton–Schulz workspace cache may hold, in MiB (float)."""

DEFAULT_UPDATE_CHUNK_MIB: Final = {"cpu": 128, "cuda": 1024}
"""Chunk size per device type. On CPU a small chunk costs nothing measurable (batching matters
little) and keeps RSS down; on CUDA every chunk costs kernel launches, so chunks are larger: a
GPT-2-medium step is 2 chunks, GPT-2-XL's 6 × 1 GiB of transients instead of ≈ 8 GiB at once.
Other device types use the CPU entry."""

DEFAULT_NS_WORKSPACE_BYTES: Final = 256 * 2**20
"""Default bound of the Newton–Schulz workspace cache (and of one workspace)."""

PER_DEVICE: Final = "per_device"
"""``max_chunk_bytes`` value: the entry of :data:`DEFAULT_UPDATE_CHUNK_MIB` for the device of
the tensors being updated."""

UNCHUNKED: Final = None
"""``max_chunk_bytes`` value: everything in one chunk."""

ChunkBytes = int | Literal["per_device"] | None
"""A chunk budget: a number of bytes, :data:`PER_DEVICE` or :data:`UNCHUNKED`."""


def chunk_bytes_for(max_chunk_bytes: ChunkBytes, device: torch.device | None) -> int | None:
    """The byte budget ``max_chunk_bytes`` means for tensors on ``device``."""
    if max_chunk_bytes == PER_DEVICE:
        kind = device.type if device is not None else "cpu"
        return DEFAULT_UPDATE_CHUNK_MIB.get(kind, DEFAULT_UPDATE_CHUNK_MIB["cpu"]) * 2**20
    if max_chunk_bytes is not None and (
        not isinstance(max_chunk_bytes, int)
        or isinstance(max_chunk_bytes, bool)
        or max_chunk_bytes < 1
    ):
        raise ValueError(
            f"max_chunk_bytes must be a positive int, {PER_DEVICE!r} or None, "
            f"got {max_chunk_bytes!r}"
        )
    return max_chunk_bytes


def _mib_from(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None:
        return None
    try:
        mib = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of MiB, got {value!r}") from None
    if not (mib > 0 and math.isfinite(mib)):
        raise ValueError(f"{name} must be a finite positive number of MiB, got {value!r}")
    return max(1, int(mib * 2**20))


@dataclass(frozen=True)
class MemoryBudget:
    """The memory bounds one optimizer applies to its steps.

    Attributes:
        update_chunk_bytes: transients per update chunk (:data:`PER_DEVICE` by default).
        ns_workspace_bytes: bound of the Newton–Schulz workspace cache.
    """

    update_chunk_bytes: ChunkBytes = PER_DEVICE
    ns_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> MemoryBudget:
        """The defaults, overridden by ``MUONSCALE_UPDATE_CHUNK_MB`` and
        ``MUONSCALE_NS_WORKSPACE_MB`` where set (``environ`` defaults to ``os.environ``)."""
        environ = os.environ if environ is None else environ
        chunk = _mib_from(environ, UPDATE_CHUNK_ENV)
        workspace = _mib_from(environ, NS_WORKSPACE_ENV)
        return cls(
            update_chunk_bytes=PER_DEVICE if chunk is None else chunk,
            ns_workspace_bytes=DEFAULT_NS_WORKSPACE_BYTES if workspace is None else workspace,
        )


Piece = tuple[int, int | None, int | None]
"""(index, start, stop): a flat element range of item ``index``; ``start=None``: all of it."""


def split_by_budget(
    sizes: Sequence[int],
    budget: int | None,
    *,
    itemsizes: Sequence[int] | None = None,
) -> list[list[Piece]]:
    """Pack items of ``sizes`` bytes, in order, into consecutive groups of at most ``budget``
    bytes (``None``: one group). An item that does not fit in what is left of the current
    group starts a new one; an item bigger than the budget is a group alone, unless it is
    divisible: with ``itemsizes`` (bytes per element, 0 for an item that cannot be split),
    items are cut at element boundaries so that every group is filled up to the budget."""
    if budget is None:
        return [[(i, None, None) for i in range(len(sizes))]]
    groups: list[list[Piece]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        unit = itemsizes[i] if itemsizes is not None else 0
        if size <= budget - used or (not unit and not groups[-1]):
            groups[-1].append((i, None, None))
            used += size
            continue
        if not unit:
            groups.append([(i, None, None)])
            used = size
            continue
        numel, start = size // unit, 0
        while start < numel:
            take = min(numel - start, max(budget - used, 0) // unit)
            if take == 0:
                if groups[-1]:
                    groups.append([])
                    used = 0
                    continue
                take = 1  # a budget below one element: one element at a time
            groups[-1].append((i, start, start + take))
            used += take * unit
            start += take
    return [g for g in groups if g]


def group_by_budget(sizes: Sequence[int], budget: int | None) -> list[list[int]]:
    """Indices of ``sizes`` packed whole by :func:`split_by_budget`."""
    return [[i for i, _, _ in group] for group in split_by_budget(sizes, budget)]
