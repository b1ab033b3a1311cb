"""One rank of a ``muonscale train --parallel dp|fsdp`` job under torchrun.

:class:`Parallelism` owns what differs from a single-process run:

- the process group (from torchrun's environment: gloo on CPU, NCCL on CUDA, with
  ``pg_timeout_s``);
- how the model is held: ``dp`` leaves it whole (``muon``: :class:`muonscale.DistributedMuon`
  reduces gradients through its own hooks; ``adamw``: DDP + ``torch.optim.AdamW``), ``fsdp``
  shards it with FSDP2 ``fully_shard`` (every block, then the root) for
  :class:`muonscale.DTensorMuon` or ``torch.optim.AdamW``;
- which rows of each global micro-batch this rank reads (rank r: rows ``[r·b, (r+1)·b)`` with
  ``b = micro_batch_size / world_size``), so the global batch is the single-process one;
- gradient accumulation without reduction, global gradient clipping;
- the per-step agreement: one all-reduce of ``[loss, SIGINT seen, SIGTERM seen]``, so every
  rank sees the same mean loss and stops at the same step boundary.

The parallelization itself is a set of functions that :mod:`muonscale.bench.distributed_worker`
uses as well: :func:`mesh_shape`, :func:`shard_fsdp`, :func:`apply_tensor_parallel`,
:func:`wrap_ddp`, :func:`gradient_sync` and :func:`clip_grad_norm_`.

Every collective goes through :class:`muonscale.distributed.Communicator`.
"""

from __future__ import annotations

import datetime
import gc
import os
import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muonscale.distributed.comm import Communicator
from muonscale.train.optimizers import adamw_for, muon_options, muon_params

__all__ = [
    "Parallelism",
    "apply_tensor_parallel",
    "clip_grad_norm_",
    "gradient_sync",
    "mesh_shape",
    "shard_fsdp",
    "torchrun_environment",
    "wrap_ddp",
]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def resolve_device(name: str) -> torch.device:
    """``"auto"``: CUDA when available, else the CPU; any other name as ``torch.device``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def torchrun_environment() -> dict[str, str]:
    """torchrun's variables; raise ``RuntimeError`` naming the missing ones."""
    missing = [name for name in TORCHRUN_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"--parallel needs the environment torchrun sets ({', '.join(missing)} missing): "
            "launch with `torchrun --nproc-per-node N -m muonscale train --parallel dp ...`"
        )
    return {name: os.environ[name] for name in TORCHRUN_VARIABLES}


def mesh_shape(parallel: str, nproc: int) -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) of ``parallel`` ("dp", "fsdp", "tp" or
    "fsdp+tp") on ``nproc`` ranks (mesh ``(dp, tp)`` row-major: the TP ranks of one replica are
    consecutive)."""
    if parallel == "tp":
        return 1, nproc
    if parallel == "fsdp+tp":
        return 2, nproc // 2
    return nproc, 1


def shard_fsdp(model: nn.Module, mesh) -> None:
    """FSDP2 ``fully_shard`` of every block, then of the root, over ``mesh``."""
    from torch.distributed.fsdp import fully_shard

    # the root module returns (logits, loss); they are never modified in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def wrap_ddp(model: nn.Module, device: torch.device, bucket_cap_mb: float = 25.0) -> nn.Module:
    """``DistributedDataParallel`` around ``model`` (the forward model of a DDP run)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb)


def apply_tensor_parallel(model: nn.Module, mesh) -> dict[str, Any]:
    """Megatron-style TP of the reference GPT on ``mesh["tp"]``, then FSDP2 over ``mesh["dp"]``
    when it has more than one rank; returns the QKV splits of the unsharded model.

    Fused QKV and MLP fc column-parallel, attention and MLP output projections row-parallel;
    embeddings, norms and head replicated. The QKV rows are interleaved by key/value group
    (``QKVLayout``), so a contiguous row shard holds whole groups: each rank's attention runs
    its local heads with the local layout."""
    import dataclasses

    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }
    tp = mesh["tp"].size()
    splits = {name: model.qkv_layout for name in model.qkv_param_names()}  # global layout
    for block in model.blocks:
        layout = block.attn.layout
        parallelize_module(block, mesh["tp"], plan)
        block.attn.layout = dataclasses.replace(layout, n_query_groups=layout.n_query_groups // tp)
    if mesh["dp"].size() > 1:  # replicated parameters become Replicate DTensors on "tp" first,
        # so that every parameter's mesh spans all ranks (FSDP then shards them over "dp")
        _replicate_on(model, mesh["tp"])
        shard_fsdp(model, mesh["dp"])
    return splits


def _replicate_on(model: nn.Module, tp_mesh) -> None:
    """Turn every parameter that is not yet a DTensor into a ``Replicate()`` DTensor on
    ``tp_mesh`` (module by module: inputs in as Replicate DTensors, outputs back as local)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(module, inputs, mesh):
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


def gradient_sync(model: nn.Module, forward_model: nn.Module, optimizer, *, reduce: bool):
    """Context of one micro-batch's backward; ``reduce=False``: keep gradients local (FSDP2's
    ``set_requires_gradient_sync``, DDP's or ``DistributedMuon``'s ``no_sync``)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(reduce)
        return nullcontext()
    if reduce:
        return nullcontext()
    if forward_model is not model:  # DDP
        return forward_model.no_sync()
    if hasattr(optimizer, "no_sync"):  # DistributedMuon's reduction hooks
        return optimizer.no_sync()
    return nullcontext()  # TP alone: the framework reduces nothing between data ranks


