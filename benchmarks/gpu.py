"""GPU benchmark of the Newton–Schulz fast path, the Muon optimizer step and
muonscale under Megatron-Core vs Megatron's Adam.

    PYTHONPATH=. python3 benchmarks/gpu.py                 # one H200, < 6 minutes
    PYTHONPATH=. python3 benchmarks/gpu.py --smoke         # tiny shapes, CPU, < 60 s
    PYTHONPATH=. python3 benchmarks/gpu.py --only ns --only optimizer --out runs/gpu
    PYTHONPATH=. python3 benchmarks/gpu.py --only backward_ns --out $OUT   # ~1 min

On the lent H200 (Python 3.12, CUDA torch, no megatron-core, no network)::

    bash .ci/megatron_site.sh     # here, once: megatron-core wheels unpacked into .megatron-site/
    # then the device tool's run with carry [".megatron-site"] and the command
    PYTHONPATH=. python3 benchmarks/gpu.py --out $OUT
    PYTHONPATH=. python3 benchmarks/gpu.py --only megatron --out $OUT    # that leg alone, ~1.5 min

Writes ``$OUT/gpu_bench.json`` (``--out`` > env ``OUT`` > ``./runs/gpu``; a folder) after every
section, and prints one table per section. Needs only torch, triton, numpy and muonscale;
the ``megatron`` section also needs megatron-core (``.megatron-site/`` or installed).

Sections (code in ``benchmarks/gpu_parts/``, one module each; every one wrapped: a failure
is recorded in the JSON and the rest still runs; a global time guard skips what no longer fits):

* ``matmul``      measured bf16 matmul rate (large square matmul), TFLOP/s.
* ``correctness`` Triton symmetric kernel and fast NS in bf16 on the card vs float64 references.
* ``ns``          NS time per stacked shape: ours (reference, fast plain torch/Triton, Gram,
                  auto) vs ``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` per matrix.
* ``optimizer``   optimizer step on GPT-2 small/medium/XL parameter sets: muonscale.Muon vs
                  torch.optim.Muon (+ fused AdamW for the rest) vs fused AdamW; ratio to the
                  NS FLOP floor = NS FLOPs / measured matmul rate.
* ``e2e``         tokens/s ratio vs AdamW on a GPT-2-medium model: 16K tokens per step (one
                  micro-batch) and 0.5M tokens per step (32 accumulated micro-batches),
                  measured directly and composed from measured fwd/bwd and optimizer parts.
* ``memory``      peak memory and optimizer-state bytes vs AdamW, GPT-2-XL, 8×1024 tokens,
                  bf16 autocast, fp32 params, no activation checkpointing.
* ``graph``       the optimizer step under a CUDA graph (``Muon(capturable=True)``) vs eager,
                  GPT-2 small/medium parameter sets (CPU: eager variants only).
* ``profile``     torch.profiler per step: kernel launches, copy, elementwise and matmul time.
* ``projection``  a MODEL of DistributedMuon vs ZeRO-1 AdamW tokens/s at 8/64/256 ranks
                  (GPT-2-XL, 7B-class; owned matrices timed here, collectives and
                  forward+backward modelled, assumptions printed), beside NVIDIA's 97.9%.
* ``backward_ns`` ``Muon(orthogonalize_in_backward=True)`` vs the default: GPT-2-medium train
                  step at 16K tokens, tokens/s of each (fused AdamW beside), each arm on its
                  own model copy; CUDA only (``--smoke``: tiny, on CPU).
* ``megatron``    ``benchmarks/megatron_gpu.py`` in a subprocess (``python3 -m
                  torch.distributed.run --nproc-per-node 1``, PYTHONPATH=<repo>:<site>, wall
                  limit ``--megatron-timeout-s``, outside the time guard): Megatron's GPTModel
                  (GPT-2-medium shapes, bf16) under Megatron's DDP, tokens/s of muonscale vs
                  ``get_megatron_optimizer`` Adam and Megatron-Core's own Muon. Its JSON is
                  merged into this section (also
                  ``$OUT/megatron_gpu.json``, log ``$OUT/megatron_gpu.log``); ``megatron_leg``
                  says ``"measured"`` or ``"not measured: <reason>"`` (no megatron-core, import
                  failure, time-out). ``--smoke`` runs its CPU smoke when this Python can import
                  megatron-core (>= 3.12), else records it as not measured.

Timing: CUDA events around each call (``perf_counter`` on CPU), warm-up first, variants
interleaved round by round (A B C A B C …), medians reported.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import torch

from benchmarks.gpu_parts.backward_ns import section_backward_ns
from benchmarks.gpu_parts.correctness import section_correctness
from benchmarks.gpu_parts.e2e import section_e2e
from benchmarks.gpu_parts.graph import section_graph
from benchmarks.gpu_parts.matmul import section_matmul
from benchmarks.gpu_parts.megatron_leg import section_megatron
from benchmarks.gpu_parts.memory import section_memory
from benchmarks.gpu_parts.models import GPT2
from benchmarks.gpu_parts.ns import section_ns
from benchmarks.gpu_parts.optimizer import section_optimizer
from benchmarks.gpu_parts.profile import section_profile
from benchmarks.gpu_parts.projection import section_projection
from benchmarks.gpu_parts.timing import Clock
from muonscale.kernels import clear_workspaces, triton_available


class Guard:
    """Global time guard: sections ask how much time is left before starting work."""

    def __init__(self, budget_s: float) -> None:
        self.t_end = time.perf_counter() + budget_s

    def left(self) -> float:
        return self.t_end - time.perf_counter()


class Bench:
    """What the sections share (device, dtype, clock, guard, models, matmul rate, results)
    and the bookkeeping around them: each section runs wrapped, then the JSON is rewritten."""

    def __init__(self, args) -> None:
        self.args = args
        self.smoke = args.smoke
        self.device = torch.device(
            "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        )
        self.clock = Clock(self.device)
        self.guard = Guard(args.budget_s)
        self.out_dir = args.out
        self.results: dict = {
            "meta": {
                "device": torch.cuda.get_device_name() if self.device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "triton_available": triton_available(),
                "smoke": self.smoke,
                "argv": sys.argv[1:],
            },
            "sections": {},
        }
        self.matmul_rate: float | None = None  # FLOP/s
        self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.models = {"gpt2-small-tiny": (1, 32, 2)} if self.smoke else dict(GPT2)

    # -- bookkeeping
    def save(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        with open(os.path.join(self.out_dir, "gpu_bench.json"), "w") as f:
            json.dump(self.results, f, indent=1, default=str)

    def run(
        self, name: str, fn: Callable[[Bench], dict], min_s: float, guarded: bool = True
    ) -> None:
        if self.args.only and name not in self.args.only:
            return
        if guarded and self.guard.left() < min_s:
            self.results["sections"][name] = {
                "status": "skipped",
                "reason": f"time guard ({self.guard.left():.0f}s left)",
            }
            print(f"\n== {name}: skipped by the time guard")
            self.save()
            return
        print(f"\n== {name}", flush=True)
        t0 = time.perf_counter()
        try:
            out = fn(self)
            out = {"status": "ok", **out}
        except Exception as exc:
            traceback.print_exc()
            out = {
                "status": "error",
                "error": repr(exc),
                "traceback": traceback.format_exc()[-4000:],
            }
        out["seconds"] = round(time.perf_counter() - t0, 2)
        self.results["sections"][name] = out
        self.cleanup()
        self.save()

    def cleanup(self) -> None:
        clear_workspaces()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


SECTIONS = (
    "matmul",
    "correctness",
    "ns",
    "optimizer",
    "e2e",
    "memory",
    "graph",
    "profile",
    "projection",
    "backward_ns",
    "megatron",
)
MIN_SECONDS = {
    "matmul": 5,
    "correctness": 20,
    "ns": 40,
    "optimizer": 30,
    "e2e": 40,
    "backward_ns": 30,
    "memory": 30,
    "graph": 25,
    "profile": 15,
    "projection": 30,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, < 60 s")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="run only this section (repeatable)"
    )
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT", os.path.join("runs", "gpu")),
        help="output directory (default: $OUT or ./runs/gpu)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="global time guard in seconds (default 270; none with --smoke)",
    )
    parser.add_argument(
        "--megatron-site",
        default=None,
        help="folder of unpacked megatron-core wheels (default: <repo>/.megatron-site "
        "when it exists; built by .ci/megatron_site.sh)",
    )
    parser.add_argument(
        "--megatron-timeout-s",
        type=float,
        default=None,
        help="wall limit of the megatron section's subprocess (default 150; 300 with --smoke)",
    )
    args = parser.parse_args(argv)
    if args.budget_s is None:  # smoke runs every section whatever the clock says: it tests code
        args.budget_s = 1e6 if args.smoke else 270.0
    bench = Bench(args)
    print(
        f"device: {bench.results['meta']['device']}  dtype: {bench.dtype}  "
        f"triton: {triton_available()}  budget: {args.budget_s:.0f}s"
    )
    bench.run("matmul", section_matmul, MIN_SECONDS["matmul"])
    if triton_available():
        bench.run("correctness", section_correctness, MIN_SECONDS["correctness"])
    else:
        bench.results["sections"]["correctness"] = {
            "status": "skipped",
            "reason": "triton not installed",
        }
    bench.run("ns", section_ns, MIN_SECONDS["ns"])
    bench.run("optimizer", section_optimizer, MIN_SECONDS["optimizer"])
    bench.run("e2e", section_e2e, MIN_SECONDS["e2e"])
    bench.run("memory", section_memory, MIN_SECONDS["memory"])
    for name, section in (
        ("graph", section_graph),
        ("profile", section_profile),
        ("projection", section_projection),
        ("backward_ns", section_backward_ns),
    ):
        bench.run(name, section, MIN_SECONDS[name])
    bench.run("megatron", section_megatron, 0, guarded=False)
    bench.save()
    status = {k: v["status"] for k, v in bench.results["sections"].items()}
    print(f"\nwrote {os.path.join(args.out, 'gpu_bench.json')}  sections: {status}")
    return 0 if all(s != "error" for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
