"""Peak memory of one contender, measured alone in a child process.

One process's resident set cannot be split between contenders that share it, so the bench
starts ``python -m muonscale.bench.memory_probe`` once per contender: the child builds the
same training run, takes a few steps and exits. Peak memory is

- on CUDA: ``torch.cuda.max_memory_allocated`` in the child;
- on CPU: the child's peak resident set, ``VmHWM`` from ``/proc/self/status`` read by the
  child after its last step. (Not ``ru_maxrss`` of the child as the parent sees it: Linux
  carries the high-water mark of the forked copy of the parent across ``exec``, so a child of
  a big parent reports at least the parent's size.)

The CPU figure includes the Python interpreter and torch's libraries (a few hundred MiB that
every contender pays alike), so differences between contenders are what it shows.

On CPU, :func:`probe_all` runs the children side by side, as many at a time as the CPUs hold
at the bench's thread count (each child's peak is its own, whoever runs beside it); on CUDA,
where they would share the device's memory, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from muonscale.bench.config import BenchConfig

RESULT_PREFIX = "MEMORY_PROBE_RESULT "


def probe(bench: BenchConfig, contender: str, lr: float, steps: int) -> dict:
    """Run the probe in a child process; return ``{peak_memory_bytes, source, ...}``."""
    command = [
        sys.executable,
        "-m",
        "muonscale.bench.memory_probe",
        "--config-json",
        bench.to_json(),
        "--contender",
        contender,
        "--lr",
        repr(lr),
        "--steps",
        str(steps),
    ]
    child = subprocess.run(command, capture_output=True, text=True, env=_child_env())
    if child.returncode != 0:
        raise RuntimeError(
            f"memory probe for {contender} failed (exit {child.returncode}):\n"
            f"{child.stderr[-2000:]}"
        )
    lines = [line for line in child.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if not lines:
        raise RuntimeError(
            f"memory probe for {contender} printed no result:\n{child.stdout[-2000:]}"
        )
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    if result.get("cuda_max_allocated_bytes") is not None:
        result["peak_memory_bytes"] = result["cuda_max_allocated_bytes"]
        result["source"] = "cuda_max_memory_allocated (child process)"
    else:
        result["peak_memory_bytes"] = result["vmhwm_bytes"]
        result["source"] = "peak RSS (VmHWM) of a child process running this contender alone"
    return result


def probe_all(bench: BenchConfig, lrs: dict[str, float], steps: int) -> dict[str, dict]:
    """:func:`probe` for every contender in ``lrs``, at most :func:`parallel_probes` at once."""
    from concurrent.futures import ThreadPoolExecutor

    names = list(lrs)
    workers = min(len(names), parallel_probes(bench))
    if workers <= 1:
        return {name: probe(bench, name, lrs[name], steps) for name in names}
    with ThreadPoolExecutor(max_workers=workers) as pool:  # each thread waits on a child
        futures = {name: pool.submit(probe, bench, name, lrs[name], steps) for name in names}
        return {name: future.result() for name, future in futures.items()}


def parallel_probes(bench: BenchConfig) -> int:
    """Children to run at once: on CPU, CPUs // threads (1 with torch's default threads), and
    no more than the available memory holds at this process's peak each (it held every
    contender, so it bounds one child); on CUDA 1."""
    from muonscale.bench.runner import device_type

    if device_type(bench.device) != "cpu" or bench.threads is None:
        return 1
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus // bench.threads, _memory_slots()))


def _memory_slots() -> int:
    """MemAvailable // this process's peak resident set (a large number when unknown)."""
    peak = _vmhwm_bytes()
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if not peak or available is None:
        return 1 << 30
    return available // peak


def _child_env() -> dict:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _vmhwm_bytes() -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m muonscale.bench.memory_probe",
        description="Run one bench contender alone for a few steps and print its peak memory.",
    )
    parser.add_argument("--config-json", required=True, help="BenchConfig as JSON")
    parser.add_argument("--contender", required=True, help="adamw, muon or torch-muon")
    parser.add_argument("--lr", type=float, required=True, help="learning rate")
    parser.add_argument("--steps", type=int, default=5, help="steps to take (default: 5)")
    args = parser.parse_args(argv)

    import torch

    from muonscale.bench.runner import make_run

    bench = BenchConfig.from_json(args.config_json)
    if bench.threads is not None:
        torch.set_num_threads(bench.threads)
    run = make_run(bench, args.contender, args.lr)
    cuda = run.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.steps):
        run.step()
    result = {
        "contender": args.contender,
        "steps": args.steps,
        "optimizer_state_bytes": int(run.optimizer_state_bytes()),
        "vmhwm_bytes": _vmhwm_bytes(),
        "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
