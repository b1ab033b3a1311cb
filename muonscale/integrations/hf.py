"""Hugging Face ``Trainer``: ``muonscale.Muon`` with the embeddings and the head on AdamW.

One line::

    Trainer(model, args, ..., optimizer_cls_and_kwargs=(MuonFactory, {"lr": 3e-4}))

``Trainer(optimizer_cls_and_kwargs=(muonscale.Muon, kwargs))`` hands Muon parameter groups
without names, so routing falls back to tensor rank and the embeddings and the output head are
orthogonalized too. :class:`MuonFactory` is a Trainer optimizer factory (transformers >= 5
calls a non-``Optimizer`` class as ``factory()(model, **kwargs)``), so Muon sees the model.

What the Trainer does for you, and what this module adds (see docs/integrations.md):

* **Clipping** (``max_grad_norm``) and **gradient accumulation** edit ``p.grad`` before
  ``step()``; ``muonscale.Muon`` reads ``p.grad`` at ``step()``, so both apply as with AdamW.
* **DDP** (``torchrun``/``accelerate launch``): the Trainer wraps the model in DDP, which
  averages gradients before ``step()``; every rank then computes the same Muon update.
* **FSDP2**: accelerate swaps the parameter objects after the optimizer is built; the optimizer
  re-binds them by name before its next step (:func:`follow_model_parameters`) and refuses
  sharded Muon parameters, which need ``muonscale.DTensorMuon``.
"""

from __future__ import annotations

import os
from typing import Any

from torch import nn

from ..optimizer import Muon
from .model_params import follow_model_parameters, muon_for_model, rebind_parameters, unwrap_model

__all__ = ["MuonFactory", "create_optimizer", "follow_model_parameters", "rebind_parameters"]


def _check_process_group() -> None:
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"WORLD_SIZE={world} but no process group is initialized: create TrainingArguments "
            "(which calls torch.distributed.init_process_group) before the optimizer"
        )


def create_optimizer(model: nn.Module, **muon_kwargs: Any) -> Muon:
    """``muonscale.Muon`` over ``model``'s trainable parameters, routed by name and module type
    (for ``Trainer(optimizers=(create_optimizer(model, lr=...), None))``, any transformers)."""
    _check_process_group()
    return muon_for_model(unwrap_model(model), **muon_kwargs)


class MuonFactory:
    """Trainer optimizer factory: ``optimizer_cls_and_kwargs=(MuonFactory, muon_kwargs)``.

    ``muon_kwargs`` are :class:`muonscale.Muon`'s (``lr``, ``weight_decay``, ``adamw_lr``, ...);
    ``TrainingArguments.learning_rate`` and ``weight_decay`` are not read, as with any
    ``optimizer_cls_and_kwargs``.
    """

    def __call__(self, model: nn.Module, **muon_kwargs: Any) -> Muon:
        return create_optimizer(model, **muon_kwargs)
