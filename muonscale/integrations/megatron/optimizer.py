"""The optimizers :func:`megatron_muon` builds (see the package docstring). Each owns its
collaborators: a :class:`~.grad_norm.GlobalGradNorm` and an orthogonalizer (by default
:class:`~.tensor_parallel.TensorParallelOrthogonalizer`) that turns momentum into updates."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muonscale.declared_state import replicated_declarations
from muonscale.distributed.comm import Communicator, WireCounter, combine_over_ranks
from muonscale.distributed.data_parallel import AgreedGradients, DistributedMuon
from muonscale.distributed.data_parallel.quantized_shards import ColumnPlacement
from muonscale.matrix_step import ApplyUpdates
from muonscale.optimizer import Muon
from muonscale.params import RouteDecision
from muonscale.quantized_state import MOMENTUM_KEY
from muonscale.settings import MuonSettings
from muonscale.step_metrics import Reduction

from .column_checkpoint import ColumnCheckpoints
from .config import MegatronMuonConfig, muon_arguments
from .grad_norm import GlobalGradNorm
from .low_bit import SharedColumnScales, refuse_cut_rows
from .main_params import MainParams
from .plan import MegatronGroups, ParamPlan
from .row_state import RowStateEntry, TensorParallelMatrices, held_row_state
from .tensor_parallel import MuonGroupStep, Orthogonalizer, TensorParallelOrthogonalizer


class MegatronMuon(Muon):
    """:class:`muonscale.Muon` on Megatron-Core parameters, every data-parallel replica running
    the same step (``dp_mode="replicated"``). Gradients come reduced from Megatron's DDP
    (``main_grad``) or are averaged here with one all-reduce per group. Build with
    :func:`megatron_muon`.

    One step: gradients (``main_grad`` or ``.grad``) → fp32 main copies of bf16 parameters
    (``main_params_dtype``) → data-parallel mean (unless already reduced) → global norm over
    all ranks (one 8-byte all-reduce; clipped when ``clip_grad > 0``; every rank skips or raises
    together on a NaN/inf anywhere) → Muon (exact TP) / AdamW → main copies written back.

    Args:
        plans, groups, config: from :func:`megatron_muon`.
        orthogonalizer: momentum directions → scaled updates (default: a
            :class:`TensorParallelOrthogonalizer` counting into ``wire_counter``).
        wire_counter: where every collective's bytes are counted (default: a new one).

    Attributes:
        plans: one :class:`ParamPlan` per parameter (``param``: the tensor the optimizer updates,
            a main copy or the model's parameter).
        main_params: the :class:`MainParams` (model tensors and their main copies).
        last_grad_norm: global gradient norm of the latest step, before clipping.
        wire_counter: bytes this rank sent, by ``"<tag>/<op>"`` (``"muon_tp"``: the TP
            all-to-alls, ``"grads"``: data-parallel gradient averaging, ``"grad_norm"``).
        last_step_wire_bytes, last_step_wire_breakdown: the latest step's total and breakdown.
    """

    dp_mode = "replicated"

    def __init__(
        self,
        plans: Sequence[ParamPlan],
        groups: MegatronGroups,
        config: MegatronMuonConfig,
        *,
        orthogonalizer: Orthogonalizer | None = None,
        wire_counter: WireCounter | None = None,
    ) -> None:
        self.main_params = MainParams(plans, config.main_params_dtype)
        self.config, self.groups, self.plans = config, groups, list(self.main_params.plans)
        self._plan_by_id = {id(pl.param): pl for pl in self.plans}
        self.wire_counter = wire_counter if wire_counter is not None else WireCounter()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = 0, {}
        self.tp_matrices = TensorParallelMatrices(groups, config)
        param_groups, options = muon_arguments(self.plans, config)
        precision = options.get("state_precision", "param")
        refuse_cut_rows(self.plans, param_groups, precision, zero1=False)
        self.column_scales = SharedColumnScales(groups, self.wire_counter)
        self.column_checkpoints = ColumnCheckpoints(
            self.column_scales, self._matrix_view, self._plan_of
        )
        super().__init__(param_groups, **options)
        self.muon_step = MuonGroupStep(
            self.column_scales, self._matrix_view, self._plan_of, self._stacked_momentum
        )
        self.routing = {pl.name: RouteDecision(pl.algorithm, pl.reason) for pl in self.plans}
        self.orthogonalizer = orthogonalizer or TensorParallelOrthogonalizer(
            groups, config, counter=self.wire_counter, memory=self.memory
        )
        self.grad_norm = GlobalGradNorm(
            self.plans,
            groups,
            counter=self.wire_counter,
            dp_replicated=True,
            nonfinite=config.nonfinite,
        )
        has_main_grad = any(hasattr(p, "main_grad") for p in self.main_params.model_params)
        self.grads_reduced = has_main_grad if config.grads_reduced is None else config.grads_reduced
        if not self.grads_reduced:
            check_self_reduction(plans, groups)

    @classmethod
    def _accepts_quantized_state(cls) -> bool:
        """Quantized on each rank's piece: alone where it holds whole rows, with the scales of
        the blocks it shares taken over its TP group where it holds columns (:mod:`.low_bit`)."""
        return cls is MegatronMuon

    def _average_grads(self) -> None:
        """Mean of ``.grad`` over the data-parallel group (dense) and the expert-data group
        (experts), one flat all-reduce per (group, dtype)."""
        buckets: dict[tuple[bool, torch.dtype], list[torch.Tensor]] = {}
        for pl in self.plans:
            if pl.param.grad is not None:
                buckets.setdefault((pl.expert, pl.param.grad.dtype), []).append(pl.param.grad)
        for (expert, _dtype), grads in buckets.items():
            comm = Communicator(
                self.groups.expt_dp if expert else self.groups.dp, counter=self.wire_counter
            )
            if comm.world_size == 1:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, tag="grads")
            flat.div_(comm.world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def _check_gradients(self, grads: Mapping[int, torch.Tensor]) -> str | None:
        """Muon.step's check, made global: one all-reduce of ‖g‖² over every rank (clipping
        included), so that all ranks agree on a non-finite gradient anywhere (``grads``: the
        parameters' own, read here through the plans)."""
        owners = [pl for pl in self.plans if pl.param.grad is not None]
        for pl in owners:
            if pl.param.grad.is_sparse:
                raise ValueError(f"parameter '{pl.name}' has a sparse gradient; Muon needs dense")
        return self.grad_norm.norm_and_clip_(
            [pl.param.grad for pl in owners], owners, self.config.clip_grad
        )

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm of the latest step, before clipping."""
        return self.grad_norm.last_norm

    def _update_group(
        self,
        group: Mapping[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        *,
        step_ok: torch.Tensor | None = None,
        apply_updates: ApplyUpdates | None = None,
    ) -> None:
        """AdamW as :class:`muonscale.Muon` (the 8-bit moments of column pieces with their
        shared scales); Muon through the orthogonalizer."""
        if group["algorithm"] != "muon" or not params:
            return self._adamw_update(group, params, grads, step_ok)
        if apply_updates is not None:  # the orthogonalizer applies its own updates
            raise NotImplementedError("the Megatron Muon step takes no apply_updates")
        states = [self._init_state(p, group) for p in params]
        label, metrics = self._group_label(group), self.step_metrics
        self.muon_step.step_(group, params, grads, states, self.orthogonalizer, metrics, label)

    def _adamw_update(
        self,
        group: Mapping[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        step_ok: torch.Tensor | None,
    ) -> None:
        """AdamW: :class:`muonscale.Muon`'s step, and the quantized column pieces' through
        :meth:`SharedColumnScales.adamw_step_ <.low_bit.SharedColumnScales.adamw_step_>`."""
        quantized = group.get("state_precision", "param") != "param"
        columns = [
            quantized and self.column_scales.adamw_blocks(self._plan_of(p)) is not None
            for p in params
        ]
        if not any(columns):
            return super()._update_group(group, params, grads, step_ok=step_ok)
        rest = [(p, g) for p, g, c in zip(params, grads, columns) if not c]
        super()._update_group(group, [p for p, _ in rest], [g for _, g in rest], step_ok=step_ok)
        mine = [(p, g) for p, g, c in zip(params, grads, columns) if c]
        pieces = [p for p, _ in mine]
        stored = self.column_scales.adamw_step_(
            group,
            pieces,
            [g for _, g in mine],
            [self._init_state(p, group) for p in pieces],
            [self._plan_of(p) for p in pieces],
            self.memory.update_chunk_bytes,
        )
        if self.step_metrics is not None:
            kept = [v for p, v in zip(pieces, stored) if self._counts_update(p)]
            self.step_metrics.record_adamw(self._group_label(group), group, kept)

    def _begin_step(self) -> Sequence[Any]:
        """Gradients into the main copies, averaged over data parallel unless reduced."""
        work = super()._begin_step()
        self.main_params.load_grads()
        if not self.grads_reduced:
            self._average_grads()
        return work

    def _apply_updates(self, grads, from_backward=(), step_ok=None) -> None:
        """:meth:`muonscale.Muon._apply_updates`, then the main copies written back."""
        super()._apply_updates(grads, from_backward, step_ok)
        self.main_params.write_back()

    def _end_step(self) -> None:
        super()._end_step()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = self.wire_counter.take()
        if self.step_metrics is not None:
            self.step_metrics.add("wire_bytes", self.last_step_wire_bytes, "sum")

    def _logical_numel(self, p: torch.Tensor) -> int:
        return whole_numel(self._plan_of(p), p)

    def _metrics_reduction(self) -> Reduction:
        return world_reduction

    def _counts_update(self, p: torch.Tensor) -> bool:
        return counted_on_this_tp_rank(self._plan_of(p), self.groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the optimizer's tensors and of the model's bf16 parameters
        (Megatron DDP's ``main_grad`` buffers are cleared by ``model.zero_grad_buffer()``)."""
        super().zero_grad(set_to_none=set_to_none)
        self.main_params.zero_model_grads(set_to_none)

    def _init_state(
        self, p: torch.Tensor, group: Mapping[str, Any], settings: MuonSettings | None = None
    ) -> dict[str, torch.Tensor]:
        """Muon's state; its row states hold the whole matrices' rows (:mod:`.row_state`), and
        a quantized column piece's scales are per block it touches (:mod:`.low_bit`)."""
        state = self.state[p]
        muon = group["algorithm"] == "muon"
        if muon:
            settings = settings if settings is not None else MuonSettings.from_group(group)
            for spec in replicated_declarations(settings):
                if spec.key not in state:
                    state[spec.key] = self.tp_matrices.row_state_zeros(
                        self._matrix_view(p, group),
                        self._plan_of(p),
                        spec.dtype(settings, p.dtype),
                        p.device,
                    )
        state = super()._init_state(p, group, settings)
        if group.get("state_precision", "param") != "param":
            view = self._matrix_view(p, group) if muon else None
            self.column_scales.shape_state_(state, self._plan_of(p), group, view)
        return state

    def _plan_of(self, p: torch.Tensor) -> ParamPlan:
        return self._plan_by_id[id(p)]

    def _row_state_entries(self) -> list[RowStateEntry]:
        return self.tp_matrices.entries(
            self.param_groups, self.state, self._matrix_view, self._plan_of
        )

    def state_dict(self) -> dict[str, Any]:
        """Muon's state dict plus the main copies (``"main_params"``). Per rank: a TP rank's
        state is its shard's (its own rows of the row state), so load it at the same TP
        size."""
        packed = super().state_dict()
        self.tp_matrices.saved_state_(packed, self.param_groups, self._matrix_view, self._plan_of)
        packed["main_params"] = self.main_params.state_dict()
        return packed

    def state_dict_in_precision(self, state_precision: str) -> dict[str, Any]:
        """:meth:`muonscale.Muon.state_dict_in_precision`; a column piece's state converts here
        (its blocks are shared with the other TP ranks: :mod:`.column_checkpoint`), collective
        over each TP group when it is quantized."""
        return self.column_checkpoints.in_precision(
            self.state_dict(), self.param_groups, state_precision
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`muonscale.Muon.load_state_dict` with the main copies and the row state
        (collective over each TP group); a column piece loads the state saved at this layout,
        converted as one process converts it (:mod:`.column_checkpoint`)."""
        state_dict = dict(state_dict)
        main = state_dict.pop("main_params", None)
        if self.main_params.copied and main is None:
            raise ValueError(
                "this optimizer keeps main copies of low-precision parameters but the checkpoint "
                "has no 'main_params' (saved with main_params_dtype=None?)"
            )
        state_dict["state"] = dict(state_dict["state"])  # column pieces' entries replaced
        aside = self.column_checkpoints.set_aside_(state_dict, self.param_groups)
        super().load_state_dict(state_dict)
        # collective over each TP group where a column piece is quantized from another precision
        self.column_checkpoints.put_back_(self.state, self.param_groups, aside)
        # collective over each TP group: the row state's rows of every TP rank
        self.tp_matrices.to_whole_(self._row_state_entries(), WireCounter())
        if main is not None:
            self.main_params.load_state_dict(main)


class MegatronDistributedMuon(DistributedMuon):
    """:class:`muonscale.DistributedMuon` over Megatron's data-parallel group
    (``dp_mode="zero1"``): gradients reduce-scattered to owner ranks during backward, each Muon
    matrix updated by one DP rank (its TP pieces exchanged exactly within that rank's TP group),
    AdamW sharded ZeRO-1, parameters all-gathered. Do not wrap the model in Megatron's DDP.
    With ``main_params_dtype`` (bf16 models), each rank keeps main copies of what it updates
    only (owned matrices, AdamW shards), as Megatron's distributed optimizer; the all-gather
    sends bf16. ``state_dict()`` is the full state over data parallel (collective; main copies
    included), so a checkpoint loads at another data-parallel size (same TP size); the row
    state is saved and loaded as :class:`MegatronMuon`'s (:mod:`.row_state`), and so is a
    quantized column piece's momentum (its scales per block it touches, shared over the TP
    group: :mod:`.low_bit`, :mod:`.column_checkpoint`), so that the two modes' checkpoints load
    into each other.

    ``data_group`` (default: Megatron's data-parallel group) is the group it shards over: the
    expert-data group for the expert half of :class:`~.expert_zero1.MegatronExpertZero1`,
    which also computes the global gradient norm for both halves (``external_grad_norm``:
    ``step()`` neither computes nor clips it, and reads ``grad_norm.last_norm`` as set)."""

    dp_mode = "zero1"

    def __init__(
        self,
        plans: Sequence[ParamPlan],
        groups: MegatronGroups,
        config: MegatronMuonConfig,
        *,
        orthogonalizer: Orthogonalizer | None = None,
        wire_counter: WireCounter | None = None,
        data_group: dist.ProcessGroup | None = None,
        external_grad_norm: bool = False,
        **dp_options: Any,
    ) -> None:
        self.config, self.groups, self.plans = config, groups, list(plans)
        self._plan_by_id = {id(pl.param): pl for pl in self.plans}
        self.wire_counter = wire_counter if wire_counter is not None else WireCounter()
        param_groups, options = muon_arguments(self.plans, config)
        if dp_options.pop("gather_updates", None):  # its Muon step runs in the orthogonalizer
            raise ValueError(
                "MegatronDistributedMuon gathers the updated parameters: gather_updates must be "
                "None or False"
            )
        precision = options.get("state_precision", "param")
        refuse_cut_rows(self.plans, param_groups, precision, zero1=True)
        self.column_scales = SharedColumnScales(groups, self.wire_counter)
        self.external_grad_norm = external_grad_norm
        super().__init__(
            param_groups,
            process_group=groups.dp if data_group is None else data_group,
            gather_updates=False,
            main_params_dtype=config.main_params_dtype,
            wire_counter=self.wire_counter,
            **options,
            **dp_options,
        )
        self.routing = {pl.name: RouteDecision(pl.algorithm, pl.reason) for pl in self.plans}
        self.tp_matrices = TensorParallelMatrices(groups, config)
        for state, view, plan in self._row_state_entries():  # the owners': the whole rows
            for key in held_row_state(state):
                held = state[key]
                state[key] = self.tp_matrices.row_state_zeros(view, plan, held.dtype, held.device)
        self.column_checkpoints = ColumnCheckpoints(
            self.column_scales, self._matrix_view, self._plan_of
        )
        self.muon_step = MuonGroupStep(
            self.column_scales, self._matrix_view, self._plan_of, self._stacked_momentum
        )
        for p, group in self._owned_muon():  # a column piece's scales: per block it touches
            self.column_scales.shape_state_(
                self.state[p], self._plan_of(p), group, self._matrix_view(p, group)
            )
        self.orthogonalizer = orthogonalizer or TensorParallelOrthogonalizer(
            groups, config, counter=self.wire_counter, memory=self.memory
        )
        self.grad_norm = GlobalGradNorm(
            self.plans,
            groups,
            counter=self.wire_counter,
            dp_replicated=False,
            nonfinite=config.nonfinite,
        )

    @property
    def last_grad_norm(self) -> float | None:
        """Global gradient norm of the latest step, before clipping."""
        return self.grad_norm.last_norm

    @classmethod
    def _accepts_quantized_state(cls) -> bool:
        """The owners' Muon momentum, whole TP pieces: alone where a piece holds whole rows,
        with the scales of the blocks it shares taken over its TP group (whose ranks own the
        same matrices) where it holds columns; AdamW's flat shards with their cut blocks'
        scales shared over data parallel, a TP-sharded bias's blocks the whole bias's (shared
        over data parallel, then TP). An AdamW piece of several rows that holds columns of them
        is refused at construction, naming the parameter (:mod:`.low_bit`)."""
        return cls is MegatronDistributedMuon

    def _owned_muon(self) -> list[tuple[torch.Tensor, Mapping[str, Any]]]:
        """(parameter, group) of each Muon parameter whose momentum this rank holds."""
        return [
            (p, group)
            for group in self.param_groups
            if group["algorithm"] == "muon"
            for p in group["params"]
            if MOMENTUM_KEY in self.state.get(p, {})
        ]

    def _column_placement(self, p: torch.Tensor) -> ColumnPlacement | None:
        """A TP-sharded bias whose blocks other TP ranks share: its place in the whole bias."""
        return self.column_scales.placement(self._plan_of(p))

    def _held_state_shape(
        self, p: torch.Tensor, group: Mapping[str, Any], key: str, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        """A column piece's quantized momentum scales are (rows, blocks it touches)."""
        precision = group.get("state_precision", "param")
        view = self._matrix_view(p, group)
        for tensor in self.column_scales.tensors(self._plan_of(p), "muon", precision, view):
            if tensor.scale_key == key:
                return (shape[0], len(tensor.blocks.blocks))
        return shape

    def _logical_numel(self, p: torch.Tensor) -> int:
        return whole_numel(self._plan_of(p), p)

    def _metrics_reduction(self) -> Reduction:
        return world_reduction  # the data-parallel group's ranks and their TP pieces

    def _counts_update(self, p: torch.Tensor) -> bool:
        return counted_on_this_tp_rank(self._plan_of(p), self.groups)

    def _plan_of(self, p: torch.Tensor) -> ParamPlan:
        return self._plan_by_id[id(self.model_param(p))]

    def _row_state_entries(self) -> list[RowStateEntry]:
        return self.tp_matrices.entries(
            self.param_groups, self.state, self._matrix_view, self._plan_of
        )

    def _gather_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """The full state over data parallel, with each TP rank's own rows of the row state."""
        entries = self._row_state_entries()
        wholes = self.tp_matrices.to_rank_rows_(entries)
        try:
            return super()._gather_state()
        finally:
            self.tp_matrices.restore_(entries, wholes)

    def state_dict_in_precision(self, state_precision: str) -> dict[str, Any]:
        """As :meth:`MegatronMuon.state_dict_in_precision`: the full state over data parallel,
        a column piece's converted under its TP group's shared maxima (collective)."""
        return self.column_checkpoints.in_precision(
            self.state_dict(), self.param_groups, state_precision
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`DistributedMuon.load_state_dict` with the column pieces' state as
        :class:`MegatronMuon` loads it (:mod:`.column_checkpoint`; collective over each TP
        group where it converts): an AdamW piece's converted to this optimizer's precision
        first (its segments take the blocks it touches), a Muon piece's set aside and put
        back at its owners; then the row state's rows of every TP rank gathered into the whole
        replica (collective over each TP group)."""
        state_dict = {**state_dict, "state": dict(state_dict["state"])}  # entries replaced
        self.column_checkpoints.converted_(state_dict, self.param_groups, algorithms=("adamw",))
        aside = self.column_checkpoints.set_aside_(state_dict, self.param_groups, ("muon",))
        entries = self._row_state_entries()
        wholes = self.tp_matrices.to_rank_rows_(entries)  # the shape a checkpoint holds
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            self.tp_matrices.restore_(entries, wholes)
            raise
        owned = {id(p) for p, _ in self._owned_muon()}  # the owners hold the momentum
        aside = {key: held for key, held in aside.items() if key in owned}
        self.column_checkpoints.put_back_(self.state, self.param_groups, aside)
        self.tp_matrices.to_whole_(self._row_state_entries(), WireCounter())

    def _update_group(
        self,
        group: Mapping[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        *,
        step_ok: torch.Tensor | None = None,
        apply_updates: ApplyUpdates | None = None,
    ) -> None:
        """AdamW as :class:`muonscale.Muon`; Muon (owned matrices or their main copies) through
        the orthogonalizer."""
        if group["algorithm"] != "muon" or not params:
            return super()._update_group(group, params, grads, step_ok=step_ok)
        if apply_updates is not None:  # the orthogonalizer applies its own updates
            raise NotImplementedError("the Megatron Muon step takes no apply_updates")
        states = [self._init_state(p, group) for p in params]
        label, metrics = self._group_label(group), self.step_metrics
        self.muon_step.step_(group, params, grads, states, self.orthogonalizer, metrics, label)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients by the global L2 norm over data *and* tensor parallel
        ranks (each gradient element counted once); returns the norm. Collective."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 under tensor parallelism, got {norm_type!r}")
        grads, owners = self.held_reduced_grads()
        self.grad_norm.norm_and_clip_(grads, owners, max_norm)
        return torch.tensor(self.last_grad_norm)

    def held_reduced_grads(self) -> tuple[list[torch.Tensor], list[ParamPlan]]:
        """The reduced gradients this rank holds (its owned matrices, its AdamW shards) and
        their plans; reductions still in flight are finished first."""
        self.reduction.finish()
        held = [(i, g) for i, g in self.reduction.local_reduced_grads().items() if g.numel()]
        return [g for _, g in held], [self._plan_by_id[id(self.params[i])] for i, _ in held]

    def _begin_step(self) -> Sequence[Any]:
        """Global norm (and clipping, ``clip_grad > 0``) over all ranks first, unless an
        ``external_grad_norm`` computed it."""
        work = super()._begin_step()
        if not self.external_grad_norm:
            self.grad_norm.last_norm = None
            self.clip_grad_norm_(self.config.clip_grad)
        return work

    def _step_gradients(self) -> AgreedGradients:
        """Agreed over data parallel; a NaN/inf on another tensor-parallel rank (seen in the
        global norm) is non-finite here too."""
        agreed = super()._step_gradients()
        norm = self.last_grad_norm
        if agreed.nonfinite is None and self.nonfinite != "ignore" and norm is not None:
            if not math.isfinite(norm):
                return AgreedGradients(
                    agreed.present, "(a parameter on another tensor-parallel rank)"
                )
        return agreed


def whole_numel(plan: ParamPlan, p: torch.Tensor) -> int:
    """Elements of the whole parameter whose TP piece ``p`` is (its step metrics' count)."""
    return p.numel() * (plan.tp_size if plan.partition_dim is not None else 1)


def counted_on_this_tp_rank(plan: ParamPlan, groups: MegatronGroups) -> bool:
    """A TP-sharded parameter's piece counts on every TP rank, a replicated one on the first
    (so that the update RMS summed over ranks weighs every element once per replica)."""
    if plan.partition_dim is not None:
        return True
    group = groups.expt_tp if plan.expert else groups.tp
    return group is None or dist.get_rank(group) == 0


def world_reduction(values: torch.Tensor, ops: Sequence[str]) -> torch.Tensor:
    """The step metrics over every rank (TP pieces and data-parallel replicas or owners)."""
    return combine_over_ranks(values, ops, None)


def check_self_reduction(plans: Sequence[ParamPlan], groups: MegatronGroups) -> None:
    """Refuse layouts whose gradients need more than a data-parallel average."""
    if groups.pp_size > 1:
        raise NotImplementedError(
            "pipeline parallelism without Megatron's gradient reduction: the tied embedding's "
            "gradient crosses stages; wrap the model in Megatron's DDP and call "
            "finalize_model_grads (then the optimizer reads main_grad)"
        )
    for pl in plans:
        if getattr(pl.param, "sequence_parallel", False):
            raise NotImplementedError(
                f"{pl.name}: sequence parallelism without Megatron's gradient reduction (norm "
                "gradients need a TP all-reduce, done by Megatron's finalize_model_grads)"
            )
