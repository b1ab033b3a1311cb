"""``--sweep``: a small learning-rate sweep per contender on a shorter budget.

Each contender tries ``factor x its --lr-*`` for every factor, with the same schedule shape
compressed to ``sweep_fraction x steps`` steps, and keeps the learning rate with the lowest
final validation loss. Runs are sequential (timing does not matter here), one at a time so
memory stays that of a single run.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from muonscale.bench.config import BenchConfig
from muonscale.train.trainer import NonFiniteLossError


def sweep_steps(bench: BenchConfig) -> int:
    return max(1, round(bench.steps * bench.sweep_fraction))


def run_sweep(
    bench: BenchConfig,
    make_run: Callable,
    *,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Return ``{"steps", "results": {contender: [{lr, final_val_loss}]}, "best": {contender: lr}}``.

    ``make_run(bench, contender, lr, steps=...)`` builds a run (``runner.make_run``); a diverged
    run (non-finite loss) ranks last.
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    steps = sweep_steps(bench)
    results: dict[str, list[dict]] = {}
    best: dict[str, float] = {}
    for contender in bench.contenders:
        rows = []
        for factor in bench.sweep_factors:
            lr = bench.lr_for(contender) * factor
            start = time.perf_counter()
            run = make_run(bench, contender, lr, steps=steps)
            try:
                for _ in range(steps):
                    run.step()
                loss = float(run.evaluate())
            except NonFiniteLossError:
                loss = math.nan
            del run
            rows.append({"lr": lr, "final_val_loss": loss if math.isfinite(loss) else None})
            log(
                f"sweep {contender} lr={lr:.3g}: val loss {loss:.4f} "
                f"({steps} steps, {time.perf_counter() - start:.1f}s)"
            )
        results[contender] = rows
        best[contender] = min(
            rows, key=lambda r: math.inf if r["final_val_loss"] is None else r["final_val_loss"]
        )["lr"]
    return {"steps": steps, "factors": list(bench.sweep_factors), "results": results, "best": best}
