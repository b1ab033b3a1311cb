"""``profile``: torch.profiler summary of the optimizer step (default options, eager, and the
capturable step): kernel launches per step, copy time, elementwise time, matmul time.

Kernel classes are by name (CUDA kernels on the card; on CPU, ``--smoke``, aten operators
stand in for kernels and the figures only test the code): copy = ``copy_``/``Memcpy``/``cat``/
``stack``; elementwise = ``elementwise``/``foreach``/``lerp``/``add``/``mul``/``div``/``sqrt``/
``where``/``fill``/the Triton elementwise kernels; matmul = ``gemm``/``bmm``/``mm``/``matmul``/
``sym``/Triton/cutlass.

Then (CUDA only) the step's two elementwise passes on the GPT-2-medium stacks, foreach vs the
Triton kernels: (a) momentum + Newton–Schulz input, (b) weight decay + update; milliseconds
per step and the ratio foreach ÷ Triton."""

from __future__ import annotations

import re

import torch
from torch.profiler import ProfilerActivity, profile

from muonscale import functional, matrix_step
from muonscale.kernels import triton_available

from .graph import make_muon
from .models import CONTEXT, GPT2, VOCAB, gpt2_shapes, param_set
from .timing import print_table

_CLASSES = {
    "copy": re.compile(r"copy_|memcpy|\bcat\b|stack", re.I),
    "matmul": re.compile(r"gemm|bmm|\bmm\b|matmul|addmm|_sym_|triton|cutlass|sm90", re.I),
    "elementwise": re.compile(
        r"elementwise|foreach|lerp|\badd|\bmul|\bdiv|sqrt|where|fill|"
        r"reduce|norm|momentum_ns_input|apply_update",
        re.I,
    ),
}


def classify(name: str) -> str:
    for label, pattern in _CLASSES.items():
        if pattern.search(name):
            return label
    return "other"


def summarize(prof, steps: int, cuda: bool) -> dict:
    """Per step: launches (device kernels + memcpys on CUDA; top-level-free aten ops on CPU)
    and milliseconds per class (device time on CUDA, self CPU time on CPU)."""
    out = {"launches": 0, "copy_ms": 0.0, "elementwise_ms": 0.0, "matmul_ms": 0.0, "other_ms": 0.0}
    for evt in prof.events():
        if cuda:
            if evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = evt.device_time
        else:
            parent = evt.cpu_parent
            if not evt.name.startswith("aten::") or (parent and parent.name.startswith("aten::")):
                continue  # aten ops called by the optimizer, not from inside other aten ops
            us = evt.self_cpu_time_total
        out["launches"] += 1
        out[f"{classify(evt.name)}_ms"] += us / 1e3
    return {k: v / steps for k, v in out.items()}


def section_profile(bench) -> dict:
    dev, cuda = bench.device, bench.device.type == "cuda"
    models = (
        bench.models if bench.smoke else {k: bench.models[k] for k in ("gpt2-small", "gpt2-medium")}
    )
    steps = 1 if bench.smoke else 3
    rows = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for name, (n_layer, d, _) in models.items():
        if bench.guard.left() < 20 and not bench.smoke:
            rows.append({"model": name, "skipped": "time guard"})
            continue
        vocab, ctx = (256, 32) if bench.smoke else (VOCAB, CONTEXT)
        for label, capturable in (("default", False), ("capturable", True)):
            muon_named, adamw_named = param_set(n_layer, d, dev, vocab, ctx)
            opt = make_muon(muon_named, adamw_named, capturable=capturable)
            for _ in range(2):
                opt.step()  # warm-up: state, workspaces, autotune
            bench.clock.sync()
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    opt.step()
                bench.clock.sync()
            rows.append({"model": name, "step": label, **summarize(prof, steps, cuda)})
            opt = muon_named = adamw_named = prof = None
            bench.cleanup()
    print_table(
        rows, ["model", "step", "launches", "copy_ms", "elementwise_ms", "matmul_ms", "other_ms"]
    )
    unit = "CUDA kernels and memcpys, device ms" if cuda else "aten ops, self CPU ms (smoke)"
    return {
        "rows": rows,
        "per_step": unit,
        "classes": {k: p.pattern for k, p in _CLASSES.items()},
        "elementwise_passes": elementwise_passes(bench),
    }


def elementwise_passes(bench, model: str = "gpt2-medium") -> dict:
    """The two elementwise passes of a Muon step over ``model``'s matrices (fp32 parameters,
    gradients and momentum, bfloat16 Newton–Schulz stacks), foreach vs Triton, interleaved
    medians of a whole step's worth (every stack). CUDA only."""
    dev = bench.device
    if dev.type != "cuda":
        return {"status": "skipped", "reason": "needs CUDA"}
    if not triton_available():
        return {"status": "skipped", "reason": "triton not installed"}
    from muonscale.kernels import triton_elementwise as kernels  # timed whatever the default

    n_layer, d, _ = GPT2[model]
    stacks = []
    for count, rows, cols in gpt2_shapes(n_layer, d):
        momentum = torch.zeros(count, rows, cols, device=dev)
        stacks.append(
            {
                "params": [torch.randn(rows, cols, device=dev) for _ in range(count)],
                "grads": [torch.randn(rows, cols, device=dev) for _ in range(count)],
                "momentum": list(momentum.unbind(0)),
                "x": torch.empty(count, rows, cols, device=dev, dtype=torch.bfloat16),
                "o": torch.randn(count, rows, cols, device=dev).to(torch.bfloat16),
            }
        )
    mu, lr, wd, alpha = 0.95, 0.02, 0.1, -1.0

    def a_foreach():
        for s in stacks:
            functional.update_momentum_(s["grads"], s["momentum"], momentum=mu)
            slots = list(s["x"].unbind(0))
            functional.write_directions_(
                s["grads"], s["momentum"], slots, momentum=mu, nesterov=True
            )

    def a_triton():
        for s in stacks:
            kernels.momentum_and_ns_input_(
                s["grads"], s["momentum"], s["x"], momentum=mu, nesterov=True
            )

    def b_foreach():
        for s in stacks:
            k = len(s["params"])
            matrix_step.apply_updates_(
                s["params"], list(s["o"].unbind(0)), [alpha] * k, lr=lr, weight_decay=wd
            )

    def b_triton():
        for s in stacks:
            kernels.apply_update_(s["params"], s["o"], lr=lr, weight_decay=wd, alpha=alpha)

    fns = {
        "a_foreach": a_foreach,
        "a_triton": a_triton,
        "b_foreach": b_foreach,
        "b_triton": b_triton,
    }
    t = bench.clock.interleaved(fns, warmup=3, reps=20, budget_s=min(10.0, bench.guard.left()))
    rows = [
        {
            "pass": name,
            "foreach_ms": 1e3 * t[f"{key}_foreach"],
            "triton_ms": 1e3 * t[f"{key}_triton"],
            "foreach_over_triton": t[f"{key}_foreach"] / t[f"{key}_triton"],
        }
        for key, name in (("a", "momentum + NS input"), ("b", "decay + update"))
    ]
    print(f"\nelementwise passes, {model} stacks (bf16 NS input/output, fp32 state):")
    print_table(rows, ["pass", "foreach_ms", "triton_ms", "foreach_over_triton"])
    stacks = fns = None
    bench.cleanup()
    return {"status": "ok", "model": model, "rows": rows}
