"""Muon variants in every layout: DistributedMuon (2 gloo ranks) and DTensorMuon (2 ranks)
against single-process muonscale.Muon."""

from __future__ import annotations

import gc

import pytest
import torch
from distributed_harness import shared_pool
from test_distributed_dp import OPTS, make_model, max_diff, reference, train
from test_dtensor_muon import (
    SHAPES,
    SPLITS,
    Bag,
    _full_tensors,
    _max_diff,
    _placements_1d,
    _reference,
    _run_injected,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

import muonscale
from muonscale.distributed import DistributedMuon
from muonscale.distributed.dtensor import DTensorMuon

pytestmark = pytest.mark.timeout(300)

VARIANTS = {
    "normuon": dict(normalize="row"),
    "cautious": dict(cautious_weight_decay=True),
    "aol": dict(preconditioner="aol"),
    "aol_gram": dict(preconditioner="aol", ns_method="gram"),
    "polar_express": dict(coefficients="polar_express"),
}
DTENSOR_VARIANTS = [k for k in VARIANTS if k != "normuon"]  # NorMuon: refused (see dtensor.py)
# Same-batch data parallelism averages gradients in another order than one process, so the
# layouts agree to float32 rounding carried through a few steps (the bound the existing
# DistributedMuon tests use); world size 1 and DTensor owners see the same bits.
TOL = 1e-6


def _dp_worker(rank, world_size, steps):
    out = {}
    for name, kw in VARIANTS.items():
        ref = reference(steps, dict(n_hidden=3), **kw)
        model = make_model(n_hidden=3)
        opt = DistributedMuon(model, **OPTS, **kw, bucket_cap_mb=2e-4)
        train(model, opt, steps)
        single = muonscale.Muon(make_model(n_hidden=3), **{**OPTS, **kw})
        state, ref_state = opt.state_dict(), None
        if name == "normuon":  # round trip of the NorMuon state through a single process
            ref_model = make_model(n_hidden=3)
            ref_opt = muonscale.Muon(ref_model, **{**OPTS, **kw})
            train(ref_model, ref_opt, steps)
            ref_state = ref_opt.state_dict()
            single.load_state_dict(state)
            moments = {k: v["row_second_moment"] for k, v in state["state"].items()
                       if "row_second_moment" in v}  # fmt: skip
            ref_moments = {k: v["row_second_moment"] for k, v in ref_state["state"].items()
                           if "row_second_moment" in v}  # fmt: skip
            assert moments.keys() == ref_moments.keys() and moments
            moment_diff = max((moments[k] - ref_moments[k]).abs().max().item() for k in moments)
            fresh = DistributedMuon(make_model(n_hidden=3), **OPTS, **kw, bucket_cap_mb=2e-4)
            fresh.load_state_dict(state)
            again = fresh.state_dict()
            assert all(torch.equal(again["state"][k]["row_second_moment"], moments[k])
                       for k in moments)  # fmt: skip
            out["normuon_moment_diff"] = moment_diff
        out[name] = max_diff(ref, model)
    return out


def test_variants_distributed_muon_2_ranks():
    res = shared_pool(2).run(_dp_worker, 3)
    for rank_result in res:
        for name in VARIANTS:
            assert rank_result[name] <= TOL, (name, rank_result[name])
        # the moment is an EMA of squared entries (~1/n): float32 rounding of those
        assert rank_result["normuon_moment_diff"] <= 1e-6


def test_variants_world_size_one_distributed_is_bitwise():
    for kw in VARIANTS.values():
        a, b = make_model(), make_model()
        train(a, muonscale.Muon(a, **OPTS, **kw), 3)
        train(b, DistributedMuon(b, **OPTS, **kw), 3)
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters())), kw


def _dtensor_worker(rank, world_size):
    init = _full_tensors(SHAPES, 0)
    out = {}
    for name in DTENSOR_VARIANTS:
        kw = VARIANTS[name]
        ref = _reference(init, SHAPES, SPLITS, **kw)
        for kind in ("fsdp", "tp1"):
            mesh = init_device_mesh("cpu", (world_size,))
            if kind == "fsdp":
                bag = Bag(init)
                fully_shard(bag, mesh=mesh)
                named = list(bag.named_parameters())
            else:
                named = [
                    (n, nn.Parameter(distribute_tensor(t.clone(), mesh, _placements_1d(kind, t.ndim))))
                    for n, t in init.items()
                ]  # fmt: skip
            full, _ = _run_injected(named, SHAPES, SPLITS, **kw)
            out[(name, kind)] = _max_diff(full, ref)
            del named, full
            gc.collect()
    mesh = init_device_mesh("cpu", (world_size,))
    w = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, _placements_1d("tp1", 2)))
    try:
        DTensorMuon([("h.weight", w)], normalize="row")
        out["normuon_refused"] = False
    except NotImplementedError as exc:
        out["normuon_refused"] = "normalize" in str(exc)
    return out


def test_variants_dtensor_muon_2_ranks():
    res = shared_pool(2).run(_dtensor_worker)[0]
    for key, diff in res.items():
        if key == "normuon_refused":
            assert diff
        else:
            # DTensorMuon runs Newton–Schulz on whole matrices and elementwise math on shards:
            # the existing layouts are exact to 1e-6 (test_dtensor_muon.TOL); so are variants
            assert diff <= 1e-6, (key, diff)
