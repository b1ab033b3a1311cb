"""Hugging Face ``Trainer``: ``muonscale.Muon`` with the embeddings and the head on AdamW.

One line::

    Trainer(model, args, ..., optimizer_cls_and_kwargs=(MuonFactory, muon_kwargs(args)))

:func:`muon_kwargs` takes ``lr`` and ``weight_decay`` from the ``TrainingArguments``, which the
Trainer does not pass to a factory; a factory without ``lr`` refuses to build.

``Trainer(optimizer_cls_and_kwargs=(muonscale.Muon, kwargs))`` hands Muon parameter groups
without names, so routing falls back to tensor rank and the embeddings and the output head are
orthogonalized too. :class:`MuonFactory` is a Trainer optimizer factory (transformers >= 5
calls a non-``Optimizer`` class as ``factory()(model, **kwargs)``), so Muon sees the model.

What the Trainer does for you, and what this module adds (see *Integrations* in the docs):

* **Clipping** (``max_grad_norm``) and **gradient accumulation** edit ``p.grad`` before
  ``step()``; ``muonscale.Muon`` reads ``p.grad`` at ``step()``, so both apply as with AdamW.
* **DDP** (``torchrun``/``accelerate launch``): the Trainer wraps the model in DDP, which
  averages gradients before ``step()``; every rank then computes the same Muon update.
* **FSDP2**: the Trainer builds the optimizer before accelerate shards the model and swaps the
  DTensor shards into its groups. The factories read accelerate's FSDP plugin
  (:func:`accelerate_fsdp_version`) and build a ``DTensorMuon``, which re-binds the shards by
  name before its first step (:func:`follow_model_parameters`) and orthogonalizes whole
  matrices. FSDP1 (flat shards) is refused; a plain ``muonscale.Muon`` refuses sharded Muon
  parameters at ``step()``.

``DistributedMuon`` (sharded state, one owner per matrix) under the Trainer::

    Trainer(..., optimizer_cls_and_kwargs=(DistributedMuonFactory, muon_kwargs(args)),
            callbacks=[DistributedCheckpointCallback()])

The Trainer wraps the model in DDP, which averages ``p.grad``; the factory builds the optimizer
with ``reduce_at="never"`` (no second reduction; each rank reads its slices of ``p.grad`` at
``step()``), so the Trainer's clipping (``max_grad_norm``, on ``p.grad``) and its accumulation
(DDP's ``no_sync``) apply as with AdamW. ``DistributedMuon.state_dict()`` is collective, but the
Trainer calls it on the saving rank only: :class:`DistributedCheckpointCallback` makes every
rank call ``opt.prepare_state_dict()`` (the collective part) just before a save; loading needs
nothing (every rank reads the file and keeps its part). Without the callback, the first
``step()`` of a multi-process run raises on every rank, naming it, instead of the first save
hanging.

Step metrics (what Muon did each step: :mod:`muonscale.step_metrics`) in every ``report_to``
backend and in ``trainer.state.log_history``: ``add_step_metrics(trainer)`` before
``trainer.train()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch.distributed as dist
from torch import nn

from ..distributed.setup_checks import check_process_group, is_dtensor
from ..optimizer import Muon
from .model_params import follow_model_parameters, muon_for_model, rebind_parameters, unwrap_model

__all__ = [
    "DistributedCheckpointCallback",
    "StepMetricsCallback",
    "add_step_metrics",
    "DistributedMuonFactory",
    "MuonFactory",
    "accelerate_fsdp_version",
    "create_optimizer",
    "follow_model_parameters",
    "muon_kwargs",
    "rebind_parameters",
]


def _check_process_group() -> None:
    check_process_group(None, "muonscale.integrations.hf")


def accelerate_fsdp_version() -> int | None:
    """The FSDP version (1 or 2) accelerate will shard the model with: its plugin in the
    ``AcceleratorState`` the Trainer set up; ``None`` without FSDP or without accelerate.

    Read from the shared state, not ``AcceleratorState()``: a new instance re-copies the
    process state's ``distributed_type`` over ``FSDP``. accelerate keeps the plugin only where it
    will shard (not on CPU, where it silently runs DDP instead)."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover - the Trainer always brings accelerate
        return None
    plugin = AcceleratorState._shared_state.get("fsdp_plugin")
    return None if plugin is None else int(plugin.fsdp_version)


