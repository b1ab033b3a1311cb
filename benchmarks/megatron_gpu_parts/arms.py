"""The contenders: a model, its optimizer and the two gradient hooks of Megatron's loop."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .device import Device
from .model import build_gpt, seed_weights

if TYPE_CHECKING:  # the config lives in the entry script, benchmarks/megatron_gpu.py
    from megatron_gpu import BenchConfig

ARMS = ("megatron_adam", "muonscale")
CPU_STANDIN = "adamw_cpu_standin"


@dataclass
class Arm:
    """One contender: a model, its optimizer and the two gradient hooks of Megatron's loop."""

    name: str
    model: nn.Module
    optimizer: Any
    zero_grad_buffer: Callable[[], None]
    finalize_grads: Callable[[], None]
    grad_norms: list[float | None] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    loss_before: float = math.nan

    def grad_norm(self, step_result: Any) -> float | None:
        """Megatron's step returns (success, grad_norm, zeros); muonscale keeps last_grad_norm."""
        if isinstance(step_result, tuple) and len(step_result) == 3:
            return None if step_result[1] is None else float(step_result[1])
        norm = getattr(self.optimizer, "last_grad_norm", None)
        return None if norm is None else float(norm)


def build_arm(name: str, cfg: BenchConfig, spec: str, device: Device) -> Arm:
    """Build the model (seeded identically for every arm) and the arm's optimizer."""
    seed_weights(cfg, device)
    model = build_gpt(cfg, spec, device)
    if device.cuda:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        zero_grad_buffer = model.zero_grad_buffer
        finalize = lambda: finalize_model_grads([model])  # noqa: E731
    else:
        zero_grad_buffer = finalize = lambda: None  # noqa: E731
    if name == "muonscale":
        from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

        optimizer = megatron_muon(
            [model],
            MegatronMuonConfig(
                lr=cfg.lr, weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad,
                adam_beta1=0.9, adam_beta2=0.95, main_params_dtype=torch.float32,
                dp_mode="replicated",
            ),
        )  # fmt: skip
    elif name == "megatron_adam":
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", bf16=True, params_dtype=torch.bfloat16, lr=cfg.lr,
                weight_decay=cfg.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
                clip_grad=cfg.clip_grad, use_distributed_optimizer=False,
            ),
            [model],
        )  # fmt: skip
    elif name == CPU_STANDIN:
        optimizer = StandinAdamW(model, cfg)
        finalize = lambda: standin_mean_over_dp(model)  # noqa: E731
    else:
        raise ValueError(f"unknown arm {name!r}")
    return Arm(name, model, optimizer, zero_grad_buffer, finalize)


class StandinAdamW(torch.optim.AdamW):
    """(--smoke only) What ``get_megatron_optimizer`` builds underneath when TE and apex are
    absent, on the model's own parameters: ``torch.optim.AdamW``, no weight decay for 1-D
    tensors, global-norm clip before the step (``clip_grad_norm_``: exact at TP 1)."""

    def __init__(self, model: nn.Module, cfg: BenchConfig) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        super().__init__(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
        self.clip_grad, self.last_grad_norm = cfg.clip_grad, None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        max_norm = self.clip_grad if self.clip_grad > 0 else math.inf
        self.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return super().step(closure)


def standin_mean_over_dp(model: nn.Module) -> None:
    """(--smoke stand-in for Megatron's DDP) mean of ``.grad`` over the data-parallel group."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dist.get_world_size(group))
