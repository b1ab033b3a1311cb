"""The optimizers :func:`megatron_muon` builds (see the package docstring)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import fields, replace
from typing import Any

import torch
from torch import nn

from muonscale.distributed.comm import Communicator, WireCounter
from muonscale.distributed.data_parallel import DistributedMuon
from muonscale.optimizer import Muon

from .config import MegatronMuonConfig
from .grad_norm import clip_coefficient, counts_in_norm, global_grad_norm
from .main_params import MainParams
from .plan import MegatronGroups, ParamPlan, plan_parameters
from .tensor_parallel import _muon_arguments, _TensorParallelMatrices


class _GlobalGradNorm:
    """Mixin: the global gradient norm, clipping and non-finite agreement across every rank
    (:mod:`.grad_norm`). ``last_grad_norm`` is the latest step's norm before clipping."""

    config: MegatronMuonConfig
    groups: MegatronGroups
    plans: list[ParamPlan]
    nonfinite: str

    def _init_grad_norm(self, counter: WireCounter, *, dp_replicated: bool) -> None:
        self._norm_comm = Communicator(None, counter=counter)  # every rank of the job
        self._counted = {
            id(pl.param): counts_in_norm(pl, self.groups, dp_replicated=dp_replicated)
            for pl in self.plans
        }
        self.last_grad_norm: float | None = None

    def _global_norm_and_clip(
        self, grads: list[torch.Tensor], owners: list[ParamPlan], max_norm: float
    ) -> str | None:
        """Global norm of ``grads`` (this rank's, ``owners[i]`` the plan of ``grads[i]``); clip
        them in place by ``max_norm`` (0: no clipping). Returns None, or when some rank holds a
        non-finite gradient: a name to report (the local one if this rank has it)."""
        counted = [self._counted[id(pl.param)] for pl in owners]
        norm, first_bad = global_grad_norm(grads, counted, self._norm_comm)
        self.last_grad_norm = float(norm)
        if not math.isfinite(self.last_grad_norm):
            if self.nonfinite == "ignore":
                return None
            if first_bad is not None:
                return owners[first_bad].name
            return "(a parameter on another rank: the global gradient norm is not finite)"
        if max_norm > 0 and grads:
            coef = clip_coefficient(norm, max_norm)
            if float(coef) < 1.0:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        return None


