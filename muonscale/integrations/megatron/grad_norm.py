"""The global gradient norm of a Megatron-Core model, every gradient element counted once.

Megatron's layout replicates some gradients: a tensor that is not TP-sharded (norms, biases,
un-split embeddings) is the same on every rank of its TP group; after Megatron's DDP (or the
replicated optimizer's own all-reduce) every data-parallel replica holds the same gradients;
the tied embedding has a copy on the last pipeline stage (Megatron's ``shared`` flag). A rank
adds ‖g‖² of a gradient only where it is the designated holder (TP rank 0 for TP duplicates,
DP rank 0 for DP replicas, never the pipeline copy) and one all-reduce over all ranks sums
the rest: TP shards, pipeline stages, expert-parallel ranks, ZeRO-1 shards. This is what
Megatron's ``get_grad_norm_fp32`` computes over its model-parallel group, and what
``torch.nn.utils.clip_grad_norm_`` gives on the unsharded model.

The same all-reduce tells every rank whether *any* rank saw a NaN/inf gradient (the sum is then
not finite), so all ranks skip or raise together instead of deadlocking in the next collective.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from muonscale.distributed.comm import Communicator, WireCounter

from .plan import MegatronGroups, ParamPlan

CLIP_EPS = 1e-6
"""Added to the norm in the clip coefficient ``max_norm / (norm + eps)``, as torch and Megatron."""


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


def counts_in_norm(plan: ParamPlan, groups: MegatronGroups, *, dp_replicated: bool) -> bool:
    """Whether this rank adds ``plan``'s gradient to the global norm (see the module docstring).
    ``dp_replicated``: every data-parallel rank holds the same (reduced) gradient."""
    if plan.pipeline_copy:
        return False
    if plan.partition_dim is None and _rank(groups.expt_tp if plan.expert else groups.tp) != 0:
        return False
    if dp_replicated and _rank(groups.expt_dp if plan.expert else groups.dp) != 0:
        return False
    return True


def global_grad_norm(
    grads: Sequence[torch.Tensor], counted: Sequence[bool], comm: Communicator
) -> tuple[torch.Tensor, int | None]:
    """(L2 norm over all ranks as a float64 scalar, index into ``grads`` of the first local
    non-finite gradient or None). Collective over ``comm`` (one 8-byte all-reduce). The norm
    is NaN/inf on every rank when any rank holds a non-finite gradient."""
    if len(grads) != len(counted):
        raise ValueError(f"{len(grads)} gradients but {len(counted)} counted flags")
    local = torch.zeros(1, dtype=torch.float64, device=comm.device)
    first_bad = None
    if grads:
        norms = torch.stack(
            [n.to(comm.device, torch.float64) for n in torch._foreach_norm(list(grads), 2.0)]
        )
        finite = norms.isfinite()
        if not bool(finite.all()):
            first_bad = int((~finite).nonzero()[0])
            local.fill_(float("nan"))  # poison the sum even when this copy is not counted
        else:
            mask = torch.tensor(list(counted), dtype=torch.bool, device=comm.device)
            local += (norms[mask] ** 2).sum()
    comm.all_reduce(local, tag="grad_norm")
    return local.sqrt().squeeze(0), first_bad


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total_norm + 1e-6))`` as a float32 scalar tensor."""
    return torch.clamp(max_norm / (total_norm.float() + CLIP_EPS), max=1.0)


class GlobalGradNorm:
    """The global gradient norm, clipping and non-finite agreement across every rank of the
    job, for the gradients of ``plans`` (owned by a Megatron optimizer).

    Attributes:
        last_norm: the latest norm before clipping (None before the first step).
    """

    def __init__(
        self,
        plans: Sequence[ParamPlan],
        groups: MegatronGroups,
        *,
        counter: WireCounter,
        dp_replicated: bool,
        nonfinite: str,
    ) -> None:
        self._comm = Communicator(None, counter=counter)  # every rank of the job
        self._counted = {
            id(pl.param): counts_in_norm(pl, groups, dp_replicated=dp_replicated) for pl in plans
        }
        self.nonfinite = nonfinite
        self.last_norm: float | None = None

    def norm_and_clip_(
        self, grads: list[torch.Tensor], owners: list[ParamPlan], max_norm: float
    ) -> str | None:
        """Global norm of ``grads`` (this rank's, ``owners[i]`` the plan of ``grads[i]``); clip
        them in place by ``max_norm`` (0: no clipping). Returns None, or when some rank holds a
        non-finite gradient: a name to report (the local one if this rank has it)."""
        counted = [self._counted[id(pl.param)] for pl in owners]
        norm, first_bad = global_grad_norm(grads, counted, self._comm)
        self.last_norm = float(norm)
        if not math.isfinite(self.last_norm):
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
