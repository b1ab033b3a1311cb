"""The exchange: what a layout contributes to Muon's step.

Every layout runs the same matrix step (:mod:`muonscale.matrix_step`) where a matrix is whole.
A layout differs only in how whole matrices reach that step and how results get back::

    pieces ─ run ─▶ whole matrices at their owners ─ matrix step ─▶ results ─▶ pieces

plus the sharing of replicated row state: a matrix's replicated row states (each a variant's
value per row, declared with its statistics: :class:`~muonscale.state_tensor.StateTensor`) are
held by every rank of the group (a replica each), and the statistics the owner computed step
every replica (:meth:`MatrixExchange.share_row_statistics`), so the replicas stay equal.
:func:`step_through_exchange` is that sequence, for every layout that exchanges.

Implementations: :class:`PieceExchange` (one all-to-all each way over a process group, with
:class:`~muonscale.distributed.sharded.ShardedMatrices`: ``DTensorMuon`` and Megatron tensor
parallelism) and :class:`LocalExchange` (every matrix whole on this rank: Megatron at tensor
parallel size 1, or when every rank holds every matrix whole). All bytes go through
:mod:`muonscale.distributed.comm`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist

from ..matrix_step import RowStates, step_row_replicas_
from ..settings import MuonSettings
from ..state_tensor import StateTensor
from .comm import Communicator, WireCounter
from .hosts import HostMap
from .sharded import MatrixLayout, ShardedMatrices, WholeMatrixFn

__all__ = [
    "LocalExchange",
    "MatrixExchange",
    "OwnerStep",
    "PieceExchange",
    "step_through_exchange",
]

OwnerStep = Callable[
    [list[int], list[torch.Tensor]],
    tuple[list[torch.Tensor], Sequence[Mapping[StateTensor, torch.Tensor]]],
]
"""The matrix step where matrices are whole: ``(indices, whole matrices)`` → (results, each
one's row statistics by declaration), e.g. :func:`muonscale.matrix_step.matrix_updates` with
``step_row_state=False``."""


class MatrixExchange(Protocol):
    """Brings matrices whole to the matrix step and the results back as pieces."""

    def run(
        self,
        pieces: Sequence[torch.Tensor],
        owner_step: WholeMatrixFn,
        *,
        result_dtype: torch.dtype | None = None,
        packed: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """``owner_step(indices, whole matrices)`` where they are whole; this rank's pieces of
        its results (in ``result_dtype``)."""
        ...

    def share_row_statistics(
        self, owner_stats: Mapping[int, torch.Tensor], rows: Sequence[int | None]
    ) -> dict[int, torch.Tensor]:
        """Every matrix's row statistics on every rank (``rows[i]``: its row count, None for a
        matrix without row state; ``owner_stats``: those this rank's matrix step computed)."""
        ...


class LocalExchange:
    """Every matrix is whole on this rank: the step runs here, nothing is sent (Megatron's
    orthogonalizer at tensor parallel size 1, or where every matrix is whole everywhere)."""

    def run(
        self,
        pieces: Sequence[torch.Tensor],
        owner_step: WholeMatrixFn,
        *,
        result_dtype: torch.dtype | None = None,
        packed: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        del packed  # nothing to send from
        indices = list(range(len(pieces)))
        out = owner_step(indices, list(pieces)) if indices else []
        return [o if result_dtype is None else o.to(result_dtype) for o in out]

    def share_row_statistics(
        self, owner_stats: Mapping[int, torch.Tensor], rows: Sequence[int | None]
    ) -> dict[int, torch.Tensor]:
        return {i: owner_stats[i] for i, r in enumerate(rows) if r is not None}


class PieceExchange:
    """Matrices sharded over ``group`` (``layouts``: each rank's piece of each): one
    all-to-all sends every piece to its matrix's owner, one sends the results back
    (:class:`~muonscale.distributed.sharded.ShardedMatrices`); row statistics reach every rank
    in one float32 all-reduce (sum: ranks other than the owner add zeros, so it is exact).
    Matrices every rank holds whole are computed by every rank, with no traffic."""

    def __init__(
        self,
        layouts: Sequence[MatrixLayout],
        *,
        group: dist.ProcessGroup | None,
        counter: WireCounter,
        tag: str,
        row_tag: str | None = None,  # the row statistics' tag (default: ``tag``)
        hosts: HostMap | None = None,
        owners: Sequence[int] | None = None,
        row_comm: Communicator | None = None,  # the row statistics' (default: a new one)
    ) -> None:
        self.matrices = ShardedMatrices(
            layouts, group=group, owners=owners, counter=counter, tag=tag, hosts=hosts
        )
        self._comm = row_comm if row_comm is not None else Communicator(group, counter=counter)
        self._row_tag = row_tag or tag

    @property
    def local(self) -> list[int]:
        """Matrices every rank holds whole (computed on every rank)."""
        return list(self.matrices.local)

    def piece_buffer(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """:meth:`ShardedMatrices.piece_buffer`: write pieces where the all-to-all sends them."""
        return self.matrices.piece_buffer(dtype, device)

    def run(
        self,
        pieces: Sequence[torch.Tensor],
        owner_step: WholeMatrixFn,
        *,
        result_dtype: torch.dtype | None = None,
        packed: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        return self.matrices.apply(pieces, owner_step, result_dtype=result_dtype, packed=packed)

    def share_row_statistics(
        self, owner_stats: Mapping[int, torch.Tensor], rows: Sequence[int | None]
    ) -> dict[int, torch.Tensor]:
        local = set(self.matrices.local)
        out = {i: owner_stats[i] for i in local if rows[i] is not None}
        shared = [i for i, r in enumerate(rows) if r is not None and i not in local]
        if not shared:
            return out
        flat = torch.zeros(
            sum(rows[i] for i in shared), dtype=torch.float32, device=self._comm.device
        )
        offset = 0
        slices = {}
        for i in shared:
            slices[i] = slice(offset, offset + rows[i])
            mine = owner_stats.get(i)  # only on the matrix's owner
            if mine is not None:
                flat[slices[i]] = mine
            offset += rows[i]
        self._comm.all_reduce(flat, op=dist.ReduceOp.SUM, tag=self._row_tag)
        out.update((i, flat[s]) for i, s in slices.items())
        return out


def step_through_exchange(
    exchange: MatrixExchange,
    pieces: Sequence[torch.Tensor],
    owner_step: OwnerStep,
    replicas: Sequence[RowStates],
    settings: Sequence[MuonSettings],
    *,
    result_dtype: torch.dtype | None = None,
    packed: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """The matrix step of sharded matrices: ``owner_step`` runs where each matrix is whole
    (:meth:`MatrixExchange.run`: this rank's pieces of its results come back, in
    ``result_dtype``), then the owners' row statistics reach every rank (one
    :meth:`~MatrixExchange.share_row_statistics`, none without row state) and every rank steps
    its replicas (``replicas[i]``: entry i's replicated row states by declaration, whole rows,
    the states its rule keeps; stepped with ``settings[i]``), as the owner's own step would:
    the replicas stay equal. Collective over the exchange's group."""
    owner_stats: dict[int, torch.Tensor] = {}

    def whole_step(indices: list[int], matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        out, stats = owner_step(indices, matrices)
        for i, by_state in zip(indices, stats):
            if replicas[i]:  # one vector per entry: its states' statistics, in replica order
                owner_stats[i] = _concatenated([by_state[spec] for spec in replicas[i]])
        return out

    out = exchange.run(pieces, whole_step, result_dtype=result_dtype, packed=packed)
    rows = [sum(v.numel() for v in held.values()) if held else None for held in replicas]
    if any(r is not None for r in rows):
        shared = exchange.share_row_statistics(owner_stats, rows)
        step_row_replicas_(
            replicas,
            [_by_state(replicas[i], shared[i]) if i in shared else None for i in range(len(rows))],
            settings,
        )
    return out


def _concatenated(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _by_state(held: RowStates, flat: torch.Tensor) -> dict[StateTensor, torch.Tensor]:
    """A vector of :func:`_concatenated` statistics split back by state (``held``'s order)."""
    out, start = {}, 0
    for spec, replica in held.items():
        out[spec] = flat[start : start + replica.numel()]
        start += replica.numel()
    return out
