"""Checkpoints of :class:`~muonscale.distributed.DistributedMuon`: full (unsharded) state.

Checkpoint format (a choice, documented here): ``state_dict()`` returns the **full** state,
keyed exactly like single-process :class:`muonscale.Muon`'s (``momentum_buffer`` per Muon
matrix; ``step``, ``exp_avg``, ``exp_avg_sq`` per AdamW parameter, parameter-shaped), plus
``main_param`` (parameter-shaped, main dtype) for every parameter with a main copy
(``main_params_dtype``), so that a resumed run is bit-identical:

* Why not per-rank shards: ``torch.distributed.checkpoint`` treats plain tensors under the same
  key on different ranks as replicas and keeps one of them, so shards saved as plain tensors
  are silently lost. Full tensors are true replicas: DCP writes each once, and loading at any
  world size (or into single-process ``Muon``) is a plain read, no resharding logic.
* Cost: the momentum is broadcast from its owner and AdamW shards are all-gathered at save
  time (one parameter-sized copy of the state per rank while saving).

:func:`gather_full_state` is collective; :func:`load_full_state` is local (each rank keeps the
part it holds). Both take the :class:`~.layout.DataParallelLayout`, the
:class:`~.reduction.BucketedReduction` (``streams``, ``flat_shards``, ``segments``,
``main_dtype``), the optimizer's state and its :class:`~muonscale.param_table.ParamTable`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ...declared_state import (
    MOMENTUM,
    MOMENTUM_ABSMAX,
    MOMENTUM_SCALE,
    VARIANT_STATE,
    kept_state,
    momentum_shape,
    saved_precision,
)
from ...optimizer_state import check_loaded_groups, keep_state_precisions
from ...param_table import ParamTable
from ...settings import MuonSettings
from ..comm import WireCounter
from .buckets import ExpertRange, OwnedUnit
from .layout import DataParallelLayout, expert_rows
from .reduction import BucketedReduction

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")
HELD_BESIDES_MOMENTUM = (MOMENTUM_SCALE, MOMENTUM_ABSMAX, *VARIANT_STATE)
"""The state a Muon parameter's owner may hold besides the momentum (``kept`` decides)."""


def _sharded_names(store: Any) -> tuple[str, ...]:
    """The element-wise sharded state of a flat shard or fill range: the AdamW moments, and
    ``main_param`` where it keeps main copies."""
    return ADAMW_MOMENTS + (() if store.main_param is None else ("main_param",))


@torch.no_grad()
def gather_full_state(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    param_table: ParamTable,
) -> dict[int, dict[str, torch.Tensor]]:
    """``{parameter index: state}`` for every parameter, on every rank (collective; not
    counted as a step's traffic)."""
    step_counter, layout.comm.counter = layout.comm.counter, WireCounter()
    try:
        return _gather_full_state(layout, reduction, state, param_table)
    finally:
        layout.comm.counter = step_counter


