"""Bucket layouts of :class:`~muonscale.distributed.DistributedMuon` (pure bookkeeping, no I/O).

**Owner buckets (Muon).** Each rank r has an *owner stream*: the flattened gradients of the
parameters it owns, concatenated in readiness order (reverse registration order, as gradients
arrive in backward). Every stream is padded to the longest one, T elements. Bucket b covers
stream elements ``[b·L, b·L + L_b)`` of **every** rank (L = per-rank slice, L_b ≤ L for the
last bucket), and its buffer holds N such slices side by side::

    bucket buffer (N · L_b):  [ rank 0: stream_0[bL : bL+L_b] | rank 1: stream_1[...] | ... ]
    reduce-scatter  ->  rank r receives stream_r[bL : bL+L_b] summed over ranks = exactly the
                        gradients of the matrices it owns (a parameter may span two buckets)

The all-gather of updated parameters (or of the owners' bf16 updates, then without fill) uses
the same layout in reverse.

**Fill: AdamW elements level the streams.** Whole-matrix owners rarely own equal numbers of
elements (8 matrices of 3 sizes cannot be split evenly over 4 ranks), and a reduce-scatter gives
every rank the same number of elements, so the shorter streams would be padded: Σ_r (T − T_r)
elements of zeros on the wire. AdamW parameters are sharded element-wise (ZeRO-1) and can sit
anywhere, so the shorter streams are topped up with AdamW elements instead: whole AdamW
parameters (``fillers``, taken in the order given until they cover the gap) are laid end to end
and cut into one range per rank, rank r's range placed right after its owned elements::

    stream_r = [ owned Muon parameters (T_r) | AdamW fill range r | padding ]  (length T)

with T = max(max_r T_r, ⌈(Σ_r T_r + F)/N⌉) for F fill elements, so the padding left is below
N elements whenever the fillers cover the gap (otherwise it is the gap minus F). On NCCL the
native collectives send the padding; on the other backends the collectives take each slice's
data length (:meth:`OwnerStreams.data_lengths`) and leave the padding off the wire. Each rank
holds one contiguous range of the fill, hence at most one segment of each AdamW parameter, and
updates it as it would a ZeRO-1 shard. The fill must share the stream's dtype (a
``reduce_dtype`` other than the parameters' disables it: AdamW gradients are reduced in their
own dtype; so does a gather of bf16 updates: AdamW parameters travel in their own dtype).

**Flat buckets (AdamW, ZeRO-1).** The remaining AdamW parameters, concatenated in readiness order
into buckets of about ``bucket_elems``, each padded to a multiple of N; rank r holds shard r
(elements ``[r·S, (r+1)·S)``, S = padded/N) of every bucket, and the AdamW state for that
shard only. A parameter lies in one flat bucket (or in the fill), so a rank holds at most one
segment of it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_start, param_start + length)`` of a flattened parameter, stored at
    ``buffer_start`` of a bucket buffer (or of a shard, for :class:`Segment`); in an owner
    bucket, ``unit`` is the owned unit it belongs to (None: AdamW fill)."""

    param: int
    param_start: int
    buffer_start: int
    length: int
    unit: OwnedUnit | None = field(default=None, compare=False)


Segment = Piece  # a piece of a parameter inside this rank's shard of a flat bucket


@dataclass(frozen=True)
class ExpertRange:
    """Experts ``[first, stop)`` of the ``count`` experts of the stack that is Muon parameter
    ``param``, owned by rank ``owner`` when the stack is spread over several owners: elements
    ``[start, start + numel)`` of the flattened parameter (a stack's experts are contiguous
    along dim 0), a sub-stack of ``shape``."""

    param: int
    first: int
    stop: int
    count: int
    owner: int
    start: int
    numel: int
    shape: tuple[int, ...]


OwnedUnit = int | ExpertRange
"""What an owner stream carries and one rank steps: a Muon parameter index (owned whole) or an
:class:`ExpertRange` of one."""


def unit_param(unit: OwnedUnit) -> int:
    """The parameter index of an owned unit."""
    return unit.param if isinstance(unit, ExpertRange) else unit


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

    def rank_of(self, piece: Piece) -> int:
        """The rank whose stream slice holds ``piece`` (its owner, or its fill holder)."""
        return piece.buffer_start // self.length


@dataclass
class StreamFill:
    """AdamW parameters laid end to end (the *fill sequence*) and cut into one range per rank:
    rank r holds fill elements ``[starts[r], starts[r] + lengths[r])``, stored from offset
    ``stream_starts[r]`` of its owner stream (right after the Muon parameters it owns)."""

    params: list[int]  # whole AdamW parameters, in fill order
    offsets: list[int]  # offset of each parameter in the fill sequence
    numels: list[int]
    starts: list[int]  # per rank
    lengths: list[int]  # per rank
    stream_starts: list[int]  # per rank

    @property
    def numel(self) -> int:
        return sum(self.numels)

    def segments(self, rank: int) -> list[Segment]:
        """Pieces of parameters in rank ``rank``'s range (buffer_start relative to the range)."""
        lo_range, hi_range = self.starts[rank], self.starts[rank] + self.lengths[rank]
        out = []
        for p, off, n in zip(self.params, self.offsets, self.numels):
            lo, hi = max(lo_range, off), min(hi_range, off + n)
            if lo < hi:
                out.append(Segment(p, lo - off, lo - lo_range, hi - lo))
        return out


