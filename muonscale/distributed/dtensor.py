"""Exact Muon for DTensor parameters: FSDP2 (``fully_shard``), tensor parallel
(``parallelize_module``), HSDP, and 2-D FSDP × TP meshes.

Meshes and placements are read from the parameters. Per step (``DTensorMuon.step``)::

    grads (DTensor, already reduced by FSDP2 / TP)        every rank, on its local shard
      │  B ← B.lerp(G, 1−μ);  U = G.lerp(B, μ)             elementwise: exact on shards
      ▼
    U shards ──all_to_all──▶ owner: whole U → matrices (QKV split) → NS → scale   (sharded.py)
      ◀──all_to_all── O shards
    (both legs in Newton–Schulz's dtype where it is narrower than the gradient's: bf16 NS
    sends bf16 U, since the owner's first step casts U to it anyway)
      │  W ← W(1 − ηλ) − η s O                             elementwise on the local shard
      ▼
    AdamW params: the whole AdamW step elementwise on local shards (exact, no traffic)

The update is the same function as single-process :class:`muonscale.Muon`: elementwise math on
a shard gives the same numbers as on the full tensor, and Newton–Schulz always sees the whole
matrix (split into Q/K/V blocks or heads on the owner, when ``splits=`` says so).

Momentum and AdamW state are DTensors with the parameter's placements, so
``torch.distributed.checkpoint`` saves them sharded and loads them onto another mesh. The
momentum's local shards live in one stack per (param group, local shard shape, dtype) as in
:class:`muonscale.Muon` (:class:`~muonscale.optimizer_state.MomentumStacks`, rebuilt after a
load): the momentum pass is one foreach per group, and the directions are written straight
into the all-to-all's send buffer.

Gradient reduction is the framework's job: FSDP2 reduce-scatters (and all-reduces across an
HSDP replicate axis), TP gradients come out of autograd complete. A gradient placed unlike its
parameter (TP without FSDP: a ``Partial`` gradient on a ``Replicate`` parameter, a ``Replicate``
one on a ``Shard`` parameter) is redistributed to the parameter's placements once at the start
of the step, as DTensor dispatch does for torch's optimizers; nothing else is reduced again
here. Every mesh must therefore span the optimizer's whole process group; a TP-only mesh under
data parallelism outside the mesh is refused (put data parallelism on a mesh axis:
``fully_shard`` on a 2-D mesh). Plain (non-DTensor) parameters — e.g. the embedding and norms
outside ``parallelize_module``'s plan — are taken to be identical on every rank, gradients
included, and are updated locally on each (Muon ones too: no traffic, duplicated FLOPs). Under
FSDP2, ``fully_shard`` the root module as well, so that every parameter is a DTensor: a plain
parameter there would carry an unreduced gradient.

``approximate_per_shard=True`` (off by default) instead orthogonalizes each local shard on its
own, with no traffic: *not* Muon's update (per-shard, "blockwise" Newton–Schulz); the scale
rule still uses the full matrix shape, and ``splits`` are ignored.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import functional, matrix_step
from ..declared_state import ROW_MOMENT, kept_state
from ..newton_schulz import default_ns_dtype
from ..optimizer import Muon
from ..optimizer_state import parameter_states
from ..scaling import matrix_update_scales, update_scale
from ..settings import MuonSettings, NewtonSchulzSettings
from ..variants import (  # [variants]
    row_factors,
    row_statistics,
    update_row_moments_,
)
from .agreement import check_same_on_every_rank
from .comm import Communicator, WireCounter
from .data_parallel import check_process_group
from .sharded import MatrixLayout, ShardedMatrices, chunk_bounds, default_owners

try:  # FSDP2 on a TP-sharded dim: right-to-left sharding
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _StridedShard = None

__all__ = ["DTensorMuon", "dtensor_layout", "local_indices", "local_tensor"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: in-place ops update the DTensor), else ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


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
    idx = torch.arange(t.shape[dim])
    coord = t.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(t.placements):
        _check_placement("local_indices", placement, t.ndim)
        if isinstance(placement, Replicate) or placement.dim != dim:
            continue
        chunks, index = t.device_mesh.size(mesh_dim), coord[mesh_dim]
        if _StridedShard is not None and isinstance(placement, _StridedShard):
            idx = _strided_select(idx, chunks, index, int(placement.split_factor))
        else:
            start, length = chunk_bounds(idx.numel(), chunks, index)
            idx = idx[start : start + length]
    return idx


def _check_placement(name: str, placement: Any, ndim: int) -> None:
    if isinstance(placement, Replicate):
        return
    sharded = isinstance(placement, Shard) or (
        _StridedShard is not None and isinstance(placement, _StridedShard)
    )
    if sharded and 0 <= placement.dim < ndim:
        return
    raise ValueError(
        f"DTensorMuon: parameter '{name}' has placement {placement!r}, which is not supported "
        "(supported: Shard(dim), Replicate(), and FSDP2's _StridedShard). A Partial parameter "
        "holds unreduced values; redistribute it to Shard or Replicate first."
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
        _check_placement(name, placement, len(shape))
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


def _narrower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The floating dtype of fewer bits (``b`` on a tie)."""
    return a if torch.finfo(a).bits < torch.finfo(b).bits else b


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], math.prod(t.shape[1:])) if t.ndim != 2 else t


