"""Quantized state (``state_precision="int8"``) of DTensor parameters, shard by shard.

Blocks are segments of one row of a state tensor's block matrix
(:func:`~muonscale.block_quantization.block_matrix_shape`). Where every rank holds whole rows
of that matrix (the parameter sharded on dim 0 only: ``Shard(0)``, FSDP2's ``_StridedShard(0)``;
or replicated), a rank's codes and scales are exactly its rows of the ones one process holds,
quantized on the local shard by the same code, with no communication. The codes are DTensors
with the parameter's placements, the float32 scales ``(rows, blocks)`` DTensors with the same
placements on their rows. A placement that cuts the rows (a shard of another dim) is refused
with the parameter's name: a 256-entry block would span ranks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from ..block_quantization import scale_shape
from ..momentum_formats import INT8_MOMENTUM, momentum_format_of
from ..quantized_state import (
    ADAMW_MOMENTS,
    MOMENTUM_KEY,
    QuantizedMomentum,
    adamw_block_shape,
    adamw_state_is_quantized,
    dequantize_adamw_state_,
    momentum_block_shape,
    quantize_adamw_state_,
    zero_adamw_moments,
)
from .dtensor_layout import held_indices, local_tensor

__all__ = [
    "check_whole_rows",
    "convert_dtensor_state_",
    "local_quantized_momentum",
    "state_block_shape",
    "zero_quantized_state",
]


def state_block_shape(p: torch.Tensor, group: Mapping[str, Any], view: Any) -> tuple[int, int]:
    """(rows, cols) of the block matrix of ``p``'s quantized state (global): the Muon
    momentum's by its matrix ``view``, AdamW's moments' by ``p``'s shape."""
    return momentum_block_shape(view) if group["algorithm"] == "muon" else adamw_block_shape(p)


def check_whole_rows(name: str, p: DTensor, block_shape: tuple[int, int]) -> None:
    """``ValueError`` naming parameter ``name`` and the placement unless every rank holds whole
    rows of the ``(rows, cols)`` block matrix of ``p``'s state, in the chunks that the same
    placements make of its scales' rows (dim 0 of ``p`` spans whole rows of the block matrix
    when ``p`` has 2 or more dims; a 1-D tensor is one row)."""
    rows, _ = block_shape
    mesh, placements = p.device_mesh, p.placements
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate) or mesh.size(mesh_dim) == 1:
            continue
        if p.ndim < 2 or placement.dim != 0:
            raise ValueError(
                f"DTensorMuon: parameter '{name}' has placement {placement!r} (mesh dim "
                f"{mesh_dim}), which cuts the rows of its {rows}×{block_shape[1]} state into "
                "pieces on several ranks, and with them the 256-entry blocks that "
                "state_precision='int8' keeps one scale for; int8 state needs every rank to "
                "hold whole rows (Shard(0) or Replicate). Put it in a param group with "
                "state_precision='param'."
            )
    if p.ndim < 2 or p.shape[0] == 0:
        return
    per = rows // p.shape[0]  # rows of the block matrix per index of dim 0
    held = held_indices(p.shape[0], 0, mesh, placements)
    held_rows = (held[:, None] * per + torch.arange(per)).reshape(-1)
    if not torch.equal(held_rows, held_indices(rows, 0, mesh, placements)):
        raise ValueError(
            f"DTensorMuon: parameter '{name}' of shape {tuple(p.shape)} with placements "
            f"{p.placements} splits its dim 0 into chunks whose {per} rows each are not the "
            f"chunks the same placements make of the {rows} rows of its int8 state's scales; "
            "give dim 0 a size the mesh divides, or put it in a param group with "
            "state_precision='param'."
        )


def _on_mesh(local: torch.Tensor, p: DTensor, shape: tuple[int, ...]) -> DTensor:
    """``local`` (contiguous) as this rank's shard of a DTensor of ``shape`` with ``p``'s mesh
    and placements."""
    shape = tuple(int(s) for s in shape)
    stride = tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))
    return DTensor.from_local(
        local, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape), stride=stride
    )


def _local_block_shape(local: torch.Tensor, block_shape: tuple[int, int]) -> tuple[int, int]:
    """The rows of the block matrix a local shard of whole rows holds, and its columns."""
    cols = block_shape[1]
    return (local.numel() // cols if cols else 0), cols


def _scales_on_mesh(local: torch.Tensor, p: DTensor, block_shape: tuple[int, int]) -> DTensor:
    return _on_mesh(local, p, scale_shape(*block_shape))


def zero_quantized_state(
    p: DTensor, group: Mapping[str, Any], view: Any, name: str
) -> dict[str, torch.Tensor]:
    """The quantized state of the DTensor ``p`` that the plain creation would make whole:
    the Muon momentum's scales (its codes are made like the parameter), or AdamW's step
    counter and zero moments; ``ValueError`` naming ``name`` for a layout that cuts rows."""
    block = state_block_shape(p, group, view)
    check_whole_rows(name, p, block)
    local = local_tensor(p)
    if group["algorithm"] == "muon":
        rows, cols = _local_block_shape(local, block)
        scales = torch.zeros(scale_shape(rows, cols), dtype=torch.float32, device=local.device)
        return {INT8_MOMENTUM.scale_key: _scales_on_mesh(scales, p, block)}
    moments = zero_adamw_moments(local)
    out: dict[str, torch.Tensor] = {"step": torch.zeros((), dtype=torch.float32)}
    for key, absmax_key, _ in ADAMW_MOMENTS:
        out[key] = _on_mesh(moments[key], p, p.shape)
        out[absmax_key] = _scales_on_mesh(moments[absmax_key], p, block)
    return out


def local_quantized_momentum(state: Mapping[str, Any], view: Any) -> QuantizedMomentum:
    """The int8 momentum of this rank's shard: its local codes and scales, whole rows."""
    codes = local_tensor(state[MOMENTUM_KEY])
    block = _local_block_shape(codes, momentum_block_shape(view))
    return QuantizedMomentum(codes, local_tensor(state[INT8_MOMENTUM.scale_key]), block)


def convert_dtensor_state_(
    entry: MutableMapping[str, Any],
    p: DTensor,
    group: Mapping[str, Any],
    view: Any,
    precision: str,
) -> None:
    """The DTensor state ``entry`` of ``p`` in ``precision``, in place, each rank converting
    its shard (float → int8 quantized, int8 → float dequantized into ``p``'s dtype): a shard
    of whole rows converts as those rows of the whole tensor do. ``view``: ``p``'s matrix
    view (Muon)."""
    local_p = local_tensor(p)
    block = state_block_shape(p, group, view)
    if group["algorithm"] == "muon":
        momentum = entry.get(MOMENTUM_KEY)
        stored = momentum_format_of(entry)
        if stored not in (None, INT8_MOMENTUM) or precision not in ("param", "int8"):
            raise ValueError(
                f"DTensorMuon converts floating and int8 state only; this state is "
                f"{stored.precision if stored else 'param'!r}, asked for {precision!r}: load it "
                "into muonscale.Muon and save it with state_dict_in_precision('int8') first"
            )
        quantized = stored is INT8_MOMENTUM
        if momentum is None or quantized == (precision == "int8"):
            return
        if precision == "int8":
            values = local_tensor(momentum)
            local_block = _local_block_shape(values, block)
            codes = torch.empty(values.shape, dtype=torch.int8, device=values.device)
            scales = torch.empty(
                scale_shape(*local_block), dtype=torch.float32, device=values.device
            )
            QuantizedMomentum(codes, scales, local_block).store_(values.float())
            entry[MOMENTUM_KEY] = _on_mesh(codes, p, p.shape)
            entry[INT8_MOMENTUM.scale_key] = _scales_on_mesh(scales, p, block)
        else:
            values = local_quantized_momentum(entry, view).values().to(p.dtype)
            entry[MOMENTUM_KEY] = _on_mesh(values, p, p.shape)
            del entry[INT8_MOMENTUM.scale_key]
        return
    if adamw_state_is_quantized(entry) == (precision == "int8"):
        return
    local = {key: local_tensor(value) for key, value in entry.items()}
    if precision == "int8":
        quantize_adamw_state_(local, local_p)
    else:
        dequantize_adamw_state_(local, local_p)
    for key, absmax_key, _ in ADAMW_MOMENTS:
        entry[key] = _on_mesh(local[key], p, p.shape)
        if absmax_key in local:
            entry[absmax_key] = _scales_on_mesh(local[absmax_key], p, block)
        else:
            entry.pop(absmax_key, None)
