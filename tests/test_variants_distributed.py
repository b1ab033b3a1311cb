"""Muon variants in every layout: DistributedMuon (2 gloo ranks) and DTensorMuon (2 ranks)
against single-process muonscale.Muon."""

from __future__ import annotations

import gc

import pytest
import torch
from distributed_harness import shared_pool
from test_distributed_dp import OPTS, make_model, max_diff, reference, train
from test_dtensor_muon import (
    E2E_TOL,
    SHAPES,
    SPLITS,
    STEPS,
    Bag,
    TinyLM,
    _full_params,
    _full_tensors,
    _grads,
    _max_diff,
    _parallel_model,
    _placements_1d,
    _reference,
    _run_injected,
    _shard_like,
    _train,
)
from test_dtensor_muon import OPTIONS as DT_OPTIONS
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, distribute_tensor

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
DTENSOR_ONLY = {"qk_lr_scale": dict(qk_lr_scale=2.0)}
"""Options that act on a split QKV weight: the DTensor models below have one (SPLITS)."""
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
            moments = {
                k: v["row_second_moment"]
                for k, v in state["state"].items()
                if "row_second_moment" in v
            }
            ref_moments = {
                k: v["row_second_moment"]
                for k, v in ref_state["state"].items()
                if "row_second_moment" in v
            }
            assert moments.keys() == ref_moments.keys() and moments
            moment_diff = max((moments[k] - ref_moments[k]).abs().max().item() for k in moments)
            fresh = DistributedMuon(make_model(n_hidden=3), **OPTS, **kw, bucket_cap_mb=2e-4)
            fresh.load_state_dict(state)
            again = fresh.state_dict()
            assert all(
                torch.equal(again["state"][k]["row_second_moment"], moments[k]) for k in moments
            )
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
    for name, kw in {**VARIANTS, **DTENSOR_ONLY}.items():
        ref = _reference(init, SHAPES, SPLITS, **kw)
        for kind in ("fsdp", "tp1"):
            mesh = init_device_mesh("cpu", (world_size,))
            if kind == "fsdp":
                bag = Bag(init)
                fully_shard(bag, mesh=mesh)
                named = list(bag.named_parameters())
            else:
                named = [
                    (
                        n,
                        nn.Parameter(
                            distribute_tensor(t.clone(), mesh, _placements_1d(kind, t.ndim))
                        ),
                    )
                    for n, t in init.items()
                ]
            full, _ = _run_injected(named, SHAPES, SPLITS, **kw)
            out[(name, kind)] = _max_diff(full, ref)
            del named, full
            gc.collect()
    plain = _reference(init, SHAPES, SPLITS)
    out["qk_lr_scale_effect"] = _max_diff(
        _reference(init, SHAPES, SPLITS, **DTENSOR_ONLY["qk_lr_scale"]), plain
    )
    return out


def test_variants_dtensor_muon_2_ranks():
    res = shared_pool(2).run(_dtensor_worker)[0]
    effect = res.pop("qk_lr_scale_effect")
    assert {name for name, _ in res} == set(VARIANTS) | set(DTENSOR_ONLY)
    assert effect > 1e-3  # the Q and K blocks moved further than without the option
    for key, diff in res.items():
        # DTensorMuon's owners run the matrix step of one process on the same whole matrices
        # (NorMuon's rows and every scale at the owner, as on one process) and elementwise math
        # on shards gives the bits it gives on whole tensors: bitwise
        assert diff == 0.0, (key, diff)


def _normuon_dtensor_state_worker(rank, world_size):
    """NorMuon's row second moment under DTensorMuon: the same on every rank (replicated), and
    equal to single-process Muon's after the same steps, for FSDP2 and column TP."""
    init = _full_tensors(SHAPES, 0)
    kw = VARIANTS["normuon"]
    ref_params = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    ref_opt = muonscale.Muon(list(ref_params.items()), splits=SPLITS, **{**DT_OPTIONS, **kw})
    for k in range(STEPS):
        grads = _grads(SHAPES, k)
        for n, p in ref_params.items():
            p.grad = grads[n].clone()
        ref_opt.step()
    ref_moments = {
        n: ref_opt.state[p]["row_second_moment"]
        for n, p in ref_params.items()
        if "row_second_moment" in ref_opt.state[p]
    }
    out = {}
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
            ]
        opt = DTensorMuon(named, splits=SPLITS, **{**DT_OPTIONS, **kw})
        for k in range(STEPS):
            grads = _grads(SHAPES, k)
            for n, p in named:
                p.grad = _shard_like(grads[n], p)
            opt.step()
        moments = {
            n: opt.state[p]["row_second_moment"]
            for n, p in named
            if "row_second_moment" in opt.state[p]
        }
        assert moments.keys() == ref_moments.keys() and moments
        out[kind] = {
            "diff": max((moments[n] - ref_moments[n]).abs().max().item() for n in moments),
            "moments": {n: m.clone() for n, m in moments.items()},
            "wire": opt.last_step_wire_breakdown,
        }
        del opt, named
        gc.collect()
    return out


def test_normuon_dtensor_moment_replicated_and_equal_to_single_process():
    res = shared_pool(2).run(_normuon_dtensor_state_worker)
    rows = sum(v.numel() for v in res[0]["fsdp"]["moments"].values())
    for kind in ("fsdp", "tp1"):
        for rank_result in res:
            # every replica steps from the owner's statistics of the same whole matrix
            assert rank_result[kind]["diff"] == 0.0, (kind, rank_result[kind]["diff"])
        a, b = res[0][kind]["moments"], res[1][kind]["moments"]
        assert all(torch.equal(a[n], b[n]) for n in a), kind  # bitwise replicas
        # one all-reduce of the owners' row statistics per step (plus the all-to-alls)
        assert res[0][kind]["wire"].get("muon/all_reduce", 0) > 0, res[0][kind]["wire"]
    assert rows > 0


