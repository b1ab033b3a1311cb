"""Checks made while building a data-parallel optimizer: DTensor parameters, a launcher without
a process group, a DDP-wrapped model, and ranks that built different parameter lists."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .agreement import digests_agree

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
    (``signature``: one (name, shape, dtype, algorithm, sends its update) per parameter)."""
    if digests_agree(comm, signature):
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
                    f"is {a} on rank 0 but {b} on rank {rank} (name, shape, dtype, algorithm, "
                    "sends its update). Every rank must build the same model and optimizer."
                )
    raise ValueError("DistributedMuon: the parameter lists differ between ranks")


_WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHECKSUM_CHUNK = 1 << 22  # elements per pass (bounds the int64 temporaries)


def value_checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 checksums of ``t``'s bits on its device: Σ w and Σ (k mod 65521 + 1)·w over its
    machine words w (wrapping sums, so independent of the summation order)."""
    flat = t.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    words = flat.view(_WORD[flat.element_size()])
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHECKSUM_CHUNK):
        w = words[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        k = torch.arange(start, start + w.numel(), device=w.device) % 65521 + 1
        out[0] += w.sum()
        out[1] += (w * k).sum()
    return out


def require_same_values(comm: Communicator, params: list[torch.Tensor], names: list[str]) -> None:
    """Raise naming the first parameter whose initial values differ between ranks: replicas
    that start apart would never meet again once only updates are exchanged (collective: one
    all-gather of two int64 per parameter)."""
    if not params:
        return
    mine = torch.stack([value_checksum(p).to(comm.device) for p in params])  # (P, 2)
    every = torch.empty(comm.world_size * mine.numel(), dtype=torch.int64, device=comm.device)
    comm.all_gather(every, mine.reshape(-1), tag="setup")
    every = every.view(comm.world_size, len(params), 2)
    differs = (every != every[0]).any(dim=2)  # (N, P)
    if bool(differs.any()):
        first = int(differs.any(dim=0).nonzero()[0])
        ranks = differs[:, first].nonzero().flatten().tolist()
        raise ValueError(
            f"DistributedMuon: parameter '{names[first]}' holds different initial values on "
            f"rank(s) {ranks} than on rank 0. Replicas must start identical: seed every rank "
            "alike, or broadcast the weights from rank 0, before building the optimizer."
        )