def _gather_full_state(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    param_table: ParamTable,
) -> dict[int, dict[str, torch.Tensor]]:
    full: dict[int, dict[str, torch.Tensor]] = {}
    for i in layout.muon_indices:  # momentum (and main copy) live on the owners only
        p, group = layout.params[i], layout.group_of[i]
        main_dtype = reduction.main_dtype(p.dtype)
        settings = MuonSettings.from_group(group)
        view = param_table.view(p, group["matrix_mode"])
        specs = {
            MOMENTUM.key: (
                momentum_shape(settings.state_precision, view),
                MOMENTUM.dtype(settings, main_dtype or p.dtype),
            )
        }
        if main_dtype is not None:
            specs["main_param"] = (p.shape, main_dtype)
        for spec in kept_state(settings, variants_only=True):  # on the owner, whole
            specs[spec.key] = (spec.shape(view), spec.dtype(settings, p.dtype))
        full[i] = {}
        for name, (shape, dtype) in specs.items():
            buf = torch.empty(shape, dtype=dtype, device=p.device)
            for part, owner in _owned_parts(layout, i, buf):
                if owner == layout.rank:
                    held = state[p][name]
                    if held.shape != part.shape:  # replaced by hand: never broadcast it
                        raise ValueError(
                            f"state_dict: state '{name}' of parameter "
                            f"'{param_table.label(p, layout.param_groups)}' held on rank "
                            f"{layout.rank} has shape {tuple(held.shape)}, expected "
                            f"{tuple(part.shape)}"
                        )
                    part.copy_(held)
                layout.comm.broadcast(part, src=owner, tag="checkpoint")
            full[i][name] = buf
    for shards in reduction.flat_shards:  # AdamW moments: shard r of every flat bucket
        gathered = {}
        for name in _sharded_names(shards):
            mine = getattr(shards, name)
            gathered[name] = shards.full.new_empty(shards.full.numel(), dtype=mine.dtype)
            layout.comm.all_gather(gathered[name], mine, tag="checkpoint")  # (padded,)
        flat = shards.layout
        for i, off, n in zip(flat.params, flat.offsets, flat.numels):
            p = layout.params[i]
            full[i] = {"step": state[p]["step"].clone()}
            for name in gathered:
                full[i][name] = gathered[name][off : off + n].view(p.shape).clone()
    full.update(_gather_fill_state(layout, reduction, state))
    return {i: full[i] for i in sorted(full)}


def _owned_parts(
    layout: DataParallelLayout, i: int, whole: torch.Tensor
) -> list[tuple[torch.Tensor, int]]:
    """(part of ``whole``, the rank that holds it) for a state tensor of Muon parameter ``i``:
    the tensor and the parameter's owner, or for a stack spread over several owners each
    range's rows (:func:`~.layout.expert_rows`) and its owner."""
    if i not in layout.expert_ranges:
        return [(whole, layout.owner_rank[i])]
    return [(expert_rows(whole, r), r.owner) for r in layout.expert_ranges[i]]


def _gather_fill_state(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
) -> dict[int, dict[str, torch.Tensor]]:
    """Full AdamW state (and main copies) of the parameters in stream fills (collective: one
    all-gather per moment and stream, each rank's range padded to the longest)."""
    full: dict[int, dict[str, torch.Tensor]] = {}
    for stream in reduction.streams:
        fill = stream.fill
        if fill is None:
            continue
        fill_layout, width = fill.layout, max(fill.layout.lengths)
        names = _sharded_names(fill)
        gathered = {}
        for name in names:
            mine = getattr(fill, name)
            padded = torch.zeros(width, dtype=mine.dtype, device=mine.device)
            padded[: mine.numel()].copy_(mine)
            gathered[name] = torch.empty(
                layout.world_size * width, dtype=mine.dtype, device=mine.device
            )
            layout.comm.all_gather(gathered[name], padded, tag="checkpoint")
        for i in fill_layout.params:
            p = layout.params[i]
            full[i] = {"step": state[p]["step"].clone()}
            for name in names:
                full[i][name] = torch.empty_like(p, dtype=gathered[name].dtype)
        for rank in range(layout.world_size):
            for seg in fill_layout.segments(rank):
                src = rank * width + seg.buffer_start
                for name in names:
                    full[seg.param][name].view(-1)[
                        seg.param_start : seg.param_start + seg.length
                    ] = gathered[name][src : src + seg.length]
    return full


