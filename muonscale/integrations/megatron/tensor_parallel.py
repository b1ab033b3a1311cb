"""Exact tensor-parallel Muon: each TP-sharded matrix goes through the matrix step whole at one
owner rank of its TP group (one all-to-all there, one back), never per shard unless asked by
name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch

from muonscale import functional, matrix_step
from muonscale.declared_state import replicated_state
from muonscale.distributed.comm import WireCounter
from muonscale.distributed.exchange import (
    LocalExchange,
    MatrixExchange,
    PieceExchange,
    step_through_exchange,
)
from muonscale.distributed.sharded import MatrixLayout
from muonscale.matrices import MatrixView
from muonscale.matrix_step import RowStates
from muonscale.memory import MemoryBudget
from muonscale.quantized_state import QuantizedMomentum, quantized_momentum
from muonscale.settings import MuonSettings
from muonscale.state_tensor import StateTensor
from muonscale.step_metrics import StepMetrics

from .config import MegatronMuonConfig
from .low_bit import ColumnMomentum, SharedColumnScales
from .plan import MegatronGroups, ParamPlan
from .row_state import TensorParallelMatrices


class TensorParallelOrthogonalizer:
    """The orthogonalizer the Megatron optimizers are given: every Muon matrix goes through
    the matrix step (:func:`muonscale.matrix_step.matrix_updates`) where it is whole, through
    one :class:`~muonscale.distributed.exchange.PieceExchange` per TP group (dense and expert)
    and layout, with its rule from its *global* shape (× ``muon_extra_scale_factor`` × the Q/K
    factor).

    Call it with the momentum directions of one param group (``directions[i]`` shaped like
    parameter i), their :class:`~muonscale.MatrixView`, their :class:`ParamPlan`, the group
    and each parameter's row state (the whole matrices' rows, a replica on every TP rank:
    :mod:`.row_state`); it returns the scaled updates, parameter-shaped. The owner computes the
    row statistics of the whole O, the exchange shares them (one float32 all-reduce per TP
    group and step, tag ``"muon_tp_rows"``) and every rank steps its replica
    (:func:`~muonscale.distributed.exchange.step_through_exchange`). Collective over
    each TP group (every rank of it calls with the same matrices); bytes are counted in
    ``counter``. ``approximate_blockwise``: each rank's piece is a matrix of its own.
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
        self.matrices = TensorParallelMatrices(groups, config)
        self._exchanges: dict[tuple, MatrixExchange] = {}

    def __call__(
        self,
        directions: Sequence[torch.Tensor],  # parameter-shaped momentum directions U
        views: Sequence[MatrixView],
        plans: Sequence[ParamPlan],
        group: Mapping[str, Any],
        row_states: Sequence[RowStates] | None = None,  # whole rows, per parameter
    ) -> list[torch.Tensor]:
        settings = MuonSettings.from_group(group)
        extra = self.config.muon_extra_scale_factor
        batches = {False: _Batch(), True: _Batch()}  # dense, expert
        slots: list[list[tuple[bool, int]]] = []
        for i, (direction, view, plan) in enumerate(zip(directions, views, plans)):
            layouts, shapes = self.matrices.layouts(view, plan)
            rules = matrix_step.matrix_rules(
                view, settings, shapes=shapes, extra_scale=extra, scaled=True
            )
            rows = _row_slices(layouts, None if row_states is None else row_states[i])
            missing = [
                s.what for rule, row in zip(rules, rows) for s in rule.row_state if s not in row
            ]
            if missing:
                raise ValueError(f"parameter '{plan.name}': its rule needs {missing[0]}")
            batch, entries = batches[plan.expert], []
            for mat, layout, rule, row in zip(view.to_matrices(direction), layouts, rules, rows):
                entries.append((plan.expert, len(batch.pieces)))
                batch.add(mat.contiguous(), layout, rule, row)
            slots.append(entries)
        results = {
            expert: self._step(expert, batch) for expert, batch in batches.items() if batch.pieces
        }
        return [
            view.from_matrices([results[k][s].to(d.dtype) for k, s in entries]).reshape(d.shape)
            for d, view, entries in zip(directions, views, slots)
        ]

    def _exchange(self, expert: bool, layouts: list[MatrixLayout]) -> MatrixExchange:
        tp_group = self.matrices.tp_group(expert)
        if MegatronGroups.size(tp_group) == 1 or all(lay.whole_everywhere for lay in layouts):
            return LocalExchange()
        key = (expert, tuple((lay.shape, _piece_shapes(lay)) for lay in layouts))
        if key not in self._exchanges:
            self._exchanges[key] = PieceExchange(
                layouts, group=tp_group, counter=self.counter, tag="muon_tp", row_tag="muon_tp_rows"
            )
        return self._exchanges[key]

    def _step(self, expert: bool, batch: _Batch) -> list[torch.Tensor]:
        """This rank's pieces of the matrix step's results; every replica's row state stepped."""
        workspace = self.memory.ns_workspace_bytes

        def owner_step(indices: list[int], matrices: list[torch.Tensor]):
            return matrix_step.matrix_updates(
                matrices,
                [batch.rules[i] for i in indices],
                [batch.rows[i] for i in indices],
                step_row_state=False,  # replicas: every TP rank steps its own
                max_workspace_bytes=workspace,
            )

        return step_through_exchange(
            self._exchange(expert, batch.layouts),
            batch.pieces,
            owner_step,
            batch.rows,
            [rule.settings for rule in batch.rules],
        )


