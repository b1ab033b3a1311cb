"""``muonscale bench``: AdamW vs Muon (and baselines) side by side, with a report.

Pipeline of :func:`run_bench`::

    [--sweep: short runs per contender and lr]  ->  one training run per contender
    -> steps interleaved A B A B ..., all evaluated at the same steps  (side_by_side.py)
    -> each contender alone in a child process for peak memory         (memory_probe.py)
    -> report.json / report.md / table (report.py), PNG plots (plots.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from muonscale.bench.config import BenchConfig

__all__ = ["BenchConfig", "default_out_dir", "prepare_out_dir", "run_bench", "torch_threads"]


def default_out_dir() -> Path:
    return Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())


def prepare_out_dir(path: str | Path | None) -> Path:
    """Create the output folder (``None``: :func:`default_out_dir`) and check that a file can
    be written in it, before any training; raise ``OSError`` naming the folder otherwise."""
    out_dir = Path(path) if path else default_out_dir()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        raise OSError(
            error.errno, f"--out {out_dir} is not a writable folder: {error.strerror or error}"
        ) from error
    return out_dir


def run_bench(
    config: BenchConfig,
    *,
    make_run: Callable | None = None,
    stream: TextIO | None = None,
) -> dict:
    """Run the benchmark described by ``config``; write the report files; return report.json.

    ``make_run(config, contender, lr, steps=None)`` builds one training run (default:
    :func:`muonscale.bench.runner.make_run`); tests pass a fake.
    """
    out_dir = prepare_out_dir(config.out)
    config = dataclasses.replace(config, out=str(out_dir))
    if config.nproc > 1:
        return _run_distributed(config)
    with torch_threads(config.threads):
        return _run_bench(config, make_run, stream or sys.stdout)


def _run_distributed(config: BenchConfig) -> dict:
    """``--nproc N``: the distributed side-by-side bench (wire bytes per step per contender)."""
    from muonscale.bench.distributed import run_distributed_bench

    overrides = {
        key: value
        for key, value in (("n_layer", config.n_layer), ("d_model", config.d_model), ("n_head", config.n_head))
        if value is not None
    }
    return run_distributed_bench(
        nproc=config.nproc,
        parallel=config.parallel,
        steps=config.steps,
        model_overrides=overrides,
        lrs={"muon": config.lr_muon, "adamw": config.lr_adamw},
        seed=config.seed,
        out_dir=config.out or default_out_dir(),
    )


def _run_bench(config: BenchConfig, make_run: Callable | None, stream: TextIO) -> dict:
    from muonscale.bench.memory_probe import probe
    from muonscale.bench.report import build_report, format_table, write_report
    from muonscale.bench.side_by_side import eval_steps_for, run_side_by_side
    from muonscale.bench.sweep import run_sweep
    from muonscale.train.trainer import NonFiniteLossError

    start = time.perf_counter()
    out_dir = Path(config.out) if config.out else default_out_dir()
    if make_run is None:
        from muonscale.bench.runner import make_run

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    lrs = {name: config.lr_for(name) for name in config.contenders}
    sweep = None
    if config.sweep:
        sweep = run_sweep(config, make_run, log=log)
        lrs = dict(sweep["best"])
        log("sweep picked " + ", ".join(f"{n} lr={lr:.3g}" for n, lr in lrs.items()))

    runs = {name: make_run(config, name, lrs[name]) for name in config.contenders}
    eval_steps = eval_steps_for(config.steps, config.eval_interval)
    records = run_side_by_side(
        runs,
        lrs,
        config.steps,
        eval_steps,
        progress=config.progress,
        desc="bench",
        divergence_errors=(NonFiniteLossError,),
    )
    resolved = _resolved_config(config, lrs, eval_steps, records)
    del runs  # free the training runs before the memory probes start

    peak_memory = {}
    if config.memory_probe_steps > 0:
        for name in config.contenders:
            log(f"memory probe: {name} alone for {config.memory_probe_steps} steps")
            peak_memory[name] = probe(config, name, lrs[name], config.memory_probe_steps)

    report = build_report(
        records,
        config,
        peak_memory=peak_memory,
        resolved=resolved,
        sweep=sweep,
        wall_seconds=time.perf_counter() - start,
    )
    print(format_table(report), file=stream, flush=True)  # before any file can fail
    plot_files = []
    if config.plots:
        from muonscale.bench.plots import plot_report

        plot_files = plot_report(report, out_dir)
    write_report(report, out_dir, plot_files)
    print(f"\nreport: {out_dir / 'report.md'}  ({report['wall_seconds']:.0f}s)", file=stream)
    return report


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """``torch.set_num_threads(threads)`` inside the block (None: leave as is)."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _resolved_config(config, lrs, eval_steps, records) -> dict:
    """What the run actually used, beyond the BenchConfig flags."""
    from muonscale.bench.runner import train_config_for

    resolved: dict = {"lrs": dict(lrs), "eval_steps": list(eval_steps)}
    initial = {name: r.val_losses[0] for name, r in records.items() if r.eval_steps[:1] == [0]}
    # Same init and same validation set => bitwise-equal losses before the first step.
    resolved["same_initial_val_loss"] = len(set(initial.values())) <= 1
    train = {name: train_config_for(config, name, lrs[name]) for name in lrs}
    resolved["model"] = dataclasses.asdict(next(iter(train.values())).model_config())
    resolved["train"] = {name: t.to_dict() for name, t in train.items()}
    return resolved