@dataclass
class OwnerStreams:
    """Muon parameters of one dtype: who owns what, where it sits in the stream, the AdamW fill
    that levels the streams, the buckets."""

    owned: list[list[OwnedUnit]]  # per rank: owned units in stream order
    offsets: dict[OwnedUnit, int]  # owned unit -> offset in its owner's stream
    numels: dict[OwnedUnit, int]
    length: int  # T: padded stream length
    fill: StreamFill
    buckets: list[OwnerBucket] = field(default_factory=list)

    def owned_numel(self, rank: int) -> int:
        return sum(self.numels[p] for p in self.owned[rank])

    def stream_numel(self, rank: int) -> int:
        """Elements of rank ``rank``'s stream that carry data (owned + fill)."""
        return self.owned_numel(rank) + self.fill.lengths[rank]

    def padding(self) -> int:
        """Padding elements over all ranks (Σ_r T − T_r − fill_r)."""
        return sum(self.length - self.stream_numel(r) for r in range(len(self.owned)))

    def data_lengths(self, k: int) -> list[int]:
        """Per rank: the elements of its slice of bucket ``k`` that carry data (the slice
        starts with them; the rest is padding)."""
        b = self.buckets[k]
        return [
            max(0, min(b.length, self.stream_numel(r) - b.stream_start))
            for r in range(len(self.owned))
        ]


def plan_owner_streams(
    order: Sequence[OwnedUnit],
    numels: Mapping[int, int],
    owners: Mapping[int, int],
    world_size: int,
    bucket_elems: int,
    fillers: Sequence[int] = (),
) -> OwnerStreams:
    """Lay out the owner streams of the units in ``order`` (readiness order): Muon parameters
    owned whole (``owners``: their ranks) or :class:`ExpertRange` s, topped up with whole
    AdamW parameters from ``fillers`` (in that order of preference) while the streams are
    uneven; ``numels`` covers the parameters."""
    owned: list[list[OwnedUnit]] = [[] for _ in range(world_size)]
    offsets: dict[OwnedUnit, int] = {}
    sizes: dict[OwnedUnit, int] = {}
    fill = [0] * world_size
    for p in order:
        r = p.owner if isinstance(p, ExpertRange) else owners[p]
        sizes[p] = p.numel if isinstance(p, ExpertRange) else numels[p]
        owned[r].append(p)
        offsets[p] = fill[r]
        fill[r] += sizes[p]
    longest, total = max(fill, default=0), sum(fill)
    gap = world_size * longest - total
    chosen: list[int] = []
    fill_numel = 0
    for p in fillers:
        if fill_numel >= gap:
            break
        chosen.append(p)
        fill_numel += numels[p]
    length = max(longest, -(-(total + fill_numel) // world_size))
    starts, lengths, cursor = [], [], 0
    for r in range(world_size):
        starts.append(cursor)
        lengths.append(min(length - fill[r], fill_numel - cursor))
        cursor += lengths[-1]
    fill_offsets = [0, *itertools.accumulate(numels[p] for p in chosen)][: len(chosen)]
    stream_fill = StreamFill(
        chosen, fill_offsets, [numels[p] for p in chosen], starts, lengths, list(fill)
    )
    streams = OwnerStreams(owned, offsets, sizes, length, stream_fill)
    # every rank's (parameter, parameter offset, stream offset, length) runs
    runs: list[list[tuple[OwnedUnit | None, int, int, int, int]]] = [
        [(u, unit_param(u), _first_element(u), offsets[u], sizes[u]) for u in owned[r]]
        + [
            (None, s.param, s.param_start, fill[r] + s.buffer_start, s.length)
            for s in stream_fill.segments(r)
        ]
        for r in range(world_size)
    ]
    slice_len = max(1, -(-bucket_elems // world_size))  # L = ceil(cap / N)
    for start in range(0, length, slice_len):
        size = min(slice_len, length - start)
        pieces = []
        for r in range(world_size):
            for u, p, p_start, s_start, n in runs[r]:
                lo, hi = max(start, s_start), min(start + size, s_start + n)
                if lo < hi:
                    offset = p_start + lo - s_start
                    pieces.append(Piece(p, offset, r * size + lo - start, hi - lo, u))
        params = frozenset(piece.param for piece in pieces)
        streams.buckets.append(OwnerBucket(start, size, world_size, pieces, params))
    return streams


def _first_element(unit: OwnedUnit) -> int:
    return unit.start if isinstance(unit, ExpertRange) else 0


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
