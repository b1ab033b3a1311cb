"""The optimizers :func:`megatron_muon` builds (see the package docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from muonscale.distributed.comm import Communicator, WireCounter
from muonscale.distributed.data_parallel import DistributedMuon
from muonscale.optimizer import Muon

from .config import MegatronMuonConfig
from .plan import MegatronGroups, ParamPlan, plan_parameters
from .tensor_parallel import _muon_arguments, _TensorParallelMatrices


class MegatronMuon(_TensorParallelMatrices, Muon):
    """:class:`muonscale.Muon` on Megatron-Core parameters, every data-parallel replica running
    the same step (``dp_mode="replicated"``). Gradients come reduced from Megatron's DDP
    (``main_grad``) or are averaged here with one all-reduce per group. Build with
    :func:`megatron_muon`.

    Attributes:
        plans: one :class:`ParamPlan` per parameter.
        wire_counter: bytes this rank sent, by ``"<tag>/<op>"`` (``"muon_tp"``: the TP
            all-to-alls, ``"grads"``: data-parallel gradient averaging).
        last_step_wire_bytes, last_step_wire_breakdown: the latest step's total and breakdown.
    """

    dp_mode = "replicated"

    def __init__(
        self, plans: Sequence[ParamPlan], groups: MegatronGroups, config: MegatronMuonConfig
    ) -> None:
        self._init_megatron(plans, groups, config)
        self.wire_counter = WireCounter()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = 0, {}
        param_groups, options = _muon_arguments(self.plans, config)
        super().__init__(param_groups, **options)
        self._finish_megatron_init()
        has_main_grad = any(hasattr(pl.param, "main_grad") for pl in self.plans)
        self.grads_reduced = has_main_grad if config.grads_reduced is None else config.grads_reduced
        if not self.grads_reduced:
            _check_self_reduction(self.plans, groups)

    def _gather_grads(self) -> None:
        """Megatron DDP accumulates into ``main_grad``; point ``.grad`` at it (as Megatron's
        FP32Optimizer does) so the rest of the step reads one attribute."""
        for pl in self.plans:
            main_grad = getattr(pl.param, "main_grad", None)
            if main_grad is not None:
                pl.param.grad = (
                    main_grad if main_grad.dtype == pl.param.dtype else main_grad.to(pl.param.dtype)
                )

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

    @torch.no_grad()
    def step(self, closure=None):
        """Average gradients over data parallel (unless already reduced), then one Muon/AdamW
        step; TP-sharded Muon matrices are orthogonalized whole (see the module docstring)."""
        self._gather_grads()
        if not self.grads_reduced:
            self._average_grads()
        try:
            return super().step(closure)
        finally:
            self.last_step_wire_bytes, self.last_step_wire_breakdown = self.wire_counter.take()


class MegatronDistributedMuon(_TensorParallelMatrices, DistributedMuon):
    """:class:`muonscale.DistributedMuon` over Megatron's data-parallel group
    (``dp_mode="zero1"``): gradients reduce-scattered to owner ranks during backward, each Muon
    matrix updated by one DP rank (its TP pieces exchanged exactly within that rank's TP group),
    AdamW sharded ZeRO-1, parameters all-gathered. Do not wrap the model in Megatron's DDP."""

    dp_mode = "zero1"

    def __init__(
        self,
        plans: Sequence[ParamPlan],
        groups: MegatronGroups,
        config: MegatronMuonConfig,
        **dp_options: Any,
    ) -> None:
        self._init_megatron(plans, groups, config)
        param_groups, options = _muon_arguments(self.plans, config)
        super().__init__(param_groups, process_group=groups.dp, **options, **dp_options)
        self._finish_megatron_init()
        self.wire_counter = self.comm.counter


def _check_self_reduction(plans: Sequence[ParamPlan], groups: MegatronGroups) -> None:
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


def megatron_muon(
    model_chunks: Sequence[nn.Module] | nn.Module,
    config: MegatronMuonConfig | None = None,
    *,
    pg_collection: Any = None,
    **overrides: Any,
) -> MegatronMuon | MegatronDistributedMuon:
    """Build the muonscale optimizer for Megatron-Core ``model_chunks``.

    Args:
        model_chunks: a model chunk or the list of them (virtual pipeline); bare, or wrapped in
            Megatron's DDP (``use_distributed_optimizer=False``; then ``dp_mode`` is replicated).
        config: :class:`MegatronMuonConfig` (``MegatronMuonConfig.from_megatron(opt_config)``
            reads Megatron's ``OptimizerConfig``); ``overrides`` replace its fields.
        pg_collection: Megatron's ``ProcessGroupCollection``; None → ``parallel_state``.

    Returns :class:`MegatronDistributedMuon` for ``dp_mode="zero1"`` (``"auto"``: when nothing
    else reduces gradients, and there are no expert or pipeline-parallel layouts), else
    :class:`MegatronMuon`.
    """
    config = config if config is not None else MegatronMuonConfig()
    if overrides:
        unknown = set(overrides) - {f.name for f in fields(MegatronMuonConfig)}
        if unknown:
            raise TypeError(f"megatron_muon: unknown options {sorted(unknown)}")
        config = replace(config, **overrides)
    groups = MegatronGroups.from_megatron(pg_collection)
    plans = plan_parameters(model_chunks, groups, split_qkv=config.muon_split_qkv)
    has_main_grad = any(hasattr(pl.param, "main_grad") for pl in plans)
    zero1_blockers = []
    if has_main_grad or config.grads_reduced:
        zero1_blockers.append("gradients are reduced by Megatron's DDP (main_grad)")
    if any(pl.expert for pl in plans):
        zero1_blockers.append("expert parameters (their data-parallel group differs)")
    if groups.pp_size > 1:
        zero1_blockers.append("pipeline parallelism")
    mode = config.dp_mode
    if mode == "auto":
        mode = "replicated" if zero1_blockers or MegatronGroups.size(groups.dp) == 1 else "zero1"
    if mode == "zero1":
        if zero1_blockers:
            raise NotImplementedError(
                f"dp_mode='zero1' is not supported with: {'; '.join(zero1_blockers)}"
            )
        _check_self_reduction(plans, groups)
        return MegatronDistributedMuon(plans, groups, config)
    return MegatronMuon(plans, groups, config)
