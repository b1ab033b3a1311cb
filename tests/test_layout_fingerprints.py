"""Weights after 3 steps of ``DistributedMuon`` and ``DTensorMuon`` (FSDP2) at 2 gloo ranks,
with injected gradients, fixed by their SHA-256 (:mod:`fingerprints`): a change that must move
no bits (a refactor of the layouts) keeps them."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import shared_pool
from fingerprints import assert_fingerprint
from torch import nn

pytestmark = pytest.mark.timeout(240)

STEPS = 3
VARIANTS = {
    "plain": {},
    "normuon_cautious": {"normalize": "row", "cautious_weight_decay": True},
}
OPTS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=0.01)


def _grads(named, step):
    g = torch.Generator().manual_seed(2000 + step)
    return {n: (torch.randint(-40, 41, tuple(p.shape), generator=g) / 64) for n, p in named}


def _dp_worker(rank, world_size, variant):
    from test_distributed_dp import make_model

    from muonscale.distributed import DistributedMuon

    torch.set_num_threads(1)
    model = make_model()
    opt = DistributedMuon(model, **OPTS, **VARIANTS[variant])
    named = list(model.named_parameters())
    for step in range(STEPS):
        opt.zero_grad()
        for (_, p), g in zip(named, _grads(named, step).values()):
            p.grad = g.to(p.dtype)
        opt.step()
    return {n: p.detach().clone() for n, p in named}


SHAPES = {"w": (12, 20), "tall": (21, 6), "qkv": (24, 16), "bias": (20,), "gain": (7,)}


def _dtensor_worker(rank, world_size, variant):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    import muonscale
    from muonscale.distributed.dtensor import DTensorMuon

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    bag = nn.Module()
    for n, s in SHAPES.items():
        bag.register_parameter(n, nn.Parameter(torch.randn(s, generator=g) * 0.5))
    fully_shard(bag, mesh=init_device_mesh("cpu", (world_size,)))
    named = list(bag.named_parameters())
    qkv = muonscale.QKVLayout(n_query_groups=2, q_per_group=2, head_dim=3)
    opt = DTensorMuon(named, splits={"qkv": qkv}, **OPTS, **VARIANTS[variant])
    for step in range(STEPS):
        grads = _grads(named, step)
        for n, p in named:
            full = distribute_tensor(grads[n], p.device_mesh, [Replicate()])
            p.grad = full.redistribute(p.device_mesh, p.placements)
        opt.step()
    out = {n: p.full_tensor().detach().clone() for n, p in named if isinstance(p, DTensor)}
    del opt
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_distributed_muon_weights_are_fixed(variant):
    results = shared_pool(2).run(_dp_worker, variant, timeout=180)
    for r in results[1:]:
        assert all(torch.equal(r[n], results[0][n]) for n in r)  # replicas equal
    assert_fingerprint(f"distributed_muon_2_{variant}", results[0])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dtensor_muon_weights_are_fixed(variant):
    results = shared_pool(2).run(_dtensor_worker, variant, timeout=180)
    assert all(torch.equal(results[1][n], results[0][n]) for n in results[0])
    assert_fingerprint(f"dtensor_muon_fsdp_2_{variant}", results[0])