def _sharded_build(model: nn.Module) -> Any:
    """``DTensorMuon`` when the parameters are, or will be, FSDP2 shards; else ``None``."""
    version = accelerate_fsdp_version()
    if version == 1:
        raise ValueError(
            "muonscale.integrations.hf: accelerate is set up for FSDP version 1, which flattens "
            "the parameters into 1-D shards, so Muon cannot see the matrices. Use FSDP2: "
            "TrainingArguments(fsdp=True, fsdp_config={'version': 2, ...})"
        )
    if version == 2 or any(is_dtensor(p) for p in model.parameters()):
        from ..distributed import DTensorMuon

        return DTensorMuon
    return None


def create_optimizer(model: nn.Module, **muon_kwargs: Any) -> Muon:
    """``muonscale.Muon`` over ``model``'s trainable parameters, routed by name and module type
    (for ``Trainer(optimizers=(create_optimizer(model, lr=...), None))``, any transformers).

    Under accelerate's FSDP2 (the Trainer builds the optimizer before sharding, then swaps in
    DTensor shards) or on DTensor parameters: a :class:`muonscale.distributed.DTensorMuon`
    (on the world group), which re-binds the shards by name before its first step."""
    _check_process_group()
    model = unwrap_model(model)
    if "build" not in muon_kwargs:
        sharded = _sharded_build(model)
        if sharded is not None:
            muon_kwargs["build"] = sharded
    return muon_for_model(model, **muon_kwargs)


def muon_kwargs(args: Any, **overrides: Any) -> dict[str, Any]:
    """The factories' kwargs with ``lr`` and ``weight_decay`` taken from ``TrainingArguments``
    (``args.learning_rate``, ``args.weight_decay``), then ``overrides`` (any
    :class:`muonscale.Muon` option, e.g. ``adamw_lr``)::

        optimizer_cls_and_kwargs=(MuonFactory, muon_kwargs(args, adamw_lr=3e-4))

    The Trainer hands a factory the model and these kwargs only, never the arguments."""
    for field in ("learning_rate", "weight_decay"):
        if not hasattr(args, field):
            raise TypeError(
                f"muon_kwargs: expected transformers.TrainingArguments (with .{field}), got "
                f"{type(args).__name__}"
            )
    return {"lr": args.learning_rate, "weight_decay": args.weight_decay, **overrides}


class _TrainerFactory(ABC):
    """What both factories share: an instance stands for its class (the Trainer calls
    ``factory()(model, **kwargs)``, so ``MuonFactory`` and ``MuonFactory()`` both work), the
    model comes first, and ``lr`` must be given."""

    def __call__(self, model: nn.Module | None = None, /, **kwargs: Any) -> Any:
        name = type(self).__name__
        if model is None:
            if kwargs:
                raise TypeError(f"{name}()(model, **kwargs): pass the model first")
            return self  # the Trainer's factory() step, applied to an instance
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"{name}: expected the model (a torch.nn.Module) as the first argument, got "
                f"{type(model).__name__}; use optimizer_cls_and_kwargs=({name}, kwargs)"
            )
        if "lr" not in kwargs:
            raise ValueError(
                f"{name}: no lr given. The Trainer does not pass TrainingArguments.learning_rate "
                "(or weight_decay) to an optimizer factory, so Muon would silently use its "
                f"default lr. Use optimizer_cls_and_kwargs=({name}, "
                "muonscale.integrations.hf.muon_kwargs(args)) to take both from the "
                f"TrainingArguments, or ({name}, {{'lr': ...}})."
            )
        return self.build(model, **kwargs)

    @abstractmethod
    def build(self, model: nn.Module, **kwargs: Any) -> Muon:
        """The optimizer for ``model`` (checked: a module, with ``lr`` in ``kwargs``)."""


