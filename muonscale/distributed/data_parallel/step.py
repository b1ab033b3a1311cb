"""The phases of ``DistributedMuon.step()`` after the reduction: the agreement across ranks
on which gradients exist and are finite, AdamW on the local shards, the owned matrices in
waves with the parameter all-gathers launched as slices become final (or, deferred, in forward
order). Each takes the :class:`~.layout.DataParallelLayout`, the
:class:`~.reduction.BucketedReduction` and the state it reads; the Muon step of a wave is the
optimizer's, passed in. The class docstring draws the pattern.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from ...group_step import adamw_group_step
from ...memory import chunk_bytes_for, group_by_budget
from . import gathers
from .buckets import OwnedUnit, unit_param
from .deferred_gather import PendingGather
from .layout import DataParallelLayout, segment_of
from .quantized_shards import SharedBlockScales
from .reduction import BucketedReduction, StreamBuffers

Pending = list[tuple[Any, Any]]  # (work, copy back) pairs in launch order


def gradient_flags(
    params: list[torch.Tensor], reduction: BucketedReduction, comm: Any, check_finite: bool
) -> tuple[list[bool], int | None, list[int] | None]:
    """One all-reduce (max) of per-parameter flags [has a gradient on some rank, non-finite
    reduced gradient], of [``p.grad`` changed after its reduction on some rank] and of the
    number of backward passes since the last step (as max and −min). Returns (present, index
    of the first non-finite, None) or, after a change, (…, …, the parameters changed on this
    rank): every rank then reduces again and asks once more. Ranks that ran different numbers
    of backward passes (one skipped ``step()``) raise, every one of them."""
    P, device = len(params), comm.device
    has_grad = [p.grad is not None for p in params]
    changed = reduction.grads_changed()
    passes = reduction.backward_passes()
    flags = torch.zeros(2 * P + 3, dtype=torch.int32)  # built on the host, one copy to device
    flags[:P] = torch.tensor(has_grad, dtype=torch.int32)
    flags[2 * P] = int(bool(changed))
    flags[2 * P + 1], flags[2 * P + 2] = passes, -passes
    flags = flags.to(device)
    if check_finite:
        local = {i: g for i, g in reduction.local_reduced_grads().items() if g.numel()}
        if local:
            max_abs = torch._foreach_norm(list(local.values()), float("inf"))  # NaN propagates
            finite = torch.stack([m.to(device) for m in max_abs]).isfinite()
            index = torch.tensor([P + i for i in local], device=device)
            flags.index_copy_(0, index, (~finite).to(torch.int32))
    comm.all_reduce(flags, op=dist.ReduceOp.MAX, tag="control")
    most, fewest = int(flags[2 * P + 1]), -int(flags[2 * P + 2])
    if fewest >= 1 and most != fewest:  # (a rank with no backward at all only idles)
        raise RuntimeError(
            f"DistributedMuon: the ranks ran different numbers of backward passes since the "
            f"last step() ({fewest} on some rank, {most} on another; this rank {passes}): a rank "
            "skipped step(), or accumulated a different number of micro-batches. Every rank "
            "must call step() after the same backward passes"
        )
    present = [bool(f) for f in flags[:P].tolist()]
    bad = flags[P : 2 * P].nonzero()
    return present, (int(bad[0]) if bad.numel() else None), (changed if flags[2 * P] else None)


def update_adamw_shards(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    state: Mapping[torch.Tensor, dict[str, Any]],
    present: list[bool],
    max_chunk_bytes: int,
    block_scales: SharedBlockScales,
) -> None:
    """AdamW on this rank's segments of every AdamW parameter with a gradient; 8-bit moments
    (``state_precision="int8"`` groups) through ``block_scales``, whose blocks cut by shard
    boundaries take their absmax shared over the ranks (one all-reduce, collective)."""
    cut_pieces = []
    for group in layout.param_groups:
        if group["algorithm"] != "adamw":
            continue
        indices = [layout.index_of(p) for p in group["params"] if present[layout.index_of(p)]]
        local = [i for i in indices if i in reduction.segments]
        for i in indices:
            if i not in reduction.segments:  # no local shard: only the step counter moves
                state[layout.params[i]]["step"] += 1
        if not local:
            continue
        states = [state[layout.params[i]] for i in local]
        segments = [segment_of(layout.params[i], reduction.segments[i][1]) for i in local]
        # the tensors updated: main copies where kept, else the parameters' segments
        params = [s.get("main_param", seg) for s, seg in zip(states, segments)]
        grads = [reduction.reduced_shard_grad(i) for i in local]
        grads = [g if g.dtype == t.dtype else g.to(t.dtype) for g, t in zip(grads, params)]
        if group.get("state_precision", "param") != "param":
            cut_pieces += block_scales.step(group, local, params, grads, states, max_chunk_bytes)
        else:
            adamw_group_step(
                group,
                params,
                grads,
                states,
                capturable=False,
                step_ok=None,
                max_chunk_bytes=max_chunk_bytes,
            )
        for target, segment in zip(params, segments):
            if target is not segment:
                segment.copy_(target)  # rounded into the model's parameter
    if block_scales.exchanges(present):
        block_scales.exchange(cut_pieces)


def _waves(
    layout: DataParallelLayout, stream: StreamBuffers, chunk_bytes: int
) -> list[list[OwnedUnit]]:
    """This rank's owned units of ``stream`` in waves of at most one update chunk."""
    owned = stream.layout.owned[layout.rank]
    budget = chunk_bytes_for(chunk_bytes, stream.gather_in.device)
    sizes = [stream.layout.numels[u] * layout.params[unit_param(u)].element_size() for u in owned]
    return [[owned[j] for j in wave] for wave in group_by_budget(sizes, budget)]


