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
"""

from __future__ import annotations

import functools
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
from ...column_blocks import ColumnBlocks, quantize_columns_, span_blocks
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


def absmax_numel(shape: Sequence[int]) -> int:
    """Entries of a parameter's flattened absmax (rows · ⌈cols / 256⌉)."""
    rows, cols = block_matrix_shape(shape, "flatten")  # as adamw_block_shape
    return rows * -(-cols // BLOCK_SIZE)


def zero_code(signed: bool) -> int:
    """The code of 0 in the dynamic table (``signed``: the first moment's)."""
    return dynamic_values(signed).index(0.0)


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

    Attributes:
        blocks: each local segment's :class:`SegmentBlocks`.
        slots: (parameter index, flattened block) of every cut block -> its slot in the
            exchanged vector (2 · slots float32: the first moment's maxima, then the second's).
    """

    def __init__(
        self,
        shapes: Mapping[int, Sequence[int]],
        starts: Mapping[int, Sequence[int]],
        local: Mapping[int, tuple[int, int]],
        comm: Any,
    ) -> None:
        self.comm = comm
        self.blocks = {i: segment_blocks(shapes[i], s, n) for i, (s, n) in local.items()}
        self.slots: dict[tuple[int, int], int] = {}
        for i in sorted(shapes):
            for block in cut_blocks(shapes[i], starts[i]):
                self.slots[(i, block)] = len(self.slots)
        self._cut_params = frozenset(i for i, _ in self.slots)

    def zero_state(self, i: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The float32 absmax of local segment ``i`` (its range of the flattened absmax),
        zero; the codes are views of the store's buffers (:data:`CODE_BUFFERS`)."""
        n = self.blocks[i].block_count
        return {
            absmax_key: torch.zeros(n, dtype=torch.float32, device=device)
            for _, absmax_key, _ in ADAMW_MOMENTS
        }

    def moment_values(self, i: int, state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Local segment ``i``'s two moments in float32, flat (``state``: its codes and absmax),
        with its ``step``: what :meth:`~muonscale.step_metrics.StepMetrics.record_adamw`
        reads."""
        values: dict[str, torch.Tensor] = {"step": state["step"]}
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
    ) -> list[_CutPiece]:
        """AdamW on the local segments ``indices`` (``targets``: flat, updated in place) with
        8-bit moments: the whole blocks as one process steps rows (each part a (rows, width)
        matrix of its own in :func:`~muonscale.group_step.adamw_group_step`), the cut pieces
        on their moments in float32 (the same arithmetic), returned for :meth:`exchange`."""
        whole: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # (param, grad, its state)
        cut: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict, _CutPiece]] = []
        counters: list[tuple[torch.Tensor, dict]] = []  # each part's step counter, then its own
        for i, target, grad, s in zip(indices, targets, grads, states):
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

    def exchanges(self, present: Sequence[bool]) -> bool:
        """Whether this step exchanges maxima (the same on every rank: ``present`` is agreed):
        some parameter with a cut block has a gradient."""
        return any(present[i] for i in self._cut_params)

    @torch.no_grad()
    def exchange(self, pending: list[_CutPiece]) -> None:
        """The shared absmax of every cut block (one all-reduce (max) of 2 · slots float32,
        tag ``"block_scales"``; collective) and the codes of the pending pieces under it."""
        n = len(self.slots)
        maxima = torch.zeros(2 * n, dtype=torch.float32, device=self.comm.device)
        if pending:
            local = torch.stack(
                [v.abs().amax().float() for piece in pending for v in piece.values]
            ).to(maxima.device)
            where = [m * n + piece.slot for piece in pending for m in range(2)]
            maxima.index_copy_(0, torch.tensor(where, device=maxima.device), local)
        self.comm.all_reduce(maxima, op=dist.ReduceOp.MAX, tag="block_scales")
        for piece in pending:
            for m, (key, _, _) in enumerate(ADAMW_MOMENTS):
                shared = maxima[m * n + piece.slot].to(piece.values[m].device)
                values = piece.values[m]
                blocks = _cut_piece_blocks(values.shape[1])
                fmt = ADAMW_FORMATS[key]
                quantize_columns_(
                    values, blocks, shared.view(1, 1), fmt, piece.codes[m], piece.absmax[m]
                )


@functools.lru_cache(maxsize=BLOCK_SIZE)
def _cut_piece_blocks(n: int) -> ColumnBlocks:
    """A cut piece of n entries (n < 256: part of one block) as the columns ``[0, n)`` of a
    block of n + 1 whose last column, on another rank, holds the shared absmax: the codes of
    x / absmax are those of the piece at its place in its block."""
    return span_blocks(n + 1, BLOCK_SIZE, 0, n, shared=(0,))
