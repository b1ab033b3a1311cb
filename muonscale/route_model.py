"""``muonscale route``: the routing table of a model, before any training.

The model comes from ``package.module:callable`` (called with no arguments, returning an
``nn.Module``) or from a Hugging Face ``config.json`` (or a folder holding one; needs
transformers), built on the meta device so that no weights are allocated. The table is
:meth:`muonscale.Muon.summary` of the optimizer :func:`muonscale.integrations.model_params.
muon_for_model` builds: the same names, module types, transposed weights and splits.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from torch import nn


class ModelSpecError(ValueError):
    """The model specification cannot be turned into an ``nn.Module``."""


def _from_callable(spec: str) -> nn.Module:
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ModelSpecError(f"expected package.module:callable, got {spec!r}")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # modules beside the user, as ``python -m`` finds them
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ModelSpecError(f"{spec}: cannot import {module_name!r}: {error}") from error
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ModelSpecError(f"{spec}: {module_name} has no attribute {attribute!r}")
        target = getattr(target, part)
    if isinstance(target, nn.Module):
        return target
    if not callable(target):
        raise ModelSpecError(f"{spec}: {attribute} is neither callable nor an nn.Module")
    try:
        model = target()
    except TypeError as error:  # e.g. a class that needs arguments
        raise ModelSpecError(
            f"{spec}: calling {attribute}() with no arguments failed ({error}); point at a "
            "function that builds the model"
        ) from error
    if not isinstance(model, nn.Module):
        raise ModelSpecError(
            f"{spec}: expected the callable to return a torch.nn.Module, got {type(model).__name__}"
        )
    return model


def _from_hf_config(path: Path) -> nn.Module:
    try:
        import torch
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
    except ImportError as error:
        raise ModelSpecError(
            f"{path}: a Hugging Face config needs transformers, which is not installed: "
            'pip install "muonscale[hf]"'
        ) from error
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):  # shapes only: no memory for the weights
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal LM architecture (e.g. BERT): its base model
            return AutoModel.from_config(config)


def build_model(spec: str) -> nn.Module:
    """The model named by ``spec`` (see the module docstring)."""
    path = Path(spec)
    if path.suffix == ".json" or path.is_dir():
        if not (path / "config.json" if path.is_dir() else path).is_file():
            raise ModelSpecError(f"{spec}: no Hugging Face config file there")
        return _from_hf_config(path)
    if ":" not in spec:
        raise ModelSpecError(
            f"expected package.module:callable or a Hugging Face config.json, got {spec!r}"
        )
    return _from_callable(spec)


def routing_table(model: nn.Module, *, qkv_split: str = "qkv") -> str:
    """The routing table muonscale gives ``model``: :meth:`muonscale.Muon.summary` of the
    optimizer built for it by name (QKV splits from ``model.qkv_layout`` when it has one, as
    muonscale's reference GPT does)."""
    from muonscale.integrations.model_params import muon_for_model

    kwargs: dict[str, Any] = {"lr": 0.02, "qkv_split": qkv_split}
    if hasattr(model, "qkv_layout") and hasattr(model, "qkv_param_names"):
        kwargs["splits"] = {name: model.qkv_layout for name in model.qkv_param_names()}
    optimizer = muon_for_model(model, **kwargs)
    return optimizer.summary()