class MegatronMuon(_GlobalGradNorm, _TensorParallelMatrices, Muon):
    """:class:`muonscale.Muon` on Megatron-Core parameters, every data-parallel replica running
    the same step (``dp_mode="replicated"``). Gradients come reduced from Megatron's DDP
    (``main_grad``) or are averaged here with one all-reduce per group. Build with
    :func:`megatron_muon`.

    One step: gradients (``main_grad`` or ``.grad``) → fp32 main copies of bf16 parameters
    (``main_params_dtype``) → data-parallel mean (unless already reduced) → global norm over
    all ranks (one 8-byte all-reduce; clipped when ``clip_grad > 0``; every rank skips or raises
    together on a NaN/inf anywhere) → Muon (exact TP) / AdamW → main copies written back.

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
        self, plans: Sequence[ParamPlan], groups: MegatronGroups, config: MegatronMuonConfig
    ) -> None:
        self.main_params = MainParams(plans, config.main_params_dtype)
        self._init_megatron(self.main_params.plans, groups, config)
        self.wire_counter = WireCounter()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = 0, {}
        param_groups, options = _muon_arguments(self.plans, config)
        super().__init__(param_groups, **options)
        self._finish_megatron_init()
        self._init_grad_norm(self.wire_counter, dp_replicated=True)
        has_main_grad = any(hasattr(p, "main_grad") for p in self.main_params.model_params)
        self.grads_reduced = has_main_grad if config.grads_reduced is None else config.grads_reduced
        if not self.grads_reduced:
            _check_self_reduction(plans, groups)

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

    def _check_gradients(self) -> str | None:
        """Muon.step's check, made global: one all-reduce of ‖g‖² over every rank (clipping
        included), so that all ranks agree on a non-finite gradient anywhere."""
        owners = [pl for pl in self.plans if pl.param.grad is not None]
        for pl in owners:
            if pl.param.grad.is_sparse:
                raise ValueError(f"parameter '{pl.name}' has a sparse gradient; Muon needs dense")
        return self._global_norm_and_clip(
            [pl.param.grad for pl in owners], owners, self.config.clip_grad
        )

    @torch.no_grad()
    def step(self, closure=None):
        """One step (see the class docstring). Returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.main_params.load_grads()
        if not self.grads_reduced:
            self._average_grads()
        try:
            super().step()
        finally:
            self.last_step_wire_bytes, self.last_step_wire_breakdown = self.wire_counter.take()
        self.main_params.write_back()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the optimizer's tensors and of the model's bf16 parameters
        (Megatron DDP's ``main_grad`` buffers are cleared by ``model.zero_grad_buffer()``)."""
        super().zero_grad(set_to_none=set_to_none)
        self.main_params.zero_model_grads(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Muon's state dict plus the main copies (``"main_params"``). Per rank: a TP rank's
        state is its shard's, so load it at the same TP size."""
        packed = super().state_dict()
        packed["main_params"] = self.main_params.state_dict()
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        main = state_dict.pop("main_params", None)
        if self.main_params.copied and main is None:
            raise ValueError(
                "this optimizer keeps main copies of low-precision parameters but the checkpoint "
                "has no 'main_params' (saved with main_params_dtype=None?)"
            )
        super().load_state_dict(state_dict)
        if main is not None:
            self.main_params.load_state_dict(main)


class MegatronDistributedMuon(_GlobalGradNorm, _TensorParallelMatrices, DistributedMuon):
    """:class:`muonscale.DistributedMuon` over Megatron's data-parallel group
    (``dp_mode="zero1"``): gradients reduce-scattered to owner ranks during backward, each Muon
    matrix updated by one DP rank (its TP pieces exchanged exactly within that rank's TP group),
    AdamW sharded ZeRO-1, parameters all-gathered. Do not wrap the model in Megatron's DDP.
    With ``main_params_dtype`` (bf16 models), each rank keeps main copies of what it updates
    only (owned matrices, AdamW shards), as Megatron's distributed optimizer; the all-gather
    sends bf16. ``state_dict()`` is the full state over data parallel (collective; main copies
    included), so a checkpoint loads at another data-parallel size (same TP size)."""

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
        super().__init__(
            param_groups,
            process_group=groups.dp,
            main_params_dtype=config.main_params_dtype,
            **options,
            **dp_options,
        )
        self._finish_megatron_init()
        self.wire_counter = self.comm.counter
        self._init_grad_norm(self.wire_counter, dp_replicated=False)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the reduced gradients by the global L2 norm over data *and* tensor parallel
        ranks (each gradient element counted once); returns the norm. Collective."""
        if norm_type != 2.0:
            raise ValueError(f"norm_type must be 2.0 under tensor parallelism, got {norm_type!r}")
        self._finish_reductions()
        held = [(i, g) for i, g in self._local_reduced_grads().items() if g.numel()]
        owners = [self._plan_by_id[id(self._params[i])] for i, _ in held]
        self._global_norm_and_clip([g for _, g in held], owners, max_norm)
        return torch.tensor(self.last_grad_norm)

    def _agree_on_gradients(self) -> tuple[list[bool], str | None]:
        present, bad = super()._agree_on_gradients()  # over data parallel
        if bad is None and self.nonfinite != "ignore" and self.last_grad_norm is not None:
            if not math.isfinite(self.last_grad_norm):  # a NaN/inf on another TP rank
                bad = "(a parameter on another tensor-parallel rank)"
        return present, bad

    @torch.no_grad()
    def step(self, closure=None):
        """Global norm (and clipping, ``clip_grad > 0``) over all ranks, then
        :meth:`DistributedMuon.step`."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_grad_norm = None
        self.clip_grad_norm_(self.config.clip_grad)
        super().step()
        return loss


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
