"""Lightning: ``muonscale.Muon`` from a ``LightningModule``, routed by parameter name, and
Lightning's gradient clipping wired to the optimizer. In your ``LightningModule``::

    def configure_optimizers(self):
        return muonscale.integrations.lightning.configure_optimizers(self, lr=3e-4)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None,
                                    gradient_clip_algorithm=None):
        muonscale.integrations.lightning.configure_gradient_clipping(
            self, optimizer, gradient_clip_val, gradient_clip_algorithm)

Accumulation (``accumulate_grad_batches``) and DDP (``strategy="ddp"``) need nothing more:
Lightning sums or averages ``p.grad`` before ``step()``, where ``muonscale.Muon`` reads it.
Under FSDP2 / tensor parallelism (``ModelParallelStrategy``, parameters made DTensors in
``configure_model``) the same call builds :class:`muonscale.distributed.DTensorMuon`.

Step metrics (what Muon did each step: :mod:`muonscale.step_metrics`) through
``pl_module.log``: ``Trainer(callbacks=[StepMetricsCallback()])``.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..distributed import distributed_muon
from ..distributed.setup_checks import is_dtensor
from ..optimizer import Muon
from .model_params import muon_for_model

__all__ = ["StepMetricsCallback", "configure_gradient_clipping", "configure_optimizers"]


def configure_optimizers(module: nn.Module, **muon_kwargs: Any) -> Muon:
    """``muonscale.Muon`` over ``module``'s trainable parameters, routed by name and module type
    (embeddings and the output head to AdamW); :func:`muonscale.distributed_muon` (the DTensor
    optimizer, on the world group) when ``configure_model`` made them DTensors."""
    if "build" not in muon_kwargs and any(is_dtensor(p) for p in module.parameters()):
        muon_kwargs["build"] = distributed_muon
    return muon_for_model(module, **muon_kwargs)


def configure_gradient_clipping(
    module: Any,
    optimizer: Any,
    gradient_clip_val: float | None = None,
    gradient_clip_algorithm: str | None = None,
) -> None:
    """Clip as the Trainer's ``gradient_clip_val`` / ``gradient_clip_algorithm`` ask: by the
    optimizer's own ``clip_grad_norm_`` when it has one (an optimizer that holds reduced
    gradients outside ``p.grad``), else Lightning's default on ``p.grad``."""
    inner = getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps it
    own = getattr(inner, "clip_grad_norm_", None)
    if own is None:
        module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return
    if gradient_clip_val is None or gradient_clip_val == 0:
        return
    if gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(
            f"gradient_clip_algorithm={gradient_clip_algorithm!r}: {type(inner).__name__} clips "
            "by norm only"
        )
    own(float(gradient_clip_val))


def _lightning_callback_base() -> type:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # pragma: no cover - the class is only useful with Lightning
        return object
    return Callback


class StepMetricsCallback(_lightning_callback_base()):
    """Logs the optimizer's step metrics (:mod:`muonscale.step_metrics`) with
    ``pl_module.log_dict`` after the optimizer steps that Lightning logs (every
    ``log_every_n_steps`` optimizer steps), so every Lightning logger gets them and
    ``trainer.logged_metrics`` holds them. They are read (one host sync; ``across_ranks``: one
    collective, every rank reads) only then."""

    def __init__(self, *, timing: bool = False, across_ranks: bool = True) -> None:
        self.timing, self.across_ranks = timing, across_ranks
        self.optimizer: Muon | None = None
        self._read_at = 0  # the metrics' step count when last read

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from ..step_metrics import find_step_metrics_optimizer

        found = [find_step_metrics_optimizer(o) for o in trainer.optimizers]
        found = [o for o in found if o is not None]
        if not found:
            raise TypeError(
                "StepMetricsCallback: none of the Trainer's optimizers is a muonscale optimizer "
                "(return muonscale.integrations.lightning.configure_optimizers(...) from "
                "configure_optimizers)"
            )
        self.optimizer = found[0]
        self.optimizer.enable_step_metrics(timing=self.timing)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
        metrics = None if self.optimizer is None else self.optimizer.step_metrics
        if metrics is None or metrics.steps == self._read_at:
            return  # no optimizer step since the last read (gradient accumulation)
        every = trainer.log_every_n_steps
        if not every or trainer.global_step % every:
            return  # Lightning's logger connector does not log this step
        self._read_at = metrics.steps
        read = self.optimizer.read_step_metrics(across_ranks=self.across_ranks)
        pl_module.log_dict(read, on_step=True, on_epoch=False, batch_size=1)
