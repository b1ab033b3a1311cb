"""Every optimizer option reaches every layout: single-process ``Muon``, ``DistributedMuon``
owners and ``DTensorMuon`` (FSDP2) at 2 real gloo ranks.

For each option set to a non-default value, each layout's parameters after a few steps must
equal, bitwise, single-process ``Muon`` given the same option (every layout runs the same
functions of :mod:`muonscale.functional` on the same whole matrices), and that result must
differ from the default's (``qk_lr_scale``: from the same QKV split without it): an option a
layout dropped would leave it at the default's result.
Options that only change rounding (``ns_method``, ``momentum_dtype``) move float64 parameters
by ~1e-7 after three steps with the float32 iteration (CPU default), far above 0.
"""

from __future__ import annotations

import gc

import pytest
import torch
from distributed_harness import WorkerPool
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import muonscale
from muonscale.distributed import DistributedMuon
from muonscale.distributed.dtensor import DTensorMuon

pytestmark = pytest.mark.timeout(400)

STEPS = 3
MIN_EFFECT = 1e-9  # below every option's measured effect (smallest: ns_method, 5.6e-7)
SHAPES = {
    "wide": (8, 40),
    "w": (12, 20),
    "tall": (20, 12),
    "sq": (10, 10),
    "batched": (2, 6, 10),
    "bias": (20,),
}
QKV = muonscale.QKVLayout(n_query_groups=2, q_per_group=1, head_dim=2)  # 12 rows: "w"
REFERENCE = {"qk_lr_scale": "qkv_split"}
"""Cases compared with another case instead of the default (the option needs a QKV split)."""
BASE = dict(lr=0.5, weight_decay=0.1, momentum=0.95, nesterov=True)
CASES = {  # option -> value different from the default, chosen to change the result
    "ns_method": {"ns_method": "gram"},  # 'auto' takes Gram for 'wide' only
    "ns_method_plain": {"ns_method": "plain"},
    "ns_dtype": {"ns_dtype": torch.float64},  # default on CPU: float32
    "ns_dtype_bf16": {"ns_dtype": torch.bfloat16},  # DTensorMuon: bf16 U on the wire
    "coefficients": {"coefficients": "polar_express"},
    "ns_steps": {"ns_steps": 3},
    "scale": {"scale": "shape", "adamw_lr": 0.01},
    "nesterov": {"nesterov": False},
    "momentum": {"momentum": 0.8},
    "momentum_dtype": {"momentum_dtype": torch.float32},
    "matrix_mode": {"matrix_mode": "batch"},
    "splits": {"splits": {"w": 3, "tall": [5, 15]}},
    "qkv_split": {"splits": {"w": QKV}},
    "qk_lr_scale": {"splits": {"w": QKV}, "qk_lr_scale": 2.0},
    "weight_decay": {"weight_decay": 0.4},
    "lr": {"lr": 0.05},
    "eps": {"eps": 50.0},  # the norm floor is active: X₀ = X / 50
    "adamw": {"adamw_betas": (0.8, 0.9), "adamw_eps": 1e-3, "adamw_weight_decay": 0.3},
}


def _tensors(seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}


def _single(init, options):
    params = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    opt = muonscale.Muon(list(params.items()), **options)
    for k in range(STEPS):
        grads = _tensors(100 + k)
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}


def _distributed(init, options):
    params = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    opt = DistributedMuon(list(params.items()), **options)
    for k in range(STEPS):
        grads = _tensors(100 + k)
        for n, p in params.items():
            p.grad = grads[n].clone()  # same on every rank: the average is the gradient
        opt.step()
    out = {n: p.detach().clone() for n, p in params.items()}
    opt.remove_hooks()
    return out


class Bag(nn.Module):
    def __init__(self, tensors):
        super().__init__()
        for n, t in tensors.items():
            self.register_parameter(n, nn.Parameter(t.clone()))


def _dtensor(init, options, world_size):
    bag = Bag(init)
    fully_shard(bag, mesh=init_device_mesh("cpu", (world_size,)))
    named = list(bag.named_parameters())
    opt = DTensorMuon(named, **options)
    for k in range(STEPS):
        grads = _tensors(100 + k)
        for n, p in named:
            full = distribute_tensor(grads[n], p.device_mesh, [Replicate()])
            p.grad = full.redistribute(p.device_mesh, p.placements)
        opt.step()
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in named
    }


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


def options_worker(rank, world_size, cases):
    init = _tensors(0)
    default = _single(init, BASE)
    out = {}
    for name in cases:
        options = {**BASE, **CASES[name]}
        single = _single(init, options)
        before = default
        if name in REFERENCE:
            before = _single(init, {**BASE, **CASES[REFERENCE[name]]})
        out[name] = {
            "from_default": _max_diff(single, before),
            "dp": _max_diff(_distributed(init, options), single),
            "dtensor": _max_diff(_dtensor(init, options, world_size), single),
        }
        gc.collect()
    return out


@pytest.fixture(scope="module")
def results():
    with WorkerPool(2) as pool:
        return pool.run(options_worker, list(CASES))[0]


@pytest.mark.parametrize("case", list(CASES))
def test_option_reaches_every_layout(results, case):
    r = results[case]
    assert r["from_default"] > MIN_EFFECT, r  # the option changes the update
    assert r["dp"] == 0.0, r  # DistributedMuon owners
    assert r["dtensor"] == 0.0, r  # DTensorMuon on FSDP2 shards


def test_qk_lr_scale_reaches_every_layout_at_four_ranks():
    """At 4 ranks the 12-row QKV weight is sharded 3 rows a rank (FSDP2): each rank holds a
    piece of one block, and the owners still scale only the Q and K blocks."""
    with WorkerPool(4) as pool:
        r = pool.run(options_worker, ["qk_lr_scale"])[0]["qk_lr_scale"]
    assert r["from_default"] > MIN_EFFECT, r
    assert r["dp"] == 0.0 and r["dtensor"] == 0.0, r
