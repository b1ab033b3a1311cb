"""Async handles of the collectives :mod:`.comm` composes (a local step runs at ``wait``), and
the local steps themselves: summing received chunks in rank order, placing uneven pieces."""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch


class CompletedWork:
    """Stands in for a ``Work`` handle when no collective was issued (world size 1)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def sum_chunks(output: torch.Tensor, received: torch.Tensor, world_size: int) -> None:
    """``output`` <- sum of the ``world_size`` equal chunks of ``received``, in rank order."""
    chunks = received.view(world_size, received.numel() // world_size)
    low_precision = received.dtype in (torch.float16, torch.bfloat16)
    acc = chunks[0].float() if low_precision else chunks[0].clone()
    for r in range(1, world_size):
        acc.add_(chunks[r])
    output.copy_(acc.view(output.shape))


class SumAfterWork:
    """The async handle of an all-to-all reduce-scatter: waiting also does the local sum."""

    def __init__(self, work, output: torch.Tensor, received: torch.Tensor, world_size: int):
        self._work, self._output, self._received = work, output, received
        self._world_size = world_size

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._received is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            sum_chunks(self._output, self._received, self._world_size)
            self._received = None
        return True

    def is_completed(self) -> bool:
        return self._received is None


class ThenWork:
    """An async handle whose ``wait`` also runs ``finish`` (once)."""

    def __init__(self, work, finish):
        self._work, self._finish = work, finish

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._finish is not None:
            self._work.wait() if timeout is None else self._work.wait(timeout)
            self._finish()
            self._finish = None
        return True

    def is_completed(self) -> bool:
        return self._finish is None


def place_uneven(rows: torch.Tensor, packed: torch.Tensor, lengths: Sequence[int]) -> None:
    """Row ``j`` of ``rows`` (N, S) <- the ``j``-th piece (``lengths[j]`` elements) of
    ``packed``, left-aligned (the rest of the row untouched)."""
    start = 0
    for j, n in enumerate(lengths):
        rows[j, :n].copy_(packed[start : start + n])
        start += n
