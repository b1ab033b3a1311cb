"""The contenders: a model, its optimizer and the two gradient hooks of Megatron's loop.

Both Muon arms are built from one Megatron ``OptimizerConfig`` (:func:`muon_optimizer_config`):
Megatron's through ``get_megatron_optimizer``, muonscale's through
``MegatronMuonConfig.from_megatron``; :func:`muon_settings` reads back what each optimizer was
built with."""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .device import Device
from .model import build_gpt, seed_weights

if TYPE_CHECKING:  # the config lives in the entry script, benchmarks/megatron_gpu.py
    from megatron_gpu import BenchConfig

ARMS = ("megatron_adam", "muonscale", "megatron_muon")
CPU_STANDINS = {
    "megatron_adam": "adamw_cpu_standin",
    "megatron_muon": "megatron_muon_unwrapped_cpu",
}
"""--smoke: what runs in place of each arm that needs CUDA (see the script's docstring)."""
CPU_STANDIN = CPU_STANDINS["megatron_adam"]
GPU_ONLY_REASONS = {
    "megatron_adam": "get_megatron_optimizer wraps Adam in Float16OptimizerWithFloat16Params "
    "(CUDA tensors only) and Megatron's DDP allocates its buffers on CUDA; the smoke runs "
    "adamw_cpu_standin",
    "megatron_muon": "get_megatron_optimizer(optimizer='muon') wraps TensorParallelMuon and Adam "
    "in Float16OptimizerWithFloat16Params (CUDA tensors only); the smoke runs the same "
    "get_megatron_optimizer call with those wrappers unwrapped (megatron_muon_unwrapped_cpu)",
}
"""Why the Megatron arms are not measured on CPU (their figures read "not measured: ...")."""


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


def muon_optimizer_config(cfg: BenchConfig) -> Any:
    """The one Megatron ``OptimizerConfig`` both Muon arms are built from (Megatron's Adam arm
    uses the same with ``optimizer="adam"``): lr, weight decay, Adam betas and clipping of the
    run, and the ``muon_*`` flags of the benchmark."""
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(
        optimizer="muon",
        bf16=True,
        params_dtype=torch.bfloat16,
        lr=cfg.lr,
        min_lr=0.0,
        weight_decay=cfg.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_eps=1e-8,
        clip_grad=cfg.clip_grad,
        use_distributed_optimizer=False,
        muon_momentum=cfg.muon_momentum,
        muon_nesterov=cfg.muon_nesterov,
        muon_split_qkv=cfg.muon_split_qkv,
        muon_scale_mode=cfg.muon_scale_mode,
        muon_extra_scale_factor=cfg.muon_extra_scale_factor,
        muon_fp32_matmul_prec=cfg.muon_fp32_matmul_prec,
        muon_coefficient_type=cfg.muon_coefficient_type,
        muon_num_ns_steps=cfg.muon_num_ns_steps,
        muon_tp_mode=cfg.muon_tp_mode,
    )


def muonscale_config(optimizer_config: Any) -> Any:
    """muonscale's side of :func:`muon_optimizer_config`: ``from_megatron``, plus the two options
    Megatron does not have (fp32 main copies, as its bf16 optimizer; DDP's reduced gradients)."""
    from muonscale.integrations.megatron import MegatronMuonConfig

    return MegatronMuonConfig.from_megatron(
        optimizer_config, main_params_dtype=torch.float32, dp_mode="replicated"
    )