class _Batch:
    """The matrices of one TP group's exchange: pieces, layouts, rules and row states."""

    def __init__(self) -> None:
        self.pieces: list[torch.Tensor] = []
        self.layouts: list[MatrixLayout] = []
        self.rules: list[matrix_step.MatrixRule] = []
        self.rows: list[RowStates] = []

    def add(self, piece, layout, rule, rows) -> None:
        self.pieces.append(piece)
        self.layouts.append(layout)
        self.rules.append(rule)
        self.rows.append(rows)


def _piece_shapes(layout: MatrixLayout) -> tuple[tuple[int, int], ...]:
    return tuple(layout.piece_shape(r) for r in range(len(layout.pieces)))


def _row_slices(
    layouts: Sequence[MatrixLayout], row_states: RowStates | None
) -> list[dict[StateTensor, torch.Tensor]]:
    """Each whole matrix's rows of a parameter's replicated row states, by declaration."""
    out: list[dict[StateTensor, torch.Tensor]] = [{} for _ in layouts]
    for spec, state in (row_states or {}).items():
        start = 0
        for rows, lay in zip(out, layouts):
            rows[spec] = state[start : start + lay.shape[0]]
            start += lay.shape[0]
    return out


class Orthogonalizer(Protocol):
    """What the Megatron optimizers call to turn momentum directions into scaled updates."""

    def __call__(
        self,
        directions: Sequence[torch.Tensor],
        views: Sequence[MatrixView],
        plans: Sequence[ParamPlan],
        group: Mapping[str, Any],
        row_states: Sequence[RowStates] | None = None,
    ) -> list[torch.Tensor]: ...


class QuantizedBuffer(Protocol):
    """A quantized momentum as :func:`muon_update_` reads it (its values, float32)."""

    def values(self) -> torch.Tensor: ...


StoreMomenta = Callable[[Sequence[QuantizedBuffer], Sequence[torch.Tensor]], None]
"""Writes the new float32 momentum values into their quantized buffers."""


def store_each_(buffers: Sequence[QuantizedMomentum], values: Sequence[torch.Tensor]) -> None:
    """Each quantized buffer stores its own values (its rows whole on this rank)."""
    for stored, value in zip(buffers, values):
        stored.store_(value)


@torch.no_grad()
def muon_update_(
    params: Sequence[torch.Tensor],  # updated in place
    grads: Sequence[torch.Tensor],  # same shapes
    momentum_buffers: Sequence[torch.Tensor | QuantizedBuffer],  # updated in place
    views: Sequence[MatrixView],
    plans: Sequence[ParamPlan],
    group: Mapping[str, Any],
    orthogonalize: Orthogonalizer,
    row_states: Sequence[RowStates] | None = None,  # whole rows, per parameter
    store_momenta: StoreMomenta = store_each_,
) -> None:
    """Muon's step with an injected orthogonalizer: B ← B.lerp(G, 1 − μ), U = G.lerp(B, μ) or
    B; W ← W (1 − η λ) − η · ``orthogonalize(U)`` with the matrix step's apply rule of a scaled
    update (:func:`muonscale.matrix_step.apply_updates_by_rule_`, elementwise on each rank's
    shard). A quantized buffer (:class:`~muonscale.quantized_state.QuantizedMomentum`, or a
    column piece's :class:`~.low_bit.ColumnMomentum`) is read as float32 values and its new
    value stored once the directions are out (``store_momenta``), as one process does."""
    values = [b if torch.is_tensor(b) else b.values() for b in momentum_buffers]
    directions = functional.momentum_directions_(
        list(grads), values, momentum=group["momentum"], nesterov=group["nesterov"]
    )
    quantized = [(b, v) for b, v in zip(momentum_buffers, values) if not torch.is_tensor(b)]
    if quantized:
        store_momenta([b for b, _ in quantized], [v for _, v in quantized])
    del values, quantized
    updates = orthogonalize(directions, views, plans, group, row_states)
    settings = MuonSettings.from_group(group)
    matrix_step.apply_updates_by_rule_(
        params,
        updates,
        [matrix_step.apply_rule(view, settings, scaled=True) for view in views],
        lr=float(group["lr"]),
        weight_decay=group["weight_decay"],
    )


