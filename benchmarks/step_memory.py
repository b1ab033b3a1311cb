"""Peak memory of an optimizer step on GPT-2-small-shaped parameters (CPU, peak RSS): AdamW vs
muonscale Muon, with and without chunked updates (``MUONSCALE_UPDATE_CHUNK_MB``).

Each contender runs alone in a fresh child process (peak RSS is a per-process high-water
mark): build the parameters, give them gradients (what a training step holds before
``optimizer.step()``), run ``--steps`` steps, and report

* ``peak``: the process's peak RSS (parameters + gradients + optimizer state + the step's
  transient buffers + the Python/torch runtime);
* ``optimizer``: peak minus the RSS just before the first step (state + transients);
* ``state``: the optimizer-state bytes counted from its tensors.

No activations are involved: this isolates what the optimizer adds. The end-to-end
memory is measured on GPU (benchmarks/gpu.py); ``muonscale bench`` reports the CPU
end-to-end peak for the tiny model.

    # 12 layers (GPT-2 small), ~2 min
    PYTHONPATH=. python3 benchmarks/step_memory.py
    PYTHONPATH=. python3 benchmarks/step_memory.py --layers 4 --json out.json
    # the low-bit state against fused AdamW, medians of 3 fresh processes each
    PYTHONPATH=. python3 benchmarks/step_memory.py --repeats 3 \\
        --contenders 'adamw[fused],muonscale[default=128MiB],muonscale[int8]'
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

CONTENDERS = {
    "adamw[foreach]": {},
    "adamw[fused]": {},
    "muonscale[chunk=256MiB]": {"MUONSCALE_UPDATE_CHUNK_MB": "256"},
    "muonscale[default=128MiB]": {"MUONSCALE_UPDATE_CHUNK_MB": "128"},
    "muonscale[chunk=64MiB]": {"MUONSCALE_UPDATE_CHUNK_MB": "64"},
    "muonscale[unchunked]": {"MUONSCALE_UPDATE_CHUNK_MB": "1e9"},
    "muonscale[bf16-momentum]": {},
    "muonscale[int8]": {},
    "muonscale[int8+chunk=32MiB]": {
        "MUONSCALE_UPDATE_CHUNK_MB": "32",
        "MUONSCALE_NS_WORKSPACE_MB": "32",
    },
}
"""Name → environment of its child process."""

MUON_OPTIONS = {
    "muonscale[bf16-momentum]": {"momentum_dtype": "bfloat16"},
    "muonscale[int8]": {"state_precision": "int8"},
    "muonscale[int8+chunk=32MiB]": {"state_precision": "int8"},
}
"""Name → the ``muonscale.Muon`` options of a contender that are not the defaults (dtypes by
name)."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def child(name: str, layers: int, steps: int) -> dict:
    import torch

    import muonscale
    from benchmarks.optimizer_step import gpt2_small_parameters

    torch.set_num_threads(1)
    named = gpt2_small_parameters(layers)
    g = torch.Generator().manual_seed(1)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    if name.startswith("adamw"):
        opt = torch.optim.AdamW(
            [p for _, p in named], lr=1e-3, betas=(0.9, 0.95), fused=name == "adamw[fused]"
        )
    else:
        options = {
            k: getattr(torch, v) if k.endswith("dtype") else v
            for k, v in MUON_OPTIONS.get(name, {}).items()
        }
        opt = muonscale.Muon(named, lr=1e-3, ns_dtype=torch.float32, **options)
    before = _rss_bytes()
    for _ in range(steps):
        opt.step()
    peak = _peak_rss_bytes()
    state = sum(
        t.numel() * t.element_size()
        for s in opt.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    params = sum(p.numel() * p.element_size() for _, p in named)
    return dict(peak=peak, optimizer=peak - before, state=state, params=params)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12, help="GPT-2-small transformer layers")
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per contender")
    parser.add_argument(
        "--contenders", default=",".join(CONTENDERS), help=f"comma-separated, of {list(CONTENDERS)}"
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="fresh processes per contender (medians reported)"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.layers < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--layers, --steps and --repeats must be >= 1")
    if args.child is not None:
        print(json.dumps(child(args.child, args.layers, args.steps)))
        return {}

    names = args.contenders.split(",")
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    results = {}
    for _ in range(args.repeats):
        for name in names:  # interleaved: each repeat runs every contender once
            env = dict(os.environ, **CONTENDERS[name])
            start = time.perf_counter()
            out = subprocess.run(
                [
                    sys.executable,
                    os.path.abspath(__file__),
                    "--child",
                    name,
                    "--layers",
                    str(args.layers),
                    "--steps",
                    str(args.steps),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            results.setdefault(name, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{name:<26} done in {time.perf_counter() - start:.0f} s", flush=True)
    runs = results
    results = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }

    mib = 2**20
    params = next(iter(results.values()))["params"]
    print(
        f"\nGPT-2-small shapes, {args.layers} layers: "
        f"parameters {params / mib:.0f} MiB (+ as much in gradients)"
    )
    print(
        f"{'contender':<26}{'peak MiB':>10}{'optimizer MiB':>15}{'state MiB':>11}"
        f"{'peak vs adamw[foreach]':>24}{'optimizer vs adamw[fused]':>27}"
    )
    base = results.get("adamw[foreach]", next(iter(results.values())))["peak"]
    fused = results.get("adamw[fused]", next(iter(results.values())))["optimizer"]
    for name, r in results.items():
        print(
            f"{name:<26}{r['peak'] / mib:>10.0f}{r['optimizer'] / mib:>15.0f}"
            f"{r['state'] / mib:>11.0f}"
            f"{r['peak'] / base:>24.3f}{r['optimizer'] / fused:>27.3f}"
        )
    summary = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.processor() or platform.machine(),
        "layers": args.layers,
        "steps": args.steps,
        "repeats": args.repeats,
        "results": results,
        "runs": runs,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return summary


if __name__ == "__main__":
    main()
