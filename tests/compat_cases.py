"""The cases behind ``tests/assets/compat/``: a tiny model, its gradients, and the optimizer
options of each saved asset. The assets were written by ``tests/assets/compat/make_assets.py``
from an earlier version of the code; ``tests/test_compat_assets.py`` loads them with this one.
Nothing here may change once assets were written from it."""

from __future__ import annotations

import torch
from torch import nn

from muonscale import QKVLayout

LAYOUT = QKVLayout(n_query_groups=2, q_per_group=1, head_dim=4)  # 24 fused QKV rows
BASE = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=0.01)

SINGLE_PROCESS = {
    "muon": {},
    "normuon": dict(normalize="row"),
    "cautious": dict(cautious_weight_decay=True),
    "aol": dict(preconditioner="aol"),
    "qk_lr_scale": dict(qk_lr_scale=1.5, splits={"qkv.weight": LAYOUT}),
    "polar_express": dict(ns_coefficients="polar_express"),
    "bf16_momentum": dict(momentum_dtype=torch.bfloat16),
    "batch": dict(matrix_mode="batch"),
}
"""Options of single-process ``Muon`` (on top of ``BASE``), one asset each."""

PICKLED_BY_0_1 = {
    "muon": {},
    "bf16_momentum": dict(momentum_dtype=torch.bfloat16),
    "nonfinite_skip": dict(nonfinite="skip"),
}
"""Options of ``Muon`` (on top of ``BASE``) pickled by muonscale 0.1.0 (commit 2c7e802), one
asset each (``pickled-0.1/<case>.pt``). That version pickled torch's state only (``defaults``,
``state``, ``param_groups``): not ``nonfinite``, nor the parameters' names."""

DISTRIBUTED = {"muon": {}, "normuon": dict(normalize="row")}
"""Options of the 2-rank DCP assets (``DistributedMuon`` and ``DTensorMuon``)."""

SAVE_AT = 2
"""Steps taken before an asset was saved; the asset also holds the step after."""


class Tiny(nn.Module):
    """Embedding and head (AdamW), a fused QKV weight, two Linear layers (one with a bias),
    a norm weight, and a 3-D weight (stacked experts)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.wte = nn.Embedding(16, 8)
        self.qkv = nn.Linear(8, LAYOUT.rows, bias=False)
        self.fc = nn.Linear(8, 12)
        self.proj = nn.Linear(12, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.experts = nn.Parameter(torch.randn(3, 4, 8) * 0.3)
        self.lm_head = nn.Linear(8, 16, bias=False)


def build_distributed(kind: str, case: str, seed: int = 0):
    """The model and optimizer of a DCP asset (``kind``: ``"distributed"`` or ``"dtensor"``,
    FSDP2 at the world size), on an initialized process group."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from muonscale.distributed import DistributedMuon, DTensorMuon

    model = Tiny(seed)
    if kind == "dtensor":
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        return model, DTensorMuon(model, **BASE, **DISTRIBUTED[case])
    return model, DistributedMuon(model, **BASE, **DISTRIBUTED[case])


def gradients(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Full (unsharded) float32 gradients of ``model``'s parameters at ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def set_gradients(model: nn.Module, step: int) -> None:
    """``model``'s gradients at ``step`` (DTensor parameters get their own shards)."""
    for p, full in zip(model.parameters(), gradients(model, step).values()):
        if hasattr(p, "device_mesh"):  # DTensor: shard the full gradient as the parameter
            from torch.distributed.tensor import Replicate, distribute_tensor

            full = distribute_tensor(full, p.device_mesh, [Replicate()])
            full = full.redistribute(p.device_mesh, p.placements)
        p.grad = full


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        set_gradients(model, step)
        opt.step()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else ``t`` (detached copy)."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: local(p) for n, p in model.named_parameters()}


def local_state(opt: torch.optim.Optimizer) -> dict[int, dict[str, torch.Tensor]]:
    """``opt.state_dict()["state"]`` with every tensor as its local part (copies)."""
    return {
        i: {k: local(v) if torch.is_tensor(v) else v for k, v in s.items()}
        for i, s in opt.state_dict()["state"].items()
    }


def recorded_platform() -> dict[str, str]:
    """What makes a continued step bitwise reproducible: torch and the CPU kernels."""
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }
