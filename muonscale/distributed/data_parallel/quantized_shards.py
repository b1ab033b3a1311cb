"""8-bit AdamW moments of ``DistributedMuon``'s ZeRO-1 segments (an AdamW param group with
``state_precision="int8"``).

Each rank holds one contiguous segment of a flattened AdamW parameter (a flat bucket's shard or
a stream's fill range), and its ends may fall inside a 256-entry block of the moments' block
matrix (:func:`~muonscale.quantized_state.adamw_block_shape`). The blocks a segment touches are
a contiguous range of the parameter's flattened absmax (blocks lie along rows, rows one after
another), so a rank keeps that range of absmax and the codes of its entries. A block whose
pieces lie on several ranks takes the **shared** absmax: the maximum over the ranks holding its
pieces (one all-reduce (max) of those blocks' maxima per step, :class:`SharedBlockScales`), and
each rank quantizes its piece with it. The 8-bit dynamic code of an entry depends only on
x / absmax of its block, so codes and absmax are one process's, bitwise. The derivation is in
*Low-bit state* in the docs.

A parameter that is itself a piece of one row of a larger tensor (a :class:`ColumnPlacement`:
a tensor-parallel shard of a bias) has its blocks in that row's coordinates: a segment touches
blocks that other data-parallel segments and other pieces' segments share. Its absmax are per
whole-row block it touches (:mod:`muonscale.column_blocks`), the maxima of the shared ones
taken with max over the data-parallel group and then over the pieces' group (max composes),
and a checkpoint holds the absmax of the blocks the piece touches (the replicated layout's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...block_quantization import (
    BLOCK_SIZE,
    block_matrix_shape,
    dequantize_dynamic,
    dynamic_values,
)
from ...column_blocks import (
    ColumnBlocks,
    Span,
    column_blocks,
    dequantize_columns,
    local_block_maxima,
    quantize_columns_,
    span_blocks,
)
from ...group_step import adamw_group_step
from ...quantized_state import ADAMW_FORMATS, ADAMW_MOMENTS

CODE_BUFFERS = {"exp_avg": "exp_avg_codes", "exp_avg_sq": "exp_avg_sq_codes"}
"""A shard store's buffer of each moment's 8-bit codes (beside its floating ``exp_avg``)."""


@dataclass(frozen=True)
class BlockPart:
    """Entries ``[start, start + rows · width)`` of a segment, a (rows, width) matrix whose
    blocks are the parameter's; their absmax are entries ``[block_start, block_start + rows ·
    blocks)`` of the segment's absmax, (rows, blocks). ``cut``: a piece of one block that a
    shard boundary cuts (its absmax shared across ranks)."""

    start: int
    rows: int
    width: int
    block_start: int
    blocks: int
    cut: bool = False


@dataclass(frozen=True)
class SegmentBlocks:
    """The blocks that elements ``[start, start + length)`` of a flattened parameter touch:
    flattened absmax entries ``[first_block, first_block + block_count)``, and the segment cut
    into :class:`BlockPart` s in order."""

    first_block: int
    block_count: int
    parts: tuple[BlockPart, ...]


def _block_of(q: int, cols: int) -> int:
    """Flattened absmax index of the block holding element ``q`` of a matrix of ``cols``."""
    row, col = divmod(q, cols)
    return row * -(-cols // BLOCK_SIZE) + col // BLOCK_SIZE


def segment_blocks(shape: Sequence[int], start: int, length: int) -> SegmentBlocks:
    """Blocks and parts of elements ``[start, start + length)`` (``length`` > 0) of a parameter
    of ``shape``: whole blocks in (rows, width) matrices, and the pieces of blocks that the
    segment's ends cut (at most two; one when both ends fall in the same block)."""
    _, cols = block_matrix_shape(shape, "flatten")  # as adamw_block_shape
    stop = start + length
    first = _block_of(start, cols)
    parts: list[BlockPart] = []
    pos = start
    while pos < stop:
        row, col = divmod(pos, cols)
        row_end = (row + 1) * cols
        at = _block_of(pos, cols) - first
        if col % BLOCK_SIZE:  # inside a block: the piece up to its end is cut
            end = min(stop, row_end, row * cols + (col // BLOCK_SIZE + 1) * BLOCK_SIZE)
            parts.append(BlockPart(pos - start, 1, end - pos, at, 1, cut=True))
        elif col == 0 and stop - pos >= cols:  # whole rows
            rows = (stop - pos) // cols
            end = pos + rows * cols
            parts.append(BlockPart(pos - start, rows, cols, at, -(-cols // BLOCK_SIZE)))
        else:  # whole blocks of one row, then (if the segment ends inside one) a cut piece
            end = row_end if stop >= row_end else pos + (stop - pos) // BLOCK_SIZE * BLOCK_SIZE
            if end > pos:
                parts.append(
                    BlockPart(pos - start, 1, end - pos, at, -(-(end - pos) // BLOCK_SIZE))
                )
            else:
                end = stop
                parts.append(BlockPart(pos - start, 1, end - pos, at, 1, cut=True))
        pos = end
    return SegmentBlocks(first, _block_of(stop - 1, cols) + 1 - first, tuple(parts))


def cut_blocks(shape: Sequence[int], starts: Sequence[int]) -> list[int]:
    """Flattened absmax indices of the blocks of a parameter of ``shape`` that segments
    starting at ``starts`` (every rank's) cut: a start inside a block, not at its beginning."""
    _, cols = block_matrix_shape(shape, "flatten")  # as adamw_block_shape
    out = []
    for q in starts:
        if q > 0 and q % cols % BLOCK_SIZE:
            out.append(_block_of(q, cols))
    return sorted(set(out))


def zero_code(signed: bool) -> int:
    """The code of 0 in the dynamic table (``signed``: the first moment's)."""
    return dynamic_values(signed).index(0.0)


@dataclass(frozen=True)
class ColumnPlacement:
    """A parameter that holds column spans of the one row of a whole tensor (a TP shard of a
    bias): the row's ``cols``, the spans every piece holds (``spans[rank]``: this one's, in
    the order its entries lie) and ``comm``, the pieces' communicator (tag
    ``"tp_block_scales"``)."""

    cols: int
    spans: tuple[tuple[Span, ...], ...]
    rank: int
    comm: Any

    def segment_spans(self, piece: int, start: int, count: int) -> tuple[Span, ...]:
        """The row's spans of entries ``[start, start + count)`` of piece ``piece``."""
        out, offset = [], 0
        for first, n in self.spans[piece]:
            lo, hi = max(start, offset), min(start + count, offset + n)
            if lo < hi:
                out.append((first + lo - offset, hi - lo))
            offset += n
        return tuple(out)

    @functools.cached_property
    def piece_blocks(self) -> tuple[int, ...]:
        """The row's blocks this piece touches: a checkpoint's absmax (1, len), in order."""
        return column_blocks(self.cols, BLOCK_SIZE, self.spans, self.rank).blocks


@dataclass
class _ColumnPiece:
    """A column segment after AdamW, waiting for its shared maxima: the new float32 values of
    both moments, where their codes and absmax go, and its blocks."""

    param: int
    blocks: ColumnBlocks
    values: list[torch.Tensor]  # (1, n) float32 per moment
    codes: list[torch.Tensor]  # (1, n) uint8 views per moment
    absmax: list[torch.Tensor]  # (1, len(blocks.blocks)) float32 views per moment


@dataclass
class _CutPiece:
    """A cut block's piece after AdamW, waiting for its shared absmax: the new float32 values
    of both moments, where their codes and absmax go, and its slot in the exchange."""

    values: list[torch.Tensor]  # (1, n) float32 per moment
    codes: list[torch.Tensor]  # (1, n) uint8 views per moment
    absmax: list[torch.Tensor]  # (1, 1) float32 views per moment
    slot: int


class SharedBlockScales:
    """The int8 AdamW segments of this rank and the exchange of cut blocks' maxima.

    Args:
        shapes: each int8 AdamW parameter index -> its shape.
        starts: each of them -> the starts of its segments on every rank.
        local: each of them held here -> (its segment's start, length).
        comm: the data-parallel communicator (:meth:`exchange`'s all-reduce).
        columns: those of them that are pieces of a whole row -> their
            :class:`ColumnPlacement` (1-D parameters).

    Attributes:
        blocks: each local segment's :class:`SegmentBlocks` (of its own blocks).
        slots: (parameter index, flattened block) of every cut block -> its slot in the
            exchanged vector (2 · slots float32: the first moment's maxima, then the second's).
        column_blocks: each local segment of a column parameter -> its
            :class:`~muonscale.column_blocks.ColumnBlocks` in the whole row.
        column_slots: each column parameter -> (offset in the exchanged vector after the
            slots, the whole row's blocks several segments touch), every rank's.
    """

    def __init__(
        self,
        shapes: Mapping[int, Sequence[int]],
        starts: Mapping[int, Sequence[int]],
        local: Mapping[int, tuple[int, int]],
        comm: Any,
        columns: Mapping[int, ColumnPlacement] | None = None,
    ) -> None:
        self.comm = comm
        self.columns = dict(columns or {})
        own = {i: shape for i, shape in shapes.items() if i not in self.columns}
        self.blocks = {i: segment_blocks(own[i], s, n) for i, (s, n) in local.items() if i in own}
        self.slots: dict[tuple[int, int], int] = {}
        for i in sorted(own):
            for block in cut_blocks(own[i], starts[i]):
                self.slots[(i, block)] = len(self.slots)
        self._cut_params = frozenset(i for i, _ in self.slots)
        self.column_blocks: dict[int, ColumnBlocks] = {}
        self.column_slots: dict[int, tuple[int, tuple[int, ...]]] = {}
        offset = 2 * len(self.slots)
        for i in sorted(self.columns):
            place, numel = self.columns[i], math.prod(shapes[i])
            bounds = sorted(set(starts[i])) + [numel]
            segments = [(a, b - a) for a, b in zip(bounds, bounds[1:])]
            spans = [
                place.segment_spans(r, a, n) for r in range(len(place.spans)) for a, n in segments
            ]
            shared = column_blocks(place.cols, BLOCK_SIZE, spans, 0).shared
            if i in local:
                mine = place.rank * len(segments) + segments.index(local[i])
                self.column_blocks[i] = column_blocks(place.cols, BLOCK_SIZE, spans, mine)
            self.column_slots[i] = (offset, shared)
            offset += 2 * len(shared)
        self._column_width = offset - 2 * len(self.slots)

    def zero_state(self, i: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The float32 absmax of local segment ``i`` (its range of the flattened absmax),
        zero; the codes are views of the store's buffers (:data:`CODE_BUFFERS`)."""
        n = len(self.column_blocks[i].blocks) if i in self.columns else self.blocks[i].block_count
        return {
            absmax_key: torch.zeros(n, dtype=torch.float32, device=device)
            for _, absmax_key, _ in ADAMW_MOMENTS
        }

    def moment_values(self, i: int, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Local segment ``i``'s two moments in float32, flat (``state``: its codes and absmax),
        with its ``step``: what :meth:`~muonscale.step_metrics.StepMetrics.record_adamw`
        reads."""
        values: dict[str, torch.Tensor] = {"step": state["step"]}
        if i in self.columns:
            for key, absmax_key, _ in ADAMW_MOMENTS:
                codes, absmax = state[key].view(1, -1), state[absmax_key].view(1, -1)
                blocks, fmt = self.column_blocks[i], ADAMW_FORMATS[key]
                values[key] = dequantize_columns(codes, absmax, blocks, fmt).view(-1)
            return values
        for key, absmax_key, signed in ADAMW_MOMENTS:
            pieces = []
            for part in self.blocks[i].parts:
                span = slice(part.start, part.start + part.rows * part.width)
                scales = slice(part.block_start, part.block_start + part.rows * part.blocks)
                codes = state[key][span].view(part.rows, part.width)
                absmax = state[absmax_key][scales].view(part.rows, part.blocks)
                pieces.append(dequantize_dynamic(codes, absmax, signed=signed).reshape(-1))
            values[key] = torch.cat(pieces)
        return values

    @torch.no_grad()
    def step(
        self,
        group: Mapping[str, Any],
        indices: list[int],
        targets: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        max_chunk_bytes: Any,
    ) -> list[_CutPiece | _ColumnPiece]:
        """AdamW on the local segments ``indices`` (``targets``: flat, updated in place) with
        8-bit moments: the whole blocks as one process steps rows (each part a (rows, width)
        matrix of its own in :func:`~muonscale.group_step.adamw_group_step`), the cut pieces
        and the column segments on their moments in float32 (the same arithmetic), returned
        for :meth:`exchange`."""
        whole: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # (param, grad, its state)
        cut: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, Any]] = []
        counters: list[tuple[torch.Tensor, dict]] = []  # each part's step counter, then its own
        for i, target, grad, s in zip(indices, targets, grads, states):
            if i in self.columns:
                counters.append((s["step"], self._column_step(i, target, grad, s, cut)))
                continue
            segment = self.blocks[i]
            for part in segment.parts:
                span = slice(part.start, part.start + part.rows * part.width)
                x = target[span].view(part.rows, part.width)
                g = grad[span].view(part.rows, part.width)
                scales = slice(part.block_start, part.block_start + part.rows * part.blocks)
                held = {"step": s["step"].clone()}  # each part starts from the counter
                for key, absmax_key, _ in ADAMW_MOMENTS:
                    held[key] = s[key][span].view(part.rows, part.width)
                    held[absmax_key] = s[absmax_key][scales].view(part.rows, part.blocks)
                counters.append((s["step"], held))
                if not part.cut:
                    whole.append((x, g, held))
                    continue
                codes = [held[key] for key, _, _ in ADAMW_MOMENTS]
                absmax = [held[key] for _, key, _ in ADAMW_MOMENTS]
                moments = [
                    dequantize_dynamic(c, a, signed=signed)
                    for c, a, (_, _, signed) in zip(codes, absmax, ADAMW_MOMENTS)
                ]
                slot = self.slots[(i, segment.first_block + part.block_start)]
                work = x if x.dtype == torch.float32 else x.float()  # rounded once, as Muon
                values = {"exp_avg": moments[0], "exp_avg_sq": moments[1], "step": held["step"]}
                cut.append((x, work, g.float(), values, _CutPiece(moments, codes, absmax, slot)))
        options = dict(capturable=False, step_ok=None, max_chunk_bytes=max_chunk_bytes)
        if whole:
            params, part_grads, held_states = (list(t) for t in zip(*whole))
            adamw_group_step(group, params, part_grads, held_states, **options)
        if cut:
            floating = {**group, "state_precision": "param"}  # the float32 moments, stepped
            works, part_grads, values = ([c[k] for c in cut] for k in (1, 2, 3))
            adamw_group_step(floating, works, part_grads, values, **options)
            for x, work, *_ in cut:
                if work is not x:
                    x.copy_(work)
        for counter, held in counters:
            counter.copy_(held["step"])
        return [c[4] for c in cut]

    def _column_step(
        self, i: int, target: torch.Tensor, grad: torch.Tensor, s: dict, cut: list
    ) -> dict:
        """Column segment ``i``'s moments read as float32 and its work appended to ``cut``
        (stepped there as a cut piece is); returns its counter's holder."""
        blocks = self.column_blocks[i]
        codes = [s[key].view(1, -1) for key, _, _ in ADAMW_MOMENTS]
        absmax = [s[key].view(1, -1) for _, key, _ in ADAMW_MOMENTS]
        moments = [
            dequantize_columns(c, a, blocks, ADAMW_FORMATS[key])
            for c, a, (key, _, _) in zip(codes, absmax, ADAMW_MOMENTS)
        ]
        x = target.view(1, -1)
        work = x if x.dtype == torch.float32 else x.float()  # rounded once, as Muon
        held = {"exp_avg": moments[0], "exp_avg_sq": moments[1], "step": s["step"].clone()}
        piece = _ColumnPiece(i, blocks, moments, codes, absmax)
        cut.append((x, work, grad.view(1, -1).float(), held, piece))
        return held

    def exchanges(self, present: Sequence[bool]) -> bool:
        """Whether this step exchanges maxima (the same on every rank: ``present`` is agreed):
        some parameter with a cut block, or some column parameter, has a gradient."""
        return any(present[i] for i in (*self._cut_params, *self.columns))

    @torch.no_grad()
    def exchange(self, pending: list[_CutPiece | _ColumnPiece]) -> None:
        """The shared absmax of every cut block (one all-reduce (max) of 2 · slots float32 and
        the column parameters' shared blocks, tag ``"block_scales"``, then of the latter over
        their pieces' group, tag ``"tp_block_scales"``; collective) and the codes of the
        pending pieces under it."""
        n = len(self.slots)
        maxima = torch.zeros(
            2 * n + self._column_width, dtype=torch.float32, device=self.comm.device
        )
        columns = [piece for piece in pending if isinstance(piece, _ColumnPiece)]
        pending = [piece for piece in pending if isinstance(piece, _CutPiece)]
        if pending:
            local = torch.stack(
                [v.abs().amax().float() for piece in pending for v in piece.values]
            ).to(maxima.device)
            where = [m * n + piece.slot for piece in pending for m in range(2)]
            maxima.index_copy_(0, torch.tensor(where, device=maxima.device), local)
        found = [self._column_maxima(piece, maxima) for piece in columns]
        self.comm.all_reduce(maxima, op=dist.ReduceOp.MAX, tag="block_scales")
        self._reduce_over_pieces(maxima[2 * n :])
        for piece, (held, where, cut) in zip(columns, found):
            for m, (key, _, _) in enumerate(ADAMW_MOMENTS):
                held[m][:, cut] = maxima[where[m]].to(held[m].device)
                quantize_columns_(
                    piece.values[m],
                    piece.blocks,
                    held[m],
                    ADAMW_FORMATS[key],
                    piece.codes[m],
                    piece.absmax[m],
                )
        for piece in pending:
            for m, (key, _, _) in enumerate(ADAMW_MOMENTS):
                shared = maxima[m * n + piece.slot].to(piece.values[m].device)
                values = piece.values[m]
                blocks = _cut_piece_blocks(values.shape[1])
                fmt = ADAMW_FORMATS[key]
                quantize_columns_(
                    values, blocks, shared.view(1, 1), fmt, piece.codes[m], piece.absmax[m]
                )

    def _column_maxima(
        self, piece: _ColumnPiece, maxima: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        """A column segment's block maxima of each moment (1, blocks it touches), its shared
        blocks' written into ``maxima``; returns them, where in ``maxima`` the shared ones are
        (per moment) and their indices among the touched blocks."""
        offset, shared = self.column_slots[piece.param]
        blocks = piece.blocks
        cut = list(blocks.cut)
        held, where = [], []
        for m, values in enumerate(piece.values):
            local = local_block_maxima(values, blocks)
            at = [offset + m * len(shared) + shared.index(blocks.blocks[k]) for k in cut]
            index = torch.tensor(at, dtype=torch.long, device=maxima.device)
            maxima.index_copy_(0, index, local[0, cut].to(maxima.device))
            held.append(local)
            where.append(index)
        return held, where, cut

    def _reduce_over_pieces(self, section: torch.Tensor) -> None:
        """Max of the column parameters' shared blocks over their pieces' groups (one
        all-reduce per process group, tag ``"tp_block_scales"``; collective)."""
        by_comm: dict[int, tuple[Any, list[int]]] = {}
        for i, (offset, shared) in self.column_slots.items():
            comm = self.columns[i].comm
            first = offset - 2 * len(self.slots)
            by_comm.setdefault(id(comm.group), (comm, []))[1].extend(
                range(first, first + 2 * len(shared))
            )
        for comm, where in by_comm.values():
            if not where:
                continue
            index = torch.tensor(where, dtype=torch.long, device=section.device)
            values = section.index_select(0, index)
            comm.all_reduce(values, op=dist.ReduceOp.MAX, tag="tp_block_scales")
            section.index_copy_(0, index, values)

    def saved_absmax(self, i: int) -> tuple[int, list[int]] | None:
        """For column parameter ``i``: the absmax a checkpoint holds per moment (its piece's
        touched blocks, (1, count)) and where the local segment's lie among them (none when no
        segment is local); None for a parameter of its own blocks."""
        if i not in self.columns:
            return None
        order = self.columns[i].piece_blocks
        held = self.column_blocks[i].blocks if i in self.column_blocks else ()
        return len(order), [order.index(b) for b in held]


@functools.lru_cache(maxsize=BLOCK_SIZE)
def _cut_piece_blocks(n: int) -> ColumnBlocks:
    """A cut piece of n entries (n < 256: part of one block) as the columns ``[0, n)`` of a
    block of n + 1 whose last column, on another rank, holds the shared absmax: the codes of
    x / absmax are those of the piece at its place in its block."""
    return span_blocks(n + 1, BLOCK_SIZE, 0, n, shared=(0,))
