"""Host maps and the two-level collectives on real gloo processes that fake hosts with an
explicit ``host_map`` (loopback only): results against the flat collectives and against one
process, and bytes per link class by hand."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import shared_pool
from test_distributed_dp import OPTS, make_model, max_diff, reference, train

from muonscale.distributed import DistributedMuon
from muonscale.distributed.comm import Communicator
from muonscale.distributed.hosts import INTER, INTRA, HostMap, discover_host_map

pytestmark = pytest.mark.timeout(180)


def test_host_map_numbers_hosts_by_first_appearance():
    hosts = HostMap.from_labels(["b", "b", "a", "a"])
    assert hosts.host_of == (0, 0, 1, 1) and hosts.hosts == 2
    assert hosts.ranks_per_host == 2 and hosts.two_level
    assert hosts.local_rank(3) == 1 and hosts.peers(3) == [1, 3]
    assert not HostMap.from_labels([0, 1]).two_level  # one rank per host: flat is optimal
    assert not HostMap.from_labels([0, 0, 0, 1]).two_level  # uneven hosts: flat
    assert HostMap.unknown(3).host_of == (0, 1, 2)


def test_bad_host_map_is_refused_naming_it():
    with pytest.raises(ValueError, match="host_map has 3 entries, expected one per rank"):
        DistributedMuon(make_model(), **OPTS, host_map=[0, 0, 1])


def _collectives(rank, world_size, host_map, dtype):
    """Two-level against flat reduce-scatter and all-gather; bytes per link of each."""
    flat = Communicator(reduce_scatter_impl="all_to_all")
    hosts = discover_host_map(flat, host_map)
    two = Communicator(hosts=hosts)
    g = torch.Generator().manual_seed(rank)
    c = 6
    x = torch.randn(world_size * c, generator=g).to(dtype)
    out = {}
    for name, comm in (("flat", flat), ("two", two)):
        comm.counter.reset()
        rs = torch.empty(c, dtype=dtype)
        comm.wait(comm.reduce_scatter(rs, x, tag="t", async_op=True))
        rs_links = comm.counter.by_link()
        comm.counter.reset()
        ag = torch.empty(world_size * c, dtype=dtype)
        comm.wait(comm.all_gather(ag, x[:c], tag="t", async_op=True))
        out[name] = (rs, ag, rs_links, comm.counter.by_link())
    everyone = torch.empty(world_size * world_size * c, dtype=dtype)
    flat.all_gather(everyone, x)
    exact = everyone.double().view(world_size, -1).sum(0).view(world_size, c)[rank]
    return out, exact, two.reduce_scatter_impl


@pytest.mark.parametrize(
    "world_size,host_map", [(2, [0, 1]), (2, [0, 0]), (4, ["a", "a", "b", "b"]), (4, [0, 1, 1, 0])]
)
def test_two_level_collectives_match_flat_and_count_links(world_size, host_map):
    results = shared_pool(world_size).run(_collectives, host_map, torch.float32)
    H = len(set(host_map))
    L = world_size // H
    S = world_size * 6 * 4  # bytes of the full input
    for out, exact, impl in results:
        assert impl == ("two_level" if H > 1 and L > 1 else "all_to_all")
        (f_rs, f_ag, f_rsl, f_agl), (t_rs, t_ag, t_rsl, t_agl) = out["flat"], out["two"]
        assert torch.equal(f_ag, t_ag)
        # both orders sum N fp32 terms: within N·eps32 of the float64 sum
        tol = world_size * torch.finfo(torch.float32).eps * exact.abs().max().item()
        assert (t_rs.double() - exact).abs().max().item() <= tol
        assert (f_rs.double() - exact).abs().max().item() <= tol
        # flat, hosts unknown: everything counted inter-host
        assert f_rsl == f_agl == {INTRA: 0, INTER: (world_size - 1) * S // world_size}
        assert t_rsl == {INTRA: (L - 1) * S // L, INTER: (H - 1) * S // world_size}
        # all-gather rings: inter, then intra
        assert t_agl == {INTRA: (L - 1) * S // L, INTER: (H - 1) * S // world_size}
    if L > 1:
        same = [torch.equal(o["flat"][0], o["two"][0]) for o, _, _ in results]
        print(f"\ntwo-level reduce-scatter bitwise equal to flat on ranks: {same}")


def _dp_against_one_process(rank, world_size, host_map, split, steps):
    ref = reference(steps)
    model = make_model()
    opt = DistributedMuon(model, **OPTS, bucket_cap_mb=2e-4, host_map=host_map)
    train(model, opt, steps, rank=rank, world_size=world_size, split=split)
    bitwise = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return (
        max_diff(ref, model),
        bitwise,
        flat,
        opt.comm.reduce_scatter_impl,
        opt.last_step_wire_links,
    )


@pytest.mark.parametrize("world_size,host_map", [(2, [0, 1]), (4, [0, 0, 1, 1])])
def test_same_batch_on_faked_hosts_is_bitwise_one_process(world_size, host_map):
    results = shared_pool(world_size).run(_dp_against_one_process, host_map, False, 4)
    for diff, bitwise, _, impl, links in results:
        assert bitwise, diff
        assert impl == ("two_level" if world_size == 4 else "all_to_all")
        assert links[INTER] > 0 and (links[INTRA] > 0) == (world_size == 4)


@pytest.mark.parametrize("world_size,host_map", [(2, [0, 1]), (4, [0, 0, 1, 1])])
def test_split_batch_on_faked_hosts_stays_close_and_replicas_agree(world_size, host_map):
    results = shared_pool(world_size).run(_dp_against_one_process, host_map, True, 5)
    assert max(r[0] for r in results) <= 1e-6  # as tests/test_distributed_dp.py's split batch
    for r in results[1:]:
        assert torch.equal(r[2], results[0][2])  # replicas bitwise identical


def _bf16_reduce(rank, world_size, host_map, steps):
    ref = reference(steps)
    model = make_model()
    opt = DistributedMuon(model, **OPTS, reduce_dtype=torch.bfloat16, host_map=host_map)
    train(model, opt, steps, rank=rank, world_size=world_size, split=True)
    return max_diff(ref, model), opt.comm.reduce_scatter_impl


def test_bf16_reduce_on_faked_hosts_stays_within_the_flat_bound():
    # host sums are rounded to bf16 before they cross hosts: one more rounding than the flat
    # all-to-all, within tests/test_distributed_dp.py's bound for a bf16 reduction
    results = shared_pool(4).run(_bf16_reduce, [0, 0, 1, 1], 3)
    for diff, impl in results:
        assert impl == "two_level"
        assert 0 < diff < 0.05, diff


def _differing_weights(rank, world_size, host_map):
    model = make_model()
    if rank == world_size - 1:
        with torch.no_grad():
            model.blocks[1].weight[0, 0] += 1.0
    try:
        DistributedMuon(model, **OPTS, host_map=host_map)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("world_size,host_map", [(2, [0, 1]), (4, [0, 0, 1, 1])])
def test_replicas_that_start_apart_are_refused_by_name(world_size, host_map):
    for message in shared_pool(world_size).run(_differing_weights, host_map):
        assert message is not None and "'blocks.1.weight'" in message, message
        assert f"rank(s) [{world_size - 1}]" in message


def _bytes_around_a_checkpoint(rank, world_size, host_map):
    model = make_model()
    opt = DistributedMuon(model, **OPTS, bucket_cap_mb=2e-4, host_map=host_map)
    train(model, opt, 1)
    first = opt.last_step_wire_links
    train(model, opt, 1, first_step=1)
    before = opt.last_step_wire_links
    opt.state_dict()  # collective, not a step's traffic
    train(model, opt, 1, first_step=2)
    return first, before, opt.last_step_wire_links


def test_setup_and_checkpoint_bytes_stay_out_of_the_step_count():
    for first, before, after in shared_pool(4).run(_bytes_around_a_checkpoint, [0, 0, 1, 1]):
        assert first == before == after


def _uneven_collectives(rank, world_size, host_map):
    """Collectives that skip each shard's padding, flat and two-level, against the padded ones."""
    flat = Communicator(reduce_scatter_impl="all_to_all")
    two = Communicator(hosts=discover_host_map(flat, host_map))
    c = 5
    lengths = [c, 3, 0, 4][:world_size]
    x = torch.randn(world_size, c, generator=torch.Generator().manual_seed(rank))
    for j, n in enumerate(lengths):
        x[j, n:] = 0.0  # padding
    mine = x[rank].clone()
    out = {}
    for name, comm in (("flat", flat), ("two", two)):
        padded, skipped = torch.full((c,), 7.0), torch.full((c,), 7.0)
        comm.reduce_scatter(padded, x.reshape(-1))
        comm.counter.reset()
        comm.wait(comm.reduce_scatter(skipped, x.reshape(-1), async_op=True, lengths=lengths))
        rs_links = comm.counter.by_link()
        comm.counter.reset()
        gathered = torch.full((world_size, c), 7.0)
        comm.wait(comm.all_gather(gathered.view(-1), mine, async_op=True, lengths=lengths))
        out[name] = (padded, skipped, gathered, rs_links, comm.counter.by_link())
    return out, lengths, x


