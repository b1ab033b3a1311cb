"""Expert views under the distributed optimizers as they stand (each Muon parameter owned
whole): ``DistributedMuon`` and ``DTensorMuon`` under FSDP2 at 2 gloo ranks equal single-process
Muon bitwise on a model with expert stacks (GPT-OSS's layout: (in, out), interleaved gate/up,
per-expert biases) and a dense fused gate/up weight, with identical gradients injected; plain
Muon and NorMuon (whose row state follows the expert view)."""

from __future__ import annotations

import pytest
import torch
from distributed_harness import shared_pool
from test_experts import Model

import muonscale

OPTIONS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=0.01)
STEPS = 3
pytestmark = pytest.mark.timeout(120)


def _gradients(model, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def _single_process(options: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    opt = muonscale.Muon(model, **OPTIONS, **options)
    for step in range(STEPS):
        for name, grad in _gradients(model, step).items():
            dict(model.named_parameters())[name].grad = grad
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _distributed(rank: int, world_size: int, kind: str, options: dict) -> dict:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from muonscale.distributed import DistributedMuon, DTensorMuon

    torch.manual_seed(0)
    model = Model()
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        opt = DTensorMuon(model, **OPTIONS, **options)
    else:
        opt = DistributedMuon(model, **OPTIONS, **options)
    for step in range(STEPS):
        for name, grad in _gradients(model, step).items():
            p = dict(model.named_parameters())[name]
            if isinstance(p, DTensor):
                grad = distribute_tensor(grad, p.device_mesh, p.placements)
            p.grad = grad
        opt.step()
    out = {}
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = whole.detach().clone()
    return out


@pytest.mark.parametrize("options", [{}, dict(normalize="row")], ids=["muon", "normuon"])
@pytest.mark.parametrize("kind", ["distributed", "dtensor"])
def test_expert_views_equal_single_process_bitwise_at_2_ranks(kind, options):
    want = _single_process(options)
    for rank, got in enumerate(shared_pool(2).run(_distributed, kind, options)):
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (kind, rank, name)
