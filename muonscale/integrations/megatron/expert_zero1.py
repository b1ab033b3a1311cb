"""ZeRO-1 for a Megatron-Core model with experts (``dp_mode="zero1"``): two
:class:`~.optimizer.MegatronDistributedMuon`, one per data-parallel group.

Dense parameters are replicated over Megatron's data-parallel group and expert parameters over
its expert-data group (expert parallelism takes ranks out of the data-parallel group for
experts), so each half is a ZeRO-1 optimizer of its own: every dense matrix is owned by one
data-parallel rank, every expert matrix by one expert-data rank, and each half reduces, steps
and gathers within its group. What they share is the step's global view: one gradient norm over
every rank (each gradient element counted once; one clipping coefficient and one non-finite
decision for both halves), computed here before either half steps.

Quantized state (``state_precision``) is each half's: every matrix is owned whole in its
group, so its Muon momentum quantizes as one process's (a row-parallel piece's, with its cut
blocks' scales shared over its TP or expert-TP group, whose ranks own the same matrices), and
the AdamW shards share their cut blocks' scales over the half's data group
(:class:`~.optimizer.MegatronDistributedMuon`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from muonscale.distributed.comm import WireCounter
from muonscale.params import RouteDecision

from .config import MegatronMuonConfig
from .grad_norm import GlobalGradNorm
from .optimizer import MegatronDistributedMuon
from .plan import MegatronGroups, ParamPlan
from .tensor_parallel import TensorParallelOrthogonalizer

__all__ = ["MegatronExpertZero1"]

_PARTS = ("dense", "experts")


class MegatronExpertZero1(torch.optim.Optimizer):
    """ZeRO-1 over the data-parallel group (dense) and the expert-data group (experts); see the
    module docstring. Build with :func:`~.optimizer.megatron_muon` (``dp_mode="zero1"`` on a
    model with experts).

    Attributes:
        dense, experts: the two :class:`MegatronDistributedMuon` (``experts`` on
            ``groups.expt_dp``).
        plans: every parameter's plan, dense first.
        last_grad_norm: the global gradient norm of the latest step (every rank, every group).
        last_step_wire_bytes, last_step_wire_breakdown: both halves' bytes and the norm's.
    """

    dp_mode = "zero1"

    def __init__(
        self,
        plans: Sequence[ParamPlan],
        groups: MegatronGroups,
        config: MegatronMuonConfig,
        *,
        memory: Any = None,
    ) -> None:
        by_part = {
            "dense": [pl for pl in plans if not pl.expert],
            "experts": [pl for pl in plans if pl.expert],
        }
        # the halves neither clip nor judge gradients on their own: the norm below does both
        unclipped = config.replaced(clip_grad=0.0)
        self.config, self.groups = config, groups
        self.parts: dict[str, MegatronDistributedMuon] = {}
        for name, data_group in (("dense", groups.dp), ("experts", groups.expt_dp)):
            counter = WireCounter()
            self.parts[name] = MegatronDistributedMuon(
                by_part[name],
                groups,
                unclipped,
                data_group=data_group,
                external_grad_norm=True,
                orthogonalizer=TensorParallelOrthogonalizer(
                    groups, unclipped, counter=counter, memory=memory
                ),
                wire_counter=counter,
            )
        self.dense, self.experts = self.parts["dense"], self.parts["experts"]
        self.plans = [pl for name in _PARTS for pl in self.parts[name].plans]
        self.norm_counter = WireCounter()
        self.grad_norm = GlobalGradNorm(
            self.plans,
            groups,
            counter=self.norm_counter,
            dp_replicated=False,
            nonfinite=config.nonfinite,
        )
        self.routing: dict[str, RouteDecision] = {}
        for part in self.parts.values():
            self.routing.update(part.routing)
        self.last_step_wire_bytes, self.last_step_wire_breakdown = 0, {}
        param_groups = [g for part in self.parts.values() for g in part.param_groups]
        # torch's Optimizer bookkeeping over the halves' own groups (LR schedulers edit these)
        torch.optim.Optimizer.__init__(self, [{"params": []}], {})
        self.param_groups = param_groups
        self.state = {}

    @property
    def last_grad_norm(self) -> float | None:
        return self.grad_norm.last_norm

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """The global norm of both halves' reduced gradients (collective over every rank), and
        both clipped by ``max_norm`` (0: no clipping); every half reads the norm from here."""
        held, owners = [], []
        for part in self.parts.values():
            grads, plans = part.held_reduced_grads()
            held += grads
            owners += plans
        self.grad_norm.norm_and_clip_(held, owners, max_norm)
        for part in self.parts.values():
            part.grad_norm.last_norm = self.grad_norm.last_norm
        return self.grad_norm.last_norm

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.clip_grad_norm_(self.config.clip_grad)
        for part in self.parts.values():
            part.step()
        breakdown: dict[str, int] = {}
        for counts in [p.last_step_wire_breakdown for p in self.parts.values()] + [
            self.norm_counter.take()[1]
        ]:
            for key, value in counts.items():
                breakdown[key] = breakdown.get(key, 0) + value
        self.last_step_wire_breakdown = breakdown
        self.last_step_wire_bytes = sum(breakdown.values())
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Each half's full state over its data-parallel group (collective), by half."""
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        missing = [name for name in _PARTS if name not in state_dict]
        if missing:
            raise ValueError(
                f"MegatronExpertZero1.load_state_dict: the checkpoint has no {missing} state "
                f"(expected the keys {list(_PARTS)}, as state_dict() writes them)"
            )
        for name, part in self.parts.items():
            part.load_state_dict(state_dict[name])

    def summary(self) -> str:
        return "\n".join(
            f"{name} (ZeRO-1 over {size} ranks):\n{part.summary()}"
            for name, part in self.parts.items()
            for size in [part.comm.world_size]
        )
