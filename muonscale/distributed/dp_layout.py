"""This rank's side of ``DistributedMuon``'s layout: the communicator that knows every rank's
host; the checks that the parameters are plain contiguous tensors, alike on every rank (at
construction) and still fit the buffers (at rebind); the state this rank creates from the
owners and its AdamW segments; the owner layout's figures. Functions of the optimizer's
public layout (``params``, ``group_of``, ``muon_indices``, ``adamw_indices``, ``owner_rank``,
``rank``, ``comm``, ``reduction``), called by that class.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from ..declared_state import MOMENTUM, kept_state
from ..settings import MuonSettings
from .comm import Communicator, WireCounter
from .dp_step import segment_of
from .hosts import discover_host_map
from .ownership import format_ownership_table, rank_loads
from .setup_checks import is_dtensor, require_same_parameters, require_same_values


def communicator(group, counter: WireCounter, host_map) -> Communicator:
    """The group's communicator, knowing the host of every rank (collective)."""
    comm = Communicator(group, counter)
    if not comm.active or dist.get_backend(comm.group) == "fake":
        if host_map is not None and len(host_map) != comm.world_size:
            raise ValueError(
                f"host_map has {len(host_map)} entries, expected one per rank of the "
                f"group ({comm.world_size})"
            )
        return comm
    return Communicator(group, counter, hosts=discover_host_map(comm, host_map))


def check_parameters(
    comm: Communicator,
    params: list[torch.Tensor],
    groups: list[dict[str, Any]],
    names: list[str],
    sends_update: Callable[[torch.Tensor, dict[str, Any]], bool],
) -> None:
    """Plain contiguous tensors only; every rank must hold the same parameter list (name,
    shape, dtype, algorithm, whether its update is gathered) with the same initial values:
    raise naming the first difference. The agreement is skipped on torch's fake process
    group (one process alone)."""
    for p, name in zip(params, names):
        if is_dtensor(p):
            raise ValueError(
                f"DistributedMuon takes plain tensors, but parameter '{name}' is a DTensor "
                "(FSDP2 / tensor parallel): build the optimizer with "
                "muonscale.distributed_muon(...), which returns a DTensorMuon for DTensor "
                "parameters"
            )
        if not p.is_contiguous():
            raise ValueError(f"DistributedMuon needs contiguous parameters; '{name}' is not")
    if not comm.active or dist.get_backend(comm.group) == "fake":
        return
    signature = [
        (name, tuple(p.shape), str(p.dtype), g["algorithm"], sends_update(p, g))
        for p, g, name in zip(params, groups, names)
    ]
    step_counter, comm.counter = comm.counter, WireCounter()  # not a step's traffic
    try:
        require_same_parameters(comm, comm.world_size, signature)
        require_same_values(comm, params, names)
    finally:
        comm.counter = step_counter


def check_rebind(bound: list[torch.Tensor], new: list[torch.Tensor], names: list[str]) -> None:
    """Refuse new parameter objects the buffers cannot follow (a DTensor; another dtype or
    device; not contiguous), naming the first."""
    for old, now, name in zip(bound, new, names):
        if now is old:
            continue
        if is_dtensor(now):
            raise ValueError(
                f"DistributedMuon: parameter '{name}' is now a DTensor (the model was sharded "
                "after the optimizer was built): build the optimizer on the sharded model "
                "with muonscale.distributed_muon(...), which returns a DTensorMuon"
            )
        if now.dtype != old.dtype or now.device != old.device or not now.is_contiguous():
            raise ValueError(
                f"DistributedMuon: parameter '{name}' changed dtype or device or is not "
                f"contiguous ({old.dtype}, {old.device} -> {now.dtype}, {now.device}); the "
                "buffers were planned for the old one: build a new optimizer"
            )


