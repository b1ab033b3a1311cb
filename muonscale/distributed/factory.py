"""``distributed_muon(params, ...)``: the data-parallel optimizer that fits the parameters —
:class:`~.dtensor.DTensorMuon` for DTensor parameters (FSDP2, tensor parallel), else
:class:`~.data_parallel.DistributedMuon`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .data_parallel import DistributedMuon
from .dtensor import DTensorMuon
from .setup_checks import is_dtensor

_DATA_PARALLEL_ONLY = ("reduce_dtype", "main_params_dtype", "bucket_cap_mb", "wire_counter")
_WHY = {
    "reduce_dtype": "their gradients are reduced by FSDP2 (set its "
    "MixedPrecisionPolicy(reduce_dtype=...) instead)",
    "main_params_dtype": "set FSDP2's MixedPrecisionPolicy instead",
    "bucket_cap_mb": "the sharding framework buckets their gradients",
    "wire_counter": "DTensorMuon counts its own bytes (last_step_wire_bytes)",
}


def _holds_dtensor(params: Any) -> bool:
    """Whether any parameter of a ``params`` argument (a module, tensors, (name, tensor) pairs
    or param groups) is a DTensor."""
    if isinstance(params, torch.nn.Module):
        return any(is_dtensor(p) for p in params.parameters())
    for entry in params:
        if isinstance(entry, Mapping):
            inner = entry["params"]
            if _holds_dtensor([inner] if isinstance(inner, torch.Tensor) else list(inner)):
                return True
        elif isinstance(entry, tuple) and len(entry) == 2:
            if is_dtensor(entry[1]):
                return True
        elif is_dtensor(entry):
            return True
    return False


def distributed_muon(
    params: Any, process_group: dist.ProcessGroup | None = None, **options: Any
) -> DistributedMuon | DTensorMuon:
    """Build data-parallel Muon for ``params`` (as :class:`muonscale.Muon` takes them).

    DTensor parameters (FSDP2 ``fully_shard``, ``parallelize_module``) get a
    :class:`~muonscale.distributed.DTensorMuon`: the sharding framework reduces their gradients
    and whole matrices go to owners by all-to-all; ``DistributedMuon``'s own options
    (``reduce_dtype``, ``main_params_dtype``, ``bucket_cap_mb``, ``wire_counter``) are refused
    there. Plain tensors get a :class:`~muonscale.distributed.DistributedMuon`, which refuses
    ``approximate_per_shard``. ``options`` are the chosen class's keyword arguments.
    """
    materialized = params if isinstance(params, torch.nn.Module) else list(params)
    if _holds_dtensor(materialized):
        for name in _DATA_PARALLEL_ONLY:
            if options.get(name) is not None:
                raise ValueError(f"{name} does not apply to DTensor parameters: {_WHY[name]}")
            options.pop(name, None)
        return DTensorMuon(materialized, process_group=process_group, **options)
    if "approximate_per_shard" in options:
        raise ValueError(
            "approximate_per_shard applies to DTensor parameters only (these are plain tensors)"
        )
    return DistributedMuon(materialized, process_group, **options)