def _dcp_normuon_worker(rank, world_size, path):
    """NorMuon under FSDP2: 2 steps, DCP save, load into a fresh model/optimizer, 1 more step;
    compare with 3 uninterrupted single-process steps."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    kw = VARIANTS["normuon"]
    model = _parallel_model("fsdp", world_size)
    opt = DTensorMuon(model, **DT_OPTIONS, **kw)
    _train(model, opt, 2)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = {
        n: opt.state[p]["row_second_moment"].clone()
        for n, p in model.named_parameters()
        if "row_second_moment" in opt.state[p]
    }
    del model, opt, msd, osd
    model = _parallel_model("fsdp", world_size)
    opt = DTensorMuon(model, **DT_OPTIONS, **kw)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = {
        n: opt.state[p]["row_second_moment"].clone()
        for n, p in model.named_parameters()
        if "row_second_moment" in opt.state[p]
    }
    restored = saved.keys() == loaded.keys() and all(
        torch.equal(saved[n], loaded[n]) for n in saved
    )
    _train(model, opt, 1, first=2)
    torch.manual_seed(0)
    ref = TinyLM()
    _train(ref, muonscale.Muon(ref, **DT_OPTIONS, **kw), 3)
    diff = _max_diff(_full_params(model), _full_params(ref))
    del model, opt, state
    gc.collect()
    return {"restored": restored, "moments": len(saved), "diff": diff}


def test_normuon_dtensor_dcp_round_trip(tmp_path):
    res = shared_pool(2).run(_dcp_normuon_worker, str(tmp_path / "ckpt"))
    for r in res:
        assert r["restored"] and r["moments"] == 2, r  # fc1, fc2
        assert r["diff"] <= E2E_TOL, r  # FSDP2's reduce-scatter rounding, as in test_dtensor_muon


def _routing_mismatch_worker(rank, world_size):
    """Rank 1 routes 'h.weight' to AdamW by a rule; rank 0 sends it to Muon."""
    mesh = init_device_mesh("cpu", (world_size,))
    w = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, _placements_1d("tp1", 2)))
    b = nn.Parameter(distribute_tensor(torch.randn(8), mesh, [Replicate()]))
    rules = [(r"h\.weight", "adamw")] if rank == 1 else []
    try:
        DTensorMuon([("h.weight", w), ("h.bias", b)], rules=rules)
    except ValueError as exc:
        return str(exc)
    return None


def test_dtensor_muon_routing_mismatch_is_named():
    for message in shared_pool(2).run(_routing_mismatch_worker):
        assert message is not None
        assert "'h.weight'" in message, message
        assert "rank 0: 'h.weight' ('muon'" in message, message
        assert "rank 1: 'h.weight' ('adamw'" in message, message


def test_row_state_refuses_approximate_per_shard():
    """Row statistics need the whole orthogonalized matrix: per-shard Newton–Schulz is refused
    for a group that keeps row state, naming the group and the state; AdamW groups pass."""
    w, b = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6))
    with pytest.raises(ValueError, match=r"param group 0 keeps NorMuon's row second moment"):
        DTensorMuon([("w", w)], normalize="row", approximate_per_shard=True)
    DTensorMuon([("w", w), ("b", b)], approximate_per_shard=True)  # plain Muon, AdamW: accepted


def _mixed_dtype_worker(rank, world_size):
    """NorMuon on float32 and bfloat16 matrices under column TP: one exchange per dtype, each
    sharing its owners' row statistics; parameters and row moments against one process."""
    shapes = {"f32": (12, 10), "bf16": (9, 14), "f32_b": (8, 6)}
    dtypes = {"f32": torch.float32, "bf16": torch.bfloat16, "f32_b": torch.float32}
    init = {n: t.to(dtypes[n]) for n, t in _full_tensors(shapes, 0).items()}
    kw = {**DT_OPTIONS, **VARIANTS["normuon"]}
    mesh = init_device_mesh("cpu", (world_size,))
    ref = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    named = [
        (n, nn.Parameter(distribute_tensor(t.clone(), mesh, _placements_1d("tp1", t.ndim))))
        for n, t in init.items()
    ]
    ref_opt = muonscale.Muon(list(ref.items()), **kw)
    opt = DTensorMuon(named, **kw)
    for k in range(STEPS):
        grads = {n: g.to(dtypes[n]) for n, g in _grads(shapes, k).items()}
        for n, p in ref.items():
            p.grad = grads[n].clone()
        for n, p in named:
            p.grad = _shard_like(grads[n], p)
        ref_opt.step()
        opt.step()
    return {
        "params": all(torch.equal(p.full_tensor(), ref[n]) for n, p in named),
        "moments": all(
            torch.equal(
                opt.state[p]["row_second_moment"], ref_opt.state[ref[n]]["row_second_moment"]
            )
            for n, p in named
        ),
        "wire": opt.last_step_wire_breakdown,
    }


def test_normuon_dtensor_mixed_dtypes_bitwise():
    for res in shared_pool(2).run(_mixed_dtype_worker):
        assert res["params"] and res["moments"], res
        assert res["wire"].get("muon/all_reduce", 0) > 0, res["wire"]
