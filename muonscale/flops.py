"""FLOP counts of the Newton–Schulz iterations, the one place they are written down.

The ownership planner balances ranks by :func:`newton_schulz_flops`; the benchmarks turn
measured times into throughput with these; ``method="auto"`` in
:mod:`muonscale.kernels.newton_schulz_fast` picks the Gram form where :func:`gram_flops` is
lower. The counts and the measurements behind them are in *Newton–Schulz* in the docs.
"""

from __future__ import annotations

__all__ = ["gram_flops", "gram_plan", "newton_schulz_flops"]


def newton_schulz_flops(m: int, n: int, steps: int, *, symmetric: bool = False) -> int:
    """FLOPs of ``steps`` quintic steps of the plain iteration on an m×n matrix, counted on the
    short side: ``steps · (4m²n + 2m³)``. ``symmetric``: the two products with a symmetric
    result computed one triangle only (idealized: diagonal tiles not counted twice),
    ``steps · (3m²n + m³)``."""
    m, n = min(m, n), max(m, n)
    if symmetric:
        return steps * (3 * m * m * n + m**3)
    return steps * (4 * m * m * n + 2 * m**3)


def gram_plan(steps: int, restart_every: int | None) -> list[tuple[bool, bool]]:
    """Per step of the Gram iteration: (restart before this step, R must be updated after
    this step). Restarts come before steps r, 2r, … for ``restart_every=r``; None: never."""
    restarts = [bool(restart_every) and t > 0 and t % restart_every == 0 for t in range(steps)]
    plan = []
    for t in range(steps):
        last = t == steps - 1
        next_restarts = not last and restarts[t + 1]
        plan.append((restarts[t], not last and not next_restarts))
    return plan


def gram_flops(
    m: int, n: int, steps: int, *, restart_every: int | None = None, symmetric: bool = False
) -> int:
    """FLOPs of the Gram iteration as implemented (the plan of :func:`gram_plan`); without
    restarts ``4m²n + (8·steps − 6)m³``, or ``3m²n + (4·steps − 3)m³`` with ``symmetric``."""
    m, n = min(m, n), max(m, n)
    gram = (1 if symmetric else 2) * m * m * n  # R = X Xᵀ
    apply = 2 * m * m * n  # X = Q X₀ (a general product)
    sq = (1 if symmetric else 2) * m**3  # one m×m product with a symmetric result
    total = gram
    first = True  # Q = P is free right after the start or a restart
    for restart, update_r in gram_plan(steps, restart_every):
        if restart:
            total += apply + gram
            first = True
        total += sq  # P = a I + b R + c R²
        if not first:
            total += sq  # Q ← Q P
        first = False
        if update_r:
            total += 2 * sq  # P², R ← R P²
    return total + apply