def clip_grad_norm_(model: nn.Module, optimizer, max_norm: float) -> None:
    """Clip the global (averaged) gradient norm to ``max_norm``."""
    if hasattr(optimizer, "clip_grad_norm_"):  # DistributedMuon: reduced gradients
        optimizer.clip_grad_norm_(max_norm)
        return
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    kinds = {isinstance(p, DTensor) for p in params}
    if len(kinds) < 2:  # DDP / FSDP2 gradients are already averaged (DTensor norms are global)
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    # TP alone mixes DTensors (sharded) and plain replicated tensors: norms one by one
    norms = [
        (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).norm() for p in params
    ]
    total = torch.stack(norms).norm()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(scale)


class Parallelism:
    """This rank's share of a data-parallel (``dp``) or FSDP2 (``fsdp``) run.

    Joins the default process group when torch.distributed is already initialized (it is
    then left to its owner), else initializes it from torchrun's environment and destroys it
    in :meth:`close`.
    """

    def __init__(self, mode: str, *, device: str, pg_timeout_s: float) -> None:
        if mode not in ("dp", "fsdp"):
            raise ValueError(f"parallel mode must be 'dp' or 'fsdp', got {mode!r}")
        self.mode = mode
        self.owns_group = not dist.is_initialized()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if self.owns_group:
            torchrun_environment()
        use_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device(device if device != "auto" else "cpu")
        if self.owns_group:
            dist.init_process_group(
                "nccl" if use_cuda else "gloo",
                timeout=datetime.timedelta(seconds=pg_timeout_s),
                device_id=self.device if use_cuda else None,
            )
        self.comm = Communicator()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.forward_model: nn.Module | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None

    def describe(self) -> str:
        backend = dist.get_backend() if dist.is_initialized() else "none"
        return f"--parallel {self.mode} on {self.world_size} ranks ({backend})"

    # ------------------------------------------------------------------ model and optimizer
    def build(self, model: nn.Module, config) -> torch.optim.Optimizer:
        """Shard or wrap ``model`` (built identically on every rank) and return its optimizer
        for ``config.optimizer`` ("muon" or "adamw"); options by keyword only."""
        self.model, self.forward_model = model, model
        model.set_expert_count_reduction(self.sum_over_ranks)
        if self.mode == "fsdp":
            from torch.distributed.device_mesh import init_device_mesh

            from muonscale.distributed.factory import distributed_muon

            shard_fsdp(model, init_device_mesh(self.device.type, (self.world_size,)))
            if config.optimizer == "muon":
                self.optimizer = distributed_muon(  # DTensor parameters: a DTensorMuon
                    muon_params(model), **muon_options(model, config)
                )
            else:
                self.optimizer = adamw_for(model, config, fused=False)
        elif config.optimizer == "muon":
            from muonscale.distributed.data_parallel import DistributedMuon

            # not wrapped in DDP: DistributedMuon reduces the gradients itself
            self.optimizer = DistributedMuon(
                muon_params(model),
                **muon_options(model, config),
                defer_gather=config.defer_gather,  # landed by the model's forward pre-hooks
                model=model,
            )
        else:
            self.forward_model = wrap_ddp(model, self.device)
            self.optimizer = adamw_for(model, config)
        return self.optimizer

    # ------------------------------------------------------------------ one step
    def rows(self, batch_size: int) -> slice:
        """The rows of a global micro-batch of ``batch_size`` that this rank reads."""
        if batch_size % self.world_size:
            raise ValueError(
                f"micro_batch_size={batch_size} must be a multiple of the number of ranks "
                f"({self.world_size}): each rank reads micro_batch_size / ranks rows of it"
            )
        share = batch_size // self.world_size
        return slice(self.rank * share, (self.rank + 1) * share)

    def accumulating(self, reduce: bool):
        """Context of one micro-batch's backward; ``reduce=False``: keep gradients local."""
        return gradient_sync(self.model, self.forward_model, self.optimizer, reduce=reduce)

    def clip_grad_norm_(self, max_norm: float) -> None:
        """Clip the global (averaged) gradient norm to ``max_norm``."""
        clip_grad_norm_(self.model, self.optimizer, max_norm)

    def agree(self, loss: torch.Tensor, signal_name: str | None) -> tuple[float, str | None]:
        """Mean loss over ranks and the signal some rank received (SIGTERM over SIGINT);
        one all-reduce, so every rank gets the same answer."""
        flags = torch.zeros(3, dtype=torch.float64, device=self.comm.device)
        flags[0] = loss.to(flags.device, torch.float64)
        flags[1] = float(signal_name == "SIGINT")
        flags[2] = float(signal_name == "SIGTERM")
        self.comm.all_reduce(flags, tag="control")
        values = flags.tolist()
        agreed = "SIGTERM" if values[2] else ("SIGINT" if values[1] else None)
        return values[0] / self.world_size, agreed

    def sum_over_ranks(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (the MoE blocks' routed-token counts)."""
        self.comm.all_reduce(tensor, tag="control")

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (one all-reduce)."""
        value = torch.tensor([0 if flag else 1], dtype=torch.int32, device=self.comm.device)
        self.comm.all_reduce(value, op=dist.ReduceOp.MAX, tag="control")
        return not bool(value.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return self.comm.all_gather_object(obj if self.rank == 0 else None)[0]

    def barrier(self) -> None:
        self.comm.barrier()

    def close(self) -> None:
        """Release the optimizer's hooks and this object's model and optimizer; destroy the
        process group when this object made it. FSDP2 and the distributed optimizers hold
        process groups: collected before the destroy, the groups end there, not at interpreter
        exit, where a gloo group still alive can abort the process (*Train* in the docs)."""
        optimizer, self.optimizer = self.optimizer, None
        if hasattr(optimizer, "remove_hooks"):
            optimizer.remove_hooks()
        del optimizer
        self.model = self.forward_model = None
        gc.collect()
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
