"""DTensor placements read as matrix layouts: which rows and columns of a parameter's 2-D
matrix ``(d0, d1·d2·…)`` each rank of the optimizer's group holds (:class:`MatrixLayout`).

Shard(dim) and FSDP2's _StridedShard select ``torch.chunk``-style (ceil) chunks along their dim,
in mesh order; Replicate keeps everything. A Partial parameter (unreduced values) and a mesh
that does not span the optimizer's group are refused with the parameter's name.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..matrices import MatrixView
from .setup_checks import is_dtensor
from .sharded import MatrixLayout, chunk_bounds

try:  # FSDP2 on a TP-sharded dim: right-to-left sharding
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = None
_SHARDS = tuple(t for t in (Shard, _StridedShard) if t is not None)

__all__ = [
    "as_2d",
    "check_mesh_spans_group",
    "check_placement",
    "dtensor_layout",
    "held_indices",
    "local_indices",
    "local_tensor",
    "parameter_layout",
    "MatrixUnit",
    "expert_units",
]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: in-place ops update the DTensor), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def _strided_select(idx: torch.Tensor, chunks: int, index: int, split_factor: int) -> torch.Tensor:
    """``_StridedShard``: ``split_factor`` chunks, each chunked ``chunks`` ways, piece
    ``index`` of each, concatenated (torch's right-to-left sharding, ceil chunks)."""
    parts = []
    for j in range(split_factor):
        s0, sl = chunk_bounds(idx.numel(), split_factor, j)
        sub = idx[s0 : s0 + sl]
        c0, cl = chunk_bounds(sub.numel(), chunks, index)
        parts.append(sub[c0 : c0 + cl])
    return torch.cat(parts)


def local_indices(t: DTensor, dim: int = 0) -> torch.Tensor:
    """Global indices along ``dim`` of the elements this rank's shard of ``t`` holds, in
    order (Shard / FSDP2's _StridedShard on ``dim`` select; Replicate and other dims keep all).
    Raises ``ValueError`` for a Partial placement (unreduced values)."""
    for placement in t.placements:
        check_placement("local_indices", placement, t.ndim)
    return held_indices(t.shape[dim], dim, t.device_mesh, t.placements)


def held_indices(
    size: int, dim: int, mesh: Any, placements: Sequence[Any], coord: Sequence[int] | None = None
) -> torch.Tensor:
    """Global indices along ``dim`` (of ``size`` elements) that this rank (or the rank at mesh
    coordinate ``coord``) holds of a tensor with ``placements`` on ``mesh`` (checked
    placements: Shard, _StridedShard, Replicate)."""
    idx = torch.arange(size)
    coord = mesh.get_coordinate() if coord is None else coord
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate) or placement.dim != dim:
            continue
        chunks, index = mesh.size(mesh_dim), coord[mesh_dim]
        if _StridedShard is not None and isinstance(placement, _StridedShard):
            idx = _strided_select(idx, chunks, index, int(placement.split_factor))
        else:
            start, length = chunk_bounds(idx.numel(), chunks, index)
            idx = idx[start : start + length]
    return idx


def check_placement(name: str, placement: Any, ndim: int) -> None:
    """``ValueError`` naming parameter ``name`` unless ``placement`` is exactly Shard,
    Replicate or FSDP2's _StridedShard (of one of its ``ndim`` dims): the layout reads those
    exactly; a subclass or another placement type may select other elements, so it is refused
    rather than assumed to be one of them."""
    kind = type(placement)
    if kind is Replicate:
        return
    if kind in _SHARDS and 0 <= placement.dim < ndim:
        return
    raise ValueError(
        f"DTensorMuon: parameter '{name}' has placement {placement!r} "
        f"({kind.__module__}.{kind.__qualname__}), which is not supported (supported: exactly "
        "Shard(dim), Replicate(), and FSDP2's _StridedShard). A Partial parameter holds "
        "unreduced values; redistribute it to Shard or Replicate first."
    )


def check_mesh_spans_group(name: str, param: DTensor, group_ranks: Sequence[int]) -> None:
    """Gradients are reduced by the framework over the mesh only: refuse a mesh that does not
    cover the optimizer's group (e.g. TP-only DTensors with plain data parallelism around)."""
    mesh_ranks = sorted(param.device_mesh.mesh.flatten().tolist())
    if mesh_ranks != sorted(group_ranks):
        raise ValueError(
            f"DTensorMuon: parameter '{name}' lives on {param.device_mesh} (ranks {mesh_ranks}) "
            f"but the optimizer's process group has ranks {sorted(group_ranks)}. Data parallelism "
            "outside the DTensor mesh (e.g. TP-only DTensors under plain DDP) is not supported: "
            "nobody would reduce those gradients here. Put data parallelism on a mesh axis "
            "(fully_shard / HSDP on a 2-D (dp, tp) mesh), or pass process_group= the mesh's group."
        )


