"""distributed/exchange.py: ``PieceExchange`` (pieces over gloo ranks, all-to-all to owners and
back) gives every rank, bitwise, its piece of what ``LocalExchange`` gives on whole matrices,
for the matrix step with row state (NorMuon rules), at 2 and 4 real processes and for every
kind of layout (uneven, empty pieces, fewer rows than ranks, strided, 2-D blocks, replicas,
whole everywhere); ``share_row_statistics`` gives every rank the owner's statistics, and
replicas stepped from them stay equal to one process's."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import shared_pool
from test_sharded_primitive import _piece, layouts_for

from muonscale import matrix_step
from muonscale.distributed.comm import WireCounter
from muonscale.distributed.exchange import LocalExchange, PieceExchange
from muonscale.distributed.sharded import MatrixLayout
from muonscale.settings import MuonSettings, NewtonSchulzSettings
from muonscale.variants import ROW_MOMENT

pytestmark = pytest.mark.timeout(120)

NS = NewtonSchulzSettings(dtype=torch.float32)
BETA2 = 0.9
ROW_SETTINGS = MuonSettings(normalize="row", row_beta2=BETA2)


def _case(world_size):
    """(names, layouts, whole matrices, rules, row moments): the same on every rank; every
    other matrix normalizes rows (with a row moment), the others have no row state."""
    named = layouts_for(world_size)
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(lay.shape, generator=g) for _, lay in named]
    rules, moments = [], []
    for i, (_, lay) in enumerate(named):
        rows = lay.shape[0]
        with_rows = i % 3 != 0
        rules.append(matrix_step.MatrixRule(NS, 0.5 + i, ROW_SETTINGS if with_rows else None))
        moments.append(torch.rand(rows, generator=g) + 0.1 if with_rows else None)
    return [n for n, _ in named], [lay for _, lay in named], fulls, rules, moments


def _by_state(moments):
    """Row moments (None: none) as the matrix step takes row states, by declaration."""
    return [{} if v is None else {ROW_MOMENT: v} for v in moments]


def _owner_step(rules, moments, computed):
    """The matrix step of whole matrices (row moments read, not stepped); each matrix's row
    statistics into ``computed``."""

    def step(indices, whole):
        out, stats = matrix_step.matrix_updates(
            whole,
            [rules[i] for i in indices],
            _by_state([moments[i] for i in indices]),
            step_row_state=False,
        )
        computed.update((i, s[ROW_MOMENT]) for i, s in zip(indices, stats) if s)
        return out

    return step


def _stepped(moments, stats):
    """Each row moment stepped from ``stats`` (a copy; None stays None)."""
    out = [None if v is None else v.clone() for v in moments]
    matrix_step.step_row_replicas_(
        _by_state(out),
        _by_state([stats.get(i) for i in range(len(out))]),
        [ROW_SETTINGS] * len(out),
    )
    return out


def exchange_worker(rank, world_size):
    names, layouts, fulls, rules, moments = _case(world_size)
    rows = [None if v is None else v.numel() for v in moments]

    # one process: every matrix whole here
    local_stats: dict[int, torch.Tensor] = {}
    local = LocalExchange()
    expect = local.run(fulls, _owner_step(rules, moments, local_stats))
    expect_shared = local.share_row_statistics(local_stats, rows)

    # pieces over the group, sent from the packed piece buffer
    counter = WireCounter()
    exchange = PieceExchange(layouts, group=None, counter=counter, tag="muon")
    packed, pieces = exchange.piece_buffer(torch.float32, torch.device("cpu"))
    for slot, full, lay in zip(pieces, fulls, layouts):
        slot.copy_(_piece(full, lay, rank))
    owner_stats: dict[int, torch.Tensor] = {}
    out = exchange.run(pieces, _owner_step(rules, moments, owner_stats), packed=packed)
    before = counter.total
    shared = exchange.share_row_statistics(owner_stats, rows)
    row_bytes = counter.total - before

    # a bf16 result leg: each piece is the whole result's piece, rounded once
    out_bf16 = exchange.run(
        [p.clone() for p in pieces],
        _owner_step(rules, moments, {}),
        result_dtype=torch.bfloat16,
    )

    # only matrices every rank holds whole: computed here, nothing sent
    whole = [i for i, lay in enumerate(layouts) if lay.whole_everywhere]
    quiet_counter = WireCounter()
    quiet = PieceExchange([layouts[i] for i in whole], group=None, counter=quiet_counter, tag="x")
    quiet_stats: dict[int, torch.Tensor] = {}
    quiet_out = quiet.run(
        [fulls[i] for i in whole],
        _owner_step([rules[i] for i in whole], [moments[i] for i in whole], quiet_stats),
    )
    quiet_shared = quiet.share_row_statistics(
        quiet_stats, [rows[i] for i in whole]
    )  # no traffic either

    return {
        "names": names,
        "owners": exchange.matrices.owners,
        "local": exchange.local,
        "pieces_equal": {
            names[i]: torch.equal(out[i], _piece(expect[i], layouts[i], rank))
            for i in range(len(layouts))
        },
        "shapes_ok": all(tuple(o.shape) == lay.piece_shape(rank) for o, lay in zip(out, layouts)),
        "bf16_equal": all(
            torch.equal(o, _piece(e, lay, rank).to(torch.bfloat16))
            for o, e, lay in zip(out_bf16, expect, layouts)
        ),
        "owner_stats": owner_stats,
        "shared": shared,
        "expect_shared": expect_shared,
        "stepped": _stepped(moments, shared),
        "expect_stepped": _stepped(moments, expect_shared),
        "row_bytes": row_bytes,
        "quiet_equal": all(torch.equal(quiet_out[k], expect[i]) for k, i in enumerate(whole)),
        "quiet_shared_equal": all(
            torch.equal(quiet_shared[k], expect_shared[i])
            for k, i in enumerate(whole)
            if rows[i] is not None
        ),
        "quiet_bytes": quiet_counter.total,
        "n_whole": len(whole),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def results(request):
    return request.param, shared_pool(request.param).run(exchange_worker)


def test_pieces_equal_local_exchange(results):
    world_size, per_rank = results
    for rank, res in enumerate(per_rank):
        assert res["shapes_ok"], rank
        bad = [name for name, ok in res["pieces_equal"].items() if not ok]
        assert not bad, f"{world_size} ranks, rank {rank}: pieces differ for {bad}"
        assert res["bf16_equal"], rank
        assert res["owners"] == per_rank[0]["owners"]


def test_share_row_statistics_gives_every_rank_the_owners(results):
    world_size, per_rank = results
    owners, local = per_rank[0]["owners"], set(per_rank[0]["local"])
    rows_of = per_rank[0]["expect_shared"]
    for rank, res in enumerate(per_rank):
        assert res["shared"].keys() == rows_of.keys(), rank  # exactly the matrices with rows
        for i, stats in res["shared"].items():
            # the owner's own statistics (a matrix whole everywhere: every rank's own)
            source = per_rank[rank if i in local else owners[i]]["owner_stats"][i]
            assert torch.equal(stats, source), (world_size, rank, res["names"][i])
            assert torch.equal(stats, rows_of[i]), (world_size, rank, res["names"][i])
        for v, ref in zip(res["stepped"], res["expect_stepped"]):
            assert (v is None) == (ref is None)
            assert v is None or torch.equal(v, ref), rank  # replicas equal one process's
    # one float32 all-reduce of the rows of the sharded matrices with row state
    sharded_rows = sum(
        stats.numel() for i, stats in per_rank[0]["shared"].items() if i not in local
    )
    assert sharded_rows > 0
    assert all(res["row_bytes"] > 0 for res in per_rank)


def test_whole_everywhere_matrices_send_nothing(results):
    _, per_rank = results
    for res in per_rank:
        assert res["n_whole"] > 0
        assert res["quiet_equal"] and res["quiet_shared_equal"]
        assert res["quiet_bytes"] == 0


def test_local_exchange_casts_and_keeps_row_statistics():
    """One process: the step runs on the given matrices, results in ``result_dtype``; the
    statistics of matrices with row state are returned as computed (no copy, no traffic)."""
    fulls = [torch.randn(4, 6), torch.randn(3, 5)]
    rules = [matrix_step.MatrixRule(NS, 2.0, ROW_SETTINGS), matrix_step.MatrixRule(NS, 1.0)]
    moments = [torch.ones(4), None]
    computed: dict[int, torch.Tensor] = {}
    exchange = LocalExchange()
    out = exchange.run(fulls, _owner_step(rules, moments, computed), result_dtype=torch.float64)
    expect, stats = matrix_step.matrix_updates(
        fulls, rules, _by_state(moments), step_row_state=False
    )
    assert all(o.dtype == torch.float64 for o in out)
    assert all(torch.equal(o, e.double()) for o, e in zip(out, expect))
    shared = exchange.share_row_statistics(computed, [4, None])
    assert shared.keys() == {0} and shared[0] is computed[0]
    assert torch.equal(shared[0], stats[0][ROW_MOMENT])
    assert torch.equal(moments[0], torch.ones(4))  # read, not stepped
    assert LocalExchange().run([], _owner_step([], [], {})) == []
    one_rank = PieceExchange(
        [MatrixLayout.replicated((4, 6), 1)], group=None, counter=WireCounter(), tag="muon"
    )
    assert one_rank.local == [0]
