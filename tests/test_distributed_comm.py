"""comm.py: the ring cost model by hand, and every collective on real gloo processes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from distributed_harness import run_workers

from muonscale.distributed.comm import (
    Communicator,
    WireCounter,
    gather_wire_stats,
    ring_wire_bytes,
)

pytestmark = pytest.mark.timeout(120)


def test_ring_model_by_hand():
    S = 4096  # bytes
    assert ring_wire_bytes("all_reduce", S, 4) == 2 * 3 * 1024
    assert ring_wire_bytes("reduce_scatter", S, 4) == 3 * 1024
    assert ring_wire_bytes("all_gather", S, 4) == 3 * 1024
    assert ring_wire_bytes("all_to_all", S, 4) == 3 * 1024
    assert ring_wire_bytes("broadcast", S, 2) == 2048
    assert ring_wire_bytes("all_reduce", S, 1) == 0
    with pytest.raises(ValueError, match="unknown collective"):
        ring_wire_bytes("gossip", S, 2)


def test_counter_breakdown_and_take():
    c = WireCounter()
    c.record("reduce_scatter", 800, 2, "muon")
    c.record("all_gather", 800, 2, "muon")
    c.record("all_reduce", 8, 2, "control")
    assert c.total == 400 + 400 + 8
    assert c.breakdown() == {
        "control/all_reduce": 8,
        "muon/all_gather": 400,
        "muon/reduce_scatter": 400,
    }
    assert c.by_op() == {"all_gather": 400, "all_reduce": 8, "reduce_scatter": 400}
    total, breakdown = c.take()
    assert total == 808 and breakdown["muon/reduce_scatter"] == 400
    assert c.total == 0


def test_single_process_communicator_copies_and_counts_nothing():
    comm = Communicator()
    assert comm.world_size == 1 and not comm.active
    x = torch.arange(6.0)
    out = torch.empty(6)
    comm.wait(comm.reduce_scatter(out, x, tag="t", async_op=True))
    assert torch.equal(out, x)
    out2 = torch.empty(6)
    comm.all_gather(out2, x)
    assert torch.equal(out2, x)
    comm.all_reduce(x)
    assert comm.counter.total == 0
    assert gather_wire_stats(123)["max"] == 123.0
    counter = WireCounter()
    counter.add("all_reduce", 7)
    assert gather_wire_stats(counter)["mean"] == 7.0


def _collectives(rank, world_size):
    comm = Communicator()
    n = world_size
    # reduce-scatter (async), float32 and bfloat16
    full = torch.arange(4 * n, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(4)
    comm.wait(comm.reduce_scatter(shard, full, tag="g", async_op=True))
    scale = sum(r + 1 for r in range(n))
    expect = torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) * scale
    assert torch.equal(shard, expect), (shard, expect)
    shard16 = torch.empty(4, dtype=torch.bfloat16)
    comm.reduce_scatter(shard16, full.to(torch.bfloat16), tag="g16")
    assert torch.allclose(shard16.float(), expect, rtol=1e-2)
    # all-gather
    gathered = torch.empty(3 * n)
    comm.all_gather(gathered, torch.full((3,), float(rank)), tag="p")
    assert torch.equal(gathered, torch.arange(n, dtype=torch.float32).repeat_interleave(3))
    # all-reduce
    x = torch.tensor([float(rank)])
    comm.all_reduce(x)
    assert x.item() == sum(range(n))
    # all-to-all with uneven split sizes: rank r sends (d + 1) elements valued 10r + d to rank d
    send_sizes = [d + 1 for d in range(n)]
    send = torch.cat([torch.full((d + 1,), 10.0 * rank + d) for d in range(n)])
    recv_sizes = [rank + 1] * n
    recv = torch.empty(sum(recv_sizes))
    comm.all_to_all_single(recv, send, recv_sizes, send_sizes, tag="a2a")
    assert torch.equal(
        recv, torch.cat([torch.full((rank + 1,), 10.0 * s + rank) for s in range(n)])
    )
    # broadcast
    b = torch.full((5,), float(rank))
    comm.broadcast(b, src=n - 1)
    assert torch.equal(b, torch.full((5,), float(n - 1)))
    stats = gather_wire_stats(comm.counter.total)
    return rank, comm.counter.breakdown(), stats


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_and_bytes_on_gloo(world_size):
    results = run_workers(_collectives, world_size)
    n = world_size
    f = (n - 1) / n
    for rank, breakdown, stats in results:
        assert breakdown["g/reduce_scatter"] == int(f * 4 * n * 4)
        assert breakdown["g16/reduce_scatter"] == int(f * 4 * n * 2)
        assert breakdown["p/all_gather"] == int(f * 3 * n * 4)
        assert breakdown["control/all_reduce"] == int(2 * f * 4)
        # all-to-all with split sizes: exactly what leaves this rank (all but its own chunk)
        assert breakdown["a2a/all_to_all"] == (sum(d + 1 for d in range(n)) - (rank + 1)) * 4
        assert breakdown["other/broadcast"] == int(f * 5 * 4)
        assert stats["min"] <= sum(breakdown.values()) <= stats["max"]
    totals = [sum(r[1].values()) for r in results]
    assert results[0][2]["mean"] == sum(totals) / n and results[0][2]["max"] == max(totals)
    assert dist.is_available()


def _reduce_scatter_impls(rank, world_size):
    # Rank r contributes values that do not sum exactly in float32 in every order, so the
    # rank-order oracle below is a real check of the summation order.
    g = torch.Generator().manual_seed(100 + rank)
    full = torch.randn(8 * world_size, generator=g) * (10.0 ** (rank - 1))
    out = {}
    for impl in ("native", "all_to_all"):
        comm = Communicator(reduce_scatter_impl=impl)
        shard = torch.empty(8)
        comm.wait(comm.reduce_scatter(shard, full, async_op=True))
        shard16 = torch.empty(8, dtype=torch.bfloat16)
        comm.reduce_scatter(shard16, full.to(torch.bfloat16))
        out[impl] = (shard, shard16, comm.counter.total)
    everyone = torch.empty(world_size * full.numel())
    Communicator().all_gather(everyone, full)
    with pytest.raises(ValueError, match="op must be ReduceOp.SUM"):
        Communicator(reduce_scatter_impl="all_to_all").reduce_scatter(
            torch.empty(8), full, op=dist.ReduceOp.MAX
        )
    return rank, out, everyone.view(world_size, -1), Communicator().reduce_scatter_impl


@pytest.mark.parametrize("world_size", [2, 4])
def test_reduce_scatter_by_all_to_all_sums_in_rank_order(world_size):
    n = world_size
    for rank, out, everyone, auto_impl in run_workers(_reduce_scatter_impls, n):
        assert auto_impl == "all_to_all"  # gloo: the native one sends a whole all-reduce
        mine = everyone[:, 8 * rank : 8 * rank + 8]
        oracle = mine[0].clone()  # left to right over the ranks, float32
        for r in range(1, n):
            oracle += mine[r]
        shard, shard16, counted = out["all_to_all"]
        assert torch.equal(shard, oracle)
        exact = mine.double().sum(0)
        # float32: n - 1 roundings of a sum of magnitude <= sum|x|
        tol = (n - 1) * torch.finfo(torch.float32).eps * mine.double().abs().sum(0)
        assert torch.all((out["native"][0].double() - exact).abs() <= tol)
        if n == 2:  # a + b == b + a: both implementations agree bitwise
            assert torch.equal(out["native"][0], shard)
        # bfloat16: float32 accumulation of bf16 inputs, one rounding to bf16 at the end
        acc = mine[0].to(torch.bfloat16).float()
        for r in range(1, n):
            acc += mine[r].to(torch.bfloat16).float()
        oracle16 = acc.to(torch.bfloat16)
        assert torch.equal(shard16, oracle16)
        # same bytes counted either way: the ring model of a reduce-scatter
        assert counted == out["native"][2] == int((n - 1) / n * 8 * n * (4 + 2))


def test_reduce_scatter_impl_is_checked():
    with pytest.raises(ValueError, match="reduce_scatter_impl must be"):
        Communicator(reduce_scatter_impl="ring")