@pytest.mark.parametrize("world_size,host_map", [(2, [0, 1]), (4, [0, 0, 1, 1]), (4, [0, 1, 1, 0])])
def test_padding_stays_off_the_wire(world_size, host_map):
    results = shared_pool(world_size).run(_uneven_collectives, host_map)
    hosts = HostMap.from_labels(host_map)
    inputs = [x for _, _, x in results]
    for rank, (out, lengths, _) in enumerate(results):
        n = lengths[rank]
        for name, (padded, skipped, gathered, _, _) in out.items():
            assert torch.equal(skipped[:n], padded[:n]), name  # same sums, same order
            assert bool((skipped[n:] == 7.0).all()), name  # padding not written
            for j, m in enumerate(lengths):
                assert torch.equal(gathered[j, :m], inputs[j][j, :m]), name
                assert bool((gathered[j, m:] == 7.0).all()), name
        # bytes: only the data; the two-level one crosses hosts once per chunk
        others = sum(lengths) - n
        assert sum(out["flat"][3].values()) == others * 4
        assert sum(out["flat"][4].values()) == (world_size - 1) * n * 4
        if hosts.two_level:
            peers = [j for j in hosts.peers(rank) if j != rank]
            assert out["two"][3][INTER] == sum(lengths[j] for j in peers) * 4
            assert out["two"][4][INTER] == len(peers) * n * 4
