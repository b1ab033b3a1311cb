"""``muonscale train --tensorboard DIR``: the run's curves as TensorBoard event files.

Scalars (x: optimizer step): ``train_loss``, ``val_loss``, ``lr``, ``optimizer_ms`` (wall time
of ``optimizer.step()``) and, for a muonscale optimizer, its step metrics
(:mod:`muonscale.step_metrics`: ``muon/ns_elements``, ``muon/update_rms/<group>``,
``muon/skipped_steps``, ...), read at the logged steps; under ``--parallel`` they are rank 0's
(the writer's). For the other contenders, the update RMS of their AdamW groups
(``adamw/update_rms/<group>``), computed from their moments by the same formula.

A write that fails with ``OSError`` (a full disk, the folder taken away) stops the logging, not
the run: it is reported once, on stderr and in the run's metrics (event
``tensorboard_failed``), and training, checkpoints and the final save go on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from muonscale.step_metrics import StepMetrics, find_step_metrics_optimizer
from muonscale.train.run_log import MetricsLog


def labelled_groups(optimizer: torch.optim.Optimizer) -> list[tuple[str, dict]]:
    """``(algorithm, param_group)`` pairs: a muonscale group's ``algorithm``, the inner
    optimizer's name in a ``HybridOptimizer``, else the optimizer's class name."""
    inner = getattr(optimizer, "optimizers", None)
    if isinstance(inner, dict):
        return [(name, g) for name, opt in inner.items() for g in opt.param_groups]
    default = type(optimizer).__name__.lower()
    return [(g.get("algorithm", default), g) for g in optimizer.param_groups]


def adamw_update_rms(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """``adamw/update_rms/group<i>_<algorithm>`` of every group whose parameters hold AdamW's
    moments (``exp_avg``, ``exp_avg_sq``, ``step``), by :meth:`StepMetrics.record_adamw`."""
    inner = getattr(optimizer, "optimizers", None)
    optimizers = list(inner.values()) if isinstance(inner, dict) else [optimizer]
    state = {p: s for opt in optimizers for p, s in opt.state.items()}
    labelled = labelled_groups(optimizer)
    metrics = StepMetrics(orthogonality=False, prefix="adamw/")
    metrics.begin([{**g, "algorithm": algorithm} for algorithm, g in labelled])
    for label, (_, group) in zip(metrics.labels, labelled):
        states = [state[p] for p in group["params"] if "exp_avg" in state.get(p, {})]
        if states and "betas" in group:
            metrics.record_adamw(label, group, states)
    return {k: v for k, v in metrics.read().items() if "/update_rms/" in k}


def optimizer_figures(optimizer: torch.optim.Optimizer) -> Callable[[], dict[str, float]]:
    """The reader of an optimizer's figures after each step: a muonscale optimizer's step
    metrics (turned on here), else the AdamW update RMS of its groups."""
    muonscale = find_step_metrics_optimizer(optimizer)
    if muonscale is None:
        return lambda: adamw_update_rms(optimizer)
    muonscale.enable_step_metrics()
    return muonscale.read_step_metrics  # one process writes: no collective


class TrainTensorBoard:
    """Writes the scalars of one training run into ``folder`` (needs tensorboard). Stops
    writing at the first ``OSError`` (see the module docstring), which it reports on stderr
    and in ``log``, the run's metrics."""

    def __init__(
        self,
        folder: str | Path,
        optimizer: torch.optim.Optimizer,
        *,
        every: int = 1,
        log: MetricsLog | None = None,
    ):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder)
        self.writer = SummaryWriter(log_dir=str(self.folder))
        """None once a write failed."""
        self.optimizer = optimizer
        self._figures = optimizer_figures(optimizer)
        self.every = max(1, every)
        self.log = log
        self._logged = False

    def _stop(self, step: int, error: OSError) -> None:
        """Report ``error`` (raised by a write at ``step``) and write nothing more."""
        writer, self.writer = self.writer, None
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
        """Note whether the step about to run (``step + 1``) is logged."""
        upcoming = step + 1
        self._logged = not (upcoming % self.every) or upcoming == total

    def after_step(self, result) -> None:
        """Log the step's loss, lr, optimizer time and the optimizer's figures."""
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
        if not self._logged:
            return
        for name, value in self._figures().items():
            self.writer.add_scalar(name, value, step)
        self._logged = False

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
