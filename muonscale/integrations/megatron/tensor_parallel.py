"""Exact tensor-parallel Muon: each TP-sharded matrix is orthogonalized whole at one owner rank
of its TP group (one all-to-all there, one back), never per shard unless asked by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muonscale import functional
from muonscale.distributed.comm import WireCounter
from muonscale.distributed.sharded import MatrixLayout, ShardedMatrices
from muonscale.params import RouteDecision
from muonscale.scaling import update_scale

from .config import MegatronMuonConfig
from .plan import MegatronGroups, ParamPlan


def _muon_arguments(
    plans: Sequence[ParamPlan], config: MegatronMuonConfig
) -> tuple[list[dict], dict[str, Any]]:
    """Param groups (routing pinned by the plan) and :class:`muonscale.Muon` options."""
    muon = [(pl.name, pl.param) for pl in plans if pl.algorithm == "muon"]
    adamw = [(pl.name, pl.param) for pl in plans if pl.algorithm == "adamw"]
    param_groups = []
    if muon:
        param_groups.append({"params": muon, "algorithm": "muon"})
    if adamw:
        param_groups.append({"params": adamw, "algorithm": "adamw"})
    options = dict(
        lr=config.lr, momentum=config.muon_momentum, nesterov=config.muon_nesterov,
        weight_decay=config.weight_decay, ns_steps=config.muon_num_ns_steps,
        coefficients=config.coefficients, scale=config.scale, ns_dtype=config.ns_dtype,
        adamw_lr=config.adam_lr, adamw_betas=(config.adam_beta1, config.adam_beta2),
        adamw_eps=config.adam_eps, adamw_weight_decay=config.adam_weight_decay,
        nonfinite=config.nonfinite, qkv_split=config.qkv_split,
        splits={pl.name: pl.qkv_layout for pl in plans if pl.qkv_layout is not None},
    )  # fmt: skip
    return param_groups, options


class _TensorParallelMatrices:
    """Mixin over :class:`muonscale.Muon` (or a subclass): the Muon update of
    :meth:`update_group` orthogonalizes each TP-sharded matrix whole, through one
    :class:`ShardedMatrices` exchange per TP group (dense and expert)."""

    config: MegatronMuonConfig
    groups: MegatronGroups
    plans: list[ParamPlan]

    def _init_megatron(
        self, plans: Sequence[ParamPlan], groups: MegatronGroups, config: MegatronMuonConfig
    ) -> None:
        self.config, self.groups, self.plans = config, groups, list(plans)
        self._plan_by_id = {id(pl.param): pl for pl in self.plans}
        self._exchanges: dict[tuple, ShardedMatrices] = {}

    def _finish_megatron_init(self) -> None:
        self.routing = {pl.name: RouteDecision(pl.algorithm, pl.reason) for pl in self.plans}

    def _tp_wire_counter(self) -> WireCounter:
        comm = getattr(self, "comm", None)  # DistributedMuon counts every collective in comm
        return comm.counter if comm is not None else self.wire_counter

    def _tp_group(self, expert: bool) -> dist.ProcessGroup | None:
        return self.groups.expt_tp if expert else self.groups.tp

    def update_group(
        self, group: Mapping[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> None:
        if group["algorithm"] != "muon" or not params:
            return super().update_group(group, params, grads)  # type: ignore[misc]
        states = [self.init_state(p, group) for p in params]  # type: ignore[attr-defined]
        directions = functional.momentum_directions_(
            grads,
            [s["momentum_buffer"] for s in states],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
        )
        exact = self.config.muon_tp_mode == "exact"
        # Every matrix joins the exchange of its TP group (dense or expert): a TP piece with its
        # global layout, or a matrix this rank holds whole (replicated layout: computed here).
        batches: dict[bool, list[tuple[torch.Tensor, MatrixLayout]]] = {False: [], True: []}
        slots: list[list[tuple[bool, int, tuple[int, int]]]] = []
        for p, direction in zip(params, directions):
            model_param = getattr(self, "model_param", None)  # a main copy's model parameter
            plan = self._plan_by_id[id(p if model_param is None else model_param(p))]
            kind = plan.expert
            group_size = MegatronGroups.size(self._tp_group(kind))
            # A head of a QKV split lies whole on one rank; Q, K, V blocks are dim-0 pieces.
            sharded = plan.partition_dim is not None and not (
                plan.qkv_layout is not None and self.config.qkv_split == "head"
            )
            entries = []
            for mat in self.matrix_view(p, group).to_matrices(direction):  # type: ignore[attr-defined]
                m, n = mat.shape
                full = (m, n)
                if sharded:
                    full = (
                        (m * plan.tp_size, n) if plan.partition_dim == 0 else (m, n * plan.tp_size)
                    )
                if sharded and exact:
                    sizes = [full[plan.partition_dim] // plan.tp_size] * plan.tp_size
                    layout = MatrixLayout.sharded(full, plan.partition_dim, sizes)
                else:  # whole here, or approximate_blockwise: NS on this rank's piece
                    layout = MatrixLayout.replicated((m, n), group_size)
                entries.append((kind, len(batches[kind]), full))
                batches[kind].append((mat.contiguous(), layout))
            slots.append(entries)

        ns = dict(
            ns_steps=group["ns_steps"],
            coefficients=group["coefficients"],
            ns_dtype=group["ns_dtype"],
            eps=group["ns_eps"],
            max_workspace_bytes=self.memory.ns_workspace_bytes,
        )

        def orthogonalize(_indices: list[int], matrices: list[torch.Tensor]) -> list[torch.Tensor]:
            return functional.orthogonalize_matrices(matrices, **ns)

        results: dict[bool, list[torch.Tensor]] = {}
        for kind, items in batches.items():
            if not items:
                continue
            tp_group = self._tp_group(kind)
            if MegatronGroups.size(tp_group) == 1 or all(lay.whole_everywhere for _, lay in items):
                results[kind] = orthogonalize([], [mat for mat, _ in items])
                continue
            key = (kind, tuple((lay.shape, lay.whole_everywhere) for _, lay in items))
            exchange = self._exchanges.get(key)
            if exchange is None:
                exchange = ShardedMatrices(
                    [lay for _, lay in items],
                    group=tp_group,
                    counter=self._tp_wire_counter(),
                    tag="muon_tp",
                )
                self._exchanges[key] = exchange
            results[kind] = exchange.apply([mat for mat, _ in items], orthogonalize)

        # W ← W (1 − η λ) − η s(m, n) O, s from the matrix's *global* shape
        lr, wd = float(group["lr"]), group["weight_decay"]
        extra = self.config.muon_extra_scale_factor
        for p, entries in zip(params, slots):
            scaled = [
                results[kind][slot].to(p.dtype) * (update_scale(group["scale"], *full) * extra)
                for kind, slot, full in entries
            ]
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.add_(self.matrix_view(p, group).from_matrices(scaled).reshape(p.shape), alpha=-lr)  # type: ignore[attr-defined]
