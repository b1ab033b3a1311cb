"""``optimizer``: optimizer step on GPT-2 parameter sets: muonscale.Muon vs torch.optim.Muon
(+ fused AdamW for the rest) vs fused AdamW; ratio to the NS FLOP floor = NS FLOPs / measured
matmul rate."""

from __future__ import annotations

import torch

from muonscale.flops import newton_schulz_flops
from muonscale.kernels import newton_schulz_fast

from .matmul import matmul_rate
from .models import CONTEXT, VOCAB, make_optimizer, param_set, state_bytes
from .timing import print_table


def section_optimizer(bench) -> dict:
    dev, dt, rate = bench.device, bench.dtype, matmul_rate(bench)
    rows = []
    for name, (n_layer, d, _) in bench.models.items():
        if bench.guard.left() < 40 and not bench.smoke:
            rows.append({"model": name, "skipped": "time guard"})
            continue
        vocab, ctx = (256, 32) if bench.smoke else (VOCAB, CONTEXT)
        muon_named, adamw_named = param_set(n_layer, d, dev, vocab, ctx)
        floor_flops = sum(newton_schulz_flops(*p.shape, 5) for _, p in muon_named)
        opts = {
            k: make_optimizer(k, muon_named, adamw_named)
            for k in ("adamw", "torch_muon", "muonscale")
        }
        fns = {k: o.step for k, o in opts.items()}
        # NS alone through the fast path, grouped by shape as the optimizer batches them
        groups: dict[tuple, list] = {}
        for _, p in muon_named:
            groups.setdefault(tuple(p.shape), []).append(p.grad)
        stacks = {s: torch.stack(gs) for s, gs in groups.items()}
        fns["ns_fast_auto_only"] = lambda st=stacks: [
            newton_schulz_fast(g, ns_dtype=dt, method="auto") for g in st.values()
        ]
        fns["ns_fast_plain_only"] = lambda st=stacks: [
            newton_schulz_fast(g, ns_dtype=dt) for g in st.values()
        ]
        times = bench.clock.interleaved(
            fns, warmup=1 if bench.smoke else 2, reps=2 if bench.smoke else 8, budget_s=30
        )
        floor = floor_flops / rate
        row = {
            "model": name,
            "muon_matrices": len(muon_named),
            "ns_flops": floor_flops,
            "floor_ms": floor * 1e3,
        }
        for k, t in times.items():
            row[f"{k}_ms"] = t * 1e3
            row[f"{k}_vs_floor"] = t / floor
        for k, o in opts.items():
            row[f"{k}_state_bytes"] = state_bytes(o)
        rows.append(row)
        opts = fns = stacks = muon_named = adamw_named = None
        bench.cleanup()
    print_table(
        rows,
        [
            "model",
            "floor_ms",
            "adamw_ms",
            "torch_muon_ms",
            "muonscale_ms",
            "ns_fast_auto_only_ms",
            "torch_muon_vs_floor",
            "muonscale_vs_floor",
        ],
    )
    return {"rows": rows, "matmul_tflops": rate / 1e12}
