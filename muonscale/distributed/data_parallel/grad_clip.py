"""``clip_grad_norm_`` for :class:`~muonscale.distributed.DistributedMuon`: the global norm of
the averaged gradient (one all-reduce over the data-parallel group) and the clipping of the
reduced gradients that ``step()`` uses; ``p.grad`` (local) is not touched."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Communicator
from .reduction import BucketedReduction

CLIP_EPS = 1e-6
"""Added to the norm in ``max_norm / (norm + eps)``, as ``torch.nn.utils.clip_grad_norm_``."""


@torch.no_grad()
def clip_grad_norm_(
    reduction: BucketedReduction, comm: Communicator, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Clip the reduced gradients held in ``reduction`` by their global norm over ``comm``
    (collective); returns the norm, as ``torch.nn.utils.clip_grad_norm_`` on the averaged
    gradients of every parameter in one process."""
    if not max_norm >= 0:  # also rejects NaN
        raise ValueError(f"max_norm must be a number >= 0, got {max_norm!r}")
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type!r}")
    reduction.finish()
    grads = [g for g in reduction.local_reduced_grads().values() if g.numel()]
    device = comm.device
    if norm_type == 2.0:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for n in torch._foreach_norm(grads, 2.0) if grads else []:
            local += n.to(device, torch.float64) ** 2
        comm.all_reduce(local.view(1), tag="clip")
        total = local.sqrt().float()
    else:
        local = torch.zeros((), dtype=torch.float32, device=device)
        for n in torch._foreach_norm(grads, float("inf")) if grads else []:
            local = torch.maximum(local, n.to(device, torch.float32))
        comm.all_reduce(local.view(1), op=dist.ReduceOp.MAX, tag="clip")
        total = local
    reduction.scale_reduced_grads_(torch.clamp(max_norm / (total + CLIP_EPS), max=1.0))
    return total
