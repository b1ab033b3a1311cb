"""Ownership and bucket layouts (pure bookkeeping, no processes)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muonscale.distributed.data_parallel.buckets import Piece, plan_flat_buckets, plan_owner_streams
from muonscale.distributed.ownership import (
    assign_owners,
    format_ownership_table,
    parameter_cost,
    parameter_elements,
    rank_loads,
    rank_totals,
)

GPT2_SMALL = [(2304, 768), (768, 768), (3072, 768), (768, 3072)] * 12


def test_lpt_by_hand():
    # costs: 8x8 < 16x16 < 32x32; LPT: 32 -> r0, 16 -> r1, 16 -> r1? no: r1 has 16 < r0's 32
    shapes = [(8, 8), (32, 32), (16, 16), (16, 16)]
    assert assign_owners(shapes, 2) == [1, 0, 1, 1]
    assert assign_owners(shapes, 1) == [0, 0, 0, 0]
    # equal costs: ties by parameter index, then by lowest rank -> round robin
    assert assign_owners([(4, 4)] * 5, 2) == [0, 1, 0, 1, 0]
    # fewer matrices than ranks: the last ranks own nothing
    assert assign_owners([(4, 4), (4, 8)], 4) == [1, 0]


def test_gpt2_small_is_balanced():
    owners = assign_owners(GPT2_SMALL, 4)
    loads = rank_loads(GPT2_SMALL, owners, 4)
    assert max(loads) == min(loads)
    table = format_ownership_table([f"p{i}" for i in range(48)], GPT2_SMALL, owners, 4)
    assert "rank 3: 12 parameters" in table


def test_cost_counts_every_matrix_of_a_parameter():
    assert (
        parameter_cost([(8, 4), (8, 4)], 5)
        == 2 * parameter_cost((4, 8), 5)
        == 2 * 5 * (4 * 16 * 8 + 2 * 64)
    )


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    world_size=st.integers(1, 5),
    bucket=st.integers(1, 120),
    seed=st.integers(0, 1000),
)
def test_owner_streams_cover_every_element_once(numels, world_size, bucket, seed):
    owners = {i: (i * 7 + seed) % world_size for i in range(len(numels))}
    sizes = dict(enumerate(numels))
    order = list(reversed(range(len(numels))))
    streams = plan_owner_streams(order, sizes, owners, world_size, bucket)
    covered = {i: [0] * n for i, n in sizes.items()}
    for b in streams.buckets:
        slots = [0] * b.numel
        for piece in b.pieces:
            rank = piece.buffer_start // b.length
            assert owners[piece.param] == rank  # a rank's slice holds only what it owns
            for k in range(piece.length):
                covered[piece.param][piece.param_start + k] += 1
                slots[piece.buffer_start + k] += 1
        assert max(slots) <= 1
    assert all(c == 1 for cs in covered.values() for c in cs)
    # padding is only the imbalance between the streams
    per_rank = [sum(n for i, n in sizes.items() if owners[i] == r) for r in range(world_size)]
    assert streams.length == max(per_rank)
    assert sum(b.numel for b in streams.buckets) == world_size * max(per_rank)
    assert streams.padding() == sum(max(per_rank) - t for t in per_rank)


@settings(max_examples=60, deadline=None)
@given(
    numels=st.lists(st.integers(1, 50), min_size=1, max_size=12),
    world_size=st.integers(1, 5),
    bucket=st.integers(1, 120),
)
def test_flat_shards_cover_every_element_once(numels, world_size, bucket):
    sizes = dict(enumerate(numels))
    buckets = plan_flat_buckets(list(range(len(numels))), sizes, world_size, bucket)
    covered = {i: [0] * n for i, n in sizes.items()}
    for b in buckets:
        assert b.padded_numel % world_size == 0 and b.padded_numel - b.numel < world_size
        for rank in range(world_size):
            segs = b.segments(rank)
            assert len({s.param for s in segs}) == len(segs)  # at most one segment per parameter
            for s in segs:
                assert s.buffer_start + s.length <= b.shard_numel
                for k in range(s.length):
                    covered[s.param][s.param_start + k] += 1
    assert all(c == 1 for cs in covered.values() for c in cs)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        assign_owners([(2, 2)], 0)


# ---------------------------------------------------------------------------- bytes + FLOPs
# muonscale bench's distributed default model (2 layers, d_model 128, QKV orthogonalized per
# Q/K/V block): per layer qkv 3x128x128, attn proj 128x128, fc 512x128, mlp proj 128x512.
BENCH_DP = [[(128, 128)] * 3, (128, 128), (512, 128), (128, 512)] * 2


def _elements(shapes) -> list[int]:
    return [parameter_elements(entry) for entry in shapes]


def _local_search_is_done(owners, costs, sizes, world_size) -> bool:
    """No move / swap from the largest rank lowers it below its bytes within the FLOP cap."""
    flops = rank_totals(costs, owners, world_size)
    weight = rank_totals(sizes, owners, world_size)
    h = max(range(world_size), key=lambda r: (weight[r], -r))
    cap = max(rank_totals(costs, assign_owners_lpt(costs, world_size), world_size))
    for p in (i for i, o in enumerate(owners) if o == h):
        for r in (r for r in range(world_size) if r != h):
            for q in [None, *(i for i, o in enumerate(owners) if o == r)]:
                c_q, s_q = (0, 0) if q is None else (costs[q], sizes[q])
                if s_q >= sizes[p]:
                    continue
                if max(flops[h] - costs[p] + c_q, flops[r] + costs[p] - c_q) > cap:
                    continue
                if weight[r] + sizes[p] - s_q < weight[h]:
                    return False
    return True


def assign_owners_lpt(costs, world_size) -> list[int]:
    """Plain LPT on ``costs`` (the FLOP-only assignment the byte search starts from)."""
    load, out = [0] * world_size, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        out[i], load[r] = r, load[r] + costs[i]
    return out


def test_bench_model_bytes_balanced_flops_kept():
    sizes = _elements(BENCH_DP)
    flop_only = assign_owners(BENCH_DP, 4)
    both = assign_owners(BENCH_DP, 4, sizes=sizes)
    # FLOP-only LPT: 131072 elements on one rank, 65536 on another
    assert sorted(rank_totals(sizes, flop_only, 4)) == [65536, 81920, 114688, 131072]
    # bytes too: the whole-matrix optimum (the four 65536-element matrices need four ranks,
    # and the two 49152-element ones two of them), same FLOP loads as LPT
    assert sorted(rank_totals(sizes, both, 4)) == [81920, 81920, 114688, 114688]
    assert sorted(rank_loads(BENCH_DP, both, 4)) == sorted(rank_loads(BENCH_DP, flop_only, 4))
    assert both == assign_owners(BENCH_DP, 4, sizes=sizes)  # deterministic
    # GPT-2 small is balanced in both already: the search changes nothing
    assert assign_owners(GPT2_SMALL, 4, sizes=_elements(GPT2_SMALL)) == assign_owners(GPT2_SMALL, 4)


def _optimal_makespan(costs, world_size) -> int:
    return min(
        max(rank_totals(costs, owners, world_size))
        for owners in itertools.product(range(world_size), repeat=len(costs))
    )


shape_lists = st.lists(
    st.one_of(
        st.tuples(st.integers(1, 12), st.integers(1, 12)),
        st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=3),
    ),
    min_size=1,
    max_size=7,
)


@settings(max_examples=80, deadline=None)
@given(shapes=shape_lists, world_size=st.integers(1, 4), byte_scale=st.sampled_from([1, 2, 4]))
def test_bicriteria_assignment_oracles(shapes, world_size, byte_scale):
    costs = [parameter_cost(e) for e in shapes]
    sizes = [n * byte_scale for n in _elements(shapes)]
    owners = assign_owners(shapes, world_size, sizes=sizes)
    lpt = assign_owners(shapes, world_size)
    # every parameter owned exactly once, by a real rank; deterministic
    assert len(owners) == len(shapes) and all(0 <= o < world_size for o in owners)
    assert owners == assign_owners(list(shapes), world_size, sizes=list(sizes))
    # FLOPs: never above LPT's makespan, so Graham's bound (4/3 - 1/(3N)) x optimum holds
    flops = max(rank_totals(costs, owners, world_size))
    assert flops <= max(rank_totals(costs, lpt, world_size))
    if len(shapes) <= 6 and world_size <= 3:
        assert 3 * world_size * flops <= (4 * world_size - 1) * _optimal_makespan(costs, world_size)
    # bytes: never above LPT's, and no single move or swap improves the largest rank
    assert max(rank_totals(sizes, owners, world_size)) <= max(rank_totals(sizes, lpt, world_size))
    assert _local_search_is_done(owners, costs, sizes, world_size)


def test_sizes_must_match_shapes():
    with pytest.raises(ValueError, match="sizes"):
        assign_owners([(2, 2), (3, 3)], 2, sizes=[4])


# ---------------------------------------------------------------------------- AdamW fill
def _check_streams(streams, sizes, owners, fillers, world_size):
    """Every Muon and fill element lands exactly once, in its holder's slice; returns the
    per-rank fill segments."""
    chosen = set(streams.fill.params)
    assert streams.fill.params == list(fillers[: len(chosen)])  # a prefix, in order
    covered = {i: [0] * sizes[i] for i in [*owners, *chosen]}
    for b in streams.buckets:
        slots = [0] * b.numel
        for piece in b.pieces:
            rank = b.rank_of(piece)
            if piece.param in owners:
                assert owners[piece.param] == rank  # a rank's slice holds what it owns
            else:  # ... and its fill range, which follows its owned elements
                seg = [s for s in streams.fill.segments(rank) if s.param == piece.param]
                assert len(seg) == 1
                lo = piece.param_start - seg[0].param_start
                assert 0 <= lo and lo + piece.length <= seg[0].length
                stream_pos = b.stream_start + piece.buffer_start - rank * b.length
                assert stream_pos == streams.owned_numel(rank) + seg[0].buffer_start + lo
            for k in range(piece.length):
                covered[piece.param][piece.param_start + k] += 1
                slots[piece.buffer_start + k] += 1
        assert max(slots, default=0) <= 1
    assert all(c == 1 for cs in covered.values() for c in cs)
    for r in range(world_size):
        segs = streams.fill.segments(r)
        assert len({s.param for s in segs}) == len(segs)  # at most one segment per parameter
        assert sum(s.length for s in segs) == streams.fill.lengths[r]
        assert streams.stream_numel(r) <= streams.length
    return chosen


@settings(max_examples=80, deadline=None)
@given(
    muon=st.lists(st.integers(1, 50), min_size=1, max_size=8),
    adamw=st.lists(st.integers(1, 40), min_size=0, max_size=6),
    world_size=st.integers(1, 5),
    bucket=st.integers(1, 120),
    seed=st.integers(0, 1000),
)
def test_fill_levels_streams(muon, adamw, world_size, bucket, seed):
    sizes = dict(enumerate(muon + adamw))
    owners = {i: (i * 7 + seed) % world_size for i in range(len(muon))}
    fillers = list(range(len(muon), len(muon) + len(adamw)))
    order = list(reversed(range(len(muon))))
    streams = plan_owner_streams(order, sizes, owners, world_size, bucket, fillers)
    chosen = _check_streams(streams, sizes, owners, fillers, world_size)
    per_rank = [sum(n for i, n in enumerate(muon) if owners[i] == r) for r in range(world_size)]
    gap = world_size * max(per_rank) - sum(per_rank)
    fill = sum(sizes[i] for i in chosen)
    # the fewest fillers (in order) that cover the gap, or all of them
    assert fill >= gap or chosen == set(fillers)
    assert not chosen or fill - sizes[streams.fill.params[-1]] < gap
    total = sum(per_rank) + fill
    assert streams.length == max(max(per_rank), -(-total // world_size))
    assert sum(b.numel for b in streams.buckets) == world_size * streams.length
    assert streams.padding() == world_size * streams.length - total
    assert streams.padding() < world_size if fill >= gap else streams.padding() == gap - fill


def test_fill_by_hand():
    # ranks own 100, 60 and 0 elements (gap 140); AdamW parameters of 90, 60 and 7
    sizes = {0: 100, 1: 60, 2: 90, 3: 60, 4: 7}
    streams = plan_owner_streams([1, 0], sizes, {0: 0, 1: 1}, 3, 1000, [2, 3, 4])
    assert streams.fill.params == [2, 3]  # 150 elements cover the gap; 7 is not needed
    assert streams.length == 104  # max(100, ceil((160 + 150) / 3))
    assert streams.fill.lengths == [4, 44, 102] and streams.fill.starts == [0, 4, 48]
    assert streams.fill.segments(1) == [Piece(2, 4, 0, 44)]
    assert streams.fill.segments(2) == [Piece(2, 48, 0, 42), Piece(3, 0, 42, 60)]
    assert streams.padding() == 2
    (bucket,) = streams.buckets
    assert Piece(2, 4, 104 + 60, 44) in bucket.pieces  # rank 1: after its 60 owned elements
    assert Piece(3, 0, 208 + 42, 60) in bucket.pieces  # rank 2's slice starts at 2 x 104
