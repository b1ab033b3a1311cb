"""The layout of ``DistributedMuon`` over its data-parallel group, owned by one object:
:class:`DataParallelLayout` (every parameter and its group, which are Muon's and AdamW's, the
owner of each Muon matrix (a parameter owned whole, or a range of the experts of a stack), the
communicator that knows every rank's host, and the main copies'
model parameters), with the checks that the parameters are plain contiguous tensors, alike on
every rank (at construction) and still fit the buffers (at rebind), the state this rank creates
from the owners and its AdamW segments, and the owner layout's figures.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...declared_state import MOMENTUM, kept_state, zero_momentum
from ...matrices import MatrixView
from ...settings import MuonSettings
from ..agreement import require_same_options
from ..comm import Communicator, WireCounter
from ..hosts import discover_host_map
from ..ownership import assign_expert_ranges, format_ownership_table, rank_loads, rank_totals
from ..setup_checks import is_dtensor, require_same_parameters, require_same_values
from .buckets import ExpertRange, OwnedUnit
from .quantized_shards import CODE_BUFFERS, SharedBlockScales
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
            maps each Muon index owned whole to its owner rank (not the stacks spread over
            several owners), ``expert_ranges`` each expert
            stack spread over several owners to its :class:`~.buckets.ExpertRange` s (one per
            owner; FLOP-balanced per expert: :mod:`..ownership`), and
            ``matrix_shapes_by_index`` each Muon index to its matrices' shapes.
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
        views = [matrix_view(self.params[i], self.group_of[i]) for i in self.muon_indices]
        shapes = [view.matrix_shapes for view in views]
        sizes = [self.params[i].numel() * self.params[i].element_size() for i in self.muon_indices]
        experts = [view.experts or 1 for view in views]
        ranges = assign_expert_ranges(shapes, experts, self.world_size, sizes=sizes)
        self.owner_rank: dict[int, int] = {}
        self.expert_ranges: dict[int, list[ExpertRange]] = {}
        self._range_views: dict[ExpertRange, MatrixView] = {}
        for i, view, owned in zip(self.muon_indices, views, ranges):
            if len(owned) == 1:  # one owner: the parameter whole, as any other
                self.owner_rank[i] = owned[0][0]
                continue
            self.expert_ranges[i] = [expert_range(i, view, *r) for r in owned]
            for r in self.expert_ranges[i]:
                self._range_views[r] = view.experts_view(r.stop - r.first)
        self.held_ranges: dict[int, ExpertRange] = {
            r.param: r for rs in self.expert_ranges.values() for r in rs if r.owner == self.rank
        }
        """This rank's experts of each stack spread over several owners (one range each)."""
        self._range_of: dict[int, ExpertRange] = {}  # id(main copy or slice) -> its range
        self.matrix_shapes_by_index = dict(zip(self.muon_indices, shapes))

    def index_of(self, p: torch.Tensor) -> int:
        """Position of parameter ``p`` in :attr:`params`."""
        return self._index[id(p)]

    def owned_unit(self, i: int) -> OwnedUnit | None:
        """What this rank steps of Muon parameter ``i``: ``i`` (owned whole), its range of
        experts, or None."""
        if i in self.held_ranges:
            return self.held_ranges[i]
        return i if self.owner_rank.get(i) == self.rank else None

    def units_of(self, i: int) -> list[OwnedUnit]:
        """Every owned unit of Muon parameter ``i`` (on any rank), in expert order."""
        return list(self.expert_ranges.get(i, [i]))

    def range_of(self, t: torch.Tensor) -> ExpertRange | None:
        """The expert range that ``t`` (a range's main copy or slice being stepped) stands for;
        None for anything else."""
        return self._range_of.get(id(t))

    def unit_of(self, t: torch.Tensor) -> OwnedUnit | None:
        """The owned unit that ``t`` is: a parameter's index, a range of experts (its main
        copy or its slice being stepped), or None."""
        return self._range_of.get(id(t), self._index.get(id(t)))

    def range_view(self, r: ExpertRange) -> MatrixView:
        """The expert view of the sub-stack ``r``."""
        return self._range_views[r]

    @contextlib.contextmanager
    def stepping(self, units: list[OwnedUnit], targets: list[torch.Tensor]) -> Iterator[None]:
        """While ``targets`` (slices of their parameters, for expert ranges) are stepped, they
        stand for their units: :meth:`model_param` and :meth:`range_of` know them."""
        added = [
            (t, u)
            for u, t in zip(units, targets)
            if isinstance(u, ExpertRange) and id(t) not in self._range_of
        ]
        for t, u in added:
            self._range_of[id(t)], self._model_of[id(t)] = u, self.params[u.param]
        try:
            yield
        finally:
            for t, _ in added:
                del self._range_of[id(t)], self._model_of[id(t)]

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
        block_scales: SharedBlockScales,
    ) -> None:
        """Create this rank's state now (owned momentum, AdamW shard views, every step counter,
        main copies), so that no rank's state is empty (DCP's ``get_state_dict`` would otherwise
        call ``step()`` on that rank alone); the main copies' model parameters are recorded.
        8-bit AdamW moments: views of the stores' codes and ``block_scales``' absmax."""
        for i in self.muon_indices:
            p, group = self.params[i], self.group_of[i]
            held = state[p]  # an entry on every rank, owner or not
            unit = self.owned_unit(i)
            if unit is None:
                continue
            rng = unit if isinstance(unit, ExpertRange) else None
            view = matrix_view(p, group) if rng is None else self.range_view(rng)
            owned = reduction.owned_slice(unit)  # the parameter, or its range of experts
            main_dtype = reduction.main_dtype(p.dtype)
            settings = MuonSettings.from_group(group)
            dtype = main_dtype or p.dtype
            held[MOMENTUM.key] = zero_momentum(owned, settings, dtype, lambda v=view: v)
            for spec in kept_state(settings, variants_only=True):  # on the owner
                held[spec.key] = spec.zeros(settings, view, p.dtype, p.device)
            if main_dtype is not None:  # the whole matrices: this rank updates them
                main = torch.empty_like(owned, dtype=main_dtype).copy_(owned)
                held["main_param"] = main
                self._model_of[id(main)] = p
                if rng is not None:
                    self._range_of[id(main)] = rng
        for i in self.adamw_indices:
            p = self.params[i]
            held = state[p]
            held["step"] = torch.tensor(0.0, dtype=torch.float32)
            if i in reduction.segments:  # a flat-bucket shard or a stream fill range
                store, seg = reduction.segments[i]
                window = slice(seg.buffer_start, seg.buffer_start + seg.length)
                if i in reduction.quantized_adamw:
                    for name, buffer in CODE_BUFFERS.items():
                        held[name] = getattr(store, buffer)[window]
                    held.update(block_scales.zero_state(i, p.device))
                else:
                    held["exp_avg"] = store.exp_avg[window]
                    held["exp_avg_sq"] = store.exp_avg_sq[window]
                if store.main_param is not None:
                    held["main_param"] = store.main_param[window]
                    held["main_param"].copy_(segment_of(p, seg))

    def ownership_table(self, names: list[str], reduction: BucketedReduction) -> str:
        """Which rank owns which Muon parameter (``names``: of the Muon parameters) or range
        of experts, with NS FLOPs and elements per rank."""
        name_of = dict(zip(self.muon_indices, names))
        units = self._units()
        labels = [
            name_of[u.param] + f" [experts {u.first}:{u.stop}]"
            if isinstance(u, ExpertRange)
            else name_of[u]
            for u in units
        ]
        shapes, owners, numels = self._unit_columns(units)
        table = format_ownership_table(labels, shapes, owners, self.world_size, numels=numels)
        stats = self.stats(reduction)
        return (
            f"{table}\nowner streams: {stats['stream_elements']} elements per rank, "
            f"{stats['fill_elements']} of them AdamW fill, {stats['padding_elements']} padding"
        )

    def stats(self, reduction: BucketedReduction) -> dict[str, Any]:
        """Owner layout figures: ``ns_flops`` and ``muon_elements`` per rank (owned Muon
        parameters and ranges of experts), and over every owner stream of ``reduction``:
        ``stream_elements`` (T per rank), ``fill_elements`` (AdamW elements riding in the
        streams) and ``padding_elements`` (zeros in the buffers, Σ over ranks; sent by NCCL's
        native collectives only)."""
        shapes, owners, numels = self._unit_columns(self._units())
        return {
            "ns_flops": rank_loads(shapes, owners, self.world_size),
            "muon_elements": rank_totals(numels, owners, self.world_size),
            "stream_elements": sum(s.layout.length for s in reduction.streams),
            "fill_elements": sum(s.layout.fill.numel for s in reduction.streams),
            "padding_elements": sum(s.layout.padding() for s in reduction.streams),
        }

    def _units(self) -> list[OwnedUnit]:
        return [u for i in self.muon_indices for u in self.units_of(i)]

    def _unit_columns(self, units: list[OwnedUnit]) -> tuple[list, list[int], list[int]]:
        """Matrix shapes, owner rank and elements of each owned unit."""
        shapes, owners, numels = [], [], []
        for u in units:
            if isinstance(u, ExpertRange):
                shapes.append(self._range_views[u].matrix_shapes)
                owners.append(u.owner)
                numels.append(u.numel)
            else:
                shapes.append(self.matrix_shapes_by_index[u])
                owners.append(self.owner_rank[u])
                numels.append(self.params[u].numel())
        return shapes, owners, numels