class MuonFactory(_TrainerFactory):
    """Trainer optimizer factory: ``optimizer_cls_and_kwargs=(MuonFactory, muon_kwargs)``.

    ``muon_kwargs`` are :class:`muonscale.Muon`'s (``lr``, ``weight_decay``, ``adamw_lr``, ...)
    and must include ``lr``: :func:`muon_kwargs` fills ``lr`` and ``weight_decay`` from the
    ``TrainingArguments``, which the Trainer does not pass to a factory.
    """

    def build(self, model: nn.Module, **muon_kwargs: Any) -> Muon:
        return create_optimizer(model, **muon_kwargs)


_CALLBACK_MARK = "_muonscale_checkpoint_callback"  # set on the optimizer by the callback


class DistributedMuonFactory(_TrainerFactory):
    """Trainer optimizer factory for ``DistributedMuon``:
    ``optimizer_cls_and_kwargs=(DistributedMuonFactory, kwargs)`` with
    ``callbacks=[DistributedCheckpointCallback()]``; ``kwargs`` must include ``lr`` (see
    :func:`muon_kwargs`).

    With several processes the Trainer wraps the model in DDP after this runs, so the optimizer
    is built with ``reduce_at="never"`` (DDP's average is used, not reduced again); with one,
    ``reduce_at="step"``. Pass ``reduce_at`` in ``kwargs`` to choose yourself. Under
    accelerate's FSDP2: a ``DTensorMuon``, as :class:`MuonFactory` builds.

    With several processes and without the callback, the first ``step()`` raises on every
    rank, naming the callback: ``DistributedMuon.state_dict()`` is collective and the Trainer
    calls it on the saving rank only, so the first checkpoint would hang until
    ``ddp_timeout``."""

    def build(self, model: nn.Module, **kwargs: Any) -> Muon:
        from ..distributed import distributed_muon

        _check_process_group()
        model = unwrap_model(model)
        sharded = _sharded_build(model)
        if sharded is not None:  # FSDP2 reduces the gradients: DTensorMuon, as MuonFactory
            if "reduce_at" in kwargs:
                raise ValueError(
                    "DistributedMuonFactory: reduce_at does not apply under FSDP2 (FSDP2 "
                    "reduce-scatters the gradients; the optimizer is a DTensorMuon)"
                )
            return muon_for_model(model, build=sharded, **kwargs)
        wrapped_later = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        kwargs.setdefault("reduce_at", "never" if wrapped_later else "step")
        optimizer = muon_for_model(model, build=distributed_muon, **kwargs)
        if _collective_state_dict(optimizer) and optimizer.world_size > 1:
            optimizer.register_step_pre_hook(_require_checkpoint_callback)
        return optimizer


def _require_checkpoint_callback(optimizer: Any, args: Any, kwargs: Any) -> None:
    if not getattr(optimizer, _CALLBACK_MARK, False):
        raise RuntimeError(
            "DistributedMuonFactory: the Trainer has no "
            "muonscale.integrations.hf.DistributedCheckpointCallback. Pass "
            "Trainer(..., callbacks=[DistributedCheckpointCallback()]): DistributedMuon's "
            "state_dict() is collective and the Trainer calls it on the saving rank only, so the "
            "first checkpoint would hang until ddp_timeout. Stopped at the first step, on every "
            "rank, before any update."
        )


def _collective_state_dict(optimizer: Any) -> bool:
    from ..distributed import DistributedMuon

    return isinstance(optimizer, DistributedMuon)


