"""``ns``: NS time per stacked shape: ours (reference, fast plain torch/Triton, Gram, auto) vs
``torch.optim.Muon``'s ``_zeropower_via_newtonschulz`` per matrix."""

from __future__ import annotations

import torch

from muonscale.flops import gram_flops, newton_schulz_flops
from muonscale.kernels import (
    choose_method,
    clear_workspaces,
    newton_schulz_fast,
    triton_available,
)
from muonscale.newton_schulz import newton_schulz, resolve_coefficients

from .matmul import matmul_rate
from .models import gpt2_shapes
from .timing import print_table

KELLER = resolve_coefficients("keller", 1)[0]


def section_ns(bench) -> dict:
    dev, dt, rate = bench.device, bench.dtype, matmul_rate(bench)
    from torch.optim._muon import _zeropower_via_newtonschulz

    shapes = []
    for n_layer, d, _ in bench.models.values():
        shapes += gpt2_shapes(n_layer, d)
    shapes = list(dict.fromkeys(shapes))
    rows = []
    per_shape_budget = max(2.0, (bench.guard.left() - 150) / max(len(shapes), 1))
    for k, r, c in shapes:
        if bench.guard.left() < 60 and not bench.smoke:
            rows.append({"shape": (k, r, c), "skipped": "time guard"})
            continue
        G = torch.randn(k, r, c, device=dev)
        out = torch.empty_like(G)
        fns = {
            "torch_muon_loop": lambda G=G: [
                _zeropower_via_newtonschulz(G[i], KELLER, 5, 1e-7) for i in range(G.shape[0])
            ],
            "reference_batched": lambda G=G: newton_schulz(G, ns_dtype=dt),
            "fast_plain_torch": lambda G=G, o=out: newton_schulz_fast(
                G, ns_dtype=dt, out=o, backend="torch"
            ),
            "fast_gram_torch": lambda G=G, o=out: newton_schulz_fast(
                G, ns_dtype=dt, out=o, method="gram", backend="torch", restart_every=2
            ),
        }
        if triton_available() and dev.type == "cuda":
            fns["fast_plain_triton"] = lambda G=G, o=out: newton_schulz_fast(
                G, ns_dtype=dt, out=o, backend="triton"
            )
            fns["fast_gram_triton"] = lambda G=G, o=out: newton_schulz_fast(
                G, ns_dtype=dt, out=o, method="gram", backend="triton", restart_every=2
            )
        fns["fast_auto"] = lambda G=G, o=out: newton_schulz_fast(
            G, ns_dtype=dt, out=o, method="auto"
        )
        times = bench.clock.interleaved(
            fns,
            warmup=1 if bench.smoke else 2,
            reps=2 if bench.smoke else 10,
            budget_s=per_shape_budget,
        )
        flops = k * newton_schulz_flops(r, c, 5)
        m, n = min(r, c), max(r, c)
        row = {
            "shape": (k, r, c),
            "ns_flops": flops,
            "floor_s": flops / rate,
            "auto_method": choose_method(m, n, dt),
            "gram_r2_flops": k * gram_flops(m, n, 5, restart_every=2),
            "plain_sym_flops": k * newton_schulz_flops(m, n, 5, symmetric=True),
        }
        for name, t in times.items():
            row[f"{name}_ms"] = t * 1e3
            row[f"{name}_tflops"] = flops / t / 1e12  # nominal (plain) FLOPs / time
        rows.append(row)
        del G, out
        clear_workspaces()
    print_table(rows, ["shape"] + [f"{k}_ms" for k in fns] + ["floor_s"])
    return {"rows": rows, "matmul_tflops": rate / 1e12}