class DTensorMuon(Muon):
    r""":class:`muonscale.Muon` for DTensor parameters (FSDP2, TP, HSDP, FSDP × TP), exact.

    Same arguments as :class:`muonscale.Muon` (pass ``model.named_parameters()`` or the model
    so ``splits`` and routing see names), plus:

    Args:
        process_group: the group spanning every parameter's mesh (default: the world).
        approximate_per_shard: opt in to per-shard Newton–Schulz (approximate, no traffic).

    Step phases (see the module docstring for the picture): check gradients (one tiny
    all-reduce of non-finite flags, unless ``nonfinite="ignore"``) → momentum on shards →
    all-to-all to owners → Newton–Schulz on whole matrices → all-to-all back → update shards →
    AdamW on shards. NorMuon (``normalize="row"``) normalises rows on the owner and shares the
    owners' row statistics in one all-reduce, so its row second moment is replicated.
    ``last_step_wire_bytes`` / ``last_step_wire_breakdown`` give the bytes this rank sent in the
    last step (``"muon/all_to_all"``, ``"muon/all_reduce"``, ``"control/all_reduce"``), counted
    by :mod:`.comm` as for :class:`~muonscale.distributed.DistributedMuon`. Construction checks
    that every rank routed and configured every parameter alike (:mod:`.agreement`).
    """

    _ACCEPTS_DTENSOR = True
    _CAPTURABLE_REFUSAL = (
        "its all-to-all exchange sizes and the non-finite decision are read on the host every "
        "step; use muonscale.Muon(capturable=True) on one GPU"
    )
    _BACKWARD_NS_REFUSAL = (
        "its gradients are redistributed and its matrices gathered in step(); use "
        "muonscale.Muon(orthogonalize_in_backward=True) in one process"
    )

    def __init__(
        self,
        params: Any,
        *args: Any,
        process_group: dist.ProcessGroup | None = None,
        approximate_per_shard: bool = False,
        **kwargs: Any,
    ) -> None:
        check_process_group(process_group, "DTensorMuon")
        super().__init__(params, *args, **kwargs)
        if not isinstance(approximate_per_shard, bool):
            raise ValueError(f"approximate_per_shard must be a bool, got {approximate_per_shard!r}")
        self.approximate_per_shard = approximate_per_shard
        if approximate_per_shard and any(  # [variants]
            g["algorithm"] == "muon" and g.get("normalize", "none") != "none"
            for g in self.param_groups
        ):
            raise ValueError(
                "DTensorMuon: normalize='row' (NorMuon) needs the whole orthogonalized matrix; "
                "it cannot be combined with approximate_per_shard=True"
            )
        self.process_group = process_group
        self.wire_counter = WireCounter()
        self.last_step_wire_bytes = 0
        self.last_step_wire_breakdown: dict[str, int] = {}
        self.last_step_wire_links: dict[str, int] = WireCounter().by_link()
        self.comm = Communicator(process_group, counter=self.wire_counter)
        if self.comm.active:
            self._group_ranks = dist.get_process_group_ranks(process_group or dist.group.WORLD)
        else:
            self._group_ranks = [0]
        self._plans: dict[tuple, ShardedMatrices] = {}
        self._layouts: dict[int, MatrixLayout] = {}
        self._row_stats: dict[int, torch.Tensor] = {}  # [variants] NorMuon, this step's owners
        check_same_on_every_rank(
            self.comm,
            self._routing_records(),
            who="DTensorMuon",
            fields="algorithm, shape, dtype, matrices, options",
        )
        for group in self.param_groups:  # fail fast on unsupported placements / meshes
            for p in group["params"]:
                self.matrix_layout(p)

    def _routing_records(self) -> list[tuple[str, tuple]]:
        """Per parameter: its name and what this rank decided for it (routing, matrices,
        options); every rank must decide the same (checked at construction)."""
        records = []
        for group in self.param_groups:
            options = tuple(
                (k, repr(v)) for k, v in sorted(group.items()) if k not in ("params", "param_names")
            )
            for p in group["params"]:
                shapes = (
                    tuple(self._matrix_view(p, group).matrix_shapes)
                    if group["algorithm"] == "muon"
                    else ()
                )
                decision = (group["algorithm"], tuple(p.shape), str(p.dtype), shapes, options)
                records.append((self._name(p), decision))
        return records

    # ---------------------------------------------------------------- layouts
    def matrix_layout(self, p: torch.Tensor) -> MatrixLayout:
        """How ``p`` is laid out over the group, as a 2-D matrix (cached)."""
        layout = self._layouts.get(id(p))
        if layout is None:
            shape2d = (p.shape[0], math.prod(p.shape[1:])) if p.ndim >= 2 else (1, p.numel())
            if isinstance(p, DTensor) and self.comm.active:
                if p.ndim >= 2:
                    layout = dtensor_layout(self._name(p), p, self._group_ranks)
                else:  # AdamW-only, elementwise: just validate
                    for placement in p.placements:
                        _check_placement(self._name(p), placement, p.ndim)
                    check_mesh_spans_group(self._name(p), p, self._group_ranks)
                    layout = MatrixLayout.replicated(shape2d, self.comm.world_size)
            else:
                layout = MatrixLayout.replicated(shape2d, self.comm.world_size)
            if p.ndim >= 2 and layout.piece_shape(self.comm.rank) != tuple(
                _as_2d(local_tensor(p)).shape
            ):
                raise ValueError(
                    f"DTensorMuon: parameter '{self._name(p)}': computed local shard "
                    f"{layout.piece_shape(self.comm.rank)} but the DTensor holds "
                    f"{tuple(_as_2d(local_tensor(p)).shape)} "
                    f"(placements {getattr(p, 'placements', None)})"
                )
            self._layouts[id(p)] = layout
        return layout

    def _plan(self, entries: list[tuple[torch.Tensor, Mapping[str, Any]]], dtype: torch.dtype):
        key = (tuple(id(p) for p, _ in entries), dtype)
        if key not in self._plans:
            layouts = [self.matrix_layout(p) for p, _ in entries]
            costs = [self._matrix_view(p, g).matrix_shapes for p, g in entries]
            owners = default_owners(layouts, self.comm.world_size, matrix_shapes=costs)
            self._plans[key] = ShardedMatrices(
                layouts,
                group=self.process_group,
                owners=owners,
                counter=self.wire_counter,
                hosts=self.comm.hosts,
            )
        return self._plans[key]

    def _after_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """New parameter objects: lay them out again (and fail fast on unsupported ones)."""
        self._layouts.clear()
        self._plans.clear()
        for group in self.param_groups:
            for p in group["params"]:
                self.matrix_layout(p)

    # ---------------------------------------------------------------- state / checks
    def optimizer_state_bytes(self) -> int:
        """Exact bytes of state tensors held by this rank (local shards)."""
        return sum(
            local_tensor(v).numel() * local_tensor(v).element_size()
            for s in parameter_states(self.state)
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def _step_gradients(self) -> dict[int, torch.Tensor]:
        """The base class's, each DTensor gradient redistributed to its parameter's placements
        (a TP ``Partial`` gradient reduced, a ``Replicate`` one on a sharded parameter sliced),
        as torch's optimizers get from DTensor dispatch."""
        grads = super()._step_gradients()  # refuses sparse gradients first
        return {
            id(p): self.comm.redistribute_like(p.grad, p, tag="gradients")
            for group in self.param_groups
            for p in group["params"]
            if id(p) in grads
        }

    def _first_nonfinite(self, grads: list[torch.Tensor], owners: list[torch.Tensor]) -> str | None:
        """Non-finite check on local shards; one all-reduce (max) of per-parameter flags so that
        every rank takes the same decision."""
        local = [local_tensor(g) for g in grads]
        flags = torch.zeros(len(local), dtype=torch.float32, device=self.comm.device)
        nonempty = [i for i, t in enumerate(local) if t.numel()]
        if nonempty:  # the inf-norm propagates NaN; empty shards are finite
            max_abs = torch._foreach_norm([local[i] for i in nonempty], float("inf"))
            bad = ~torch.stack([m.float().to(flags.device) for m in max_abs]).isfinite()
            flags[torch.tensor(nonempty, device=flags.device)] = bad.float()
        self.comm.all_reduce(flags, op=dist.ReduceOp.MAX, tag="control")
        bad = flags.nonzero()
        return None if bad.numel() == 0 else self._name(owners[int(bad[0])])

    # ---------------------------------------------------------------- step
    def _apply_updates(
        self,
        grads: Mapping[int, torch.Tensor],
        from_backward: Sequence[Any] = (),
        step_ok: torch.Tensor | None = None,
    ) -> None:
        """The update phases of :meth:`step` (see the class docstring); ``Muon.step`` runs the
        closure and the collective non-finite check first (neither ``capturable`` nor
        ``orthogonalize_in_backward``: ``from_backward`` is empty, ``step_ok`` None)."""
        muon_entries: list[tuple[torch.Tensor, Mapping[str, Any]]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == "muon":
                muon_entries.extend((p, group) for p in params)
            else:
                self._adamw_on_shards(group, params, grads)
        if muon_entries:
            self._muon(muon_entries, grads)
        self.last_step_wire_links = self.wire_counter.by_link()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = self.wire_counter.take()

    def _adamw_on_shards(
        self, group: Mapping[str, Any], params: list[torch.Tensor], grads: Mapping[int, Any]
    ) -> None:
        if not params:
            return
        states = [self._init_state(p, group) for p in params]
        beta1, beta2 = group["betas"]
        functional.adamw(
            [local_tensor(p) for p in params],
            [local_tensor(grads[id(p)]) for p in params],
            [local_tensor(s["exp_avg"]) for s in states],
            [local_tensor(s["exp_avg_sq"]) for s in states],
            [s["step"] for s in states],
            lr=float(group["lr"]),
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            max_chunk_bytes=self.memory.update_chunk_bytes,
        )

    def _muon(
        self, entries: list[tuple[torch.Tensor, Mapping[str, Any]]], grads: Mapping[int, Any]
    ) -> None:
        # phase 1: momentum on local shards (elementwise: one foreach per group, for its μ);
        # it lives in stacks per local shard shape, so nothing is stacked per step
        groups = list({id(g): g for _, g in entries}.values())
        local_grads = {id(p): local_tensor(grads[id(p)]) for p, _ in entries}
        momenta: dict[int, torch.Tensor] = {}
        for group in groups:
            params = [p for p, g in entries if g is group]
            states = [self._init_state(p, group) for p in params]
            bufs = [local_tensor(b) for b in self._stacked_momentum(group, params, states)]
            functional.update_momentum_(
                [local_grads[id(p)] for p in params], bufs, momentum=group["momentum"]
            )
            momenta.update((id(p), b) for p, b in zip(params, bufs))

        # phase 2: directions U → whole matrices at owners → Newton–Schulz → update pieces back
        if self.approximate_per_shard:
            directions = {id(p): torch.empty_like(local_grads[id(p)]) for p, _ in entries}
            self._write_directions(entries, local_grads, momenta, directions)
            updates = self._per_shard_updates(entries, directions)
        else:
            updates, whole_here = {}, set()
            for dtype in sorted({local_grads[id(p)].dtype for p, _ in entries}, key=str):
                part = [(p, g) for p, g in entries if local_grads[id(p)].dtype == dtype]
                plan = self._plan(part, dtype)
                result_dtype = self._result_dtype(part, dtype)
                # U written straight where the all-to-all sends it from (no packing copy), in
                # Newton–Schulz's dtype where that is narrower: the owner's first step casts
                # the whole U to it, so the cast moves before the wire with the same bits
                wire_dtype = _narrower(result_dtype, dtype)
                device = local_grads[id(part[0][0])].device
                packed, pieces = plan.piece_buffer(wire_dtype, device)
                self._write_directions(
                    part, local_grads, momenta, {id(p): x for (p, _), x in zip(part, pieces)}
                )
                out = plan.apply(
                    pieces,
                    lambda idx, mats, part=part: self._orthogonalize(part, idx, mats),
                    result_dtype=result_dtype,
                    packed=packed,
                )
                updates.update({id(p): (o, self._alpha(p, g)) for (p, g), o in zip(part, out)})
                whole_here.update(id(part[i][0]) for i in plan.local)
            self._share_row_statistics(entries, whole_here)  # [variants] NorMuon

        # phase 3: weight decay and update on local shards, per group for its lr / λ
        for group in groups:
            params = [p for p, g in entries if g is group]
            shards = [local_tensor(p) for p in params]
            ups = [updates[id(p)][0].reshape(x.shape) for p, x in zip(params, shards)]
            alphas = [updates[id(p)][1] for p in params]
            functional.apply_updates_(
                shards,
                ups,
                alphas,
                lr=float(group["lr"]),
                weight_decay=group["weight_decay"],
                cautious=MuonSettings.from_group(group).cautious_weight_decay,
            )

    @staticmethod
    def _write_directions(entries, grads, momenta, out: Mapping[int, torch.Tensor]) -> None:
        """U = G.lerp(B, μ) (Nesterov) or B of every entry, per group for its μ / Nesterov,
        into ``out[id(p)]`` (any shape holding the local shard's elements, contiguous)."""
        for group in {id(g): g for _, g in entries}.values():
            params = [p for p, g in entries if g is group]
            functional.write_directions_(
                [grads[id(p)] for p in params],
                [momenta[id(p)] for p in params],
                [out[id(p)].view(grads[id(p)].shape) for p in params],
                momentum=group["momentum"],
                nesterov=group["nesterov"],
            )

    def _share_row_statistics(self, entries, whole_here: set[int]) -> None:
        """[variants] NorMuon: every rank's replica of a matrix's row second moment takes the
        step the owner took. The owners' row statistics reach every rank in one all-reduce
        (sum; the other ranks add zeros, so the sum is exact); matrices every rank holds whole
        used their own statistics, with no traffic."""
        shared = []
        for p, group in entries:
            if ROW_MOMENT not in kept_state(MuonSettings.from_group(group)):
                continue
            v = self.state[p][ROW_MOMENT.key]
            if id(p) in whole_here:
                update_row_moments_(v, self._row_stats.pop(id(p)), group["row_beta2"])
            else:
                shared.append((p, group, v))
        if shared:
            total = sum(v.numel() for _, _, v in shared)
            stats = torch.zeros(total, dtype=torch.float32, device=self.comm.device)
            offset = 0
            for p, _, v in shared:
                mine = self._row_stats.pop(id(p), None)  # only on the matrix's owner
                if mine is not None:
                    stats[offset : offset + v.numel()] = mine
                offset += v.numel()
            self.comm.all_reduce(stats, op=dist.ReduceOp.SUM, tag="muon")
            offset = 0
            for _, group, v in shared:
                chunk = stats[offset : offset + v.numel()].to(v.device)
                update_row_moments_(v, chunk, group["row_beta2"])
                offset += v.numel()
        self._row_stats.clear()

    def _row_normalize_on_owner(self, p, group, mats: list[torch.Tensor]) -> None:
        """[variants] NorMuon on the owner's whole matrices of ``p``, in place: each matrix's
        rows scaled by :func:`~muonscale.variants.row_factors` of the moment after this step
        (computed on a copy; every replica is stepped by :meth:`_share_row_statistics`)."""
        v, offset, stats = self.state[p][ROW_MOMENT.key], 0, []
        for mat in mats:
            rows = mat.shape[0]
            s = row_statistics(mat)
            moment = update_row_moments_(v[offset : offset + rows].clone(), s, group["row_beta2"])
            mat.mul_(row_factors(moment, s).to(mat.dtype)[:, None])
            stats.append(s.to(torch.float32))
            offset += rows
        self._row_stats[id(p)] = torch.cat(stats)

    def _result_dtype(self, part, dtype: torch.dtype) -> torch.dtype:
        """Newton–Schulz's output dtype when all groups agree (bf16 on GPU halves the return
        traffic; adding it to the parameter promotes exactly as on one process)."""
        ns = {
            MuonSettings.from_group(g).ns_dtype or default_ns_dtype(local_tensor(p).device)
            for p, g in part
        }
        return ns.pop() if len(ns) == 1 else dtype

    def _orthogonalize(
        self, part, indices: list[int], whole: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """On the owner: whole U (2-D) → view's matrices → batched NS per setting → the update
        as a 2-D matrix; unscaled for a single matrix (scaled at the shard, as on one process),
        scaled per block for split / batched views."""
        by_setting: dict[NewtonSchulzSettings, list[tuple[int, int, torch.Tensor]]] = {}
        per_param: list[list[torch.Tensor | None]] = []
        for slot, (i, u) in enumerate(zip(indices, whole)):
            p, group = part[i]
            mats = self._matrix_view(p, group).to_matrices(u.reshape(p.shape))
            per_param.append([None] * len(mats))
            ns = MuonSettings.from_group(group).ns
            for j, mat in enumerate(mats):
                by_setting.setdefault(ns, []).append((slot, j, mat))
        for ns, items in by_setting.items():
            ortho = matrix_step.orthogonalize_matrices(
                [m for _, _, m in items], ns, max_workspace_bytes=self.memory.ns_workspace_bytes
            )
            for (slot, j, _), o in zip(items, ortho):
                per_param[slot][j] = o
        out = []
        for slot, i in enumerate(indices):
            p, group = part[i]
            view, mats = self._matrix_view(p, group), per_param[slot]
            settings = MuonSettings.from_group(group)
            if ROW_MOMENT in kept_state(settings):  # [variants] NorMuon
                self._row_normalize_on_owner(p, group, mats)
            if len(mats) == 1 and view.row_partition is None and not view.transposed:
                out.append(mats[0].reshape(whole[slot].shape))
            else:
                scales = matrix_update_scales(settings.scale, view, settings.qk_lr_scale)
                scaled = [m * s for m, s in zip(mats, scales)]
                out.append(view.from_matrices(scaled).reshape(whole[slot].shape))
        return out

    def _alpha(self, p: torch.Tensor, group: Mapping[str, Any]) -> float:
        """−s(m, n) for an unscaled single-matrix update, −1 for one scaled on the owner."""
        view = self._matrix_view(p, group)
        shapes = view.matrix_shapes
        if len(shapes) == 1 and view.row_partition is None and not view.transposed:
            return -update_scale(group["scale"], *shapes[0])
        return -1.0

    def _per_shard_updates(self, entries, directions):
        """``approximate_per_shard``: NS of each local 2-D shard alone (not Muon's update)."""
        out = {}
        for p, group in entries:
            u = _as_2d(directions[id(p)])
            if u.numel() == 0:
                out[id(p)] = (u, -1.0)
                continue
            (o,) = matrix_step.orthogonalize_matrices(
                [u],
                MuonSettings.from_group(group).ns,
                max_workspace_bytes=self.memory.ns_workspace_bytes,
            )
            out[id(p)] = (o, -update_scale(group["scale"], p.shape[0], math.prod(p.shape[1:])))
        return out
