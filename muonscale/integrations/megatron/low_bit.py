"""Quantized state (``state_precision`` "int8" / "int4") of Megatron's TP pieces.

Blocks are segments of a row of the whole parameter's block matrix. A piece that holds whole
rows (column-parallel weights, replicated parameters, the vocabulary-parallel embedding)
quantizes as one process does, alone. A piece that holds *columns* of every row (a
row-parallel weight, ``partition_dim=1``; a TP-sharded bias, whose one row the shard cuts)
touches blocks that other TP ranks share: :class:`SharedColumnScales` keeps its scales per
block it touches (:mod:`.column_blocks`, the plain-tensor math) and, each step, gives every
such block the maximum of its pieces' absmax over the TP group (one all-reduce (max) per param
group and TP group, tag ``"tp_block_scales"``), so codes and scales are one process's.
Their checkpoints: :mod:`.column_checkpoint`.

Under ZeRO-1 (``dp_mode="zero1"``) a Muon matrix is owned whole per TP piece, and the ranks of
one TP group own the same matrices (ownership is a function of the pieces' shapes, the same on
every TP rank), so the owners share these scales as above. A TP-sharded bias's AdamW moments
lie in flat data-parallel segments: :meth:`SharedColumnScales.placement` tells
:mod:`muonscale.distributed.data_parallel.quantized_shards` where the piece lies in the whole
bias, whose blocks its segments then take (maxima over data parallel, then over the TP
group). Only an AdamW piece of several rows whose blocks the TP split cuts is refused there,
by name, pointing at ``float_state_params`` (*Low-bit state* in the docs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from muonscale.block_quantization import (
    BLOCK_SIZE,
)
from muonscale.column_blocks import (
    ColumnBlocks,
    column_blocks,
    dequantize_columns,
    local_block_maxima,
    quantize_columns_,
    strided_spans,
)
from muonscale.distributed.comm import Communicator, WireCounter
from muonscale.distributed.data_parallel.quantized_shards import ColumnPlacement
from muonscale.group_step import adamw_group_step
from muonscale.matrices import MatrixView
from muonscale.momentum_formats import MOMENTUM_FORMATS, MomentumFormat, momentum_format_of
from muonscale.quantized_state import (
    ADAMW_FORMATS,
    ADAMW_MOMENTS,
    MOMENTUM_KEY,
    QuantizedMomentum,
    adamw_block_shape,
    momentum_block_shape,
)

from .plan import MegatronGroups, ParamPlan


def _whole_block_shape(plan: ParamPlan, local: tuple[int, int]) -> tuple[int, int] | None:
    """(rows, cols) of the whole parameter's block matrix when ``plan``'s piece holds columns of
    its rows (``local``: the piece's block matrix), else None (it holds whole rows)."""
    dim = plan.partition_dim
    if dim is None or plan.tp_size == 1:
        return None
    if plan.param.dim() == 1 or (plan.param.dim() == 2 and dim == 1):
        return local[0], local[1] * plan.tp_size
    return None


def plan_column_blocks(
    plan: ParamPlan, local: tuple[int, int], block_size: int, rank: int
) -> ColumnBlocks | None:
    """The :class:`ColumnBlocks` of TP rank ``rank``'s piece of ``plan`` (``local``: the
    piece's block matrix), or None when every block it touches is its own (it holds whole rows,
    or its spans fall on block boundaries)."""
    whole = _whole_block_shape(plan, local)
    if whole is None:
        return None
    spans = [
        strided_spans(whole[1], plan.tp_size, r, plan.partition_stride) for r in range(plan.tp_size)
    ]
    blocks = column_blocks(whole[1], block_size, spans, rank)
    return blocks if blocks.shared else None


def cut_rows_reason(plan: ParamPlan, precision: str, zero1: bool) -> str | None:
    """Why ``plan``'s quantized state (in ``precision``) cannot be exact on this layout (None:
    it is). A piece whose blocks other TP ranks share is exact through shared scales, except
    for AdamW under ZeRO-1 (``zero1``), whose flat data-parallel shards share the scales of
    the blocks of the piece's own shape (Muon momentum is owned whole per TP piece, and the
    owners of one matrix's pieces share their scales over the TP group)."""
    if not zero1 or plan.algorithm == "muon" or precision == "param":
        return None
    local = adamw_block_shape(plan.param)
    if local[0] == 1 or plan_column_blocks(plan, local, BLOCK_SIZE, 0) is None:
        return None
    return (
        f"its tensor-parallel shard (partition_dim={plan.partition_dim}) cuts blocks of its "
        f"{local[0]} rows, and ZeRO-1 shares the scales of such blocks in AdamW's flat "
        "data-parallel shards for pieces of one row only (a TP-sharded bias); under "
        "dp_mode='replicated' every piece shares them"
    )


def refuse_cut_rows(
    plans: Sequence[ParamPlan],
    param_groups: Sequence[Mapping[str, Any]],
    default_precision: str,
    *,
    zero1: bool,
) -> None:
    """ValueError naming the first parameter whose quantized state cannot be exact on this
    layout (``param_groups``: :func:`~.config.muon_arguments`' groups, ``default_precision``
    its ``state_precision`` option)."""
    precision = {
        id(p): group.get("state_precision", default_precision)
        for group in param_groups
        for _, p in group["params"]
    }
    for plan in plans:
        wanted = precision.get(id(plan.param), "param")
        if wanted == "param":
            continue
        reason = cut_rows_reason(plan, wanted, zero1)
        if reason is not None:
            suggestion = f"({'*.' + '.'.join(plan.name.split('.')[-2:])!r},)"
            raise ValueError(
                f"parameter '{plan.name}': state_precision={wanted!r} quantizes state in "
                f"blocks of a row, but {reason}; use dp_mode='replicated', or keep its state "
                f"floating with float_state_params={suggestion} (names or fnmatch patterns: "
                "state_precision='param' for those parameters)"
            )


@dataclass(frozen=True)
class ColumnTensor:
    """One quantized tensor of a column piece's state: its codes (``code_key``) and scales
    (``scale_key``, (rows, blocks it touches)) in ``format``, over its ``blocks``."""

    code_key: str
    scale_key: str
    format: MomentumFormat
    blocks: ColumnBlocks

    def values(self, entry: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 (rows, columns) values of ``entry``'s codes and scales."""
        scales = entry[self.scale_key]
        codes = entry[self.code_key].reshape(scales.shape[0], -1)
        return dequantize_columns(codes, scales, self.blocks, self.format)


@dataclass
class ColumnMomentum:
    """A quantized Muon momentum of a piece that holds columns of its rows: ``codes`` (int8:
    the piece's shape; int4: its packed rows) and ``scales`` (rows, blocks it touches)."""

    codes: torch.Tensor
    scales: torch.Tensor
    blocks: ColumnBlocks
    format: MomentumFormat
    plan: ParamPlan
    rows: int

    def values(self) -> torch.Tensor:
        """The momentum in float32, the piece's shape (a new tensor)."""
        codes = self.codes.view(self.rows, -1)
        values = dequantize_columns(codes, self.scales, self.blocks, self.format)
        return values.view(self.plan.param.shape)


@dataclass
class ColumnPiece:
    """New float32 ``values`` (rows, columns) of a column piece's tensor of ``plan``, to be
    written into its ``codes`` (rows, bytes) and ``scales`` under the shared maxima."""

    plan: ParamPlan
    blocks: ColumnBlocks
    format: MomentumFormat
    values: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor


class SharedColumnScales:
    """The quantized state of the pieces that hold columns of their rows, and the exchange of
    the maxima of the blocks they share (see the module docstring). Collective over each TP
    group: every rank of it steps the same parameters.

    Args:
        groups: the process groups (a piece's TP group: ``tp``, or ``expt_tp`` for experts).
        counter: where the exchanges' bytes are counted.
    """

    def __init__(self, groups: MegatronGroups, counter: WireCounter) -> None:
        self.groups, self.counter = groups, counter
        self._blocks: dict[tuple[int, int], ColumnBlocks | None] = {}

    def _rank(self, plan: ParamPlan) -> int:
        group = self.groups.expt_tp if plan.expert else self.groups.tp
        return dist.get_rank(group) if group is not None else 0

    def blocks(
        self, plan: ParamPlan, local: tuple[int, int], block_size: int
    ) -> ColumnBlocks | None:
        """:func:`plan_column_blocks` of this rank (cached per parameter and block size)."""
        key = (id(plan.param), block_size)
        if key not in self._blocks:
            rank = self._rank(plan)
            self._blocks[key] = plan_column_blocks(plan, local, block_size, rank)
        return self._blocks[key]

    def adamw_blocks(self, plan: ParamPlan) -> ColumnBlocks | None:
        return self.blocks(plan, adamw_block_shape(plan.param), BLOCK_SIZE)

    def placement(self, plan: ParamPlan) -> ColumnPlacement | None:
        """Where an AdamW piece of one row (a TP-sharded bias) lies in the whole row, for
        ZeRO-1's flat shards (:mod:`muonscale.distributed.data_parallel.quantized_shards`),
        when it shares blocks with other TP ranks; else None."""
        blocks = self.adamw_blocks(plan)
        if blocks is None or adamw_block_shape(plan.param)[0] != 1:
            return None
        spans = tuple(
            strided_spans(blocks.cols, plan.tp_size, r, plan.partition_stride)
            for r in range(plan.tp_size)
        )
        group = self.groups.expt_tp if plan.expert else self.groups.tp
        comm = Communicator(group, counter=self.counter)
        return ColumnPlacement(blocks.cols, spans, self._rank(plan), comm)

    def tensors(
        self, plan: ParamPlan, algorithm: str, precision: str, view: MatrixView | None
    ) -> list[ColumnTensor]:
        """The quantized tensors of ``plan``'s state in ``precision`` (``view``: a Muon
        parameter's) when it is a column piece; none for a piece of whole rows or floating
        state."""
        if precision == "param":
            return []
        if algorithm == "muon":
            fmt = MOMENTUM_FORMATS[precision]
            blocks = self.blocks(plan, momentum_block_shape(view), fmt.block_size)
            return (
                [] if blocks is None else [ColumnTensor(MOMENTUM_KEY, fmt.scale_key, fmt, blocks)]
            )
        blocks = self.adamw_blocks(plan)
        if blocks is None:
            return []
        return [ColumnTensor(k, a, ADAMW_FORMATS[k], blocks) for k, a, _ in ADAMW_MOMENTS]

    # ------------------------------------------------------------------ state
    def shape_state_(
        self, state: dict, plan: ParamPlan, group: Mapping[str, Any], view: MatrixView | None
    ) -> None:
        """Give a new quantized state of a column piece its scales: zeros of (rows, blocks it
        touches), in place of the ones of the piece's own blocks."""
        precision = group.get("state_precision", "param")
        for tensor in self.tensors(plan, group["algorithm"], precision, view):
            held = state[tensor.scale_key]
            if held.shape != (held.shape[0], len(tensor.blocks.blocks)):
                state[tensor.scale_key] = held.new_zeros((held.shape[0], len(tensor.blocks.blocks)))

    def momentum(
        self, state: Mapping[str, Any], plan: ParamPlan, view: MatrixView
    ) -> ColumnMomentum | None:
        """The quantized momentum of ``state``: a :class:`ColumnMomentum` for a column piece,
        else None."""
        fmt = momentum_format_of(state)
        found = [] if fmt is None else self.tensors(plan, "muon", fmt.precision, view)
        if not found:
            return None
        rows = momentum_block_shape(view)[0]
        blocks = found[0].blocks
        return ColumnMomentum(state[MOMENTUM_KEY], state[fmt.scale_key], blocks, fmt, plan, rows)

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def quantize_(self, pieces: Sequence[ColumnPiece]) -> None:
        """Each piece's codes and scales of its values, under the maxima of the blocks it
        shares (:meth:`shared_maxima`; collective)."""
        shared = self.shared_maxima(
            [(p.plan, p.blocks, local_block_maxima(p.values, p.blocks)) for p in pieces]
        )
        for piece, maxima in zip(pieces, shared):
            quantize_columns_(
                piece.values, piece.blocks, maxima, piece.format, piece.codes, piece.scales
            )

    @torch.no_grad()
    def store_momenta_(
        self,
        buffers: Sequence[QuantizedMomentum | ColumnMomentum],
        values: Sequence[torch.Tensor],
    ) -> None:
        """Write the new momentum ``values`` (float32, parameter-shaped) into ``buffers``: a
        piece of whole rows alone, the column pieces with their shared maxima (collective)."""
        pending = []
        for b, value in zip(buffers, values):
            if not isinstance(b, ColumnMomentum):
                b.store_(value)
                continue
            codes = b.codes.view(b.rows, -1)
            values_2d = value.reshape(b.rows, -1)
            pending.append(ColumnPiece(b.plan, b.blocks, b.format, values_2d, codes, b.scales))
        if pending:
            self.quantize_(pending)

    @torch.no_grad()
    def adamw_step_(
        self,
        group: Mapping[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        plans: list[ParamPlan],
        max_chunk_bytes: Any,
    ) -> list[dict[str, torch.Tensor]]:
        """AdamW on column pieces with 8-bit moments: the moments read as float32, stepped by
        :func:`~muonscale.group_step.adamw_group_step` on them (the arithmetic of the 8-bit
        step), written back under the shared maxima (collective). Returns each piece's stored
        moments as values, with its ``step`` (what the step metrics read)."""
        moments = [self.tensors(plan, "adamw", "int8", None) for plan in plans]
        values = []
        for p, s, tensors in zip(params, states, moments):
            values.append(
                {"step": s["step"], **{t.code_key: t.values(s).view(p.shape) for t in tensors}}
            )
        works = [p if p.dtype == torch.float32 else p.float() for p in params]  # rounded once
        floating = {**group, "state_precision": "param"}
        options = dict(capturable=False, step_ok=None, max_chunk_bytes=max_chunk_bytes)
        adamw_group_step(floating, works, [g.float() for g in grads], values, **options)
        for p, work in zip(params, works):
            if work is not p:
                p.copy_(work)
        pieces = [
            ColumnPiece(
                plan,
                t.blocks,
                t.format,
                v[t.code_key].view(s[t.scale_key].shape[0], -1),
                s[t.code_key].view(s[t.scale_key].shape[0], -1),
                s[t.scale_key],
            )
            for plan, s, v, tensors in zip(plans, states, values, moments)
            for t in tensors
        ]
        self.quantize_(pieces)
        return [
            {"step": s["step"], **{t.code_key: t.values(s) for t in tensors}}
            for s, tensors in zip(states, moments)
        ]

    def shared_maxima(
        self, items: Sequence[tuple[ParamPlan, ColumnBlocks, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Each item's local block maxima (rows, blocks) with its shared blocks' maxima taken
        over its TP group: one all-reduce (max) per TP group of rows × shared blocks float32
        per item, in item order (tag ``"tp_block_scales"``; collective)."""
        out = [maxima.clone() for _, _, maxima in items]
        for expert in (False, True):
            mine = [i for i, (plan, _, _) in enumerate(items) if plan.expert == expert]
            if not mine:
                continue
            sizes = [items[i][2].shape[0] * len(items[i][1].shared) for i in mine]
            flat = torch.zeros(sum(sizes), dtype=torch.float32, device=items[mine[0]][2].device)
            slots = []
            offset = 0
            for i, size in zip(mine, sizes):
                _, blocks, maxima = items[i]
                table = flat[offset : offset + size].view(maxima.shape[0], len(blocks.shared))
                cut = list(blocks.cut)
                where = [blocks.shared.index(blocks.blocks[k]) for k in cut]
                table[:, where] = maxima[:, cut]
                slots.append((i, table, cut, where))
                offset += size
            group = self.groups.expt_tp if expert else self.groups.tp
            comm = Communicator(group, counter=self.counter)
            comm.all_reduce(flat, op=dist.ReduceOp.MAX, tag="tp_block_scales")
            for i, table, cut, where in slots:
                out[i][:, cut] = table[:, where]
        return out
