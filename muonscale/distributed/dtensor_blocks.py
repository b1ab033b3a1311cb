"""Where a rank's shard of a DTensor parameter's state lies in the state's block matrix.

Blocks of quantized state are segments of one row of a block matrix
(:func:`~muonscale.block_quantization.block_matrix_shape`). :class:`ShardBlocks` says where
a rank's shard lies in it: a set of rows, and in each of them one contiguous range of columns;
which blocks some rank's column boundary cuts; and how the scales are placed (the
parameter's dim-0 placements where its rows are the scales' rows, else replicated).
:func:`packed_code_placements` places ``"int4"``'s packed codes the same way. What is stored
there, and the exchange of the cut blocks' maxima: :mod:`.dtensor_state`.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..column_blocks import ColumnBlocks, span_blocks
from .dtensor_layout import held_indices

__all__ = ["ShardBlocks", "packed_code_placements", "shard_blocks"]


def _block_dims(ndim: int, mode: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The dims that index the rows and the columns of the block matrix of a tensor of
    ``ndim`` dims (as :func:`~muonscale.block_quantization.block_matrix_shape` reads it)."""
    if ndim == 0:
        return (), ()
    if ndim == 1:
        return (), (0,)
    if ndim == 2 or mode == "batch":
        return tuple(range(ndim - 1)), (ndim - 1,)
    return (0,), tuple(range(1, ndim))


def _flat(shape: Sequence[int], dims: Sequence[int], held: Sequence[torch.Tensor]) -> torch.Tensor:
    """Row-major flat indices over ``dims`` of ``shape`` of the held indices ``held[d]``."""
    out = torch.zeros(1, dtype=torch.long)
    for d in dims:
        out = (out[:, None] * shape[d] + held[d][None, :]).reshape(-1)
    return out


def _coordinates(mesh: Any):
    """Every mesh coordinate (every rank's)."""
    return itertools.product(*(range(s) for s in mesh.mesh.shape))


def _piece(shape, row_dims, col_dims, mesh, placements, coord) -> tuple[torch.Tensor, torch.Tensor]:
    """(global rows, global columns) of the block matrix that the rank at mesh coordinate
    ``coord`` holds, in its local order."""
    held = {d: held_indices(shape[d], d, mesh, placements, coord) for d in (*row_dims, *col_dims)}
    return _flat(shape, row_dims, held), _flat(shape, col_dims, held)


