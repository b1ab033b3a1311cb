"""``muonscale bench``: AdamW vs Muon (and baselines) side by side, with a report.

Pipeline of :func:`run_bench`::

    [--sweep: short runs per contender and lr]  ->  one training run per contender and seed
    -> steps interleaved A B A B ..., all evaluated at the same steps  (side_by_side.py);
       --workers W: W worker processes, steps in lockstep                 (lockstep.py)
    -> every finished run saved under --out/runs/, reused by the same command  (store.py)
    -> [--seeds N: mean and spread over seeds (seeds.py)]
    -> each contender alone in a child process for peak memory         (memory_probe.py)
    -> report.json / report.md / table (report.py), PNG plots (plots.py)
    -> [--tensorboard DIR: event files (tensorboard_log.py)]
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from muonscale.bench.config import BenchConfig

PLOTS_SKIPPED = (
    "bench: matplotlib is not installed, so the report is written without plots; "
    'pip install "muonscale[bench]" for them (or pass --no-plots to skip them quietly)'
)

__all__ = [
    "BenchConfig",
    "default_out_dir",
    "prepare_out_dir",
    "run_bench",
    "torch_threads",
    "writable_folder",
]


def default_out_dir() -> Path:
    return Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S", time.gmtime())


def prepare_out_dir(path: str | Path | None) -> Path:
    """Create the output folder (``None``: :func:`default_out_dir`) and check that a file can
    be written in it, before any training; raise ``OSError`` naming the folder otherwise."""
    return writable_folder(Path(path) if path else default_out_dir(), "--out")


def writable_folder(folder: Path, flag: str) -> Path:
    """Create ``folder`` and check that a file can be written in it; ``OSError`` naming
    ``flag`` (the option that chose it) and the folder otherwise."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise OSError(
            error.errno, f"{flag} {folder} is not a writable folder: {error.strerror or error}"
        ) from error
    return folder


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
    if config.tensorboard is not None:
        writable_folder(Path(config.tensorboard), "--tensorboard")
    if config.nproc > 1:
        return _run_distributed(config)
    with torch_threads(config.threads):
        return _run_bench(config, make_run, stream or sys.stdout)


def _run_distributed(config: BenchConfig) -> dict:
    """``--nproc N``: the distributed side-by-side bench (wire bytes per step per contender).

    ``--sweep`` picks the learning rates with single-process runs first: a distributed
    contender is the same algorithm on the same global batch as its single-process twin."""
    from muonscale.bench.distributed import run_distributed_bench

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    if config.plots and importlib.util.find_spec("matplotlib") is None:
        log(PLOTS_SKIPPED)
        config = dataclasses.replace(config, plots=False)
    lrs = None
    if config.sweep:
        from muonscale.bench.lockstep import sweep_workers
        from muonscale.bench.runner import make_run
        from muonscale.bench.store import RunStore
        from muonscale.bench.sweep import run_sweep

        single = dataclasses.replace(config, nproc=1, parallel="dp")
        workers = sweep_workers(single, len(single.contenders) * len(single.sweep_factors))
        with torch_threads(config.threads):
            sweep = run_sweep(
                single,
                make_run,
                log=log,
                store=RunStore(Path(config.out) / "runs"),
                workers=workers,
            )
        lrs = dict(sweep["best"])
        log("sweep picked " + ", ".join(f"{n} lr={lr:.3g}" for n, lr in lrs.items()))
    return run_distributed_bench(config, lrs=lrs)


ONCE_ONLY = ("torch-muon-bf16",)
"""Contenders run for the first seed only (torch.optim.Muon's emulated bfloat16 on CPU is slow;
its float32 twin torch-muon carries the comparison across seeds)."""


