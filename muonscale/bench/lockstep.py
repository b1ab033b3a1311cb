"""Contenders trained in worker processes, one per core, steps in lockstep.

With ``--workers W > 1`` (opt-in: see :func:`training_workers` for what it does to timings)
the contenders of one seed are dealt round-robin to W spawned
processes, each running ``--threads`` torch threads. Every process interleaves its own
contenders as :func:`~muonscale.bench.side_by_side.run_side_by_side` does, and all processes
wait for each other after every step (a barrier), so step *i* of every contender runs at the
same time: a slow spell of the machine still hits every contender alike, and the wall time is
that of the slowest process instead of the sum over contenders. Each contender's run is seeded
on its own, so its losses are bitwise those of the one-process bench; only wall time changes.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_module
import threading
import traceback
from collections.abc import Mapping, Sequence

from muonscale.bench.config import BenchConfig
from muonscale.bench.side_by_side import ContenderRecord, progress_bar

BARRIER_TIMEOUT_S = 3600.0
"""Longest wait of a worker for the others at one step (a dead parent must not leave workers
blocked forever)."""


class BenchWorkerError(RuntimeError):
    """A worker process of the lockstep bench failed; the message holds its traceback."""


def deal(names: Sequence[str], workers: int) -> list[list[str]]:
    """Contenders per worker, dealt round-robin (adamw, the cheapest, shares a worker with the
    third contender, not with muon)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    count = min(workers, len(names))
    return [list(names[i::count]) for i in range(count)]


def run_in_lockstep(
    config: BenchConfig,
    names: Sequence[str],
    lrs: Mapping[str, float],
    eval_steps: Sequence[int],
    *,
    workers: int,
    desc: str = "bench",
) -> dict[str, ContenderRecord]:
    """Train ``names`` for ``config.steps`` steps in ``workers`` processes, steps in lockstep.

    Returns the records in the order of ``names``. Raises :class:`BenchWorkerError` with the
    worker's traceback when a worker fails (the other workers are stopped).
    """
    from muonscale.bench.store import record_from_dict

    groups = deal(names, workers)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(len(groups))
    messages = context.Queue()
    processes = [
        context.Process(
            target=_worker,
            args=(
                index,
                config,
                group,
                {name: lrs[name] for name in group},
                list(eval_steps),
                barrier,
                messages,
            ),
            name=f"muonscale-bench-{'+'.join(group)}",
            daemon=True,
        )
        for index, group in enumerate(groups)
    ]
    bar = progress_bar(config.steps * len(names), desc) if config.progress else None
    latest: dict[str, float] = {}
    records: dict[str, ContenderRecord] = {}
    finished: set[int] = set()
    try:
        for process in processes:
            process.start()
        while len(finished) < len(processes):
            try:
                message = messages.get(timeout=1.0)
            except queue_module.Empty:
                _check_alive(processes, groups, finished)
                continue
            kind, index, payload = message
            if kind == "steps" and bar is not None:
                bar.update(payload)
            elif kind == "eval":
                latest.update(payload)
                if bar is not None:
                    bar.set_postfix_str(
                        " ".join(f"{n}={latest[n]:.3f}" for n in names if n in latest),
                        refresh=True,
                    )
            elif kind == "done":
                records.update({name: record_from_dict(d) for name, d in payload.items()})
                finished.add(index)
            elif kind == "error":
                raise BenchWorkerError(
                    f"bench worker {index} ({', '.join(groups[index])}) failed:\n{payload}"
                )
    finally:
        if bar is not None:
            bar.close()
        if len(finished) < len(processes):
            barrier.abort()
        for process in processes:
            process.join(timeout=10.0)
            if process.is_alive():
                process.terminate()
                process.join()
    return {name: records[name] for name in names}


def _check_alive(processes, groups, finished) -> None:
    for index, process in enumerate(processes):
        if index not in finished and process.exitcode not in (None, 0):
            raise BenchWorkerError(
                f"bench worker {index} ({', '.join(groups[index])}) died with exit code "
                f"{process.exitcode} (killed for memory? a negative code is the signal)"
            )


def _worker(index, config, names, lrs, eval_steps, barrier, messages) -> None:
    """One worker: build its contenders' runs, train them interleaved, wait for the other
    workers after every step, send the records."""
    try:
        import torch

        from muonscale.bench.runner import make_run, step_metric_readers
        from muonscale.bench.side_by_side import run_side_by_side
        from muonscale.bench.store import record_to_dict
        from muonscale.train.trainer import NonFiniteLossError

        if config.threads is not None:
            torch.set_num_threads(config.threads)
        runs = {name: make_run(config, name, lrs[name]) for name in names}
        wanted = set(eval_steps)
        barrier.wait(BARRIER_TIMEOUT_S)  # every worker built its runs: start together

        def after_step(step: int, records: Mapping[str, ContenderRecord]) -> None:
            messages.put(("steps", index, len(names)))
            if step in wanted:
                messages.put(("eval", index, {n: r.val_losses[-1] for n, r in records.items()}))
            barrier.wait(BARRIER_TIMEOUT_S)

        records = run_side_by_side(
            runs,
            lrs,
            config.steps,
            eval_steps,
            progress=False,
            divergence_errors=(NonFiniteLossError,),
            after_step=after_step,
            step_metrics=None if config.tensorboard is None else step_metric_readers(runs),
        )
        messages.put(("done", index, {n: record_to_dict(r) for n, r in records.items()}))
    except threading.BrokenBarrierError:
        messages.put(("aborted", index, None))  # another worker failed or the parent stopped
    except BaseException:
        barrier.abort()
        messages.put(("error", index, traceback.format_exc()))


def training_workers(config: BenchConfig, contenders: int) -> int:
    """Processes for the side-by-side training runs: ``--workers`` when given (at most one per
    contender), else 1. Lockstep gives the same losses, but its timings are taken while the
    other workers compute: on the 2-core machine the default bench's throughput ratio read 0.745
    in lockstep against 0.649 interleaved, so the timed default stays in one process."""
    return max(1, min(config.workers or 1, contenders))


def sweep_workers(config: BenchConfig, runs: int) -> int:
    """Processes for the sweep runs (nothing timed): ``--workers`` when given, else on CPU as
    many as the cores hold at ``--threads`` each; on CUDA 1 (one device)."""
    from muonscale.bench.memory_probe import parallel_probes

    wanted = config.workers if config.workers is not None else parallel_probes(config)
    return max(1, min(wanted, runs))


__all__ = ["BenchWorkerError", "deal", "run_in_lockstep", "sweep_workers", "training_workers"]
