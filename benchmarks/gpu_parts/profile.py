"""``profile``: torch.profiler summary of the optimizer step (default options, eager, and the
capturable step): kernel launches per step, copy time, elementwise time, matmul time.

Kernel classes are by name (CUDA kernels on the card; on CPU, ``--smoke``, aten operators
stand in for kernels and the figures only test the code): copy = ``copy_``/``Memcpy``/``cat``/
``stack``; elementwise = ``elementwise``/``foreach``/``lerp``/``add``/``mul``/``div``/``sqrt``/
``where``/``fill``; matmul = ``gemm``/``bmm``/``mm``/``matmul``/``sym``/Triton/cutlass."""

from __future__ import annotations

import re

import torch
from torch.profiler import ProfilerActivity, profile

from .graph import make_muon
from .models import CONTEXT, VOCAB, param_set
from .timing import print_table

_CLASSES = {
    "copy": re.compile(r"copy_|memcpy|\bcat\b|stack", re.I),
    "matmul": re.compile(r"gemm|bmm|\bmm\b|matmul|addmm|_sym_|triton|cutlass|sm90", re.I),
    "elementwise": re.compile(
        r"elementwise|foreach|lerp|\badd|\bmul|\bdiv|sqrt|where|fill|"
        r"reduce|norm",
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
    return {"rows": rows, "per_step": unit, "classes": {k: p.pattern for k, p in _CLASSES.items()}}
