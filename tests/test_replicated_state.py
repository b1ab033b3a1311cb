"""A second replicated row state costs no layout code: a made-up variant declares one more
replicated ``StateTensor`` beside NorMuon's row second moment (:mod:`made_up_row_state`: its
row statistics and its replica step, registered by patching ``variants.VARIANT_STATE``), and
``DTensorMuon`` at 2 gloo ranks with row-sharded matrices (``Shard(0)``, uneven, a split QKV
weight, a 4-D weight) keeps every rank's replica of it equal, bitwise, to the owner's after
each step: to the state single-process ``muonscale.Muon`` steps where the matrix is whole.
Both states travel in the one all-reduce of row statistics. Megatron at TP 2:
``tests/megatron/test_megatron_replicated_state.py``."""

from __future__ import annotations

import gc

import pytest
import torch
from distributed_harness import shared_pool
from made_up_row_state import ROW_PEAK, declared
from test_dtensor_muon import OPTIONS, SPLITS, _full_tensors, _grads, _shard_like
from torch import nn

import muonscale
from muonscale.variants import ROW_MOMENT, VARIANT_STATE

pytestmark = pytest.mark.timeout(240)

STEPS = 3
NORMUON = dict(normalize="row")
SHAPES = {
    "w": (12, 20),
    "tall": (21, 6),  # 11 + 10 rows
    "qkv": (24, 16),  # split into Q, K, V blocks (SPLITS): three matrices, one row state
    "conv": (6, 3, 2, 2),
    "bias": (20,),
}
ROW_STATES = (ROW_MOMENT.key, ROW_PEAK.key)


def _row_states(opt, named) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's row states held by this rank (copies), by parameter name and key."""
    return {
        n: {k: opt.state[p][k].clone() for k in ROW_STATES if k in opt.state[p]}
        for n, p in named
        if any(k in opt.state[p] for k in ROW_STATES)
    }


def _single_process(init) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """Single-process Muon (NorMuon with the made-up state): the row states after each step,
    and the weights after the last."""
    params = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    opt = muonscale.Muon(list(params.items()), splits=SPLITS, **OPTIONS, **NORMUON)
    states = []
    for k in range(STEPS):
        grads = _grads(SHAPES, k)
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
        states.append(_row_states(opt, list(params.items())))
    return states, {n: p.detach().clone() for n, p in params.items()}


def _dtensor(init, world_size) -> tuple[list[dict], dict[str, torch.Tensor], int]:
    """DTensorMuon, matrices ``Shard(0)`` over the ranks: this rank's row states after each
    step, the whole weights after the last and the last step's row-statistics bytes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muonscale.distributed.dtensor import DTensorMuon

    mesh = init_device_mesh("cpu", (world_size,))
    named = [
        (
            n,
            nn.Parameter(
                distribute_tensor(t.clone(), mesh, [Shard(0) if t.ndim > 1 else Replicate()])
            ),
        )
        for n, t in init.items()
    ]
    opt = DTensorMuon(named, splits=SPLITS, **OPTIONS, **NORMUON)
    states = []
    for k in range(STEPS):
        grads = _grads(SHAPES, k)
        for n, p in named:
            p.grad = _shard_like(grads[n], p)
        opt.step()
        states.append(_row_states(opt, named))
    weights = {n: p.full_tensor().detach().clone() for n, p in named}
    row_bytes = opt.last_step_wire_breakdown.get("muon/all_reduce", 0)
    del opt, named
    gc.collect()
    return states, weights, row_bytes


def _worker(rank, world_size):
    init = _full_tensors(SHAPES, 0)
    _, _, normuon_row_bytes = _dtensor(init, world_size)  # NorMuon's state alone
    with declared(ROW_PEAK):
        ref_states, ref_weights = _single_process(init)
        states, weights, row_bytes = _dtensor(init, world_size)
    return dict(
        states=states,
        weights=weights,
        ref_states=ref_states,
        ref_weights=ref_weights,
        row_bytes=row_bytes,
        normuon_row_bytes=normuon_row_bytes,
    )


def test_second_replicated_state_stays_equal_to_the_owners():
    per_rank = shared_pool(2).run(_worker)
    assert ROW_PEAK not in VARIANT_STATE  # registered inside the workers only
    ref = per_rank[0]["ref_states"]
    names = {"w", "tall", "qkv", "conv"}
    for step in range(STEPS):
        assert set(ref[step]) == names
        for n in names:
            assert set(ref[step][n]) == set(ROW_STATES), n  # both states kept
            peak = ref[step][n][ROW_PEAK.key]
            assert peak.shape == ref[step][n][ROW_MOMENT.key].shape
            assert bool((peak > 0).all()), (step, n)  # stepped from the statistics
            if step:  # and again at each step: β₂ v < max(β₂ v, ‖O_r‖₁) somewhere
                assert not torch.equal(peak, ref[step - 1][n][ROW_PEAK.key]), (step, n)
        for rank, res in enumerate(per_rank):
            # every rank's replica: the owner's, i.e. the one process's, where O is whole
            assert res["states"][step].keys() == ref[step].keys(), (step, rank)
            for n, by_key in res["states"][step].items():
                for key, value in by_key.items():
                    assert torch.equal(value, ref[step][n][key]), (step, rank, n, key)
    for rank, res in enumerate(per_rank):
        # the made-up state moves no weight: they end bitwise where one process ends
        assert all(torch.equal(res["weights"][n], w) for n, w in res["ref_weights"].items())
        # both states' statistics in the one all-reduce: twice NorMuon's rows
        assert res["normuon_row_bytes"] > 0
        assert res["row_bytes"] == 2 * res["normuon_row_bytes"], rank
