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
``main_dtype``), the optimizer's state, its :class:`~muonscale.param_table.ParamTable` and
its :class:`~.quantized_shards.SharedBlockScales` (a column parameter's absmax: those of the
blocks its piece touches, the replicated layout's).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...block_quantization import scale_shape
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
from ...quantized_state import ADAMW_MOMENTS as QUANTIZED_MOMENTS
from ...quantized_state import adamw_block_shape
from ...settings import MuonSettings
from ..comm import WireCounter
from .buckets import ExpertRange, OwnedUnit
from .layout import DataParallelLayout, expert_rows
from .quantized_shards import (
    CODE_BUFFERS,
    SharedBlockScales,
    segment_blocks,
    zero_code,
)
from .reduction import BucketedReduction

ADAMW_MOMENTS = ("exp_avg", "exp_avg_sq")
HELD_BESIDES_MOMENTUM = (MOMENTUM_SCALE, MOMENTUM_ABSMAX, *VARIANT_STATE)
"""The state a Muon parameter's owner may hold besides the momentum (``kept`` decides)."""
HeldShape = Callable[[torch.Tensor, Mapping[str, Any], str, tuple[int, ...]], tuple[int, ...]]
"""(Muon parameter, its group, state key, declared shape) -> the shape its owner holds that
state in (a subclass's layout may differ from the declared one: Megatron's column pieces)."""


def _sharded_names(store: Any) -> tuple[str, ...]:
    """The element-wise sharded buffers of a flat shard or fill range: the AdamW moments
    (floating, and 8-bit codes: :data:`~.quantized_shards.CODE_BUFFERS`, those it has), and
    ``main_param`` where it keeps main copies."""
    names = (*ADAMW_MOMENTS, *CODE_BUFFERS.values(), "main_param")
    return tuple(name for name in names if getattr(store, name) is not None)


def _entry_buffers(reduction: BucketedReduction, i: int, store: Any) -> dict[str, str]:
    """State key -> the store's buffer that holds it, for AdamW parameter ``i`` (8-bit
    moments: the codes)."""
    quantized = i in reduction.quantized_adamw
    out = {name: CODE_BUFFERS[name] if quantized else name for name in ADAMW_MOMENTS}
    if store.main_param is not None:
        out["main_param"] = "main_param"
    return out


def _gather_absmax(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    indices: list[int],
    block_scales: SharedBlockScales,
) -> dict[int, dict[str, torch.Tensor]]:
    """The whole absmax (rows, ⌈cols / 256⌉) of each 8-bit AdamW parameter of ``indices``, a
    column parameter's of the blocks its piece touches (1, count) (collective: one all-reduce
    (max) of every range laid end to end; a block on several ranks has the same absmax on
    each)."""
    quantized = [i for i in indices if i in reduction.quantized_adamw]
    if not quantized:
        return {}
    offsets, total, shapes = {}, 0, {}
    for i in quantized:
        column = block_scales.saved_absmax(i)
        if column is not None:
            shapes[i] = (1, column[0])
        else:
            shapes[i] = scale_shape(*adamw_block_shape(layout.params[i]))
        for _, key, _ in QUANTIZED_MOMENTS:
            offsets[(i, key)] = total
            total += math.prod(shapes[i])
    device = layout.params[quantized[0]].device
    whole = torch.zeros(total, dtype=torch.float32, device=device)
    for i in quantized:
        column = block_scales.saved_absmax(i)
        if i in reduction.segments and column is not None:
            for _, key, _ in QUANTIZED_MOMENTS:
                at = torch.tensor(column[1], dtype=torch.long, device=device) + offsets[(i, key)]
                whole.index_copy_(0, at, state[layout.params[i]][key].to(device))
        elif i in reduction.segments:
            seg = reduction.segments[i][1]
            blocks = segment_blocks(layout.params[i].shape, seg.param_start, seg.length)
            for _, key, _ in QUANTIZED_MOMENTS:
                at = offsets[(i, key)] + blocks.first_block
                whole[at : at + blocks.block_count].copy_(state[layout.params[i]][key])
    layout.comm.all_reduce(whole, op=dist.ReduceOp.MAX, tag="checkpoint")
    out: dict[int, dict[str, torch.Tensor]] = {}
    for i in quantized:
        out[i] = {}
        for _, key, _ in QUANTIZED_MOMENTS:
            at = offsets[(i, key)]
            out[i][key] = whole[at : at + math.prod(shapes[i])].view(shapes[i]).clone()
    return out


@torch.no_grad()
def gather_full_state(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    param_table: ParamTable,
    block_scales: SharedBlockScales,
    held_shape: HeldShape | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """``{parameter index: state}`` for every parameter, on every rank (collective; not
    counted as a step's traffic). ``held_shape``: the shape each owned state tensor has (None:
    its declared shape)."""
    step_counter, layout.comm.counter = layout.comm.counter, WireCounter()
    try:
        return _gather_full_state(layout, reduction, state, param_table, block_scales, held_shape)
    finally:
        layout.comm.counter = step_counter


def _gather_full_state(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    param_table: ParamTable,
    block_scales: SharedBlockScales,
    held_shape: HeldShape | None,
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
            shape = tuple(spec.shape(view))
            if held_shape is not None:
                shape = held_shape(p, group, spec.key, shape)
            specs[spec.key] = (shape, spec.dtype(settings, p.dtype))
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
        absmax = _gather_absmax(layout, reduction, state, flat.params, block_scales)
        for i, off, n in zip(flat.params, flat.offsets, flat.numels):
            p = layout.params[i]
            full[i] = {"step": state[p]["step"].clone()}
            for key, name in _entry_buffers(reduction, i, shards).items():
                full[i][key] = gathered[name][off : off + n].view(p.shape).clone()
            full[i].update(absmax.get(i, {}))
    full.update(_gather_fill_state(layout, reduction, state, block_scales))
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
    block_scales: SharedBlockScales,
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
        buffers = {i: _entry_buffers(reduction, i, fill) for i in fill_layout.params}
        for i in fill_layout.params:
            p = layout.params[i]
            full[i] = {"step": state[p]["step"].clone()}
            for key, name in buffers[i].items():
                full[i][key] = torch.empty_like(p, dtype=gathered[name].dtype)
        for rank in range(layout.world_size):
            for seg in fill_layout.segments(rank):
                src = rank * width + seg.buffer_start
                for key, name in buffers[seg.param].items():
                    full[seg.param][key].view(-1)[
                        seg.param_start : seg.param_start + seg.length
                    ] = gathered[name][src : src + seg.length]
        absmax = _gather_absmax(layout, reduction, state, fill_layout.params, block_scales)
        for i, scales in absmax.items():
            full[i].update(scales)
    return full


@torch.no_grad()
def load_full_state(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    param_table: ParamTable,
    block_scales: SharedBlockScales,
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
        if i in reduction.quantized_adamw:
            label = param_table.label(p, layout.param_groups)
            _load_quantized_segment(held, entry, p.shape, seg, block_scales.saved_absmax(i), label)
            continue
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


def _load_quantized_segment(
    held: dict[str, Any],
    entry: Mapping[str, Any],
    shape: torch.Size,
    seg: Any,
    column: tuple[int, list[int]] | None,
    label: str,
) -> None:
    """This rank's codes and absmax range of a whole 8-bit AdamW entry (zero moments where the
    entry has none); ``column``: a column parameter's :meth:`~.quantized_shards.
    SharedBlockScales.saved_absmax` (its absmax taken at those places, ``ValueError`` naming
    parameter ``label`` for another count)."""
    window = slice(seg.param_start, seg.param_start + seg.length)
    if column is None:
        blocks = segment_blocks(shape, seg.param_start, seg.length)
        scales: slice | list[int] = slice(
            blocks.first_block, blocks.first_block + blocks.block_count
        )
    else:
        scales = column[1]
    for key, absmax_key, signed in QUANTIZED_MOMENTS:
        codes, absmax = entry.get(key), entry.get(absmax_key)
        if codes is None or absmax is None:
            held[key].fill_(zero_code(signed))
            held[absmax_key].zero_()
            continue
        if column is not None and absmax.numel() != column[0]:
            raise ValueError(
                f"load_state_dict: parameter '{label}': {absmax_key!r} has "
                f"{absmax.numel()} entries in the checkpoint, {column[0]} here (the blocks its "
                "tensor-parallel piece touches; saved at another TP size?)"
            )
        held[key].copy_(codes.reshape(-1)[window])
        held[absmax_key].copy_(absmax.reshape(-1)[scales])


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