class MuonGroupStep:
    """Muon on a group's parameters through an orthogonalizer, the momentum floating in its
    stacks or quantized (a column piece's under its TP group's shared maxima), shared by both
    optimizers.

    Args:
        column_scales: the optimizer's :class:`~.low_bit.SharedColumnScales`.
        view_of: a Muon parameter's matrix view in its group.
        plan_of: a parameter's (or main copy's) plan.
        stacked: the floating momenta of a group's parameters in their stacks.
    """

    def __init__(
        self,
        column_scales: SharedColumnScales,
        view_of: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
        plan_of: Callable[[torch.Tensor], ParamPlan],
        stacked: Callable[[Mapping[str, Any], list[torch.Tensor], list[dict]], list[torch.Tensor]],
    ) -> None:
        self.column_scales, self.view_of, self.plan_of = column_scales, view_of, plan_of
        self.stacked = stacked

    def step_(
        self,
        group: Mapping[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        states: list[dict],
        orthogonalizer: Orthogonalizer,
        metrics: StepMetrics | None,
        label: str,
    ) -> None:
        """:func:`~.tensor_parallel.muon_update_` on ``params`` (their ``states``), metered
        under group ``label`` when the step ``metrics`` are on."""
        orthogonalizer, timed = metered_orthogonalizer(
            orthogonalizer, metrics, label, params[0].device
        )
        column = self.column_scales.momentum
        with timed:
            muon_update_(
                params,
                grads,
                momentum_buffers(
                    group,
                    params,
                    states,
                    self.stacked,
                    self.view_of,
                    lambda s, p, view: column(s, self.plan_of(p), view),
                ),
                [self.view_of(p, group) for p in params],
                [self.plan_of(p) for p in params],
                group,
                orthogonalizer,
                [replicated_state(s, MuonSettings.from_group(group)) for s in states],
                store_momenta=self.column_scales.store_momenta_,
            )


def momentum_buffers(
    group: Mapping[str, Any],
    params: list[torch.Tensor],
    states: list[dict],
    stacked: Callable[[Mapping[str, Any], list[torch.Tensor], list[dict]], list[torch.Tensor]],
    view: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
    column: Callable[[dict, torch.Tensor, MatrixView], ColumnMomentum | None] | None = None,
) -> list[torch.Tensor | QuantizedMomentum | ColumnMomentum]:
    """The Muon momentum of ``params`` as :func:`~.tensor_parallel.muon_update_` takes it: the
    floating buffers in their stacks (``stacked``), or each quantized one as its codes and
    scales over the block matrix of its ``view`` (``column(state, p, view)``: a column piece's,
    None for a piece of whole rows)."""
    if group.get("state_precision", "param") == "param":
        return stacked(group, params, states)
    out: list[QuantizedMomentum | ColumnMomentum] = []
    for p, s in zip(params, states):
        piece = None if column is None else column(s, p, view(p, group))
        out.append(piece if piece is not None else quantized_momentum(s, view(p, group)))
    return out


def metered_orthogonalizer(
    orthogonalizer: Orthogonalizer, metrics: StepMetrics | None, label: str, device: torch.device
) -> tuple[Any, Any]:
    """``orthogonalizer`` and a timing context, metered when the step metrics are on (the
    scaled updates' squares go to the update RMS of group ``label``)."""
    if metrics is None:
        return orthogonalizer, contextlib.nullcontext()
    return metrics.metered_updates(label, orthogonalizer), metrics.timed(device)