@dataclass(frozen=True)
class ShardBlocks:
    """Where this rank's shard of one state tensor lies in its block matrix, and how its
    scales are laid out."""

    block_shape: tuple[int, int]
    """(rows, cols) of the global block matrix."""
    block_size: int
    rows: torch.Tensor
    """Global rows of the local shard's rows (its leading dims flattened), in order."""
    col_start: int
    cols: int
    """The local shard's columns of each row: ``[col_start, col_start + cols)``."""
    scale_placements: tuple
    """Placements of the scales ``(rows, blocks)``: the parameter's on dim 0 where its rows
    are the scales' chunks, else Replicate."""
    scale_rows: Any
    """The local scales' rows of the shard's rows (a slice, or an index tensor)."""
    cut_blocks: tuple[int, ...]
    """Global block columns that some rank's column boundary cuts (each row alike)."""
    replicated_on: tuple[int, ...]
    """Mesh dims on which the parameter is sharded and its scales replicated."""
    row_dims: tuple[int, ...]
    """The parameter's dims that index the block matrix's rows."""

    @property
    def whole(self) -> bool:
        """Every rank holds whole rows laid out as its scales' rows: no communication."""
        return not self.replicated_on

    @property
    def first_block(self) -> int:
        return self.col_start // self.block_size

    @property
    def stop_block(self) -> int:
        return -(-(self.col_start + self.cols) // self.block_size) if self.cols else 0

    @functools.cached_property
    def columns(self) -> ColumnBlocks:
        """The shard's one span of columns of each row in the blocks (the plain-tensor math of
        its cut blocks: :mod:`muonscale.column_blocks`)."""
        return span_blocks(
            self.block_shape[1], self.block_size, self.col_start, self.cols, self.cut_blocks
        )

    @property
    def slot_count(self) -> int:
        """Cut blocks of the whole block matrix (slots of :func:`store_shards_`'s vector)."""
        return self.block_shape[0] * len(self.cut_blocks)


def shard_blocks(
    name: str, p: DTensor, block_shape: tuple[int, int], mode: str, block_size: int
) -> ShardBlocks:
    """The :class:`ShardBlocks` of a state tensor of the DTensor ``p`` blocked as
    ``block_shape`` (``mode``: how its dims make the block matrix, ``"batch"`` or
    ``"flatten"``); ``ValueError`` naming ``name`` where a rank's columns of a row are not
    contiguous (a shard of a trailing dim of a flattened row)."""
    shape, mesh, placements = tuple(p.shape), p.device_mesh, tuple(p.placements)
    rows_count, cols_count = block_shape
    row_dims, col_dims = _block_dims(len(shape), mode)
    starts = []
    for coord in _coordinates(mesh):
        _, cols = _piece(shape, (), col_dims, mesh, placements, coord)
        first = int(cols[0]) if cols.numel() else 0
        if cols.numel() and not torch.equal(cols, torch.arange(first, first + cols.numel())):
            raise ValueError(
                f"DTensorMuon: parameter '{name}' of shape {shape} with placements {placements} "
                f"gives a rank columns of its {rows_count}×{cols_count} quantized state's rows "
                "that are not one contiguous range (a shard of a trailing dim of a flattened "
                "row), so its blocks cannot share their scales; shard another dim, or put it "
                "in a param group with state_precision='param'."
            )
        if cols.numel():
            starts.append(int(cols[0]))
    rows, cols = _piece(shape, row_dims, col_dims, mesh, placements, mesh.get_coordinate())
    cut = sorted({s // block_size for s in starts if s % block_size and s < cols_count})
    kept = tuple(
        pl
        if 0 in row_dims and len(shape) >= 2 and not isinstance(pl, Replicate) and pl.dim == 0
        else Replicate()
        for pl in placements
    )
    for coord in _coordinates(mesh):  # every rank's rows are its scales' rows, or none's
        held_rows, _ = _piece(shape, row_dims, (), mesh, placements, coord)
        if not torch.equal(held_indices(rows_count, 0, mesh, kept, coord), held_rows):
            kept = tuple(Replicate() for _ in placements)
            break
    scale_held = held_indices(rows_count, 0, mesh, kept)
    if torch.equal(scale_held, rows):
        scale_rows: Any = slice(None)
    elif rows.numel() and torch.equal(
        rows, torch.arange(int(rows[0]), int(rows[0]) + rows.numel())
    ):
        scale_rows = slice(int(rows[0]), int(rows[0]) + rows.numel())
    else:
        scale_rows = rows
    replicated_on = tuple(
        d
        for d, (pl, sp) in enumerate(zip(placements, kept))
        if not isinstance(pl, Replicate) and isinstance(sp, Replicate) and mesh.size(d) > 1
    )
    return ShardBlocks(
        block_shape=(int(rows_count), int(cols_count)),
        block_size=block_size,
        rows=rows,
        col_start=int(cols[0]) if cols.numel() else 0,
        cols=int(cols.numel()),
        scale_placements=kept,
        scale_rows=scale_rows,
        cut_blocks=tuple(cut),
        replicated_on=replicated_on,
        row_dims=row_dims,
    )


def packed_code_placements(name: str, p: DTensor, blocks: ShardBlocks) -> tuple:
    """Placements of ``"int4"``'s packed codes ``(rows, ⌈cols / 2⌉)`` of ``p``: its row
    placements on dim 0, its column ones on dim 1; ``ValueError`` naming ``name`` where a
    rank's columns are not whole bytes of the chunk those placements give it."""
    shape, mesh = tuple(p.shape), p.device_mesh
    out = []
    for pl in p.placements:
        if isinstance(pl, Replicate) or (pl.dim == 0 and 0 in blocks.row_dims):
            out.append(pl)
        else:  # checked below: the chunks these make are the shard's rows and columns
            out.append(Shard(0) if pl.dim in blocks.row_dims else Shard(1))
    rows, cols = blocks.block_shape
    col_dims = tuple(d for d in range(len(shape)) if d not in blocks.row_dims)
    fits = True
    for coord in _coordinates(mesh):  # every rank's piece: each rank decides alike
        held_rows, held_cols = _piece(shape, blocks.row_dims, col_dims, mesh, p.placements, coord)
        start = int(held_cols[0]) if held_cols.numel() else 0
        want = torch.arange(start // 2, -(-(start + held_cols.numel()) // 2))
        fits = fits and not start % 2
        fits = fits and torch.equal(held_indices(-(-cols // 2), 1, mesh, out, coord), want)
        fits = fits and torch.equal(held_indices(rows, 0, mesh, out, coord), held_rows)
    if not fits:
        raise ValueError(
            f"DTensorMuon: parameter '{name}' of shape {shape} with placements "
            f"{tuple(p.placements)}: state_precision='int4' packs two columns of each of its "
            f"{rows} rows per byte, and this rank's rows and columns are not one chunk of "
            f"rows and of whole bytes of the {rows}×{-(-cols // 2)} packed codes (a column "
            "chunk of odd size, or rows that are not contiguous). Use state_precision='int8' "
            "for it, or 'param'."
        )
    return tuple(out)