def _transformers_callback_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError:  # pragma: no cover - the class is only useful with transformers
        return object
    return TrainerCallback


class DistributedCheckpointCallback(_transformers_callback_base()):
    """Lets the Trainer checkpoint a ``DistributedMuon``: when a save is due (``on_step_end``,
    ``on_epoch_end``, after the Trainer's flow callback decided it), every rank calls the
    optimizer's collective ``prepare_state_dict()``, so that the saving rank's
    ``state_dict()`` alone returns the full state (until the next ``step()``). At
    ``on_train_begin`` it marks the optimizer as covered (the factory's first step checks).
    Other optimizers are left alone."""

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if _collective_state_dict(inner):
            setattr(inner, _CALLBACK_MARK, True)

    def _prepare(self, control: Any, optimizer: Any) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
        if control.should_save and _collective_state_dict(inner):
            inner.prepare_state_dict()  # collective: every rank is here

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any):
        self._prepare(control, optimizer)

    def on_epoch_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw: Any):
        self._prepare(control, optimizer)


def add_step_metrics(
    trainer: Any, *, timing: bool = False, across_ranks: bool = True
) -> StepMetricsCallback:
    """Put the optimizer's step metrics (:mod:`muonscale.step_metrics`) into every training log
    of ``trainer`` (any ``Trainer`` subclass): ``trainer.state.log_history`` and every
    ``report_to`` backend. Call before ``trainer.train()``; returns the callback.

    The Trainer appends a copy of the logs to ``log_history`` and then calls each callback's
    ``on_log`` with the logs, in list order, reporting callbacks first. So the callback goes to
    the front of the list: its ``on_log`` adds the metrics to the logs the reporting callbacks
    then write, and to the ``log_history`` entry just appended. The metrics are read (one host
    sync; ``across_ranks``: one collective, every rank logs) only at logging steps."""
    callback = StepMetricsCallback(timing=timing, across_ranks=across_ranks)
    callback.installed = True
    trainer.callback_handler.callbacks.insert(0, callback)
    return callback


def _muonscale_optimizer(optimizer: Any) -> Muon:
    from ..step_metrics import find_step_metrics_optimizer

    found = find_step_metrics_optimizer(optimizer)
    if found is None:
        raise TypeError(
            "muonscale step metrics: the Trainer's optimizer is "
            f"{type(getattr(optimizer, 'optimizer', optimizer)).__name__}, not a muonscale "
            "optimizer (build it with MuonFactory or DistributedMuonFactory)"
        )
    return found


class StepMetricsCallback(_transformers_callback_base()):
    """Adds the optimizer's step metrics to the Trainer's training logs; installed by
    :func:`add_step_metrics` (ahead of the reporting callbacks, which a callback passed in
    ``callbacks=[...]`` would come after)."""

    def __init__(self, *, timing: bool = False, across_ranks: bool = True) -> None:
        self.timing, self.across_ranks = timing, across_ranks
        self.installed = False
        self.optimizer: Muon | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kw):
        if not self.installed:
            raise RuntimeError(
                "StepMetricsCallback passed in Trainer(callbacks=[...]) runs after the "
                "reporting callbacks, so no logger would see the metrics: call "
                "muonscale.integrations.hf.add_step_metrics(trainer) instead"
            )
        self.optimizer = _muonscale_optimizer(optimizer)
        self.optimizer.enable_step_metrics(timing=self.timing)

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any):
        if logs is None or "loss" not in logs or self.optimizer is None:
            return  # not a training log (evaluation, the run's summary)
        if self.optimizer.step_metrics is None or not self.optimizer.step_metrics.steps:
            return
        metrics = self.optimizer.read_step_metrics(across_ranks=self.across_ranks)
        logs.update(metrics)
        history = state.log_history
        if history and history[-1].get("step") == state.global_step and "loss" in history[-1]:
            history[-1].update(metrics)  # the copy Trainer.log appended just before on_log
