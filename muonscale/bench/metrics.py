"""Figures computed from recorded curves and timings (pure Python, no torch).

Definitions follow /docs "Metrics": ratios are Muon ÷ AdamW, timings are medians after warm-up.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def steps_to_reach(steps: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """First step at which a validation-loss curve reaches ``target``, interpolated linearly.

    ``steps`` are the evaluation steps (increasing), ``losses`` the validation losses there.
    If the first evaluation at or below ``target`` is ``i > 0``, the crossing lies on the
    segment from ``(steps[i-1], losses[i-1])`` to ``(steps[i], losses[i])``::

        s* = s[i-1] + (l[i-1] - target) / (l[i-1] - l[i]) * (s[i] - s[i-1])

    Returns ``None`` when the curve never reaches ``target``.
    """
    if len(steps) != len(losses):
        raise ValueError(f"steps and losses differ in length: {len(steps)} != {len(losses)}")
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return float(steps[0])
            s0, s1 = float(steps[i - 1]), float(steps[i])
            l0, l1 = float(losses[i - 1]), float(loss)
            return s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return None


def steps_to_final_loss_ratio(
    reference_steps: Sequence[float],
    reference_losses: Sequence[float],
    steps: Sequence[float],
    losses: Sequence[float],
) -> float | None:
    """Steps a curve needs to reach the reference's final loss ÷ the reference's steps.

    The reference (AdamW) "needs" its whole run, i.e. its last evaluation step, to reach its
    final loss. ``None`` when the other curve never reaches that loss.
    """
    if not reference_steps or not steps:
        return None
    reached = steps_to_reach(steps, losses, float(reference_losses[-1]))
    if reached is None:
        return None
    return reached / float(reference_steps[-1])


def median_after_warmup(values: Sequence[float], warmup: int) -> float:
    """Median of ``values[warmup:]`` (of all values when fewer than ``warmup + 1`` exist)."""
    if not values:
        raise ValueError("no values to take the median of")
    tail = values[warmup:] if len(values) > warmup else values
    return float(statistics.median(tail))


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the denominator is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator
