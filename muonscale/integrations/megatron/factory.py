"""The factory of the Megatron optimizers: which one a model's layout and ``dp_mode`` get."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from muonscale.distributed.comm import WireCounter
from muonscale.memory import MemoryBudget

from .config import MegatronMuonConfig
from .expert_zero1 import MegatronExpertZero1
from .optimizer import MegatronDistributedMuon, MegatronMuon, check_self_reduction
from .plan import MegatronGroups, plan_parameters
from .tensor_parallel import TensorParallelOrthogonalizer

__all__ = ["megatron_muon"]


def megatron_muon(
    model_chunks: Sequence[nn.Module] | nn.Module,
    config: MegatronMuonConfig | None = None,
    *,
    pg_collection: Any = None,
    **overrides: Any,
) -> MegatronMuon | MegatronDistributedMuon | MegatronExpertZero1:
    """Build the muonscale optimizer for Megatron-Core ``model_chunks``.

    Args:
        model_chunks: a model chunk or the list of them (virtual pipeline); bare, or wrapped in
            Megatron's DDP (``use_distributed_optimizer=False``; then ``dp_mode`` is replicated).
        config: :class:`MegatronMuonConfig` (``MegatronMuonConfig.from_megatron(opt_config)``
            reads Megatron's ``OptimizerConfig``); ``overrides`` replace its fields (and its
            variant options, by name: :meth:`MegatronMuonConfig.replaced`).
        pg_collection: Megatron's ``ProcessGroupCollection``; None → ``parallel_state``.

    Returns :class:`MegatronDistributedMuon` for ``dp_mode="zero1"`` (``"auto"``: when nothing
    else reduces gradients, and there are no expert or pipeline-parallel layouts), or with
    expert weights :class:`MegatronExpertZero1` (dense matrices owned within the
    data-parallel group, experts within the expert-data group), else :class:`MegatronMuon`.
    """
    config = config if config is not None else MegatronMuonConfig()
    if overrides:
        config = config.replaced(**overrides)
    groups = MegatronGroups.from_megatron(pg_collection)
    plans = plan_parameters(model_chunks, groups, split_qkv=config.muon_split_qkv)
    has_main_grad = any(hasattr(pl.param, "main_grad") for pl in plans)
    zero1_blockers = []
    if has_main_grad or config.grads_reduced:
        zero1_blockers.append("gradients are reduced by Megatron's DDP (main_grad)")
    if groups.pp_size > 1:
        zero1_blockers.append("pipeline parallelism")
    mode = config.dp_mode
    memory = MemoryBudget.from_environment()  # the environment is read here, once
    experts = any(pl.expert for pl in plans)
    if mode == "auto":  # experts: replicated unless asked (ZeRO-1 then spans two groups)
        single = MegatronGroups.size(groups.dp) == 1
        mode = "replicated" if zero1_blockers or experts or single else "zero1"
    if mode == "zero1":
        if zero1_blockers:
            raise NotImplementedError(
                f"dp_mode='zero1' is not supported with: {'; '.join(zero1_blockers)}"
            )
        check_self_reduction(plans, groups)
        if experts:
            return MegatronExpertZero1(plans, groups, config, memory=memory)
        counter = WireCounter()
        orthogonalizer = TensorParallelOrthogonalizer(
            groups, config, counter=counter, memory=memory
        )
        return MegatronDistributedMuon(
            plans, groups, config, orthogonalizer=orthogonalizer, wire_counter=counter
        )
    counter = WireCounter()
    orthogonalizer = TensorParallelOrthogonalizer(groups, config, counter=counter, memory=memory)
    return MegatronMuon(plans, groups, config, orthogonalizer=orthogonalizer, wire_counter=counter)
