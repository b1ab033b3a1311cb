"""The three optimizers a training run can use, built from a ``TrainConfig``.

- ``adamw``: ``torch.optim.AdamW`` (fused when the device supports it); weight decay only on
  parameters with >= 2 dims.
- ``muon``: ``muonscale.Muon`` over the model itself (:func:`muon_params`); its routing sends
  embeddings, the head, norms and biases to AdamW; fused QKV weights are split by
  ``model.qkv_layout``; the expert layouts :func:`muonscale.experts.find_experts` reads from
  the model are handed over (``experts=``), so MoE expert stacks get the expert view, and
  ``summary()`` names them (and the routers) as for ``muonscale.Muon(model)``.
- ``torch-muon``: ``torch.optim.Muon`` (``adjust_lr_fn="match_rms_adamw"``) for the 2-D hidden
  matrices chosen by :func:`muonscale.params.route` plus ``torch.optim.AdamW`` for the rest,
  wrapped in one :class:`HybridOptimizer` so the trainer and ``LambdaLR`` see one optimizer.
  ``torch.optim.Muon`` takes 2-D parameters only (its documentation: filter them out), so
  the 3-D expert stacks of an MoE model train with that AdamW (:func:`torch_muon_split`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from muonscale.experts import find_experts
from muonscale.params import route

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HybridOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters behaving as one.

    ``param_groups`` holds the inner optimizers' group dicts themselves (not copies), so an
    LR scheduler writing ``group["lr"]`` drives every inner optimizer.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("HybridOptimizer needs at least one optimizer")
        self.optimizers = dict(optimizers)
        super().__init__(self._inner_groups(), defaults={})

    def _inner_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": {name: opt.state_dict() for name, opt in self.optimizers.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict["optimizers"]
        if set(saved) != set(self.optimizers):
            raise ValueError(
                f"checkpoint holds optimizers {sorted(saved)}, expected {sorted(self.optimizers)}"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(saved[name])
        # Optimizer.load_state_dict replaces the group dicts: point at the new ones.
        self.param_groups = self._inner_groups()

    def optimizer_state_bytes(self) -> int:
        return sum(optimizer_state_bytes(opt) for opt in self.optimizers.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the optimizer's state tensors (exact: numel * element size)."""
    if isinstance(optimizer, HybridOptimizer):
        return optimizer.optimizer_state_bytes()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _fused_supported(params: Iterable[torch.Tensor]) -> bool:
    params = list(params)
    return bool(params) and all(
        p.device.type in ("cuda", "cpu")
        and p.dtype in (torch.float32, torch.bfloat16, torch.float16)
        for p in params
    )


def _adamw(
    named: list[tuple[str, nn.Parameter]],
    *,
    lr: float,
    betas,
    weight_decay: float,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW with weight decay on >= 2-D parameters only."""
    decay = [(n, p) for n, p in named if p.ndim >= 2]
    no_decay = [(n, p) for n, p in named if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if fused is None:
        fused = _fused_supported(p for _, p in named)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), fused=fused or None)


def muon_options(model: nn.Module, config) -> dict[str, Any]:
    """Keyword options of :class:`muonscale.Muon` (and its distributed classes) from
    ``config``; fused QKV weights are split by ``model.qkv_layout``."""
    return dict(
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
        ns_steps=config.ns_steps,
        ns_dtype=DTYPES[config.ns_dtype] if config.ns_dtype else None,
        momentum_dtype=DTYPES[config.momentum_dtype] if config.momentum_dtype else None,
        adamw_lr=config.adamw_lr,
        adamw_betas=tuple(config.adamw_betas),
        splits={qkv: model.qkv_layout for qkv in model.qkv_param_names()},
        experts=find_experts(model).layouts,
    )


def muon_params(model: nn.Module) -> nn.Module | list[tuple[str, nn.Parameter]]:
    """What the train path hands ``muonscale.Muon`` (and its distributed classes): the model
    itself, so routing sees its embedding and expert modules and ``summary()`` labels expert
    stacks and routers as for ``muonscale.Muon(model)`` (not "3-D hidden weight"); its
    trainable ``named_parameters()`` where some parameters are frozen (the model would hand
    those over too). The param groups are the same either way."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return model if len(named) == len(list(model.parameters())) else named


def torch_muon_split(model: nn.Module) -> tuple[list[str], list[str]]:
    """(names ``torch.optim.Muon`` takes, names left to its AdamW): the trainable parameters
    :func:`muonscale.params.route` sends to Muon that are 2-D, and all others (embeddings,
    head, norms, biases, and the 3-D expert stacks, which ``torch.optim.Muon`` refuses)."""
    decisions = route(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [n for n, p in named if decisions[n].algorithm == "muon" and p.ndim == 2]
    return hidden, [n for n, _ in named if n not in set(hidden)]


def adamw_for(model: nn.Module, config, *, fused: bool | None = None) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` as the ``adamw`` optimizer builds it (decay on >= 2-D only);
    ``fused=False`` for DTensor parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return _adamw(
        named,
        lr=config.lr,
        betas=config.adamw_betas,
        weight_decay=config.weight_decay,
        fused=fused,
    )


def build_optimizer(name: str, model: nn.Module, config) -> torch.optim.Optimizer:
    """``name`` in ("adamw", "muon", "torch-muon"); hyperparameters from ``config``
    (a :class:`~muonscale.train.config.TrainConfig`)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    adamw_lr = config.lr if config.adamw_lr is None else config.adamw_lr
    if name == "adamw":
        return adamw_for(model, config)
    if name == "muon":
        try:
            from muonscale.optimizer import Muon
        except ImportError as error:
            raise RuntimeError(
                f"optimizer 'muon' needs muonscale.optimizer.Muon: {error}"
            ) from error
        return Muon(muon_params(model), **muon_options(model, config))
    if name == "torch-muon":
        muon_names, _ = torch_muon_split(model)
        hidden = [(n, p) for n, p in named if n in set(muon_names)]
        rest = [(n, p) for n, p in named if n not in set(muon_names)]
        optimizers: dict[str, torch.optim.Optimizer] = {
            "muon": torch.optim.Muon(
                hidden,
                lr=config.lr,
                weight_decay=config.weight_decay,
                momentum=config.momentum,
                ns_steps=config.ns_steps,
                adjust_lr_fn="match_rms_adamw",
            )
        }
        if rest:
            optimizers["adamw"] = _adamw(
                rest, lr=adamw_lr, betas=config.adamw_betas, weight_decay=config.weight_decay
            )
        return HybridOptimizer(optimizers)
    raise ValueError(f"unknown optimizer {name!r}; choose from ('muon', 'adamw', 'torch-muon')")