def _run_bench(config: BenchConfig, make_run: Callable | None, stream: TextIO) -> dict:
    from muonscale.bench.memory_probe import parallel_probes, probe_all
    from muonscale.bench.report import build_report, format_table, write_report
    from muonscale.bench.seeds import seed_summary
    from muonscale.bench.side_by_side import eval_steps_for
    from muonscale.bench.store import RunStore
    from muonscale.bench.sweep import run_sweep

    start = time.perf_counter()
    out_dir = Path(config.out) if config.out else default_out_dir()
    lockstep = make_run is None  # the workers build their runs with runner.make_run
    if make_run is None:
        from muonscale.bench.runner import make_run

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    plots_skipped = config.plots and importlib.util.find_spec("matplotlib") is None
    if plots_skipped:  # said before any training, and again with the report
        log(PLOTS_SKIPPED)
        config = dataclasses.replace(config, plots=False)
    store = RunStore(out_dir / "runs")
    lrs = {name: config.lr_for(name) for name in config.contenders}
    sweep = None
    if config.sweep:
        from muonscale.bench.lockstep import sweep_workers

        workers = sweep_workers(config, len(config.contenders) * len(config.sweep_factors))
        sweep = run_sweep(
            config, make_run, log=log, store=store, workers=workers if lockstep else 1
        )
        lrs = dict(sweep["best"])
        log("sweep picked " + ", ".join(f"{n} lr={lr:.3g}" for n, lr in lrs.items()))

    eval_steps = eval_steps_for(config.steps, config.eval_interval)
    seeds = [config.seed + i for i in range(config.seeds)]
    per_seed = {}
    for index, seed in enumerate(seeds):
        names = [n for n in config.contenders if index == 0 or n not in ONCE_ONLY]
        per_seed[seed] = _side_by_side_resumable(
            dataclasses.replace(config, seed=seed),
            names,
            lrs,
            eval_steps,
            make_run,
            store,
            log,
            lockstep=lockstep,
        )
    records = per_seed[seeds[0]]
    resolved = _resolved_config(config, lrs, eval_steps, records)

    peak_memory = {}
    if config.memory_probe_steps > 0:
        probed = {name: lrs[name] for name in config.contenders}
        at_once = min(len(probed), parallel_probes(config))
        log(
            f"memory probes: {', '.join(probed)}, each alone in a child process for "
            f"{config.memory_probe_steps} steps ({at_once} at a time)"
        )
        peak_memory = probe_all(config, probed, config.memory_probe_steps)

    report = build_report(
        records,
        config,
        peak_memory=peak_memory,
        resolved=resolved,
        sweep=sweep,
        seeds=seed_summary(per_seed) if len(seeds) > 1 else None,
        wall_seconds=time.perf_counter() - start,
    )
    if config.mlp == "moe":
        report["moe"] = _moe_section(config, lrs, per_seed)
    print(format_table(report), file=stream, flush=True)  # before any file can fail
    plot_files = []
    if config.plots:
        from muonscale.bench.plots import plot_max_logits, plot_report

        plot_files = plot_report(report, out_dir) + plot_max_logits(report, out_dir)
    write_report(report, out_dir, plot_files)
    if config.tensorboard is not None:
        from muonscale.bench.tensorboard_log import write_tensorboard_or_say_why

        if write_tensorboard_or_say_why(per_seed, config.tensorboard, log):
            log(f"TensorBoard event files: {config.tensorboard}")
    print(f"\nreport: {out_dir / 'report.md'}  ({report['wall_seconds']:.0f}s)", file=stream)
    if plots_skipped:
        log(PLOTS_SKIPPED)
    return report


def _moe_section(config: BenchConfig, lrs: dict, per_seed: dict) -> dict:
    """report.json's ``moe``: the MoE table over seeds (:mod:`muonscale.bench.moe`), with how
    each contender's optimizer, built as its runs build it, holds the experts, and for a
    ``muonscale.Muon`` contender the routers' measured share of its optimizer time."""
    from muonscale.bench.moe import moe_seed_table, optimizer_facts, router_time_share
    from muonscale.bench.report import json_safe
    from muonscale.bench.runner import make_run, muon_options_for

    facts = {}
    for name in config.contenders:
        run = make_run(config, name, lrs[name])
        facts[name] = optimizer_facts(run.model, run.optimizer)
        options = muon_options_for(config, name, lrs[name], run.model)
        if options is not None:
            facts[name]["router_time_share"] = router_time_share(run.model, options)
        del run
    return json_safe(moe_seed_table(per_seed, config.timing_warmup_steps, facts))