@contextmanager
def unwrapped_megatron_optimizers() -> Iterator[None]:
    """(--smoke) ``get_megatron_optimizer`` with its CUDA-only wrappers (``FP32Optimizer``,
    ``Float16OptimizerWithFloat16Params``) and ``ChainedOptimizer`` replaced by pass-throughs:
    inside, it returns the list of torch optimizers it would have wrapped, built by the same
    code (parameter tagging, param groups, ``OptimizerConfig`` → constructor arguments)."""
    import megatron.core.optimizer as megatron_optimizer

    names = ("FP32Optimizer", "Float16OptimizerWithFloat16Params", "ChainedOptimizer")
    saved = {n: getattr(megatron_optimizer, n) for n in names}

    def unwrapped(optimizer: Any, *args: Any, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(optimizer=optimizer)

    megatron_optimizer.FP32Optimizer = unwrapped
    megatron_optimizer.Float16OptimizerWithFloat16Params = unwrapped
    megatron_optimizer.ChainedOptimizer = lambda chained: [w.optimizer for w in chained]
    try:
        yield
    finally:
        for n, v in saved.items():
            setattr(megatron_optimizer, n, v)


def constant_schedule(optimizer: Any, optimizer_config: Any) -> Any:
    """Megatron's ``OptimizerParamScheduler`` at constant lr and weight decay, as
    megatron.training builds it: it writes each group's lr (``max_lr``) and weight decay
    (times ``wd_mult``: 0 for biases and 1-D tensors) into the optimizer's param groups."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr, wd = optimizer_config.lr, optimizer_config.weight_decay
    return OptimizerParamScheduler(
        optimizer,
        init_lr=lr,
        max_lr=lr,
        min_lr=0.0,
        lr_warmup_steps=0,
        lr_decay_steps=1,
        lr_decay_style="constant",
        start_wd=wd,
        end_wd=wd,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )


def megatron_muon_optimizers(optimizer: Any) -> list[Any]:
    """The ``TensorParallelMuon`` instances inside what ``get_megatron_optimizer`` returned (a
    ``ChainedOptimizer``, or the unwrapped list of :func:`unwrapped_megatron_optimizers`)."""
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is None:
        chained = optimizer if isinstance(optimizer, list) else [optimizer]
    inner = [getattr(o, "optimizer", o) for o in chained]
    return [o for o in inner if isinstance(o, TensorParallelMuon)]


def muon_settings(optimizer: Any) -> dict[str, Any]:
    """What a Muon arm's optimizer was built with, read back from the optimizer, in Megatron's
    terms: ``TensorParallelMuon`` (its param group and its ``scaled_orthogonalize_fn``'s
    closure) or muonscale's ``MegatronMuon`` (its ``MegatronMuonConfig``)."""
    from muonscale.integrations.megatron import (
        MEGATRON_MATMUL_PRECISION,
        MEGATRON_SCALE_MODES,
        megatron_coefficients,
    )

    muons = megatron_muon_optimizers(optimizer)
    if muons:
        (tpm,) = muons
        group = tpm.param_groups[0]
        closure = inspect.getclosurevars(tpm.scaled_orthogonalize_fn).nonlocals
        return dict(
            lr=group["lr"],
            momentum=group["momentum"],
            nesterov=tpm.nesterov,
            weight_decay=group["weight_decay"],
            num_ns_steps=closure["num_ns_steps"],
            coefficients=megatron_coefficients(
                closure["coefficient_type"], closure["num_ns_steps"]
            ),
            scale=(closure["scale_mode"], closure["extra_scale_factor"]),
            ns_dtype=str(MEGATRON_MATMUL_PRECISION[tpm.fp32_matmul_prec]),
            split_qkv=tpm.split_qkv,
            tp_exact=closure["tp_mode"] != "blockwise",
        )
    c = optimizer.config
    to_megatron_scale = {ours: theirs for theirs, ours in MEGATRON_SCALE_MODES.items()}
    return dict(
        lr=c.lr,
        momentum=c.muon_momentum,
        nesterov=c.muon_nesterov,
        weight_decay=c.weight_decay,
        num_ns_steps=c.muon_num_ns_steps,
        coefficients=[tuple(t) for t in c.coefficients],
        scale=(to_megatron_scale.get(c.scale, c.scale), c.muon_extra_scale_factor),
        ns_dtype=str(c.ns_dtype),
        split_qkv=c.muon_split_qkv,
        tp_exact=c.muon_tp_mode == "exact",
    )


def describe_muon_config(optimizer_config: Any, model: nn.Module) -> dict[str, Any]:
    """For the JSON: the shared ``OptimizerConfig``'s fields, what ``from_megatron`` made of it,
    and the constructor arguments ``get_megatron_optimizer`` derives for ``TensorParallelMuon``
    (``_muon_config_to_kwargs``, the function it calls)."""
    from megatron.core.optimizer.emerging_optimizers import _muon_config_to_kwargs

    shared = {
        f.name: getattr(optimizer_config, f.name) for f in dataclasses.fields(optimizer_config)
    }
    keep = (
        "optimizer",
        "lr",
        "min_lr",
        "weight_decay",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
        "clip_grad",
        "bf16",
        "decoupled_weight_decay",
        "use_distributed_optimizer",
    )
    megatron_kwargs = _muon_config_to_kwargs(optimizer_config, [model], None)
    ours = muonscale_config(optimizer_config)
    return {
        "optimizer_config": {k: v for k, v in shared.items() if k in keep or k.startswith("muon_")},
        "megatron_tensor_parallel_muon_kwargs": {
            k: v for k, v in megatron_kwargs.items() if not callable(v) and k != "pg_collection"
        },
        "muonscale_from_megatron": {
            f.name: getattr(ours, f.name) for f in dataclasses.fields(ours)
        },
        "differences": [
            "learned position embeddings: Megatron's Muon (it checks is_embedding_or_output_"
            "parameter only), AdamW in muonscale",
            "muon_tp_mode: muonscale is exact whatever the value (at TP 1 all modes agree)",
        ],
    }


def build_arm(name: str, cfg: BenchConfig, spec: str, device: Device, optimizer_config: Any) -> Arm:
    """Build the model (seeded identically for every arm) and the arm's optimizer; the Megatron
    arms and muonscale read ``optimizer_config`` (:func:`muon_optimizer_config`)."""
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
        from muonscale.integrations.megatron import megatron_muon

        optimizer = megatron_muon([model], muonscale_config(optimizer_config))
    elif name in ("megatron_adam", "megatron_muon"):
        from megatron.core.optimizer import get_megatron_optimizer

        config = optimizer_config
        if name == "megatron_adam":
            config = dataclasses.replace(optimizer_config, optimizer="adam")
        optimizer = get_megatron_optimizer(config, [model])
        constant_schedule(optimizer, config)
    elif name == CPU_STANDINS["megatron_adam"]:
        optimizer = StandinAdamW(model, cfg)
        finalize = lambda: standin_mean_over_dp(model)  # noqa: E731
    elif name == CPU_STANDINS["megatron_muon"]:
        from megatron.core.optimizer import get_megatron_optimizer

        with unwrapped_megatron_optimizers():
            optimizers = get_megatron_optimizer(optimizer_config, [model])
        optimizer = MainParamsChain(optimizers, optimizer_config.clip_grad)
        constant_schedule(optimizer, optimizer_config)
        finalize = lambda: standin_mean_over_dp(model)  # noqa: E731
    else:
        raise ValueError(f"unknown arm {name!r}")
    return Arm(name, model, optimizer, zero_grad_buffer, finalize)


class MainParamsChain:
    """(--smoke) What ``ChainedOptimizer`` of ``Float16OptimizerWithFloat16Params`` does around
    the torch optimizers ``get_megatron_optimizer`` builds (``TensorParallelMuon`` + Adam), on
    CPU: fp32 main copies of the bf16 parameters in their param groups (with Megatron's
    attributes copied, as it does), gradients copied into them, one global-norm clip over all
    (``clip_grad_norm_``: exact at the smoke's TP 1), each optimizer's step, copies written back."""

    def __init__(self, optimizers: list[torch.optim.Optimizer], clip_grad: float) -> None:
        from megatron.core.optimizer.optimizer import copy_optimizer_param_metadata
        from megatron.core.tensor_parallel import layers

        self.optimizers, self.clip_grad, self.last_grad_norm = list(optimizers), clip_grad, None
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (model param, main copy)
        for group in self.param_groups:
            for i, param in enumerate(group["params"]):
                if param.dtype in (torch.bfloat16, torch.float16):
                    main = param.detach().clone().float()
                    layers.copy_tensor_model_parallel_attributes(main, param)
                    layers.copy_gtp_attributes(main, param)
                    copy_optimizer_param_metadata(main, param)
                    group["params"][i] = main
                    self.pairs.append((param, main))

    @property
    def chained_optimizers(self) -> list[torch.optim.Optimizer]:
        return self.optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, main in self.pairs:
            param.grad = main.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for param, main in self.pairs:
            main.grad = None if param.grad is None else param.grad.float()
        params = [p for g in self.param_groups for p in g["params"]]
        max_norm = self.clip_grad if self.clip_grad > 0 else math.inf
        self.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        for o in self.optimizers:
            o.step()
        for param, main in self.pairs:
            param.copy_(main)


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
