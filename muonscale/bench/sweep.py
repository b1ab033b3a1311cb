"""``--sweep``: a small learning-rate sweep per contender on a shorter budget.

Each contender tries ``factor x its --lr-*`` for every factor, with the same schedule shape
compressed to ``sweep_fraction x steps`` steps, and keeps the learning rate with the lowest
final validation loss. Timing does not matter here: runs go one at a time, or with
``--workers W > 1`` W at a time in worker processes (one run each). Every contender is swept,
variants and torch-muon included; ``torch-muon-bf16`` takes torch-muon's pick when both run
(it is the same update, only the precision of the iteration differs). Finished sweep runs
are saved in the run store.
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
    workers: int = 1,
) -> dict:
    """Return ``{"steps", "results": {contender: [{lr, final_val_loss}]},
    "best": {contender: lr}}``.

    ``make_run(bench, contender, lr, steps=...)`` builds a run (``runner.make_run``); a diverged
    run (non-finite loss) ranks last. ``workers > 1`` runs that many sweep runs at once in
    spawned processes, each building its run with ``runner.make_run`` (``make_run`` is then
    not used).
    """
    log = log or (lambda text: print(text, file=sys.stderr, flush=True))
    store = store or RunStore(None)
    steps = sweep_steps(bench)
    losses: dict[tuple[str, float], float | None] = {}
    todo: list[tuple[str, float]] = []
    for contender in swept_contenders(bench):
        for factor in bench.sweep_factors:
            lr = bench.lr_for(contender) * factor
            saved = store.load(run_key(bench, contender, lr, kind="sweep", steps=steps))
            if saved is not None:
                losses[contender, lr] = saved["final_val_loss"]
                log(f"sweep {contender} lr={lr:.3g}: saved run, val loss {saved['final_val_loss']}")
            else:
                todo.append((contender, lr))
    for contender, lr, loss, seconds in _sweep_runs(bench, make_run, todo, steps, workers):
        final = loss if math.isfinite(loss) else None
        store.save(
            run_key(bench, contender, lr, kind="sweep", steps=steps), {"final_val_loss": final}
        )
        losses[contender, lr] = final
        log(f"sweep {contender} lr={lr:.3g}: val loss {loss:.4f} ({steps} steps, {seconds:.1f}s)")
    results: dict[str, list[dict]] = {}
    best: dict[str, float] = {}
    for contender in swept_contenders(bench):
        rows = [
            {"lr": lr, "final_val_loss": losses[contender, lr]}
            for lr in (bench.lr_for(contender) * factor for factor in bench.sweep_factors)
        ]
        results[contender] = rows
        best[contender] = min(
            rows, key=lambda r: math.inf if r["final_val_loss"] is None else r["final_val_loss"]
        )["lr"]
    for contender, source in SHARES_LR_WITH.items():
        if contender in bench.contenders and contender not in best:
            best[contender] = best[source]
    return {"steps": steps, "factors": list(bench.sweep_factors), "results": results, "best": best}


def sweep_run(bench: BenchConfig, make_run: Callable, contender: str, lr: float, steps: int):
    """Train one sweep run; ``(contender, lr, final validation loss (NaN if it diverged),
    seconds)``."""
    start = time.perf_counter()
    run = make_run(bench, contender, lr, steps=steps)
    try:
        for _ in range(steps):
            run.step()
        loss = float(run.evaluate())
    except NonFiniteLossError:
        loss = math.nan
    return contender, lr, loss, time.perf_counter() - start


def _sweep_runs(bench, make_run, todo, steps, workers):
    """Yield :func:`sweep_run` results for ``todo``: in this process, or in ``workers``
    spawned processes (as each finishes)."""
    if workers <= 1 or len(todo) <= 1:
        for contender, lr in todo:
            yield sweep_run(bench, make_run, contender, lr, steps)
        return
    import functools
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    job = functools.partial(_sweep_job, bench, steps)
    with context.Pool(
        min(workers, len(todo)), initializer=_set_threads, initargs=(bench.threads,)
    ) as pool:
        yield from pool.imap_unordered(job, todo)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def _sweep_job(bench: BenchConfig, steps: int, job: tuple[str, float]):
    from muonscale.bench.runner import make_run

    return sweep_run(bench, make_run, *job, steps)
