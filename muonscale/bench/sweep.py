"""``--sweep``: a small learning-rate sweep per contender on a shorter budget.

Each contender tries ``factor x its --lr-*`` for every factor, with the same schedule shape
compressed to ``sweep_fraction x steps`` steps, and keeps the learning rate with the lowest
final validation loss. Runs are sequential (timing does not matter here), one at a time so
memory stays that of a single run. Every contender is swept, variants and torch-muon included;
``torch-muon-bf16`` takes torch-muon's pick when both run (it is the same update, only the
precision of the iteration differs). Finished sweep runs are saved in the run store.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from muonscale.bench.config import BenchConfig
from muonscale.bench.store import RunStore, run_key
from muonscale.train.trainer import NonFiniteLossError

SHARES_LR_WITH = {"torch-muon-bf16": "torch-muon"}
"""Contenders that take another contender's swept learning rate when that one runs too."""


def swept_contenders(bench: BenchConfig) -> list[str]:
    names = bench.contenders
    return [n for n in names if SHARES_LR_WITH.get(n) not in names]


def sweep_steps(bench: BenchConfig) -> int:
    return max(1, round(bench.steps * bench.sweep_fraction))


def run_sweep(
    bench: BenchConfig,
    make_run: Callable,
    *,
    log: Callable[[str], None] | None = None,
    store: RunStore | None = None,
) -> dict:
    """Return ``{"steps", "results": {contender: [{lr, final_val_loss}]},
    "best": {contender: lr}}``.

    ``make_run(bench, contender, lr, steps=...)`` builds a run (``runner.make_run``); a diverged
    run (non-finite loss) ranks last.
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    store = store or RunStore(None)
    steps = sweep_steps(bench)
    results: dict[str, list[dict]] = {}
    best: dict[str, float] = {}
    for contender in swept_contenders(bench):
        rows = []
        for factor in bench.sweep_factors:
            lr = bench.lr_for(contender) * factor
            key = run_key(bench, contender, lr, kind="sweep", steps=steps)
            saved = store.load(key)
            if saved is not None:
                rows.append({"lr": lr, "final_val_loss": saved["final_val_loss"]})
                loss = rows[-1]["final_val_loss"]
                log(f"sweep {contender} lr={lr:.3g}: saved run, val loss {loss}")
                continue
            start = time.perf_counter()
            run = make_run(bench, contender, lr, steps=steps)
            try:
                for _ in range(steps):
                    run.step()
                loss = float(run.evaluate())
            except NonFiniteLossError:
                loss = math.nan
            del run
            row = {"lr": lr, "final_val_loss": loss if math.isfinite(loss) else None}
            store.save(key, {"final_val_loss": row["final_val_loss"]})
            rows.append(row)
            log(
                f"sweep {contender} lr={lr:.3g}: val loss {loss:.4f} "
                f"({steps} steps, {time.perf_counter() - start:.1f}s)"
            )
        results[contender] = rows
        best[contender] = min(
            rows, key=lambda r: math.inf if r["final_val_loss"] is None else r["final_val_loss"]
        )["lr"]
    for contender, source in SHARES_LR_WITH.items():
        if contender in bench.contenders and contender not in best:
            best[contender] = best[source]
    return {"steps": steps, "factors": list(bench.sweep_factors), "results": results, "best": best}
