"""Block-quantized state of a piece that holds *columns* of the rows of its state's block
matrix, on plain local tensors.

The blocks are the whole matrix's: segments of ``block_size`` consecutive entries of a whole
row. A piece holds some column spans of every row (one contiguous span: a DTensor shard or a
ZeRO-1 segment's piece of a block; several: Megatron's ``partition_stride`` > 1), so it
touches whole blocks and pieces of blocks that other ranks share (the *cut* blocks). Given the
absmax of each cut block over every rank that holds part of it (exchanged by the caller's
all-reduce (max)), a rank quantizes its entries exactly as one process quantizes the whole
row: the formats' codes depend on x / absmax of their block only. The rank lays its columns
out at their places in the blocks they touch (a *padded* row: the touched blocks one after
another, unheld places zero) and puts each cut block's shared absmax in one unheld place, so
the format's own quantization finds that absmax; its codes are then read back at the held
places. The derivation is in *Low-bit state* in the docs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from muonscale.block_quantization import block_absmax
from muonscale.block_quantization_4bit import pack_nibbles, unpack_nibbles
from muonscale.momentum_formats import MomentumFormat

Span = tuple[int, int]
"""(first column in the whole row, number of columns)."""


@dataclass(frozen=True)
class ColumnBlocks:
    """Where one rank's columns lie in the blocks of the whole rows.

    Attributes:
        cols: entries of a whole row.
        block_size: entries of a block (the last of a row may be shorter).
        spans: this rank's column spans of the whole row, in the order it holds them.
        blocks: the whole row's blocks this rank touches, ascending (its scales, one column
            per block: (rows, len(blocks))).
        shared: the whole row's blocks that several ranks touch, ascending (the same list on
            every rank: the slots of the exchanged maxima).
    """

    cols: int
    block_size: int
    spans: tuple[Span, ...]
    blocks: tuple[int, ...]
    shared: tuple[int, ...]

    @property
    def width(self) -> int:
        """Columns this rank holds."""
        return sum(n for _, n in self.spans)

    @property
    def cut(self) -> tuple[int, ...]:
        """Indices into :attr:`blocks` of the blocks other ranks share."""
        shared = set(self.shared)
        return tuple(k for k, b in enumerate(self.blocks) if b in shared)

    @functools.cached_property
    def _layout(self) -> tuple[list[int], list[int], int]:
        """(padded place of each held column, an unheld padded place of each cut block, padded
        width): the touched blocks one after another (only the row's last block is short,
        and it comes last)."""
        at = {b: k * self.block_size for k, b in enumerate(self.blocks)}
        held = [g for start, n in self.spans for g in range(start, start + n)]
        places = [at[g // self.block_size] + g % self.block_size for g in held]
        mine = set(held)
        fill = []
        for k in self.cut:
            first = self.blocks[k] * self.block_size
            stop = min(first + self.block_size, self.cols)
            free = next(g for g in range(first, stop) if g not in mine)
            fill.append(at[self.blocks[k]] + free - first)
        last = self.blocks[-1] if self.blocks else 0
        width = len(self.blocks) * self.block_size
        width -= (last + 1) * self.block_size - min((last + 1) * self.block_size, self.cols)
        return places, fill, width if self.blocks else 0

    def places(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self._layout[0], dtype=torch.long, device=device)

    def fill_places(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self._layout[1], dtype=torch.long, device=device)

    @property
    def padded_width(self) -> int:
        return self._layout[2]

    @functools.cached_property
    def place_run(self) -> slice | None:
        """The held places as one slice, where they are one ascending run (one span), else
        None."""
        return _run(self._layout[0])

    @property
    def whole(self) -> bool:
        """The held columns are the touched blocks, whole and in order: the padded row is the
        rank's own (no unheld place, no cut block)."""
        return self.place_run == slice(0, self.padded_width)

    def held(self, device: torch.device) -> slice | torch.Tensor:
        """The held places in the padded row: :attr:`place_run`, or their index tensor."""
        return self.place_run if self.place_run is not None else self.places(device)

    @functools.cached_property
    def cut_columns(self) -> tuple[tuple[int, ...], ...]:
        """The rank's columns (indices into its ``width``) in each cut block, in :attr:`cut`
        order."""
        held = [g for start, n in self.spans for g in range(start, start + n)]
        return tuple(
            tuple(i for i, g in enumerate(held) if g // self.block_size == self.blocks[k])
            for k in self.cut
        )


def _run(positions: Sequence[int]) -> slice | None:
    """``positions`` as a slice where they are one ascending run, else None."""
    first, count = (positions[0] if positions else 0), len(positions)
    if list(positions) != list(range(first, first + count)):
        return None
    return slice(first, first + count)


def strided_spans(cols: int, tp_size: int, rank: int, stride: int = 1) -> tuple[Span, ...]:
    """The column spans rank ``rank`` of ``tp_size`` holds of a row of ``cols`` split into
    ``tp_size · stride`` equal chunks, rank r holding chunks r, r + tp_size, … in that order
    (Megatron's split of a dimension with ``partition_stride``)."""
    chunk = cols // (tp_size * stride)
    return tuple(((j * tp_size + rank) * chunk, chunk) for j in range(stride))


def _touched(spans: Sequence[Span], block_size: int) -> set[int]:
    """The blocks of a whole row that the column ``spans`` touch."""
    out: set[int] = set()
    for start, n in spans:
        if n:
            out.update(range(start // block_size, (start + n - 1) // block_size + 1))
    return out


def span_blocks(
    cols: int, block_size: int, start: int, count: int, shared: Sequence[int]
) -> ColumnBlocks:
    """The :class:`ColumnBlocks` of a rank that holds the one span ``[start, start + count)``
    of each row (``shared``: the row's blocks several ranks touch, every rank's list)."""
    return ColumnBlocks(
        cols=cols,
        block_size=block_size,
        spans=((start, count),),
        blocks=tuple(sorted(_touched(((start, count),), block_size))),
        shared=tuple(sorted(shared)),
    )


def column_blocks(
    cols: int, block_size: int, spans_by_rank: Sequence[Sequence[Span]], rank: int
) -> ColumnBlocks:
    """The :class:`ColumnBlocks` of ``rank`` (``spans_by_rank``: every rank's spans)."""
    count: dict[int, int] = {}
    for spans in spans_by_rank:
        for b in _touched(spans, block_size):
            count[b] = count.get(b, 0) + 1
    return ColumnBlocks(
        cols=cols,
        block_size=block_size,
        spans=tuple(tuple(s) for s in spans_by_rank[rank]),
        blocks=tuple(sorted(_touched(spans_by_rank[rank], block_size))),
        shared=tuple(sorted(b for b, c in count.items() if c > 1)),
    )


def local_block_maxima(x: torch.Tensor, blocks: ColumnBlocks) -> torch.Tensor:
    """max |x| of this rank's entries in each block it touches, float32 (rows, len(blocks));
    ``x``: its (rows, width) columns."""
    return block_absmax(_padded(x, blocks), blocks.block_size)


def cut_block_maxima(x: torch.Tensor, blocks: ColumnBlocks) -> torch.Tensor:
    """max |x| of this rank's entries in each cut block, float32 (rows, len(cut)): the part of
    :func:`local_block_maxima` that ranks exchange; ``x``: its (rows, width) columns."""
    out = torch.empty((x.shape[0], len(blocks.cut)), dtype=torch.float32, device=x.device)
    for j, columns in enumerate(blocks.cut_columns):
        run = _run(columns)
        if run is None:
            run = torch.tensor(columns, dtype=torch.long, device=x.device)
        out[:, j] = x[:, run].abs().amax(dim=1).float()
    return out


def quantize_columns_(
    x: torch.Tensor,  # (rows, width): this rank's columns, float32
    blocks: ColumnBlocks,
    shared_absmax: torch.Tensor,  # (rows, len(blocks)): ≥ every rank's max |x| per block
    fmt: MomentumFormat,
    codes: torch.Tensor,  # (rows, ⌈width / codes per byte⌉)
    scales: torch.Tensor,  # (rows, len(blocks))
) -> None:
    """Write ``codes`` and ``scales`` of ``x`` in ``fmt``: one process's codes of these entries
    and scales of these blocks, given the cut blocks' ``shared_absmax``."""
    if blocks.whole:  # the padded row is x itself
        fmt.quantize_(x, codes, scales)
        return
    padded = _padded(x, blocks)
    cut = torch.tensor(blocks.cut, dtype=torch.long, device=x.device)
    padded[:, blocks.fill_places(x.device)] = shared_absmax.index_select(1, cut).float()
    rows = x.shape[0]
    stored = torch.empty(
        fmt.codes_matrix_shape((rows, blocks.padded_width)), dtype=fmt.code_dtype, device=x.device
    )
    fmt.quantize_(padded, stored, scales)
    held = blocks.held(x.device)
    if fmt.codes_per_byte == 1:
        codes.copy_(stored[:, held])
    else:
        pack_nibbles(unpack_nibbles(stored, blocks.padded_width)[:, held], codes)


def dequantize_columns(
    codes: torch.Tensor, scales: torch.Tensor, blocks: ColumnBlocks, fmt: MomentumFormat
) -> torch.Tensor:
    """The float32 (rows, width) values of ``codes`` and ``scales`` in ``fmt`` (the inverse of
    :func:`quantize_columns_`)."""
    if blocks.whole:
        return fmt.dequantize(codes, scales, blocks.width)
    rows, held = codes.shape[0], blocks.held(codes.device)
    wide = blocks.padded_width
    if fmt.codes_per_byte == 1:
        stored = torch.zeros((rows, wide), dtype=codes.dtype, device=codes.device)
        stored[:, held] = codes
    else:
        entries = torch.zeros((rows, wide), dtype=torch.int32, device=codes.device)
        entries[:, held] = unpack_nibbles(codes, blocks.width)
        stored = torch.empty(
            fmt.codes_matrix_shape((rows, wide)), dtype=codes.dtype, device=codes.device
        )
        pack_nibbles(entries, stored)
    return fmt.dequantize(stored, scales, wide)[:, held].contiguous()


def _padded(x: torch.Tensor, blocks: ColumnBlocks) -> torch.Tensor:
    """``x`` at its places in the touched blocks, zero elsewhere (float32: rows, padded
    width)."""
    out = x.new_zeros((x.shape[0], blocks.padded_width), dtype=torch.float32)
    out[:, blocks.held(x.device)] = x
    return out
