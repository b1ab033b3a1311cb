"""Ownership and bucket layouts (pure bookkeeping, no processes)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muonscale.distributed.buckets import plan_flat_buckets, plan_owner_streams
from muonscale.distributed.ownership import (
    assign_owners,
    format_ownership_table,
    parameter_cost,
    rank_loads,
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