def expert_range(i: int, view: MatrixView, owner: int, first: int, stop: int) -> ExpertRange:
    """Experts ``[first, stop)`` of parameter ``i``, an expert stack seen by ``view``."""
    count = view.experts or 1
    shape = view.param_shape
    numel = math.prod(shape) // count
    rows = shape[0] // count  # a 3-D stack: 1 (dim 0 indexes experts); 2-D: each expert's rows
    sub = ((stop - first) * rows, *shape[1:])
    return ExpertRange(i, first, stop, count, owner, first * numel, (stop - first) * numel, sub)


def expert_rows(tensor: torch.Tensor, r: ExpertRange, what: str = "state") -> torch.Tensor:
    """The part of a whole stack's state ``tensor`` (momentum, main copy: the parameter's
    shape; a row state: one entry per row of the expert matrices, in expert order) that
    belongs to the experts of ``r``: dim 0 holds the stack's experts one after another.
    Raises ValueError (naming ``what``) when dim 0 does not split into the stack's experts."""
    if tensor.dim() == 0 or tensor.shape[0] % r.count:
        raise ValueError(
            f"{what}: shape {tuple(tensor.shape)} does not split into {r.count} experts along dim 0"
        )
    per = tensor.shape[0] // r.count
    return tensor.narrow(0, r.first * per, (r.stop - r.first) * per)


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
