"""Exact tensor-parallel Muon: each TP-sharded matrix is orthogonalized whole at one owner rank
of its TP group (one all-to-all there, one back), never per shard unless asked by name."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muonscale import functional
from muonscale.distributed.comm import WireCounter
from muonscale.distributed.sharded import MatrixLayout, ShardedMatrices
from muonscale.matrices import MatrixView
from muonscale.memory import MemoryBudget
from muonscale.scaling import update_scale

from .config import MegatronMuonConfig
from .plan import MegatronGroups, ParamPlan


def muon_arguments(
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
        lr=config.lr,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        weight_decay=config.weight_decay,
        ns_steps=config.muon_num_ns_steps,
        coefficients=config.coefficients,
        scale=config.scale,
        ns_dtype=config.ns_dtype,
        adamw_lr=config.adam_lr,
        adamw_betas=(config.adam_beta1, config.adam_beta2),
        adamw_eps=config.adam_eps,
        adamw_weight_decay=config.adam_weight_decay,
        nonfinite=config.nonfinite,
        qkv_split=config.qkv_split,
        splits={pl.name: pl.qkv_layout for pl in plans if pl.qkv_layout is not None},
    )
    return param_groups, options


class TensorParallelOrthogonalizer:
    """The orthogonalizer the Megatron optimizers are given: each Muon matrix is orthogonalized
    whole through one :class:`ShardedMatrices` exchange per TP group (dense and expert), then
    scaled by its *global* shape (times ``muon_extra_scale_factor``).

    Call it with the momentum directions of one param group (``directions[i]`` shaped like
    parameter i), their :class:`~muonscale.MatrixView`, their :class:`ParamPlan` and the group;
    it returns the scaled updates ``s(m, n) O``, parameter-shaped. Collective over each TP group
    (every rank of it calls with the same matrices); bytes are counted in ``counter``.
    """

    def __init__(
        self,
        groups: MegatronGroups,
        config: MegatronMuonConfig,
        *,
        counter: WireCounter,
        memory: MemoryBudget | None = None,  # None: read from the environment here
    ) -> None:
        self.groups, self.config, self.counter = groups, config, counter
        self.memory = memory if memory is not None else MemoryBudget.from_environment()
        self._exchanges: dict[tuple, ShardedMatrices] = {}

    def _tp_group(self, expert: bool) -> dist.ProcessGroup | None:
        return self.groups.expt_tp if expert else self.groups.tp

    def __call__(
        self,
        directions: Sequence[torch.Tensor],  # parameter-shaped momentum directions U
        views: Sequence[MatrixView],
        plans: Sequence[ParamPlan],
        group: Mapping[str, Any],
    ) -> list[torch.Tensor]:
        exact = self.config.muon_tp_mode == "exact"
        # Every matrix joins the exchange of its TP group (dense or expert): a TP piece with its
        # global layout, or a matrix this rank holds whole (replicated layout: computed here).
        batches: dict[bool, list[tuple[torch.Tensor, MatrixView]]] = {False: [], True: []}
        slots: list[list[tuple[bool, int, tuple[int, int]]]] = []
        for direction, view, plan in zip(directions, views, plans):
            kind = plan.expert
            group_size = MegatronGroups.size(self._tp_group(kind))
            # A head of a QKV split lies whole on one rank; Q, K, V blocks are dim-0 pieces.
            sharded = plan.partition_dim is not None and not (
                plan.qkv_layout is not None and self.config.qkv_split == "head"
            )
            entries = []
            for mat in view.to_matrices(direction):
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
            method=group["ns_method"],
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
                    [lay for _, lay in items], group=tp_group, counter=self.counter, tag="muon_tp"
                )
                self._exchanges[key] = exchange
            results[kind] = exchange.apply([mat for mat, _ in items], orthogonalize)

        # s(m, n) from the matrix's *global* shape
        extra = self.config.muon_extra_scale_factor
        updates = []
        for direction, view, entries in zip(directions, views, slots):
            scaled = [
                results[kind][slot].to(direction.dtype)
                * (update_scale(group["scale"], *full) * extra)
                for kind, slot, full in entries
            ]
            updates.append(view.from_matrices(scaled).reshape(direction.shape))
        return updates


Orthogonalizer = Callable[
    [Sequence[torch.Tensor], Sequence[MatrixView], Sequence[ParamPlan], Mapping[str, Any]],
    list[torch.Tensor],
]
"""What the Megatron optimizers call to turn momentum directions into scaled updates."""


@torch.no_grad()
def muon_update_(
    params: Sequence[torch.Tensor],  # updated in place
    grads: Sequence[torch.Tensor],  # same shapes
    momentum_buffers: Sequence[torch.Tensor],  # same shapes, updated in place
    views: Sequence[MatrixView],
    plans: Sequence[ParamPlan],
    group: Mapping[str, Any],
    orthogonalize: Orthogonalizer,
) -> None:
    """Muon's step with an injected orthogonalizer: B ← B.lerp(G, 1 − μ), U = G.lerp(B, μ) or
    B; W ← W (1 − η λ) − η · ``orthogonalize(U)`` (the functions of :mod:`muonscale.functional`
    that every layout uses)."""
    directions = functional.momentum_directions_(
        list(grads), list(momentum_buffers), momentum=group["momentum"], nesterov=group["nesterov"]
    )
    updates = orthogonalize(directions, views, plans, group)
    functional.apply_updates_(
        params,
        updates,
        [-1.0] * len(updates),
        lr=float(group["lr"]),
        weight_decay=group["weight_decay"],
    )
