"""The layout of ``DistributedMuon`` over its data-parallel group, owned by one object:
:class:`DataParallelLayout` (every parameter and its group, which are Muon's and AdamW's, the
owner of each Muon matrix, the communicator that knows every rank's host, and the main copies'
model parameters), with the checks that the parameters are plain contiguous tensors, alike on
every rank (at construction) and still fit the buffers (at rebind), the state this rank creates
from the owners and its AdamW segments, and the owner layout's figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...declared_state import MOMENTUM, kept_state
from ...settings import MuonSettings
from ..agreement import require_same_options
from ..comm import Communicator, WireCounter
from ..hosts import discover_host_map
from ..ownership import assign_owners, format_ownership_table, rank_loads
from ..setup_checks import is_dtensor, require_same_parameters, require_same_values
from .reduction import BucketedReduction


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
    options: dict[str, Any],
) -> None:
    """Plain contiguous tensors only; every rank must hold the same parameter list (name,
    shape, dtype, algorithm, whether its update is gathered) with the same initial values, and
    the same ``options`` (those that shape the collectives): raise naming the first
    difference. The agreement is skipped on torch's fake process group (one process alone)."""
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
        require_same_options(comm, options, "DistributedMuon")
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


class DataParallelLayout:
    """Who holds what over the data-parallel group, built once per optimizer.

    Args:
        param_groups: the optimizer's param groups (every parameter, in param-group order).
        comm: the group's :class:`~muonscale.distributed.comm.Communicator`.
        matrix_view: ``matrix_view(p, group)``, the optimizer's :class:`~muonscale.MatrixView`
            of a parameter (its matrices' shapes set the owners' Newton–Schulz FLOPs).

    Attributes:
        param_groups: the optimizer's param groups.
        params: every parameter, in param-group order; ``group_of[i]`` is the group of
            ``params[i]``; ``muon_indices`` / ``adamw_indices`` index into it; ``owner_rank``
            maps each Muon index to its owner rank (FLOP-balanced: :mod:`..ownership`), and
            ``matrix_shapes_by_index`` to its matrices' shapes.
        comm, rank, world_size: the group.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        comm: Communicator,
        matrix_view: Callable[[torch.Tensor, Mapping[str, Any]], Any],
    ) -> None:
        self.comm, self.rank, self.world_size = comm, comm.rank, comm.world_size
        self._model_of: dict[int, torch.Tensor] = {}  # id(main copy) -> model parameter
        self.params: list[torch.Tensor] = []
        self.group_of: list[dict[str, Any]] = []
        self._index: dict[int, int] = {}
        self.rebind_groups(param_groups, [p for g in param_groups for p in g["params"]])
        self.muon_indices = [i for i, g in enumerate(self.group_of) if g["algorithm"] == "muon"]
        self.adamw_indices = [i for i, g in enumerate(self.group_of) if g["algorithm"] == "adamw"]
        shapes = [
            matrix_view(self.params[i], self.group_of[i]).matrix_shapes for i in self.muon_indices
        ]
        sizes = [self.params[i].numel() * self.params[i].element_size() for i in self.muon_indices]
        owners = assign_owners(shapes, self.world_size, sizes=sizes)
        self.owner_rank: dict[int, int] = dict(zip(self.muon_indices, owners))
        self.matrix_shapes_by_index = dict(zip(self.muon_indices, shapes))

    def index_of(self, p: torch.Tensor) -> int:
        """Position of parameter ``p`` in :attr:`params`."""
        return self._index[id(p)]

    def find(self, p: torch.Tensor) -> int | None:
        """Position of ``p`` in :attr:`params`, None for a tensor that is not one of them."""
        return self._index.get(id(p))

    def owns(self, i: int) -> bool:
        """Whether this rank owns Muon parameter ``i``."""
        return self.owner_rank[i] == self.rank

    def model_param(self, p: torch.Tensor) -> torch.Tensor:
        """The model parameter that ``p`` (a main copy, or the parameter itself) stands for."""
        return self._model_of.get(id(p), p)

    def rebind_groups(self, param_groups: list[dict[str, Any]], params: list[torch.Tensor]) -> None:
        """Follow new parameter objects (``params``, in param-group order) or new group dicts:
        indices, groups, and the main copies' model parameters."""
        new_of = {id(old): new for old, new in zip(self.params, params)}
        self._model_of = {k: new_of.get(id(v), v) for k, v in self._model_of.items()}
        self.param_groups = param_groups
        self.params = list(params)
        self.group_of = [g for g in param_groups for _ in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    @torch.no_grad()
    def init_local_state(
        self,
        state: Mapping[torch.Tensor, dict[str, Any]],
        reduction: BucketedReduction,
        matrix_view: Callable[[torch.Tensor, Mapping[str, Any]], Any],
    ) -> None:
        """Create this rank's state now (owned momentum, AdamW shard views, every step counter,
        main copies), so that no rank's state is empty (DCP's ``get_state_dict`` would otherwise
        call ``step()`` on that rank alone); the main copies' model parameters are recorded."""
        for i in self.muon_indices:
            p, group = self.params[i], self.group_of[i]
            held = state[p]
            held["owner_rank"] = self.owner_rank[i]
            if not self.owns(i):
                continue
            main_dtype = reduction.main_dtype(p.dtype)
            settings = MuonSettings.from_group(group)
            held[MOMENTUM.key] = torch.zeros_like(
                p,
                dtype=MOMENTUM.dtype(settings, main_dtype or p.dtype),
                memory_format=torch.preserve_format,
            )
            for spec in kept_state(settings, variants_only=True):  # on the owner
                held[spec.key] = spec.zeros(settings, matrix_view(p, group), p.dtype, p.device)
            if main_dtype is not None:  # the whole matrix: this rank updates it
                main = torch.empty_like(p, dtype=main_dtype).copy_(p)
                held["main_param"] = main
                self._model_of[id(main)] = p
        for i in self.adamw_indices:
            p = self.params[i]
            held = state[p]
            held["step"] = torch.tensor(0.0, dtype=torch.float32)
            if i in reduction.segments:  # a flat-bucket shard or a stream fill range
                store, seg = reduction.segments[i]
                window = slice(seg.buffer_start, seg.buffer_start + seg.length)
                held["exp_avg"] = store.exp_avg[window]
                held["exp_avg_sq"] = store.exp_avg_sq[window]
                if store.main_param is not None:
                    held["main_param"] = store.main_param[window]
                    held["main_param"].copy_(segment_of(p, seg))

    def ownership_table(self, names: list[str], reduction: BucketedReduction) -> str:
        """Which rank owns which Muon parameter (``names``: of the Muon parameters), with NS
        FLOPs and elements per rank."""
        shapes = [self.matrix_shapes_by_index[i] for i in self.muon_indices]
        owners = [self.owner_rank[i] for i in self.muon_indices]
        numels = [self.params[i].numel() for i in self.muon_indices]
        table = format_ownership_table(names, shapes, owners, self.world_size, numels=numels)
        stats = self.stats(reduction)
        return (
            f"{table}\nowner streams: {stats['stream_elements']} elements per rank, "
            f"{stats['fill_elements']} of them AdamW fill, {stats['padding_elements']} padding"
        )

    def stats(self, reduction: BucketedReduction) -> dict[str, Any]:
        """Owner layout figures: ``ns_flops`` and ``muon_elements`` per rank (owned Muon
        parameters), and over every owner stream of ``reduction``: ``stream_elements`` (T per
        rank), ``fill_elements`` (AdamW elements riding in the streams) and
        ``padding_elements`` (zeros in the buffers, Σ over ranks; sent by NCCL's native
        collectives only)."""
        shapes = [self.matrix_shapes_by_index[i] for i in self.muon_indices]
        owners = [self.owner_rank[i] for i in self.muon_indices]
        elements = [0] * self.world_size
        for i in self.muon_indices:
            elements[self.owner_rank[i]] += self.params[i].numel()
        return {
            "ns_flops": rank_loads(shapes, owners, self.world_size),
            "muon_elements": elements,
            "stream_elements": sum(s.layout.length for s in reduction.streams),
            "fill_elements": sum(s.layout.fill.numel for s in reduction.streams),
            "padding_elements": sum(s.layout.padding() for s in reduction.streams),
        }


def segment_of(p: torch.Tensor, seg: Any) -> torch.Tensor:
    """This rank's segment of parameter ``p`` (a flat view)."""
    return p.view(-1)[seg.param_start : seg.param_start + seg.length]


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
