"""The second half of data-parallel Muon's step: all-gathers of the updated parameters (or of
the owners' updates) over the buffers of a :class:`~.reduction.BucketedReduction`, and
their copy back into the model. Each launch returns (work, copy back) pairs; the step waits
for them at its end, or the next forward's pre-hooks do (``defer_gather``)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .buckets import OwnedUnit, OwnerBucket

if TYPE_CHECKING:
    from .reduction import BucketedReduction, FlatShard, StreamBuffers


def launch_flat_gathers(reduction: BucketedReduction) -> list[tuple[Any, Callable[[], None]]]:
    """All-gather every flat bucket's updated shard; returns (work, copy back) pairs."""
    return [launch_flat_gather(reduction, shards) for shards in reduction.flat_shards]


def launch_flat_gather(
    reduction: BucketedReduction, shards: FlatShard
) -> tuple[Any, Callable[[], None]]:
    """All-gather one flat bucket's updated shard; returns (work, copy back)."""
    for seg in shards.layout.segments(reduction.rank):
        flat = reduction.params[seg.param].view(-1)
        shards.shard[seg.buffer_start : seg.buffer_start + seg.length].copy_(
            flat[seg.param_start : seg.param_start + seg.length]
        )
    work = reduction.comm.all_gather(shards.full, shards.shard, tag="adamw", async_op=True)
    return work, functools.partial(_copy_back_flat, reduction, shards)


def write_fill_for_gather(reduction: BucketedReduction, stream: StreamBuffers) -> None:
    """Updated AdamW fill segments into the stream's gather buffer (its recv here)."""
    if stream.fill is not None:
        for seg in stream.fill.layout.segments(reduction.rank):
            flat = reduction.params[seg.param].view(-1)
            stream.fill.grad[seg.buffer_start : seg.buffer_start + seg.length].copy_(
                flat[seg.param_start : seg.param_start + seg.length]
            )


def write_owned_for_gather(
    reduction: BucketedReduction, stream: StreamBuffers, units: list[OwnedUnit]
) -> None:
    """Updated owned ``units`` (parameters, ranges of experts) into the stream's gather buffer
    (a stream that carries updates has them already: the owner's apply wrote them)."""
    if stream.carries_updates:
        return
    for u in units:
        off, n = stream.layout.offsets[u], stream.layout.numels[u]
        stream.gather_in[off : off + n].copy_(reduction.owned_slice(u).reshape(-1))


def launch_stream_gathers(
    reduction: BucketedReduction,
    stream: StreamBuffers,
    first: int,
    ready: int,
    apply_gathered: Callable[[StreamBuffers, int], None] | None = None,
) -> tuple[list[tuple[Any, Callable[[], None]]], int]:
    """Launch the all-gathers of buckets ``first, first + 1, …`` whose slice of this rank's
    stream ends at or before ``ready`` (everything before it is final). Returns the (work,
    copy back) pairs and the first bucket not launched. ``apply_gathered(stream, k)``: what
    a stream that carries updates does once bucket ``k`` arrived (instead of copying
    parameters back)."""
    if stream.carries_updates and apply_gathered is None:
        raise ValueError("a stream that carries updates needs apply_gathered")
    pending = []
    buckets = stream.layout.buckets
    k = first
    while k < len(buckets) and buckets[k].stream_start + buckets[k].length <= ready:
        bucket = buckets[k]
        mine = stream.gather_in[bucket.stream_start : bucket.stream_start + bucket.length]
        work = reduction.comm.all_gather(
            stream.gather_out[k],
            mine,
            tag="muon",
            async_op=True,
            lengths=stream.layout.data_lengths(k),
        )
        if stream.carries_updates:
            copy_back = functools.partial(apply_gathered, stream, k)
        else:
            copy_back = functools.partial(_copy_back_owned, reduction, bucket, stream.gather_out[k])
        pending.append((work, copy_back))
        k += 1
    return pending, k


def wait_and_copy_back(
    reduction: BucketedReduction, pending: list[tuple[Any, Callable[[], None]]]
) -> None:
    """Wait for each gather and copy its parameters back into the model."""
    for work, copy_back in pending:
        reduction.comm.wait(work, "parameter all-gather")
        copy_back()


def _copy_back_flat(reduction: BucketedReduction, shards: FlatShard) -> None:
    layout = shards.layout
    for p, off, n in zip(layout.params, layout.offsets, layout.numels):
        reduction.params[p].view(-1).copy_(shards.full[off : off + n])


def _copy_back_owned(
    reduction: BucketedReduction, bucket: OwnerBucket, gathered: torch.Tensor
) -> None:
    for piece in bucket.pieces:
        if bucket.rank_of(piece) == reduction.rank:
            continue  # updated in place already
        flat = reduction.params[piece.param].view(-1)
        flat[piece.param_start : piece.param_start + piece.length].copy_(
            gathered[piece.buffer_start : piece.buffer_start + piece.length]
        )