def _side_by_side_resumable(
    config, names, lrs, eval_steps, make_run, store, log, *, lockstep: bool = False
) -> dict:
    """Records of ``names`` for ``config.seed``: saved runs are loaded, the others trained
    side by side (steps interleaved; with ``lockstep`` and more than one worker, in worker
    processes, steps in lockstep) and saved as soon as they finish."""
    from muonscale.bench.lockstep import run_in_lockstep, training_workers
    from muonscale.bench.side_by_side import run_side_by_side
    from muonscale.bench.store import record_from_dict, record_to_dict, run_key
    from muonscale.train.trainer import NonFiniteLossError

    keys = {
        name: run_key(
            config, name, lrs[name], kind="run", steps=config.steps, eval_steps=eval_steps
        )
        for name in names
    }
    records = {}
    for name in names:
        found = store.find(keys[name])
        if found is not None:
            where, saved = found
            records[name] = record_from_dict(saved)
            log(f"seed {config.seed}: {name} lr={lrs[name]:.3g}: saved run {where}")
    todo = [name for name in names if name not in records]
    workers = training_workers(config, len(todo)) if lockstep else 1
    desc = "bench" if config.seeds == 1 else f"bench seed {config.seed}"
    if todo and workers > 1:
        log(
            f"seed {config.seed}: {', '.join(todo)} in {workers} worker processes, "
            "steps in lockstep (same losses; timings taken while the other workers compute)"
        )
        trained = run_in_lockstep(
            config, todo, {name: lrs[name] for name in todo}, eval_steps, workers=workers, desc=desc
        )
        for name, record in trained.items():
            store.save(keys[name], record_to_dict(record))
        records.update(trained)
    elif todo:
        from muonscale.bench.runner import step_metric_readers

        runs = {name: make_run(config, name, lrs[name]) for name in todo}
        trained = run_side_by_side(
            runs,
            {name: lrs[name] for name in todo},
            config.steps,
            eval_steps,
            progress=config.progress,
            desc=desc,
            divergence_errors=(NonFiniteLossError,),
            step_metrics=None if config.tensorboard is None else step_metric_readers(runs),
        )
        del runs  # free the training runs before the next seed or the memory probes
        for name, record in trained.items():
            store.save(keys[name], record_to_dict(record))
        records.update(trained)
    return {name: records[name] for name in names}


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
    from muonscale.bench.lockstep import training_workers
    from muonscale.bench.runner import newton_schulz_precision, train_config_for

    resolved: dict = {"lrs": dict(lrs), "eval_steps": list(eval_steps)}
    # > 1: trained in lockstep worker processes, so the timings were taken under contention
    resolved["training_workers"] = training_workers(config, len(lrs))
    initial = {name: r.val_losses[0] for name, r in records.items() if r.eval_steps[:1] == [0]}
    # Same init and same validation set => bitwise-equal losses before the first step.
    resolved["same_initial_val_loss"] = len(set(initial.values())) <= 1
    train = {name: train_config_for(config, name, lrs[name]) for name in lrs}
    resolved["model"] = dataclasses.asdict(next(iter(train.values())).model_config())
    resolved["train"] = {name: t.to_dict() for name, t in train.items()}
    resolved["variant_options"] = {
        name: config.variant_options(name)
        for name in lrs
        if config.variant_options(name) is not None
    }
    resolved["torch_muon_newton_schulz"] = {
        name: newton_schulz_precision(config, name)
        for name in lrs
        if newton_schulz_precision(config, name) is not None
    }
    return resolved
