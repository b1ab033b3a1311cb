"""sharded.py: whole-matrix work on sharded matrices (all-to-all to owners and back) equals the
same work on full matrices in one process, for every kind of layout, on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import WorkerPool

from muonscale.distributed.comm import WireCounter
from muonscale.distributed.sharded import (
    MatrixLayout,
    ShardedMatrices,
    all_to_all_wire_bytes,
    chunk_bounds,
    default_owners,
    duplicated_wire_bytes,
)

pytestmark = pytest.mark.timeout(120)


def whole_matrix_fn(indices, matrices):
    """Depends on every entry of the matrix: a blockwise version would differ."""
    return [(m @ m.T @ m) / m.norm() + i for i, m in zip(indices, matrices)]


def chunked(shape, dim, world_size):
    size = shape[dim]
    return MatrixLayout.sharded(
        shape, dim, [chunk_bounds(size, world_size, r)[1] for r in range(world_size)]
    )


def layouts_for(world_size):
    """(name, layout) for every layout kind; indices build per-rank pieces."""
    out = [
        ("rows 71x30", chunked((71, 30), 0, world_size)),
        ("rows 7x30", chunked((7, 30), 0, world_size)),
        ("rows 3x30 (fewer rows than ranks)", chunked((3, 30), 0, world_size)),
        ("cols 30x50", chunked((30, 50), 1, world_size)),
        ("cols uneven 12x9", MatrixLayout.sharded((12, 9), 1, [9] + [0] * (world_size - 1))),
        ("replicated 6x6", MatrixLayout.replicated((6, 6), world_size)),
        (
            "strided rows 13x5",
            MatrixLayout.from_indices(
                (13, 5),
                [(torch.arange(r, 13, world_size), torch.arange(5)) for r in range(world_size)],
            ),
        ),
    ]
    if world_size == 4:
        # 2x2 mesh: rows by mesh axis 0, columns by mesh axis 1 (FSDP x TP Shard(1))
        blocks = []
        for r in range(4):
            r0, rl = chunk_bounds(10, 2, r // 2)
            c0, cl = chunk_bounds(11, 2, r % 2)
            blocks.append((torch.arange(r0, r0 + rl), torch.arange(c0, c0 + cl)))
        out.append(("2-D blocks 10x11", MatrixLayout.from_indices((10, 11), blocks)))
        # HSDP: replicated across mesh axis 0, rows sharded across axis 1
        hsdp = []
        for r in range(4):
            r0, rl = chunk_bounds(9, 2, r % 2)
            hsdp.append((torch.arange(r0, r0 + rl), torch.arange(8)))
        out.append(("replicate x rows 9x8", MatrixLayout.from_indices((9, 8), hsdp)))
    return out


def _piece(full, layout, rank):
    rows, cols = layout.pieces[rank]
    rows = torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
    cols = torch.arange(cols.start, cols.stop) if isinstance(cols, slice) else cols
    return full.index_select(0, rows).index_select(1, cols)


def _full_matrices(layouts):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(lay.shape, generator=g) for _, lay in layouts]


def sharded_worker(rank, world_size):
    named = layouts_for(world_size)
    layouts = [lay for _, lay in named]
    fulls = _full_matrices(named)
    counter = WireCounter()
    plan = ShardedMatrices(layouts, counter=counter)
    pieces = [_piece(f, lay, rank) for f, lay in zip(fulls, layouts)]
    out = plan.apply(pieces, whole_matrix_fn)
    expect = whole_matrix_fn(list(range(len(fulls))), fulls)
    errors = {
        name: (out[i] - _piece(expect[i], layouts[i], rank)).abs().max().item()
        if out[i].numel()
        else 0.0
        for i, (name, _) in enumerate(named)
    }
    shapes_ok = all(tuple(o.shape) == lay.piece_shape(rank) for o, lay in zip(out, layouts))
    to_owners, back = plan.wire_elements()
    sent_bytes = counter.total
    # the same pieces written into piece_buffer()'s slots and sent from there: the same results
    packed, slots = plan.piece_buffer(torch.float32, torch.device("cpu"))
    for slot, piece in zip(slots, pieces):
        slot.copy_(piece)
    out_packed = plan.apply(slots, whole_matrix_fn, packed=packed)
    packed_equal = all(torch.equal(a, b) for a, b in zip(out, out_packed))
    misplaced = [slot.clone() for slot in slots]  # same values, not in the buffer
    try:
        plan.apply(misplaced, whole_matrix_fn, packed=packed)
        refused = not any(plan.send)  # nothing sent from here: nothing to check
    except ValueError:
        refused = True
    return {
        "packed_equal": packed_equal,
        "misplaced_refused": refused,
        "errors": errors,
        "shapes_ok": shapes_ok,
        "bytes": sent_bytes,
        "expected_bytes": 4 * (to_owners + back),
        "to_owners": to_owners,
        "owners": plan.owners,
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request):
    with WorkerPool(request.param) as pool:
        yield request.param, pool.run(sharded_worker)


def test_sharded_equals_whole_matrix_fn(results):
    world_size, per_rank = results
    for rank, res in enumerate(per_rank):
        assert res["shapes_ok"], rank
        assert res["packed_equal"] and res["misplaced_refused"], rank
        for name, err in res["errors"].items():
            assert err == 0.0, f"{world_size} ranks, rank {rank}, {name}: max error {err}"


def test_sharded_wire_bytes(results):
    world_size, per_rank = results
    named = layouts_for(world_size)
    for res in per_rank:
        assert res["bytes"] == res["expected_bytes"]
        assert res["owners"] == per_rank[0]["owners"]
    # to owners: every element not already at its owner crosses once (replicas sent once)
    owners = per_rank[0]["owners"]
    expected = 0
    for i, (_, lay) in enumerate(named):
        if lay.whole_everywhere:
            continue
        distinct = {}
        for r in range(world_size):
            key = tuple(str(x) for x in lay.pieces[r])
            distinct.setdefault(key, []).append(r)
        for holders in distinct.values():
            if owners[i] not in holders:
                m, n = lay.piece_shape(holders[0])
                expected += m * n
    assert sum(res["to_owners"] for res in per_rank) == expected


def test_layout_validation_and_single_process():
    assert [chunk_bounds(7, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 1)]
    assert [chunk_bounds(3, 4, r)[1] for r in range(4)] == [1, 1, 1, 0]
    for size in (0, 1, 5, 71):
        for n in (1, 2, 3, 4):
            assert [chunk_bounds(size, n, r)[1] for r in range(n)][
                : len(torch.arange(size).chunk(n))
            ] == [len(c) for c in torch.arange(size).chunk(n)]
    with pytest.raises(ValueError, match="cover"):
        MatrixLayout.from_indices((4, 4), [(torch.arange(2), torch.arange(4))] * 2)
    with pytest.raises(ValueError, match="add up"):
        MatrixLayout.sharded((4, 4), 0, [1, 1])
    # world size 1 (torch.distributed not initialized): fn on the whole matrices, no bytes
    full = torch.randn(5, 3)
    counter = WireCounter()
    plan = ShardedMatrices([MatrixLayout.sharded((5, 3), 0, [5])], counter=counter)
    (out,) = plan.apply([full], whole_matrix_fn)
    torch.testing.assert_close(out, whole_matrix_fn([0], [full])[0], rtol=0, atol=0)
    assert counter.total == 0


def test_cost_model_duplicated_vs_all_to_all():
    n = 4
    layouts = [chunked((64, 64), 0, n) for _ in range(8)]
    owners = default_owners(layouts, n)
    assert sorted(owners) == [0, 0, 1, 1, 2, 2, 3, 3]
    S = 8 * 64 * 64 * 4
    assert duplicated_wire_bytes(layouts, 4, n) == 3 * S // 4
    # all-to-all per rank: its 3/4 of S/4 out, and as much back: 2 (N-1)/N^2 S = 2/N of duplicated
    per_rank = all_to_all_wire_bytes(layouts, owners, 4, n)
    assert per_rank == [2 * 3 * S // 16] * n
    print(
        f"\nN=4, S={S} B: all-to-all {per_rank[0]} B/rank, "
        f"duplicated {duplicated_wire_bytes(layouts, 4, n)} B/rank"
    )
