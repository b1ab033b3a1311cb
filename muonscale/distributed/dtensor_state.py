"""Quantized state (``state_precision="int8"`` or ``"int4"``) of DTensor parameters, shard by
shard, with the block scales of cut blocks shared across ranks.

Blocks are segments of one row of a state tensor's block matrix; where a rank's shard lies in
it, and which blocks shard boundaries cut: :class:`~.dtensor_blocks.ShardBlocks`.

* **Whole rows** (the parameter sharded on dim 0 only: ``Shard(0)``, FSDP2's
  ``_StridedShard(0)``; or replicated): a rank's codes and scales are exactly its rows of the
  ones one process holds, quantized on the local shard, with no communication. The scales
  ``(rows, blocks)`` are DTensors with the parameter's placements on their rows.
* **Cut rows** (TP's rowwise ``Shard(1)``, FSDP2's ``Shard(1)`` of an expert stack, any shard
  of a 1-D tensor, dim-0 chunks that are not the scales' chunks): the scales are
  **replicated** on each mesh dim whose placement cuts the rows (the parameter's dim-0
  placements kept where its rows are the scales' rows). A rank writes the scales of the
  blocks its columns touch; a block that a shard boundary cuts takes the maximum of its
  pieces' absmax over the ranks (:func:`store_shards_`: one all-reduce (max) of the cut
  blocks' maxima, tag ``"block_scales"``), which is its absmax in one process, and each rank
  quantizes its piece under it. A scale replica is exact for the blocks its rank touches;
  :func:`synced_scales` (``DTensorMuon.state_dict``) makes every replica whole (an
  all-reduce (max) per replicated mesh dim, tag ``"checkpoint"``) before a checkpoint reads
  it, so ``torch.distributed.checkpoint`` loads it at any layout.

The codes are DTensors with the parameter's placements (int8 momentum, AdamW's 8-bit
moments), or, for ``"int4"``'s packed rows ``(rows, ⌈cols / 2⌉)``, with its row placements
on dim 0 and its column ones on dim 1; a layout whose column chunks are not whole bytes of
the packed chunks, or whose columns of a row are not contiguous, is refused by name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..block_quantization import BLOCK_SIZE
from ..column_blocks import (
    cut_block_maxima,
    dequantize_columns,
    quantize_columns_,
)
from ..momentum_formats import MOMENTUM_FORMATS, MomentumFormat, momentum_format_of
from ..quantized_state import (
    ADAMW_FORMATS,
    MOMENTUM_KEY,
    adamw_block_shape,
    adamw_state_is_quantized,
    momentum_block_shape,
)
from .dtensor_blocks import ShardBlocks, packed_code_placements, shard_blocks
from .dtensor_layout import local_tensor

__all__ = [
    "ShardCodes",
    "convert_dtensor_state_",
    "shard_state_codes",
    "state_blocks",
    "state_keys",
    "store_shards_",
    "stored_format",
    "synced_scales",
    "zero_quantized_state",
]


def _on_mesh(local: torch.Tensor, p: DTensor, shape: Sequence[int], placements=None) -> DTensor:
    """``local`` (contiguous) as this rank's shard of a DTensor of ``shape`` on ``p``'s mesh
    (``placements``: ``p``'s unless given)."""
    shape = tuple(int(s) for s in shape)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(
        local,
        p.device_mesh,
        p.placements if placements is None else placements,
        run_check=False,
        shape=torch.Size(shape),
        stride=stride,
    )


def _scales_on_mesh(local: torch.Tensor, p: DTensor, blocks: ShardBlocks) -> DTensor:
    rows, cols = blocks.block_shape
    shape = (rows, -(-cols // blocks.block_size))
    return _on_mesh(local, p, shape, blocks.scale_placements)


def _local_scale_rows(blocks: ShardBlocks) -> int:
    """Rows of the local scales."""
    if isinstance(blocks.scale_rows, slice) and blocks.scale_rows == slice(None):
        return int(blocks.rows.numel())
    return blocks.block_shape[0]


@dataclass
class ShardCodes:
    """One quantized state tensor of this rank's shard: its local ``codes`` and ``scales``,
    where they lie (:class:`ShardBlocks`) and their format; ``shape``: the shard's shape."""

    codes: torch.Tensor
    scales: torch.Tensor
    blocks: ShardBlocks
    format: MomentumFormat
    shape: tuple[int, ...]

    def _codes_matrix(self) -> torch.Tensor:
        b = self.blocks
        return self.codes.view(b.rows.numel(), -(-b.cols // self.format.codes_per_byte))

    def _block_columns(self) -> slice:
        return slice(self.blocks.first_block, self.blocks.stop_block)

    def _touched_scales(self) -> torch.Tensor:
        """The scales of the blocks the shard touches (a view where its rows are a slice)."""
        return self.scales[self.blocks.scale_rows, self._block_columns()]

    def values(self) -> torch.Tensor:
        """The state in float32, the shard's shape (a new tensor)."""
        b = self.blocks
        if not b.cols or not b.rows.numel():
            return torch.zeros(self.shape, dtype=torch.float32, device=self.codes.device)
        codes, scales = self._codes_matrix(), self._touched_scales()
        return dequantize_columns(codes, scales, b.columns, self.format).reshape(self.shape)

    def piece_maxima(self, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, max |x|) of the pieces of cut blocks in ``values`` (the new state, the
        shard's shape), slots of :attr:`ShardBlocks.slot_count` (row · cut blocks + which)."""
        b, columns = self.blocks, self.blocks.columns
        if not b.cols or not columns.cut:
            empty = torch.zeros(0, dtype=torch.long)
            return empty, torch.zeros(0, dtype=torch.float32, device=values.device)
        maxima = cut_block_maxima(values.reshape(b.rows.numel(), b.cols), columns)
        which = torch.tensor([b.cut_blocks.index(columns.blocks[k]) for k in columns.cut])
        slots = b.rows[:, None] * len(b.cut_blocks) + which
        return slots.reshape(-1), maxima.reshape(-1)

    @torch.no_grad()
    def store_(self, values: torch.Tensor, shared: torch.Tensor | None = None) -> None:
        """Quantize ``values`` (the shard's shape) into the codes and the scales of the blocks
        they touch; ``shared``: the absmax of this rank's cut blocks (rows, cut blocks), as
        :meth:`piece_maxima` orders them."""
        b, columns = self.blocks, self.blocks.columns
        if not b.cols or not b.rows.numel():
            return
        x = values.reshape(b.rows.numel(), b.cols)
        absmax = x.new_zeros((x.shape[0], len(columns.blocks)), dtype=torch.float32)
        if columns.cut:  # the shared absmax at their blocks' columns
            absmax[:, list(columns.cut)] = shared
        if isinstance(b.scale_rows, slice):  # the scales in place
            quantize_columns_(
                x, columns, absmax, self.format, self._codes_matrix(), self._touched_scales()
            )
            return
        scales = torch.empty_like(absmax)
        quantize_columns_(x, columns, absmax, self.format, self._codes_matrix(), scales)
        self.scales[b.scale_rows, self._block_columns()] = scales


def store_shards_(comm: Any, items: Sequence[tuple[ShardCodes, torch.Tensor]]) -> None:
    """Quantize each ``(codes, new values)`` of ``items`` (the same tensors on every rank of
    ``comm``, in the same order): the blocks of cut rows under their shared absmax, from one
    all-reduce (max) over ``comm`` of a vector of float32 holding every cut block of these
    tensors (tag ``"block_scales"``; none when nothing is cut)."""
    cut = [(c, v) for c, v in items if c.blocks.slot_count]
    for c, v in items:
        if not c.blocks.slot_count:
            c.store_(v)
    if not cut:
        return
    device = comm.device
    maxima = torch.zeros(sum(c.blocks.slot_count for c, _ in cut), dtype=torch.float32)
    maxima = maxima.to(device)
    base, where = 0, []
    for c, v in cut:
        slots, local = c.piece_maxima(v)
        where.append(slots + base)
        if slots.numel():
            maxima.index_copy_(0, (slots + base).to(device), local.to(device))
        base += c.blocks.slot_count
    comm.all_reduce(maxima, op=dist.ReduceOp.MAX, tag="block_scales")
    for (c, v), slots in zip(cut, where):
        shared = maxima[slots.to(device)].to(v.device).view(c.blocks.rows.numel(), -1)
        c.store_(v, shared)


def synced_scales(scales: DTensor, blocks: ShardBlocks, groups: Sequence[Any]) -> DTensor:
    """The scales a checkpoint holds: on every rank, each block's scale from a rank whose
    columns touch it (the blocks this rank touches kept, the others zero, then an all-reduce
    (max) over each of ``groups``, the :class:`~.comm.Communicator` s of the mesh dims
    :attr:`ShardBlocks.replicated_on`; tag ``"checkpoint"``). A new DTensor."""
    local = local_tensor(scales)
    synced = torch.zeros_like(local)
    cols = slice(blocks.first_block, blocks.stop_block)
    if blocks.cols and blocks.rows.numel():
        synced[blocks.scale_rows, cols] = local[blocks.scale_rows, cols]
    for comm in groups:
        comm.all_reduce(synced, op=dist.ReduceOp.MAX, tag="checkpoint")
    return DTensor.from_local(
        synced,
        scales.device_mesh,
        scales.placements,
        run_check=False,
        shape=scales.shape,
        stride=scales.stride(),
    )


def state_blocks(
    name: str, p: DTensor, group: Mapping[str, Any], view: Any, key: str
) -> ShardBlocks:
    """The :class:`ShardBlocks` of ``p``'s quantized state tensor ``key`` (the Muon momentum
    by its matrix ``view`` and format, AdamW's moments by ``p``'s shape)."""
    if group["algorithm"] == "muon":
        fmt = MOMENTUM_FORMATS[group["state_precision"]]
        mode = "batch" if view.experts is not None else view.mode
        return shard_blocks(name, p, momentum_block_shape(view), mode, fmt.block_size)
    return shard_blocks(name, p, adamw_block_shape(p), "flatten", BLOCK_SIZE)


def stored_format(group: Mapping[str, Any], key: str) -> MomentumFormat:
    """The format of a group's quantized state tensor ``key`` (its codes key)."""
    if group["algorithm"] == "muon":
        return MOMENTUM_FORMATS[group["state_precision"]]
    return ADAMW_FORMATS[key]


def zero_quantized_state(
    p: DTensor, group: Mapping[str, Any], blocks: Mapping[str, ShardBlocks], name: str
) -> dict[str, torch.Tensor]:
    """The quantized state of the DTensor ``p`` that the plain creation would make whole:
    the Muon momentum's codes and scales, or AdamW's step counter and zero moments.
    ``blocks``: each state tensor's :class:`ShardBlocks`, by codes key."""
    out: dict[str, torch.Tensor] = {}
    if group["algorithm"] != "muon":
        out["step"] = torch.zeros((), dtype=torch.float32)
    for key, b in blocks.items():
        out.update(_zero_codes(p, group, key, b, name))
    return out


def _zero_codes(
    p: DTensor, group: Mapping[str, Any], key: str, b: ShardBlocks, name: str
) -> dict[str, DTensor]:
    """State tensor ``key`` of ``p`` zero: its codes (each the code of 0) laid out as ``p``,
    or ``"int4"``'s packed rows (:func:`packed_code_placements`), and its zero scales."""
    fmt, device = stored_format(group, key), local_tensor(p).device
    rows, cols = b.block_shape
    scales = torch.zeros(
        (_local_scale_rows(b), -(-cols // b.block_size)), dtype=torch.float32, device=device
    )
    if fmt.codes_per_byte > 1:
        local_shape, shape = (b.rows.numel(), -(-b.cols // 2)), (rows, -(-cols // 2))
        placements = packed_code_placements(name, p, b)
    else:
        local_shape, shape, placements = local_tensor(p).shape, p.shape, None
    codes = torch.full(local_shape, fmt.zero_byte, dtype=fmt.code_dtype, device=device)
    return {
        key: _on_mesh(codes, p, shape, placements),
        fmt.scale_key: _scales_on_mesh(scales, p, b),
    }


def shard_state_codes(
    state: Mapping[str, Any], group: Mapping[str, Any], blocks: Mapping[str, ShardBlocks], shape
) -> dict[str, ShardCodes]:
    """This rank's quantized state tensors of one parameter (``shape``: its local shard's),
    by codes key."""
    out = {}
    for key, b in blocks.items():
        fmt = stored_format(group, key)
        codes, scales = local_tensor(state[key]), local_tensor(state[fmt.scale_key])
        out[key] = ShardCodes(codes, scales, b, fmt, tuple(shape))
    return out


def state_keys(group: Mapping[str, Any]) -> tuple[str, ...]:
    """The codes keys of a group's quantized state tensors."""
    return (MOMENTUM_KEY,) if group["algorithm"] == "muon" else tuple(ADAMW_FORMATS)


def convert_dtensor_state_(
    entry: MutableMapping[str, Any],
    p: DTensor,
    group: Mapping[str, Any],
    view: Any,
    precision: str,
    name: str = "",
) -> None:
    """The DTensor state ``entry`` of ``p`` in ``precision``, in place (float → quantized,
    quantized → float dequantized into ``p``'s dtype, int8 ↔ int4 through float32): quantized
    → float on each shard; float → quantized on the whole tensor (``full_tensor()``, a
    collective of ``p``'s mesh) and each rank keeps its codes and scales, exactly the ones one
    process makes. ``view``: ``p``'s matrix view (Muon)."""
    if group["algorithm"] == "muon":
        if entry.get(MOMENTUM_KEY) is None:
            return
        stored = momentum_format_of(entry)
        if (stored.precision if stored else "param") == precision:
            return
        if stored is not None:
            held = {**group, "state_precision": stored.precision}
            _dequantize_state_(entry, p, held, view, name, (MOMENTUM_KEY,))
        if precision == "param":
            return
        quantized = {**group, "state_precision": precision}
        _quantize_state_(entry, p, quantized, view, name, entry[MOMENTUM_KEY])
        return
    if adamw_state_is_quantized(entry) == (precision != "param"):
        return
    if precision == "param":
        _dequantize_state_(entry, p, group, None, name, tuple(ADAMW_FORMATS))
        return
    for key in ADAMW_FORMATS:
        _quantize_state_(entry, p, group, None, name, entry[key], key)


def _dequantize_state_(
    entry: MutableMapping[str, Any],
    p: DTensor,
    group: Mapping[str, Any],
    view: Any,
    name: str,
    keys: Sequence[str],
) -> None:
    """``entry[key]`` for each of ``keys``, quantized in ``group``'s precision, as floating
    values in ``p``'s dtype and layout (dequantized on each shard), its scales dropped."""
    blocks = {key: state_blocks(name, p, group, view, key) for key in keys}
    for key, held in shard_state_codes(entry, group, blocks, local_tensor(p).shape).items():
        entry[key] = _on_mesh(held.values().to(p.dtype), p, p.shape)
        del entry[held.format.scale_key]


def _quantize_state_(
    entry: MutableMapping[str, Any],
    p: DTensor,
    group: Mapping[str, Any],
    view: Any,
    name: str,
    floating: DTensor,
    key: str = MOMENTUM_KEY,
) -> None:
    """``entry[key]`` and its scales: the codes and scales of the ``floating`` state (laid out
    as ``p``), each rank's part of one process's: quantized on the shard where it holds whole
    rows, else quantized whole (``floating.full_tensor()``, collective) and its part kept."""
    b = state_blocks(name, p, group, view, key)
    entry.update(_zero_codes(p, group, key, b, name))
    held = shard_state_codes(entry, group, {key: b}, local_tensor(p).shape)[key]
    if b.whole:
        held.store_(local_tensor(floating).float())
        return
    fmt, (rows, cols), per = held.format, b.block_shape, held.format.codes_per_byte
    whole = floating.full_tensor().float().reshape(rows, cols)
    codes = torch.empty((rows, -(-cols // per)), dtype=fmt.code_dtype, device=whole.device)
    scales = torch.empty((rows, -(-cols // b.block_size)), dtype=torch.float32, device=whole.device)
    fmt.quantize_(whole, codes, scales)
    first = b.col_start // per
    held.codes.copy_(codes[b.rows][:, first : first + -(-b.cols // per)].reshape(held.codes.shape))
    held.scales.copy_(scales[b.rows] if held.scales.shape[0] != rows else scales)