@torch.no_grad()
def load_full_state(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    param_table: ParamTable,
    state_dict: dict[str, Any],
) -> None:
    """Take full state (keys matched through the saved param groups, as torch does) and keep
    the local part: owned momentum, this rank's AdamW segments, every step counter, and the
    main copies of those (then rounded into the model's parameters; a checkpoint without them
    leaves the main copies equal to the parameters)."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(layout.param_groups):
        raise ValueError(
            f"loaded state has {len(saved_groups)} param groups, "
            f"the optimizer {len(layout.param_groups)}"
        )
    check_loaded_groups(layout.param_groups, param_table, state_dict)  # before anything changes
    key_of: dict[int, Any] = {}
    for group, saved in zip(layout.param_groups, saved_groups):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError("loaded state dict has a parameter group of a different size")
        saved = {"algorithm": "muon", **saved}
        if saved["algorithm"] != group["algorithm"]:
            raise ValueError(
                f"loaded param group is {saved['algorithm']!r}, this one {group['algorithm']!r}"
            )
        for p, key in zip(group["params"], saved["params"]):
            key_of[layout.index_of(p)] = key
    saved_state = state_dict["state"]
    whole = _whole_shapes(layout, param_table)
    _check_whole_shapes(
        layout, param_table, whole, {i: saved_state.get(key_of[i], {}) for i in whole}
    )
    wanted = [g.get("state_precision", "param") for g in layout.param_groups]
    for group, saved in zip(layout.param_groups, saved_groups):
        for name, value in {"algorithm": "muon", **saved}.items():
            if name != "params":
                group[name] = tuple(value) if name == "betas" else value
    saved_state = _in_precisions(layout, param_table, saved_state, key_of, wanted)
    for i in layout.muon_indices:
        unit = layout.owned_unit(i)  # the parameter whole, or this rank's range of its experts
        if unit is None:
            continue
        p, held = layout.params[i], state[layout.params[i]]
        entry = saved_state.get(key_of[i], {})
        part = functools.partial(_unit_part, entry, whole[i], unit)
        source = part(MOMENTUM.key)
        buf = held[MOMENTUM.key]
        if source is None:
            buf.zero_()
        else:
            buf.copy_(source)
        if "main_param" in held:
            _load_main(held["main_param"], reduction.owned_slice(unit), part("main_param"))
        settings = MuonSettings.from_group(layout.group_of[i])  # the loaded options
        kept = kept_state(settings, variants_only=True)
        for spec in HELD_BESIDES_MOMENTUM:
            if spec not in kept:
                held.pop(spec.key, None)
                continue
            if spec.key not in held:  # built without it: the loaded options keep it
                if isinstance(unit, ExpertRange):
                    view = layout.range_view(unit)
                else:
                    view = param_table.view(p, layout.group_of[i]["matrix_mode"])
                held[spec.key] = spec.zeros(settings, view, p.dtype, p.device)
            moment = part(spec.key)
            if moment is None:
                held[spec.key].zero_()
            else:
                held[spec.key].copy_(moment)
    for i in layout.adamw_indices:
        entry = saved_state.get(key_of[i], {})
        p = layout.params[i]
        held = state[p]
        held["step"].fill_(float(entry["step"]) if "step" in entry else 0.0)
        if i not in reduction.segments:
            continue
        seg = reduction.segments[i][1]
        window = slice(seg.param_start, seg.param_start + seg.length)
        for name in ADAMW_MOMENTS:
            source = entry.get(name)
            if source is None:
                held[name].zero_()
            else:
                held[name].copy_(source.reshape(-1)[window])
        if "main_param" in held:
            source = entry.get("main_param")
            _load_main(
                held["main_param"],
                p.view(-1)[window],
                None if source is None else source.reshape(-1)[window],
            )


def _in_precisions(
    layout: DataParallelLayout,
    param_table: ParamTable,
    saved_state: Mapping[Any, dict[str, Any]],
    key_of: Mapping[int, Any],
    wanted: list[str],
) -> dict[Any, dict[str, Any]]:
    """The loaded entries (new dicts; the state dict is not changed) in this optimizer's
    ``state_precision`` per group (``wanted``), which the groups keep: state saved with
    another is converted whole, as one process converts it (quantizing a whole tensor and
    taking a range's rows equals quantizing the rows: blocks lie within rows), with
    :func:`~muonscale.optimizer_state.keep_state_precisions`' warning."""
    held = {}
    for i, key in key_of.items():
        entry = saved_state.get(key)
        if entry:
            p = layout.params[i]
            entry = dict(entry)
            momentum = entry.get(MOMENTUM.key)
            if torch.is_tensor(momentum):  # torch keeps no shapes: it may come flat
                shape = _saved_momentum_shape(layout, param_table, i, entry)
                entry[MOMENTUM.key] = momentum.reshape(shape)
            held[p] = entry
    keep_state_precisions(
        layout.param_groups,
        held,
        wanted,
        lambda p, group: param_table.view(p, group["matrix_mode"]),
        stacklevel=6,
    )
    out = dict(saved_state)
    for i, key in key_of.items():
        if layout.params[i] in held:
            out[key] = held[layout.params[i]]
    return out


def _unit_part(
    entry: Mapping[str, Any], whole: Mapping[str, torch.Size], unit: OwnedUnit, key: str
) -> torch.Tensor | None:
    """The loaded ``entry[key]`` (checked against its ``whole`` shape) of ``unit``: the whole
    tensor, or the rows of a range of experts; None when not saved."""
    source = entry.get(key)
    if source is None:
        return None
    source = source.reshape(whole[key])  # a momentum or main copy may come flat
    return expert_rows(source, unit) if isinstance(unit, ExpertRange) else source


def _whole_shapes(layout: DataParallelLayout, param_table: ParamTable) -> dict[int, dict]:
    """Per Muon index, the whole shape of each state tensor it may load: the momentum (in the
    group's ``state_precision``: the parameter's shape, or packed rows) and the main copy (the
    parameter's), and every row state (its declared shape)."""
    out = {}
    for i in layout.muon_indices:
        p, group = layout.params[i], layout.group_of[i]
        view = param_table.view(p, group["matrix_mode"])
        precision = group.get("state_precision", "param")
        out[i] = {MOMENTUM.key: torch.Size(momentum_shape(precision, view)), "main_param": p.shape}
        out[i].update({s.key: torch.Size(s.shape(view)) for s in HELD_BESIDES_MOMENTUM})
    return out


def _check_whole_shapes(
    layout: DataParallelLayout,
    param_table: ParamTable,
    whole: Mapping[int, Mapping[str, torch.Size]],
    entries: Mapping[int, Mapping[str, Any]],
) -> None:
    """ValueError naming the parameter and the key, before anything changes, unless every
    loaded state tensor of a Muon parameter has its whole shape (``whole``; the momentum that of
    the precision it was saved in; it and the main copy may come with that many elements in any
    shape: torch keeps no shapes), so that no copy into a part of it broadcasts."""
    for i, shapes in whole.items():
        for key, shape in shapes.items():
            source = entries[i].get(key)
            if key == MOMENTUM.key and torch.is_tensor(source):
                shape = torch.Size(_saved_momentum_shape(layout, param_table, i, entries[i]))
            if not torch.is_tensor(source) or source.shape == shape:
                continue
            if key in (MOMENTUM.key, "main_param") and source.numel() == shape.numel():
                continue
            label = param_table.label(layout.params[i], layout.param_groups)
            raise ValueError(
                f"load_state_dict: state '{key}' of parameter '{label}' has shape "
                f"{tuple(source.shape)}, expected {tuple(shape)}. Nothing was changed."
            )


def _saved_momentum_shape(
    layout: DataParallelLayout, param_table: ParamTable, i: int, entry: Mapping[str, Any]
) -> tuple[int, ...]:
    """The whole shape of the momentum of Muon parameter ``i`` in the loaded ``entry``, in the
    precision it was saved in."""
    view = param_table.view(layout.params[i], layout.group_of[i]["matrix_mode"])
    return momentum_shape(saved_precision(entry), view)


def _load_main(main: torch.Tensor, model: torch.Tensor, source: torch.Tensor | None) -> None:
    """Main copy from the checkpoint (else from the model's parameter), rounded into it."""
    if source is None:
        main.copy_(model)
    else:
        main.copy_(source.view(main.shape))
        model.copy_(main)