@torch.no_grad()
def init_local_state(opt: Any, matrix_view: Callable) -> dict[int, torch.Tensor]:
    """Create this rank's state now (owned momentum, AdamW shard views, every step counter,
    main copies), so that no rank's state is empty (DCP's ``get_state_dict`` would otherwise
    call ``step()`` on that rank alone). Returns the model parameter of each main copy, by
    ``id`` of the copy. ``matrix_view(p, group)``: the optimizer's view of ``p``."""
    model_of = {}
    for i in opt.muon_indices:
        p, group = opt.params[i], opt.group_of[i]
        state = opt.state[p]
        state["owner_rank"] = opt.owner_rank[i]
        if opt.owner_rank[i] == opt.rank:
            main_dtype = opt.reduction.main_dtype(p.dtype)
            settings = MuonSettings.from_group(group)
            state[MOMENTUM.key] = torch.zeros_like(
                p,
                dtype=MOMENTUM.dtype(settings, main_dtype or p.dtype),
                memory_format=torch.preserve_format,
            )
            for spec in kept_state(settings, variants_only=True):  # on the owner
                state[spec.key] = spec.zeros(settings, matrix_view(p, group), p.dtype, p.device)
            if main_dtype is not None:  # the whole matrix: this rank updates it
                main = torch.empty_like(p, dtype=main_dtype).copy_(p)
                state["main_param"] = main
                model_of[id(main)] = p
    for i in opt.adamw_indices:
        p = opt.params[i]
        state = opt.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if i in opt.reduction.segments:  # a flat-bucket shard or a stream fill range
            store, seg = opt.reduction.segments[i]
            window = slice(seg.buffer_start, seg.buffer_start + seg.length)
            state["exp_avg"] = store.exp_avg[window]
            state["exp_avg_sq"] = store.exp_avg_sq[window]
            if store.main_param is not None:
                state["main_param"] = store.main_param[window]
                state["main_param"].copy_(segment_of(p, seg))
    return model_of


def ownership_table(opt: Any, names: list[str]) -> str:
    """Which rank owns which Muon parameter (``names``: of the Muon parameters), with NS FLOPs
    and elements per rank."""
    shapes = [opt.matrix_shapes_by_index[i] for i in opt.muon_indices]
    owners = [opt.owner_rank[i] for i in opt.muon_indices]
    numels = [opt.params[i].numel() for i in opt.muon_indices]
    table = format_ownership_table(names, shapes, owners, opt.world_size, numels=numels)
    stats = layout_stats(opt)
    return (
        f"{table}\nowner streams: {stats['stream_elements']} elements per rank, "
        f"{stats['fill_elements']} of them AdamW fill, {stats['padding_elements']} padding"
    )


def layout_stats(opt: Any) -> dict[str, Any]:
    """Owner layout figures: ``ns_flops`` and ``muon_elements`` per rank (owned Muon
    parameters), and over every owner stream: ``stream_elements`` (T per rank),
    ``fill_elements`` (AdamW elements riding in the streams) and ``padding_elements``
    (zeros in the buffers, Σ over ranks; sent by NCCL's native collectives only)."""
    shapes = [opt.matrix_shapes_by_index[i] for i in opt.muon_indices]
    owners = [opt.owner_rank[i] for i in opt.muon_indices]
    elements = [0] * opt.world_size
    for i in opt.muon_indices:
        elements[opt.owner_rank[i]] += opt.params[i].numel()
    return {
        "ns_flops": rank_loads(shapes, owners, opt.world_size),
        "muon_elements": elements,
        "stream_elements": sum(s.layout.length for s in opt.reduction.streams),
        "fill_elements": sum(s.layout.fill.numel for s in opt.reduction.streams),
        "padding_elements": sum(s.layout.padding() for s in opt.reduction.streams),
    }


def expected_readiness(params: list[torch.Tensor], model: Any, given: Iterable[int]) -> list[int]:
    """Indices of ``params`` in the order backward is expected to make their gradients ready,
    as DDP assumes before its first step: the reverse of the model's registration order
    (``model``, when it is a module: a DDP wrapper lists the same order), else of the order
    the parameters were given in (``given``: their ids in that order); parameters in neither
    come last."""
    index = {id(p): i for i, p in enumerate(params)}
    source = [id(p) for p in model.parameters()] if isinstance(model, torch.nn.Module) else given
    seen = [index[k] for k in dict.fromkeys(source) if k in index]
    known = set(seen)
    return seen[::-1] + [i for i in range(len(params)) if i not in known]