def update_owned_and_gather(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    update_wave: Callable[[set[OwnedUnit]], None],
    apply: Callable | None,
    chunk_bytes: int,
    overlap: bool,
) -> Pending:
    """Update the owned matrices in waves along the owner stream and (``overlap``) launch each
    bucket's all-gather as soon as this rank's slice of it is final, so the gathers of early
    buckets overlap the Newton–Schulz of later ones; else launch them after the last wave.
    Every rank launches the same buckets in the same order, only the timing differs.
    ``update_wave(units)``: the optimizer's Muon step of those owned units; ``apply``:
    what every rank does with an arrived bucket of gathered updates."""
    pending: Pending = []
    for stream in reduction.streams:
        gathers.write_fill_for_gather(reduction, stream)
        next_bucket = 0
        for wave in _waves(layout, stream, chunk_bytes):
            update_wave(set(wave))
            gathers.write_owned_for_gather(reduction, stream, wave)
            if overlap:
                ready = stream.layout.offsets[wave[-1]] + stream.layout.numels[wave[-1]]
                launched, next_bucket = gathers.launch_stream_gathers(
                    reduction, stream, next_bucket, ready, apply
                )
                pending += launched
        if overlap:
            pending += gathers.launch_stream_gathers(
                reduction, stream, next_bucket, stream.layout.length, apply
            )[0]
    if not overlap:
        for stream in reduction.streams:
            pending += gathers.launch_stream_gathers(
                reduction, stream, 0, stream.layout.length, apply
            )[0]
    return pending


def update_owned_and_gather_in_forward_order(
    layout: DataParallelLayout,
    reduction: BucketedReduction,
    update_wave: Callable[[set[OwnedUnit]], None],
    apply: Callable | None,
    chunk_bytes: int,
    forward_position: list[int],
) -> list[PendingGather]:
    """Update every owned matrix (in waves), then launch every all-gather (flat AdamW buckets
    and owner-stream buckets alike) in the order the forward first needs one of its
    parameters (``forward_position``: a parameter index's place in the model), left in flight
    (``defer_gather``). The order is the same on every rank."""
    for stream in reduction.streams:
        gathers.write_fill_for_gather(reduction, stream)
        for wave in _waves(layout, stream, chunk_bytes):
            update_wave(set(wave))
            gathers.write_owned_for_gather(reduction, stream, wave)
    launches = []  # (params, tie-break, launch): one per gather
    for s, stream in enumerate(reduction.streams):
        for k, bucket in enumerate(stream.layout.buckets):
            end = bucket.stream_start + bucket.length

            def launch(stream=stream, k=k, end=end):
                return gathers.launch_stream_gathers(reduction, stream, k, end, apply)[0][0]

            launches.append((bucket.params, (0, s, k), launch))
    for f, shards in enumerate(reduction.flat_shards):
        launches.append(
            (
                frozenset(shards.layout.params),
                (1, f, 0),
                lambda s=shards: gathers.launch_flat_gather(reduction, s),
            )
        )
    last = len(forward_position) + len(layout.params)
    launches.sort(key=lambda g: (min((forward_position[i] for i in g[0]), default=last), g[1]))
    return [PendingGather(*launch(), params) for params, _, launch in launches]
