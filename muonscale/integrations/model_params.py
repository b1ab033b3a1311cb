"""A ``muonscale.Muon`` built from a model by parameter name, and kept bound to the model's
parameters by name when a framework swaps the parameter objects (accelerate's FSDP2 path).

Shared by the Hugging Face, Lightning and torchtitan integrations: each framework hands over a
model (or its parameter groups without names), and routing by shape alone would send the
embeddings and the output head to Muon. Here every parameter keeps its name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..distributed.setup_checks import is_dtensor
from ..experts import convolution_weights, find_experts
from ..optimizer import Muon
from ..params import route, transposed_weights


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP / DataParallel wrapper (their names carry no ``module.``)."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def trainable_named_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(n, p) for n, p in unwrap_model(model).named_parameters() if p.requires_grad]


def muon_for_model(model: nn.Module, *, build: Any = Muon, **muon_kwargs: Any) -> Muon:
    """``muonscale.Muon`` over the trainable parameters of ``model``, routed by name and by module
    type (embeddings and heads tied to them go to AdamW; expert stacks get their expert view,
    :mod:`muonscale.experts`), and kept bound to the model's
    parameters by name (see :func:`follow_model_parameters`). ``build``: the optimizer class or
    factory called as ``build(param_groups, **muon_kwargs)`` (e.g.
    :func:`muonscale.distributed_muon`)."""
    if "params" in muon_kwargs:
        raise TypeError("muon_for_model: the parameters come from the model; do not pass params")
    model = unwrap_model(model)
    decisions = route(model, muon_kwargs.get("rules"))
    named = trainable_named_parameters(model)
    if not named:
        raise ValueError(f"muon_for_model: {type(model).__name__} has no trainable parameters")
    groups = [
        {
            "params": [(n, p) for n, p in named if decisions[n].algorithm == algorithm],
            "algorithm": algorithm,
        }
        for algorithm in ("muon", "adamw")
    ]
    muon_kwargs.setdefault("transposed", transposed_weights(model))
    muon_kwargs.setdefault("experts", find_experts(model).layouts)
    muon_kwargs.setdefault("convolutions", convolution_weights(model))
    optimizer = build([g for g in groups if g["params"]], **muon_kwargs)
    for name, _ in named:  # keep the reasons (module type, name) in opt.summary()
        optimizer.routing[name] = decisions[name]
    follow_model_parameters(optimizer, model)
    return optimizer


def rebind_parameters(optimizer: Muon, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> int:
    """``optimizer.rebind_parameters(named_parameters)``
    (see :meth:`muonscale.Muon.rebind_parameters`)."""
    if not isinstance(optimizer, Muon):
        raise TypeError(
            f"re-binding by name supports muonscale optimizers, got {type(optimizer).__name__}"
        )
    return optimizer.rebind_parameters(named_parameters)


def _is_plain_muon(optimizer: Any) -> bool:
    return not type(optimizer).__module__.startswith("muonscale.distributed")


def _reject_sharded(optimizer: Muon) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if group["algorithm"] == "muon" and is_dtensor(p):
                raise TypeError(
                    f"parameter {optimizer.param_names.get(id(p), '?')!r} is a DTensor (FSDP2 or "
                    "tensor parallel): muonscale.Muon would orthogonalize each rank's shard, not "
                    "the matrix. Use muonscale.DTensorMuon for sharded parameters."
                )


def follow_model_parameters(optimizer: Muon, model: nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Before each step, re-bind ``optimizer`` by name if it holds parameters that are no longer
    ``model``'s (one identity check per parameter). Plain ``muonscale.Muon`` refuses sharded
    (DTensor) Muon parameters with a clear error instead of a wrong update; the distributed
    optimizers check the new parameters themselves."""
    if not isinstance(optimizer, Muon):
        raise TypeError(
            f"follow_model_parameters supports muonscale optimizers, got {type(optimizer).__name__}"
        )
    model = unwrap_model(model)
    seen: list[tuple[int, ...]] = [()]

    def before_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        named = list(model.named_parameters())
        ids = tuple(id(p) for g in opt.param_groups for p in g["params"]) + tuple(
            id(p) for _, p in named
        )
        if ids == seen[0]:
            return
        # Parameters changed (or first step): re-bind by name. Idempotent, and also needed when
        # the framework already swapped the groups (accelerate does), for names, splits, state.
        optimizer.rebind_parameters(named)
        if _is_plain_muon(optimizer):
            _reject_sharded(optimizer)
        seen[0] = tuple(id(p) for g in opt.param_groups for p in g["params"]) + tuple(
            id(p) for _, p in named
        )

    return optimizer.register_step_pre_hook(before_step)
