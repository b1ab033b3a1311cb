"""Learning-rate schedules as multipliers of the peak learning rate.

Applied through ``torch.optim.lr_scheduler.LambdaLR``, which multiplies every param group's
initial ``lr`` by the same factor: Muon groups and AdamW groups (inside one ``muonscale.Muon``
or a :class:`~muonscale.train.trainer.HybridOptimizer`) follow one schedule, each from its own
peak.

With ``w`` warm-up steps, ``S`` total steps and ``r`` = ``min_lr_ratio``, the multiplier of the
update applied at (0-based) step ``t`` is::

    warm-up   t < w:   (t + 1) / w
    cosine:            r + (1 - r) * (1 + cos(pi * p)) / 2,   p = (t - w) / max(1, S - 1 - w)
    wsd:               1 until S - D, then linear to r at t = S - 1,  D = round(decay_fraction * S)
    constant:          1
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCHEDULE_NAMES = ("cosine", "wsd", "constant")


@dataclass(kw_only=True)
class LRSchedule:
    """Callable ``step -> multiplier``; a dataclass so ``LambdaLR.state_dict`` records it."""

    schedule: str = "cosine"
    """cosine, wsd (warm-up, stable, linear decay) or constant."""
    total_steps: int
    """Number of optimizer steps of the run."""
    warmup_steps: int = 0
    """Steps of linear warm-up."""
    min_lr_ratio: float = 0.1
    """Final multiplier of cosine and wsd."""
    decay_fraction: float = 0.2
    """Fraction of total_steps spent in wsd's final linear decay."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"schedule must be one of {SCHEDULE_NAMES}, got {self.schedule!r}")
        if self.total_steps < 1 or self.warmup_steps < 0:
            raise ValueError(
                "need total_steps >= 1 and warmup_steps >= 0, "
                f"got {self.total_steps}, {self.warmup_steps}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 <= self.decay_fraction <= 1.0:
            raise ValueError(f"decay_fraction must be in [0, 1], got {self.decay_fraction}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        last = self.total_steps - 1
        if self.schedule == "constant":
            return 1.0
        if self.schedule == "cosine":
            progress = min(1.0, (step - self.warmup_steps) / max(1, last - self.warmup_steps))
            cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
            return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * cosine
        decay_steps = round(self.decay_fraction * self.total_steps)
        decay_start = max(self.warmup_steps, self.total_steps - decay_steps)
        if step < decay_start or decay_steps == 0:
            return 1.0
        progress = min(1.0, (step - decay_start + 1) / max(1, last - decay_start + 1))
        return 1.0 - (1.0 - self.min_lr_ratio) * progress


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: LRSchedule
) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR scaling every param group of ``optimizer`` by ``schedule(step)``."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)


def schedule_for(config) -> LRSchedule:
    """The schedule of a :class:`~muonscale.train.config.TrainConfig` (its steps, warm-up,
    schedule name, final ratio and decay fraction)."""
    return LRSchedule(
        schedule=config.schedule,
        total_steps=config.steps,
        warmup_steps=config.warmup_steps,
        min_lr_ratio=config.min_lr_ratio,
        decay_fraction=config.decay_fraction,
    )
