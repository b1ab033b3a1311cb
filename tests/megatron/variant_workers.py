"""Workers for the Muon variants (NorMuon, cautious weight decay, AOL) through the Megatron
adapter, against single-process :class:`muonscale.Muon` on the same full model and gradients.
Run on every rank of a gloo WorkerPool; results from rank 0."""

from __future__ import annotations

import megatron_workers as W
import torch

COMMON = dict(lr=0.02, weight_decay=0.5, momentum=0.9, scale="unit_rms", adam_lr=0.01)
"""Shared by both sides (Megatron names differ: ``muon_momentum``, ``adam_lr``). A large
weight decay, so that cautious decay moves the weights measurably."""


def _reference_muon(model, variant: dict):
    """Single-process muonscale.Muon on the whole (TP 1) model, routed and QKV-split as the
    adapter's plan says (routing is not what is under test)."""
    from muonscale import Muon
    from muonscale.integrations.megatron.plan import MegatronGroups, plan_parameters

    plans = plan_parameters([model], MegatronGroups.from_megatron(None), split_qkv=True)
    groups = [
        {"params": [(pl.name, pl.param) for pl in plans if pl.algorithm == kind], "algorithm": kind}
        for kind in ("muon", "adamw")
    ]
    return Muon(
        groups,
        lr=COMMON["lr"],
        momentum=COMMON["momentum"],
        nesterov=True,
        weight_decay=COMMON["weight_decay"],
        scale=COMMON["scale"],
        adamw_lr=COMMON["adam_lr"],
        adamw_betas=(0.9, 0.95),
        ns_dtype=torch.float32,
        splits={pl.name: pl.qkv_layout for pl in plans if pl.qkv_layout is not None},
        **variant,
    )


def run_variant(rank: int, world_size: int, spec: dict) -> dict | None:
    """``spec["steps"]`` steps of ``spec["variant"]`` (muonscale.Muon keyword options) with
    injected full gradients: ``impl="muon"`` single-process Muon at TP 1, ``"megatron"`` the
    adapter at ``spec["tp"]`` (``options``: further MegatronMuonConfig fields)."""
    from megatron.core import parallel_state as ps

    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    tp = spec.get("tp", 1) if spec["impl"] == "megatron" else 1
    W.setup_parallel(tp)
    model = W.build_gpt(W.TINY, seed=0)
    init = {n: W.gather_full(p) for n, p in model.named_parameters()}
    if spec["impl"] == "muon":
        opt = _reference_muon(model, spec["variant"])
    else:
        config = dict(
            lr=COMMON["lr"],
            weight_decay=COMMON["weight_decay"],
            muon_momentum=COMMON["momentum"],
            scale=COMMON["scale"],
            adam_lr=COMMON["adam_lr"],
            ns_dtype=torch.float32,
        )
        options = dict(config, **spec["variant"], **spec.get("options", {}))
        opt = megatron_muon([model], MegatronMuonConfig().replaced(**options))
    for step in range(spec["steps"]):
        W.inject_gradients(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    full = {n: W.gather_full(p) for n, p in model.named_parameters()}
    out = dict(params=full, init=init, dp_mode=getattr(opt, "dp_mode", None))
    if spec["impl"] == "megatron":
        out["breakdown"] = opt.last_step_wire_breakdown
        out["muon_names"] = [pl.name for pl in opt.plans if pl.algorithm == "muon"]
    ps.destroy_model_parallel()
    return out if rank == 0 else None