def dtensor_layout(name: str, param: DTensor, group_ranks: Sequence[int]) -> MatrixLayout:
    """Layout of ``param`` seen as its 2-D matrix ``(d0, d1·d2·…)`` over the ranks of the
    optimizer's group (``group_ranks[i]`` = global rank of group rank i)."""
    mesh, placements = param.device_mesh, param.placements
    shape = tuple(param.shape)
    for placement in placements:
        check_placement(name, placement, len(shape))
    check_mesh_spans_group(name, param, group_ranks)
    mesh_ranks = mesh.mesh  # global ranks, shape = mesh shape
    group_rank_of = {g: i for i, g in enumerate(group_ranks)}
    rest = shape[1:]
    pieces: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(group_ranks)
    for coord in itertools.product(*(range(s) for s in mesh_ranks.shape)):
        idx = [torch.arange(s) for s in shape]
        for mesh_dim, placement in enumerate(placements):
            if isinstance(placement, Replicate):
                continue
            d, k, c = placement.dim, mesh_ranks.shape[mesh_dim], coord[mesh_dim]
            if _StridedShard is not None and isinstance(placement, _StridedShard):
                idx[d] = _strided_select(idx[d], k, c, int(placement.split_factor))
            else:
                start, length = chunk_bounds(idx[d].numel(), k, c)
                idx[d] = idx[d][start : start + length]
        cols = torch.arange(math.prod(rest)).reshape(rest)  # flattened trailing dims
        for d, sel in enumerate(idx[1:]):
            cols = cols.index_select(d, sel)
        pieces[group_rank_of[int(mesh_ranks[coord])]] = (idx[0], cols.reshape(-1))
    return MatrixLayout.from_indices((shape[0], math.prod(rest)), pieces)


def as_2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as its 2-D matrix ``(d0, d1·d2·…)`` (a view)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])) if t.ndim != 2 else t


def parameter_layout(
    name: str, p: torch.Tensor, group_ranks: Sequence[int], rank: int, distributed: bool
) -> MatrixLayout:
    """How ``p`` is laid out over the ranks of the group (``rank``: this rank's index in it;
    ``distributed``: the group has more than this process): a DTensor's layout as a 2-D matrix,
    else a replica on every rank. A 1-D DTensor (AdamW only, elementwise) is only checked.
    ``ValueError`` naming ``name`` when this rank's shard is not the layout's piece."""
    world_size = len(group_ranks)
    shape2d = (p.shape[0], math.prod(p.shape[1:])) if p.ndim >= 2 else (1, p.numel())
    if isinstance(p, DTensor) and distributed:
        if p.ndim >= 2:
            layout = dtensor_layout(name, p, group_ranks)
        else:
            for placement in p.placements:
                check_placement(name, placement, p.ndim)
            check_mesh_spans_group(name, p, group_ranks)
            layout = MatrixLayout.replicated(shape2d, world_size)
    else:
        layout = MatrixLayout.replicated(shape2d, world_size)
    held = tuple(as_2d(local_tensor(p)).shape)
    if p.ndim >= 2 and layout.piece_shape(rank) != held:
        raise ValueError(
            f"DTensorMuon: parameter '{name}': computed local shard {layout.piece_shape(rank)} "
            f"but the DTensor holds {held} (placements {getattr(p, 'placements', None)})"
        )
    return layout


@dataclass(frozen=True)
class MatrixUnit:
    """What one matrix of the exchange is: a whole parameter, or one expert of a stack."""

    param: torch.Tensor
    group: Mapping[str, Any]
    view: MatrixView
    """The parameter's view, or one expert's."""
    layout: MatrixLayout
    expert: int | None = None
    shape: tuple[int, ...] = ()
    """The stored shape the owner steps (the parameter's, or one expert's)."""
    holder: int | None = None
    """The rank that holds the expert whole (its owner)."""
    local_rows: slice | None = None
    """The holder's rows of its local 2-D shard that hold this expert."""
    row_span: slice | None = None
    """The expert's rows of the parameter's replicated row states."""

    def __post_init__(self) -> None:
        if not self.shape:
            object.__setattr__(self, "shape", tuple(self.param.shape))

    def replicas(self, held: dict) -> dict:
        """This unit's rows of the parameter's replicated row states (views)."""
        if self.row_span is None:
            return held
        return {spec: tensor[self.row_span] for spec, tensor in held.items()}


def expert_units(p: torch.Tensor, view: MatrixView, layout: MatrixLayout) -> list[tuple] | None:
    """``(view, layout, expert, shape, holder, local rows, row span)`` of each expert of an
    expert stack whose every expert some single rank holds whole (contiguous rows of the 2-D
    matrix, every column; no replica), else None."""
    if view.experts is None or layout.whole_everywhere or p.ndim not in (2, 3):
        return None
    count = view.experts
    m, n = layout.shape  # 3-D: (E, A·B); 2-D concatenation: (E·A, B)
    per = m // count
    holder_of: dict[int, tuple[int, int]] = {}  # expert -> (rank, first local row)
    for rank, (rows, cols) in enumerate(layout.pieces):
        if not isinstance(rows, slice) or rows.start == rows.stop:
            continue
        if not isinstance(cols, slice) or (cols.start, cols.stop) != (0, n):
            return None
        if rows.start % per or rows.stop % per:
            return None
        for e in range(rows.start // per, rows.stop // per):
            if e in holder_of:
                return None  # held by two ranks: not one owner
            holder_of[e] = (rank, e * per - rows.start)
    if len(holder_of) != count:
        return None
    expert_view = view.experts_view()
    rows_per_expert = sum(r for r, _ in expert_view.matrix_shapes)
    world = len(layout.pieces)
    out = []
    for e in range(count):
        rank, first = holder_of[e]
        pieces = [
            (torch.arange(per), torch.arange(n))
            if r == rank
            else (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
            for r in range(world)
        ]
        out.append(
            (
                expert_view,
                MatrixLayout.from_indices((per, n), pieces),
                e,
                expert_view.param_shape,
                rank,
                slice(first, first + per),
                slice(e * rows_per_expert, (e + 1) * rows_per_expert),
            )
        )
    return out
