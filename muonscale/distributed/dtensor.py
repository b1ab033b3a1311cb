"""Exact Muon for DTensor parameters: FSDP2 (``fully_shard``), tensor parallel
(``parallelize_module``), HSDP, and 2-D FSDP × TP meshes.

Meshes and placements are read from the parameters. Per step (``DTensorMuon.step``)::

    grads (DTensor, already reduced by FSDP2 / TP)        every rank, on its local shard
      │  B ← B.lerp(G, 1−μ);  U = G.lerp(B, μ)             elementwise: exact on shards
      ▼
    U shards ──all_to_all──▶ owner: whole U → the matrix step (matrix_step.py)   (exchange.py)
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
With ``state_precision="int8"`` or ``"int4"`` each rank quantizes its shard
(:mod:`.dtensor_state`): the codes are DTensors laid out as the parameter, the scales DTensors
sharded with their rows where every rank holds whole rows, else replicated on the mesh dims
that cut the rows; a block that a shard boundary cuts shares its scale (the maximum of its
pieces' absmax, one all-reduce per step of the cut blocks' maxima, tag ``"block_scales"``),
so the codes and scales are one process's.

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

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .. import functional, matrix_step
from ..declared_state import kept_state, replicated_state
from ..group_step import adamw_group_step
from ..memory import UNCHUNKED
from ..momentum_formats import MOMENTUM_FORMATS
from ..newton_schulz import default_ns_dtype
from ..optimizer import Muon
from ..optimizer_state import parameter_states
from ..quantized_state import ADAMW_MOMENTS, MOMENTUM_KEY, QuantizedMomentum, quantized_momentum
from ..settings import MuonSettings
from ..step_metrics import Reduction
from .agreement import check_same_on_every_rank
from .comm import Communicator, WireCounter, combine_over_ranks
from .dtensor_blocks import ShardBlocks, packed_code_placements
from .dtensor_layout import (
    MatrixUnit,
    as_2d,
    dtensor_layout,
    expert_units,
    local_indices,
    local_tensor,
    parameter_layout,
)
from .dtensor_state import (
    ShardCodes,
    shard_state_codes,
    state_blocks,
    state_keys,
    store_shards_,
    stored_format,
    synced_scales,
    zero_quantized_state,
)
from .exchange import PieceExchange, step_through_exchange
from .setup_checks import check_process_group, is_dtensor
from .sharded import MatrixLayout, default_owners

__all__ = ["DTensorMuon", "dtensor_layout", "local_indices", "local_tensor"]


def _narrower(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The floating dtype of fewer bits (``b`` on a tie)."""
    return a if torch.finfo(a).bits < torch.finfo(b).bits else b


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
    AdamW on shards. Row state (a variant's statistic per row of a matrix) is replicated: the
    owners' row statistics reach every rank in one all-reduce and step every replica.
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
        if approximate_per_shard:
            for k, group in enumerate(self.param_groups):
                muon = group["algorithm"] == "muon"
                kept = muon and kept_state(MuonSettings.from_group(group), variants_only=True)
                if kept:
                    raise ValueError(
                        f"DTensorMuon: param group {k} keeps {kept[0].what}, which the matrix "
                        "step computes from the whole orthogonalized matrix; it cannot be "
                        "combined with approximate_per_shard=True"
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
        self._exchanges: dict[tuple, PieceExchange] = {}
        self._layouts: dict[int, MatrixLayout] = {}
        self._blocks: dict[tuple, dict[str, ShardBlocks]] = {}
        self._mesh_comms: dict[tuple, Communicator] = {}
        check_same_on_every_rank(
            self.comm,
            self._routing_records(),
            who="DTensorMuon",
            fields="algorithm, shape, dtype, matrices, options",
        )
        self._check_layouts()

    def _check_layouts(self) -> None:
        """Fail fast on unsupported placements and meshes, and on quantized state a layout
        cannot keep exact (:func:`~.dtensor_blocks.shard_blocks`)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.matrix_layout(p)
                if self.comm.active:
                    self._state_blocks(p, group)

    def _state_blocks(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, ShardBlocks]:
        """Where this rank's shard of each quantized state tensor of ``p`` lies (cached; empty
        for floating state or a plain tensor)."""
        precision = group.get("state_precision", "param")
        key = (id(p), precision)
        if key not in self._blocks:
            blocks: dict[str, ShardBlocks] = {}
            if precision != "param" and is_dtensor(p):
                muon = group["algorithm"] == "muon"
                view = self._matrix_view(p, group) if muon else None
                for k in state_keys(group):
                    blocks[k] = state_blocks(self._name(p), p, group, view, k)
                    if muon and MOMENTUM_FORMATS[precision].codes_per_byte > 1:
                        packed_code_placements(self._name(p), p, blocks[k])
            self._blocks[key] = blocks
        return self._blocks[key]

    def _shard_codes(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, ShardCodes]:
        """This rank's quantized state tensors of ``p``, by codes key."""
        shape = local_tensor(p).shape
        return shard_state_codes(self.state[p], group, self._state_blocks(p, group), shape)

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
            layout = parameter_layout(
                self._name(p), p, self._group_ranks, self.comm.rank, self.comm.active
            )
            self._layouts[id(p)] = layout
        return layout

    def _exchange(self, units: list[MatrixUnit], dtype: torch.dtype) -> PieceExchange:
        """The exchange of these units' matrices (cached): FLOP-balanced owners, except that an
        expert held whole by one rank is owned by that rank (nothing moves for it)."""
        key = (tuple((id(u.param), u.expert) for u in units), dtype)
        if key not in self._exchanges:
            layouts = [u.layout for u in units]
            costs = [u.view.matrix_shapes for u in units]
            owners = default_owners(layouts, self.comm.world_size, matrix_shapes=costs)
            owners = [owner if u.holder is None else u.holder for u, owner in zip(units, owners)]
            self._exchanges[key] = PieceExchange(
                layouts,
                group=self.process_group,
                owners=owners,
                counter=self.wire_counter,
                tag="muon",
                hosts=self.comm.hosts,
                row_comm=self.comm,
            )
        return self._exchanges[key]

    def _units(self, p: torch.Tensor, group: Mapping[str, Any]) -> list[MatrixUnit]:
        """What the exchange moves for ``p``: its whole matrix, or, for an expert stack whose
        every expert is held whole by one rank (FSDP2 sharding the expert dimension, expert
        parallelism), one unit per expert, owned by that rank."""
        view, layout = self._matrix_view(p, group), self.matrix_layout(p)
        experts = expert_units(p, view, layout)
        if experts is None:
            return [MatrixUnit(p, group, view, layout)]
        return [MatrixUnit(p, group, *unit) for unit in experts]

    def _after_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """New parameter objects: lay them out again (and fail fast on unsupported ones)."""
        self._layouts.clear()
        self._exchanges.clear()
        self._blocks.clear()
        self._check_layouts()

    # ---------------------------------------------------------------- state / checks
    @classmethod
    def _accepts_quantized_state(cls) -> bool:
        """int8 and int4 state are quantized on each rank's shard, cut blocks sharing their
        scales (:mod:`.dtensor_state`); a layout it cannot keep exact is refused at
        construction, naming the parameter."""
        return cls is DTensorMuon

    def _init_state(
        self, p: torch.Tensor, group: Mapping[str, Any], settings: MuonSettings | None = None
    ) -> dict[str, torch.Tensor]:
        """The base class's; the quantized state of a DTensor parameter laid out as its shards
        (:func:`~.dtensor_state.zero_quantized_state`)."""
        state = self.state[p]
        precision = group.get("state_precision", "param")
        muon = group["algorithm"] == "muon"
        if precision != "param" and is_dtensor(p):
            missing = MOMENTUM_FORMATS[precision].scale_key not in state if muon else not state
            if missing:
                blocks = self._state_blocks(p, group)
                state.update(zero_quantized_state(p, group, blocks, self._name(p)))
        return super()._init_state(p, group, settings)

    def state_dict(self) -> dict[str, Any]:
        """The base class's, with the scales of quantized state whose rows a placement cuts
        made whole on every rank (each replica holds exactly the blocks its rank touches:
        :func:`~.dtensor_state.synced_scales`), so that a checkpoint reads one process's
        scales; collective over those parameters' meshes."""
        out = super().state_dict()
        params = [(p, g) for g in self.param_groups for p in g["params"]]
        for index, (p, group) in enumerate(params):
            entry = out["state"].get(index)
            blocks = self._state_blocks(p, group) if entry else {}
            for key, b in blocks.items():
                if b.whole or key not in entry:
                    continue
                scale_key = stored_format(group, key).scale_key
                comms = [self._mesh_comm(p, d) for d in b.replicated_on]
                entry = out["state"][index] = dict(entry)
                entry[scale_key] = synced_scales(entry[scale_key], b, comms)
        return out

    def _mesh_comm(self, p: torch.Tensor, mesh_dim: int) -> Communicator:
        """A communicator of ``p``'s mesh dim ``mesh_dim`` (cached), for checkpoint traffic
        (counted apart from the steps')."""
        mesh = p.device_mesh
        key = (id(mesh), mesh_dim)
        if key not in self._mesh_comms:
            self._mesh_comms[key] = Communicator(mesh.get_group(mesh_dim))
        return self._mesh_comms[key]

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
        cut: list[tuple[Mapping[str, Any], list[dict], list]] = []  # AdamW's cut rows
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["algorithm"] == "muon":
                muon_entries.extend((p, group) for p in params)
            else:
                cut.append((group, *self._adamw_on_shards(group, params, grads)))
        store_shards_(self.comm, [item for _, _, items in cut for item in items])
        if self.step_metrics is not None:
            for group, states, items in cut:
                if states:  # the stored moments' values
                    values = iter(codes.values() for codes, _ in items)
                    read = [
                        {"step": s["step"], "exp_avg": next(values), "exp_avg_sq": next(values)}
                        for s in states
                    ]
                    self.step_metrics.record_adamw(self._group_label(group), group, read)
        if muon_entries:
            metrics = self.step_metrics
            timed = (
                metrics.timed(self.comm.device) if metrics is not None else contextlib.nullcontext()
            )
            with timed:
                self._muon(muon_entries, grads)
        self.last_step_wire_links = self.wire_counter.by_link()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = self.wire_counter.take()
        if self.step_metrics is not None:
            self.step_metrics.add("wire_bytes", self.last_step_wire_bytes, "sum")

    def _metrics_reduction(self) -> Reduction:
        return lambda values, ops: combine_over_ranks(values, ops, self.comm.group)

    def _shard_apply(self, group: Mapping[str, Any]) -> matrix_step.ApplyUpdates:
        """Muon's last pass on local shards; with step metrics, their updates' squares go to
        the group's update RMS (pieces: no orthogonality sample)."""
        if self.step_metrics is None:
            return matrix_step.apply_updates_by_rule_
        label = self._group_label(group)
        return self.step_metrics.metered_apply(label, matrix_step.apply_updates_by_rule_, None)

    def _adamw_on_shards(
        self, group: Mapping[str, Any], params: list[torch.Tensor], grads: Mapping[int, Any]
    ) -> tuple[list[dict], list[tuple[ShardCodes, torch.Tensor]]]:
        """AdamW on the local shards. 8-bit moments whose rows a placement cuts are stepped
        here in float32 (the arithmetic of the quantized step) and returned, (their step
        counters, (codes, new values) per moment), to be stored under the shared scales of
        their cut blocks (:func:`~.dtensor_state.store_shards_`)."""
        if not params:
            return [], []
        states = [self._init_state(p, group) for p in params]
        cut = [not all(b.whole for b in self._state_blocks(p, group).values()) for p in params]
        rows = [(p, s) for p, s, c in zip(params, states, cut) if not c]
        if rows:
            # local shards of the moments (and of 8-bit codes and scales); the same step
            # counters: AdamW increments them in place
            local_states = [{k: local_tensor(v) for k, v in s.items()} for _, s in rows]
            adamw_group_step(
                group,
                [local_tensor(p) for p, _ in rows],
                [local_tensor(grads[id(p)]) for p, _ in rows],
                local_states,
                capturable=False,
                step_ok=None,
                max_chunk_bytes=self.memory.update_chunk_bytes,
            )
            if self.step_metrics is not None:
                self.step_metrics.record_adamw(self._group_label(group), group, local_states)
        held, items = [], []
        beta1, beta2 = group["betas"]
        for p, s, c in zip(params, states, cut):
            if not c:
                continue
            codes = self._shard_codes(p, group)
            moments = [codes[k].values() for k, _, _ in ADAMW_MOMENTS]
            param = local_tensor(p)
            work = param if param.dtype == torch.float32 else param.float()  # rounded once
            functional.adamw(
                [work],
                [local_tensor(grads[id(p)]).float()],
                moments[:1],
                moments[1:],
                [s["step"]],
                lr=float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                max_chunk_bytes=UNCHUNKED,
            )
            if work is not param:
                param.copy_(work)
            held.append(s)
            items.extend((codes[k], m) for (k, _, _), m in zip(ADAMW_MOMENTS, moments))
        return held, items

    def _muon(
        self, entries: list[tuple[torch.Tensor, Mapping[str, Any]]], grads: Mapping[int, Any]
    ) -> None:
        # phase 1: momentum on local shards (elementwise: one foreach per group, for its μ);
        # it lives in stacks per local shard shape, so nothing is stacked per step
        groups = list({id(g): g for _, g in entries}.values())
        local_grads = {id(p): local_tensor(grads[id(p)]) for p, _ in entries}
        momenta: dict[int, torch.Tensor] = {}
        quantized: dict[int, ShardCodes | QuantizedMomentum] = {}
        for group in groups:
            params = [p for p, g in entries if g is group]
            states = [self._init_state(p, group) for p in params]
            if group.get("state_precision", "param") == "param":
                bufs = [local_tensor(b) for b in self._stacked_momentum(group, params, states)]
            else:  # read as float32 values, written back once the directions are out
                for p, s in zip(params, states):
                    quantized[id(p)] = (
                        self._shard_codes(p, group)[MOMENTUM_KEY]
                        if is_dtensor(p)
                        else quantized_momentum(s, self._matrix_view(p, group))
                    )
                bufs = [quantized[id(p)].values() for p in params]
            functional.update_momentum_(
                [local_grads[id(p)] for p in params], bufs, momentum=group["momentum"]
            )
            momenta.update((id(p), b) for p, b in zip(params, bufs))

        # phase 2: directions U → whole matrices at owners → the matrix step → update pieces back
        if self.approximate_per_shard:
            directions = {id(p): torch.empty_like(local_grads[id(p)]) for p, _ in entries}
            self._write_directions(entries, local_grads, momenta, directions)
            self._store_quantized(entries, momenta, quantized)
            updates = self._per_shard_updates(entries, directions)
        else:
            updates = {}
            for dtype in sorted({local_grads[id(p)].dtype for p, _ in entries}, key=str):
                part = [(p, g) for p, g in entries if local_grads[id(p)].dtype == dtype]
                units = [u for p, g in part for u in self._units(p, g)]
                exchange = self._exchange(units, dtype)
                result_dtype = self._result_dtype(part, dtype)
                # U written straight where the all-to-all sends it from (no packing copy), in
                # Newton–Schulz's dtype where that is narrower: the owner's first step casts
                # the whole U to it, so the cast moves before the wire with the same bits
                wire_dtype = _narrower(result_dtype, dtype)
                device = local_grads[id(part[0][0])].device
                packed, pieces = exchange.piece_buffer(wire_dtype, device)
                self._write_unit_directions(part, units, pieces, local_grads, momenta)
                self._store_quantized(part, momenta, quantized)
                out = step_through_exchange(
                    exchange,
                    pieces,
                    lambda idx, mats, units=units: self._owner_step(units, idx, mats),
                    [u.replicas(self._replicas(u.param, u.group)) for u in units],
                    [MuonSettings.from_group(u.group) for u in units],
                    result_dtype=result_dtype,
                    packed=packed,
                )
                for p, _ in part:
                    mine = [o for u, o in zip(units, out) if u.param is p]
                    updates[id(p)] = (
                        mine[0] if len(mine) == 1 else torch.cat([o.reshape(-1) for o in mine])
                    )

        # phase 3: weight decay and update on local shards, per group for its lr / λ, each
        # with the rule it is applied with (the same on every rank)
        for group in groups:
            params = [p for p, g in entries if g is group]
            shards = [local_tensor(p) for p in params]
            self._shard_apply(group)(
                shards,
                [updates[id(p)].reshape(x.shape) for p, x in zip(params, shards)],
                [self._apply_rule(p, group) for p in params],
                lr=float(group["lr"]),
                weight_decay=group["weight_decay"],
            )

    def _store_quantized(
        self, entries, momenta: dict[int, torch.Tensor], quantized: Mapping[int, Any]
    ) -> None:
        """Quantize the new momentum of the quantized ``entries`` (their directions written),
        as one process quantizes it (cut blocks under their shared scales: one all-reduce),
        and drop its float32 values (before the exchange)."""
        shards = []
        for p, _ in entries:
            if id(p) not in quantized:
                continue
            held, values = quantized[id(p)], momenta.pop(id(p))
            if isinstance(held, ShardCodes):
                shards.append((held, values))
            else:  # a plain parameter, the same on every rank
                held.store_(values)
        store_shards_(self.comm, shards)

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

    def _write_unit_directions(self, part, units, pieces, grads, momenta) -> None:
        """U of every parameter of ``part`` into the exchange's piece buffers: straight into a
        whole parameter's piece, through one scratch tensor for an expert stack's units (each
        takes its rows of the local shard)."""
        split = {id(u.param) for u in units if u.expert is not None}
        direct = {id(u.param): x for u, x in zip(units, pieces) if u.expert is None}
        scratch = {id(p): torch.empty_like(grads[id(p)]) for p, _ in part if id(p) in split}
        self._write_directions(part, grads, momenta, {**direct, **scratch})
        for u, x in zip(units, pieces):
            if u.expert is not None and x.numel():
                x.copy_(as_2d(scratch[id(u.param)])[u.local_rows])

    def _owner_step(
        self, units: list[MatrixUnit], indices: list[int], whole: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[dict]]:
        """On the owner: the matrix step of whole matrices (2-D U → the parameter's, or the
        expert's, stored shape and view → :func:`~muonscale.matrix_step.parameter_updates`), as
        2-D matrices, and their row statistics, from which every rank steps its replicas after
        the exchange."""
        chosen = [units[i] for i in indices]
        updates, _, stats = matrix_step.parameter_updates(
            [x.reshape(u.shape) for u, x in zip(chosen, whole)],
            [u.view for u in chosen],
            [MuonSettings.from_group(u.group) for u in chosen],
            [u.replicas(self._replicas(u.param, u.group)) for u in chosen],
            step_row_state=False,  # replicas: every rank steps its own after the exchange
            max_workspace_bytes=self.memory.ns_workspace_bytes,
        )
        return [o.reshape(x.shape) for o, x in zip(updates, whole)], stats

    def _replicas(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict:
        """This rank's replicas of ``p``'s replicated row states (whole rows, by declaration)."""
        return replicated_state(self.state[p], MuonSettings.from_group(group))

    def _apply_rule(self, p: torch.Tensor, group: Mapping[str, Any]) -> matrix_step.ApplyRule:
        """The rule ``p``'s update is applied with (the same on every rank)."""
        settings = MuonSettings.from_group(group)
        if self.approximate_per_shard:
            return matrix_step.unscaled_apply_rule(settings, (p.shape[0], math.prod(p.shape[1:])))
        return matrix_step.apply_rule(self._matrix_view(p, group), settings)

    def _result_dtype(self, part, dtype: torch.dtype) -> torch.dtype:
        """Newton–Schulz's output dtype when all groups agree (bf16 on GPU halves the return
        traffic; adding it to the parameter promotes exactly as on one process)."""
        ns = {
            MuonSettings.from_group(g).ns_dtype or default_ns_dtype(local_tensor(p).device)
            for p, g in part
        }
        return ns.pop() if len(ns) == 1 else dtype

    def _per_shard_updates(self, entries, directions) -> dict[int, torch.Tensor]:
        """``approximate_per_shard``: NS of each local 2-D shard alone (not Muon's update)."""
        out = {}
        for p, group in entries:
            u = as_2d(directions[id(p)])
            if u.numel() == 0:
                out[id(p)] = u
                continue
            (out[id(p)],) = matrix_step.orthogonalize_matrices(
                [u],
                MuonSettings.from_group(group).ns,
                max_workspace_bytes=self.memory.ns_workspace_bytes,
            )
        return out
