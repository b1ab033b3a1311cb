"""Checks made while building a data-parallel optimizer: DTensor parameters, a launcher without
a process group, a DDP-wrapped model, and ranks that built different parameter lists."""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from .comm import Communicator


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` (a tensor or parameter) is a DTensor."""
    return isinstance(t, DTensor) or isinstance(getattr(t, "data", None), DTensor)


def check_process_group(process_group: dist.ProcessGroup | None, what: str) -> None:
    """Refuse to run as world size 1 when a launcher started several processes: ``WORLD_SIZE``
    > 1 in the environment (torchrun, accelerate, Lightning set it) but no process group."""
    world = os.environ.get("WORLD_SIZE", "1")
    initialized = dist.is_available() and dist.is_initialized()
    if process_group is None and not initialized and world.isdigit() and int(world) > 1:
        raise RuntimeError(
            f"{what}: WORLD_SIZE={world} in the environment but no process group is "
            "initialized, so every rank would train alone. Call "
            "torch.distributed.init_process_group(...) before building the optimizer (with "
            "Hugging Face, create the TrainingArguments first; with Lightning, build it in "
            "configure_optimizers)."
        )


def unwrap_ddp(params: Any) -> tuple[Any, bool]:
    """(the module inside a DDP wrapper, True) or (params, False)."""
    if isinstance(params, torch.nn.parallel.DistributedDataParallel):
        return params.module, True
    return params, False


def require_same_parameters(comm: Communicator, world_size: int, signature: list[tuple]) -> None:
    """Raise naming the first difference unless every rank holds the same parameter list
    (``signature``: one (name, shape, dtype, algorithm) per parameter)."""
    digest = hashlib.sha256(repr(signature).encode()).digest()
    mine = torch.tensor(
        [int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=comm.device
    )
    every = torch.empty(world_size, dtype=torch.int64, device=comm.device)
    comm.all_gather(every, mine, tag="setup")
    if bool((every == every[0]).all()):
        return
    signatures = comm.all_gather_object(signature)
    reference = signatures[0]
    for rank, other in enumerate(signatures):
        for i in range(max(len(reference), len(other))):
            a = reference[i] if i < len(reference) else None
            b = other[i] if i < len(other) else None
            if a != b:
                raise ValueError(
                    f"DistributedMuon: the parameter lists differ between ranks: parameter #{i} "
                    f"is {a} on rank 0 but {b} on rank {rank} (name, shape, dtype, algorithm). "
                    "Every rank must build the same model and optimizer."
                )
    raise ValueError("DistributedMuon: the parameter lists differ between ranks")
