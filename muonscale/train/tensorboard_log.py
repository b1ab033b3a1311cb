"""``muonscale train --tensorboard DIR``: the run's curves as TensorBoard event files.

Scalars (x: optimizer step): ``train_loss``, ``val_loss``, ``lr``, ``optimizer_ms`` (wall time
of ``optimizer.step()``), ``skipped_steps`` (for an optimizer that counts them, e.g.
``nonfinite="skip"``) and ``update_rms/<algorithm>``: the RMS of the change a step made to the
parameters of each algorithm's groups, divided by the group's learning rate (weight decay
included), so Muon's ``match_rms_adamw`` scaling reads directly. The parameters are copied
before each logged step, outside the step's timing; under ``--parallel fsdp`` the figure is
rank 0's shards'.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def labelled_groups(optimizer: torch.optim.Optimizer) -> list[tuple[str, dict]]:
    """``(algorithm, param_group)`` pairs: a muonscale group's ``algorithm``, the inner
    optimizer's name in a ``HybridOptimizer``, else the optimizer's class name."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):
        return [(name, g) for name, opt in inner.items() for g in opt.param_groups]
    default = type(optimizer).__name__.lower()
    return [(g.get("algorithm", default), g) for g in optimizer.param_groups]


class TrainTensorBoard:
    """Writes the scalars of one training run into ``folder`` (needs tensorboard)."""

    def __init__(
        self,
        folder: str | Path,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = 1,
        land: Callable[[], None] = lambda: None,
    ):
        """``land()``: lands parameters a step left in flight (``DistributedMuon``'s deferred
        gathers), called before the parameters are read."""
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self.writer = SummaryWriter(log_dir=str(self.folder))
        self.optimizer = optimizer
        self.every = max(1, every)
        self._land = land
        self._before: list[tuple[str, float, list[torch.Tensor], list[torch.Tensor]]] | None = None

    def before_step(self, step: int, total: int) -> None:
        """Copy the parameters when the step about to run (``step + 1``) is logged."""
        upcoming = step + 1
        if upcoming % self.every and upcoming != total:
            self._before = None
            return
        self._land()  # the previous step's parameters, complete
        self._before = []
        for label, group in labelled_groups(self.optimizer):
            params = [_local(p) for p in group["params"]]
            copies = [p.detach().clone() for p in params]
            self._before.append((label, float(group["lr"]), params, copies))

    @torch.no_grad()
    def after_step(self, result) -> None:
        """Log the step's loss, lr, optimizer time, skipped steps and update RMS."""
        step = result.step
        self.writer.add_scalar("train_loss", result.loss, step)
        self.writer.add_scalar("lr", result.lr, step)
        self.writer.add_scalar("optimizer_ms", result.optimizer_seconds * 1e3, step)
        skipped = getattr(self.optimizer, "skipped_steps", None)
        if skipped is not None:
            self.writer.add_scalar("skipped_steps", int(skipped), step)
        if self._before is None:
            return
        self._land()  # this step's parameters, complete
        squares: dict[str, float] = {}
        counts: dict[str, int] = {}
        for label, lr, params, copies in self._before:
            if lr == 0.0:
                continue
            for p, before in zip(params, copies):
                change = (p.detach().double() - before.double()) / lr
                squares[label] = squares.get(label, 0.0) + float(change.square().sum())
                counts[label] = counts.get(label, 0) + change.numel()
        for label, total in squares.items():
            if counts[label]:
                self.writer.add_scalar(f"update_rms/{label}", (total / counts[label]) ** 0.5, step)
        self._before = None

    def evaluated(self, step: int, val_loss: float) -> None:
        self.writer.add_scalar("val_loss", val_loss, step)

    def close(self) -> None:
        self.writer.close()
