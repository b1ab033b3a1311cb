"""``muonscale train --tensorboard DIR``: the run's curves as TensorBoard event files.

Scalars (x: optimizer step): ``train_loss``, ``val_loss``, ``lr``, ``optimizer_ms`` (wall time
of ``optimizer.step()``), ``skipped_steps`` (for an optimizer that counts them, e.g.
``nonfinite="skip"``) and ``update_rms/<algorithm>``: the RMS of the change a step made to the
parameters of each algorithm's groups, divided by the group's learning rate (weight decay
included), so Muon's ``match_rms_adamw`` scaling reads directly. The parameters are copied
before each logged step, outside the step's timing; under ``--parallel fsdp`` the figure is
rank 0's shards'.

A write that fails with ``OSError`` (a full disk, the folder taken away) stops the logging, not
the run: it is reported once, on stderr and in the run's metrics (event
``tensorboard_failed``), and training, checkpoints and the final save go on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from muonscale.distributed.dtensor_layout import local_tensor
from muonscale.train.run_log import MetricsLog


def labelled_groups(optimizer: torch.optim.Optimizer) -> list[tuple[str, dict]]:
    """``(algorithm, param_group)`` pairs: a muonscale group's ``algorithm``, the inner
    optimizer's name in a ``HybridOptimizer``, else the optimizer's class name."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):
        return [(name, g) for name, opt in inner.items() for g in opt.param_groups]
    default = type(optimizer).__name__.lower()
    return [(g.get("algorithm", default), g) for g in optimizer.param_groups]


class TrainTensorBoard:
    """Writes the scalars of one training run into ``folder`` (needs tensorboard); stops
    writing at the first ``OSError`` (see the module docstring), which it reports on stderr
    and in ``log``, the run's metrics."""

    def __init__(
        self,
        folder: str | Path,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = 1,
        log: MetricsLog | None = None,
        land: Callable[[], None] = lambda: None,
    ):
        """``land()``: lands parameters a step left in flight (``DistributedMuon``'s deferred
        gathers), called before the parameters are read."""
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self.writer = SummaryWriter(log_dir=str(self.folder))
        """None once a write failed."""
        self.optimizer = optimizer
        self.every = max(1, every)
        self.log = log
        self._land = land
        self._before: list[tuple[str, float, list[torch.Tensor], list[torch.Tensor]]] | None = None

    def _stop(self, step: int, error: OSError) -> None:
        """Report ``error`` (raised by a write at ``step``) and write nothing more."""
        writer, self.writer, self._before = self.writer, None, None
        try:
            writer.close()
        except OSError:
            pass  # the same failure again: nothing more reaches the folder
        message = str(error)
        print(
            f"muonscale train: TensorBoard logging to {self.folder} stopped at step {step}: "
            f"{message}; training, checkpoints and the final save go on",
            file=sys.stderr,
            flush=True,
        )
        if self.log is not None:
            self.log.write(event="tensorboard_failed", step=step, message=message)

    def before_step(self, step: int, total: int) -> None:
        """Copy the parameters when the step about to run (``step + 1``) is logged."""
        upcoming = step + 1
        if self.writer is None or (upcoming % self.every and upcoming != total):
            self._before = None
            return
        self._land()  # the previous step's parameters, complete
        self._before = []
        for label, group in labelled_groups(self.optimizer):
            params = [local_tensor(p) for p in group["params"]]
            copies = [p.detach().clone() for p in params]
            self._before.append((label, float(group["lr"]), params, copies))

    def after_step(self, result) -> None:
        """Log the step's loss, lr, optimizer time, skipped steps and update RMS."""
        if self.writer is None:
            return
        try:
            self._log_step(result)
        except OSError as error:
            self._stop(result.step, error)

    @torch.no_grad()
    def _log_step(self, result) -> None:
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
        if self.writer is None:
            return
        try:
            self.writer.add_scalar("val_loss", val_loss, step)
        except OSError as error:
            self._stop(step, error)

    def close(self, step: int) -> None:
        """Flush and close the event file (``step``: the run's last, for a failure's report)."""
        if self.writer is None:
            return
        try:
            self.writer.close()
        except OSError as error:
            self._stop(step, error)
