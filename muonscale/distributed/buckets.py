"""Bucket layouts of :class:`~muonscale.distributed.DistributedMuon` (pure bookkeeping, no I/O).

**Owner buckets (Muon).** Each rank r has an *owner stream*: the flattened gradients of the
parameters it owns, concatenated in readiness order (reverse registration order, as gradients
arrive in backward). Every stream is padded to the longest one, T elements. Bucket b covers
stream elements ``[b·L, b·L + L_b)`` of **every** rank (L = per-rank slice, L_b ≤ L for the
last bucket), and its buffer holds N such slices side by side::

    bucket buffer (N · L_b):  [ rank 0: stream_0[bL : bL+L_b] | rank 1: stream_1[...] | ... ]
    reduce-scatter  ->  rank r receives stream_r[bL : bL+L_b] summed over ranks = exactly the
                        gradients of the matrices it owns (a parameter may span two buckets)

The padding on the wire is therefore only the imbalance of the streams (Σ_r (T − T_r)), not a
per-bucket remainder. The all-gather of updated parameters uses the same layout in reverse.

**Flat buckets (AdamW, ZeRO-1).** Parameters concatenated in readiness order into buckets of
about ``bucket_elems``, each padded to a multiple of N; rank r holds shard r (elements
``[r·S, (r+1)·S)``, S = padded/N) of every bucket, and the AdamW state for that shard only.
A parameter lies in one flat bucket, so a rank holds at most one segment of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_start, param_start + length)`` of a flattened parameter, stored at
    ``buffer_start`` of a bucket buffer (or of a shard, for :class:`Segment`)."""

    param: int
    param_start: int
    buffer_start: int
    length: int


Segment = Piece  # a piece of a parameter inside this rank's shard of a flat bucket


@dataclass
class OwnerBucket:
    stream_start: int  # offset of this bucket in every rank's owner stream
    length: int  # L_b: elements per rank slice
    world_size: int
    pieces: list[Piece]  # every rank's pieces (buffer_start in the N·L_b buffer)
    params: frozenset[int]

    @property
    def numel(self) -> int:
        return self.world_size * self.length


@dataclass
class OwnerStreams:
    """Muon parameters of one dtype: who owns what, where it sits in the stream, the buckets."""

    owned: list[list[int]]  # per rank: parameter indices in stream order
    offsets: dict[int, int]  # parameter -> offset in its owner's stream
    numels: dict[int, int]
    length: int  # T: padded stream length (the longest rank's stream)
    buckets: list[OwnerBucket] = field(default_factory=list)

    def stream_numel(self, rank: int) -> int:
        return sum(self.numels[p] for p in self.owned[rank])

    def padding(self) -> int:
        """Padding elements over all ranks (Σ_r T − T_r)."""
        return sum(self.length - self.stream_numel(r) for r in range(len(self.owned)))


def plan_owner_streams(
    order: Sequence[int],
    numels: Mapping[int, int],
    owners: Mapping[int, int],
    world_size: int,
    bucket_elems: int,
) -> OwnerStreams:
    """Lay out the owner streams of the parameters in ``order`` (readiness order)."""
    owned: list[list[int]] = [[] for _ in range(world_size)]
    offsets: dict[int, int] = {}
    fill = [0] * world_size
    for p in order:
        r = owners[p]
        owned[r].append(p)
        offsets[p] = fill[r]
        fill[r] += numels[p]
    length = max(fill, default=0)
    streams = OwnerStreams(owned, offsets, dict(numels), length)
    slice_len = max(1, -(-bucket_elems // world_size))  # L = ceil(cap / N)
    for start in range(0, length, slice_len):
        size = min(slice_len, length - start)
        pieces = []
        for r in range(world_size):
            for p in owned[r]:
                lo, hi = max(start, offsets[p]), min(start + size, offsets[p] + numels[p])
                if lo < hi:
                    pieces.append(Piece(p, lo - offsets[p], r * size + lo - start, hi - lo))
        params = frozenset(piece.param for piece in pieces)
        streams.buckets.append(OwnerBucket(start, size, world_size, pieces, params))
    return streams


@dataclass
class FlatBucket:
    params: list[int]  # readiness order
    offsets: list[int]  # offset of each parameter in the flat bucket
    numels: list[int]
    world_size: int

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded_numel(self) -> int:
        n = self.world_size
        return -(-self.numel // n) * n

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def segments(self, rank: int) -> list[Segment]:
        """Pieces of parameters inside shard ``rank`` (buffer_start relative to the shard)."""
        lo_shard = rank * self.shard_numel
        hi_shard = lo_shard + self.shard_numel
        out = []
        for p, off, n in zip(self.params, self.offsets, self.numels):
            lo, hi = max(lo_shard, off), min(hi_shard, off + n)
            if lo < hi:
                out.append(Segment(p, lo - off, lo - lo_shard, hi - lo))
        return out


def plan_flat_buckets(
    order: Sequence[int], numels: Mapping[int, int], world_size: int, bucket_elems: int
) -> list[FlatBucket]:
    """Greedy: fill a bucket in readiness order until it holds ``bucket_elems`` elements."""
    buckets: list[FlatBucket] = []
    current: FlatBucket | None = None
    for p in order:
        if current is None or (current.numel > 0 and current.numel + numels[p] > bucket_elems):
            current = FlatBucket([], [], [], world_size)
            buckets.append(current)
        current.offsets.append(current.numel)
        current.params.append(p)
        current.numels.append(numels[p])
    return buckets
