"""Exact tensor-parallel Muon: each TP-sharded matrix is orthogonalized whole at one owner rank
of its TP group (one all-to-all there, one back), never per shard unless asked by name."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from muonscale import functional, matrix_step, variants
from muonscale.declared_state import ROW_MOMENT, kept_state
from muonscale.distributed.comm import Communicator, WireCounter
from muonscale.distributed.sharded import MatrixLayout, ShardedMatrices
from muonscale.matrices import MatrixView
from muonscale.memory import MemoryBudget
from muonscale.scaling import update_scale
from muonscale.settings import MuonSettings

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
        normalize=config.normalize,
        row_beta2=config.row_beta2,
        cautious_weight_decay=config.cautious_weight_decay,
        preconditioner=config.preconditioner,
        qk_lr_scale=config.qk_lr_scale,
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

    Variants: ``preconditioner="aol"`` runs at the owner on the whole matrix. NorMuon
    (``normalize="row"``, ``row_moments`` given: each parameter's row second moment over the
    rows of its local matrices) normalises each rank's piece of the whole O after the exchange:
    a piece split by columns all-reduces its row sums of squares (then every rank holds the
    matrix's row statistics and updates the same moment), a piece split by rows all-reduces
    the two sums of :func:`~muonscale.variants.row_factor_sums`; one flat all-reduce per TP
    group and step (tag ``"normuon"``). ``approximate_blockwise`` normalises each piece alone.
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
        row_moments: Sequence[torch.Tensor | None] | None = None,  # NorMuon state per parameter
    ) -> list[torch.Tensor]:
        exact = self.config.muon_tp_mode == "exact"
        # Every matrix joins the exchange of its TP group (dense or expert): a TP piece with its
        # global layout, or a matrix this rank holds whole (replicated layout: computed here).
        batches: dict[bool, list[tuple[torch.Tensor, MatrixView]]] = {False: [], True: []}
        slots: list[list[tuple[bool, int, tuple[int, int]]]] = []
        split_dims: dict[bool, list[int | None]] = {False: [], True: []}  # per matrix: TP dim
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
                split_dims[kind].append(plan.partition_dim if sharded and exact else None)
            slots.append(entries)

        settings = MuonSettings.from_group(group)
        workspace = self.memory.ns_workspace_bytes

        def orthogonalize(_indices: list[int], matrices: list[torch.Tensor]) -> list[torch.Tensor]:
            return matrix_step.orthogonalize_matrices(
                matrices, settings.ns, max_workspace_bytes=workspace
            )

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

        if ROW_MOMENT in kept_state(settings):
            if row_moments is None or any(v is None for v in row_moments):
                raise ValueError("normalize='row' needs each parameter's row second moment")
            moments: dict[bool, list[torch.Tensor]] = {False: [], True: []}  # per matrix
            for v, entries in zip(row_moments, slots):
                offset = 0
                for kind, slot, _full in entries:
                    rows = results[kind][slot].shape[0]
                    moments[kind].append(v[offset : offset + rows])
                    offset += rows
            for kind in results:
                self._row_normalize_(
                    results[kind], moments[kind], split_dims[kind], kind, group["row_beta2"]
                )

        # s(m, n) from the matrix's *global* shape
        extra = self.config.muon_extra_scale_factor
        updates = []
        qk_lr_scale = settings.qk_lr_scale
        for direction, view, entries in zip(directions, views, slots):
            scaled = [
                results[kind][slot].to(direction.dtype)
                * (update_scale(group["scale"], *full) * extra * factor)
                for (kind, slot, full), factor in zip(entries, view.lr_factors(qk_lr_scale))
            ]
            updates.append(view.from_matrices(scaled).reshape(direction.shape))
        return updates

    def _row_normalize_(
        self,
        pieces: list[torch.Tensor],  # this rank's piece of each whole O, replaced in the list
        moments: list[torch.Tensor],  # (rows of the piece,) each, updated in place
        split_dims: list[int | None],  # None: whole here; 0: rows split; 1: columns split
        expert: bool,
        beta2: float,
    ) -> None:
        """NorMuon on TP pieces (see the class docstring): every quantity that sums over a split
        dimension goes into one flat float32 all-reduce over the TP group."""
        partial: list[torch.Tensor] = []  # per split matrix: row sums (dim 1) or two sums (dim 0)
        scales: dict[int, torch.Tensor] = {}
        for i, (piece, v, dim) in enumerate(zip(pieces, moments, split_dims)):
            if dim == 1:
                partial.append((piece.float() * piece.float()).sum(dim=-1))
            elif dim == 0:
                stats = variants.row_statistics(piece)
                variants.update_row_moments_(v, stats, beta2)
                scales[i] = variants.row_scales(v)
                partial.append(variants.row_factor_sums(stats, scales[i]))
        flat = torch.cat(partial) if partial else None
        if flat is not None:
            Communicator(self._tp_group(expert), counter=self.counter).all_reduce(
                flat, tag="normuon"
            )
        offset = 0
        for i, (piece, v, dim) in enumerate(zip(pieces, moments, split_dims)):
            if dim is None:  # whole on this rank (or an approximate_blockwise piece)
                pieces[i] = variants.row_normalize_(piece.clone(), v, beta2=beta2)
                continue
            width = piece.shape[0] if dim == 1 else 2
            part, offset = flat[offset : offset + width], offset + width
            if dim == 1:  # every rank: the whole matrix's row statistics, the same moment
                stats = part / (piece.shape[1] * MegatronGroups.size(self._tp_group(expert)))
                variants.update_row_moments_(v, stats, beta2)
                factors = variants.row_factors(v, stats)
            else:
                factors = variants.row_factors_from_sums(scales[i], part)
            pieces[i] = piece * factors.to(piece.dtype)[:, None]


class Orthogonalizer(Protocol):
    """What the Megatron optimizers call to turn momentum directions into scaled updates."""

    def __call__(
        self,
        directions: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        plans: Sequence[ParamPlan],
        group: Mapping[str, Any],
        row_moments: Sequence[torch.Tensor | None] | None = None,
    ) -> list[torch.Tensor]: ...


@torch.no_grad()
def muon_update_(
    params: Sequence[torch.Tensor],  # updated in place
    grads: Sequence[torch.Tensor],  # same shapes
    momentum_buffers: Sequence[torch.Tensor],  # same shapes, updated in place
    views: Sequence[MatrixView],
    plans: Sequence[ParamPlan],
    group: Mapping[str, Any],
    orthogonalize: Orthogonalizer,
    row_moments: Sequence[torch.Tensor | None] | None = None,  # NorMuon state per parameter
) -> None:
    """Muon's step with an injected orthogonalizer: B ← B.lerp(G, 1 − μ), U = G.lerp(B, μ) or
    B; W ← W (1 − η λ) − η · ``orthogonalize(U)`` (the functions of :mod:`muonscale.functional`
    that every layout uses; cautious weight decay, elementwise, on each rank's shard)."""
    directions = functional.momentum_directions_(
        list(grads), list(momentum_buffers), momentum=group["momentum"], nesterov=group["nesterov"]
    )
    updates = orthogonalize(directions, views, plans, group, row_moments)
    lr, decay = float(group["lr"]), group["weight_decay"]
    if decay != 0 and MuonSettings.from_group(group).cautious_weight_decay:
        for param, update in zip(params, updates):
            update = update.view(param.shape)
            variants.cautious_weight_decay_(param, update, lr=lr, weight_decay=decay)
            param.add_(update, alpha=-lr)
        return
    functional.apply_updates_(
        params,
        updates,
        [-1.0] * len(updates),
        lr=float(group["lr"]),
        weight_decay=group["weight_decay"],
    )
