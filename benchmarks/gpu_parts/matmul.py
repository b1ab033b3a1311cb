"""``matmul``: measured bf16 matmul rate (large square matmul), TFLOP/s; the FLOP/s that the
``ns`` and ``optimizer`` sections divide by."""

from __future__ import annotations

import torch


def section_matmul(bench) -> dict:
    n = 256 if bench.smoke else 8192
    a = torch.randn(n, n, device=bench.device, dtype=bench.dtype)
    b = torch.randn(n, n, device=bench.device, dtype=bench.dtype)
    c = torch.empty(n, n, device=bench.device, dtype=bench.dtype)
    t = bench.clock.interleaved({"mm": lambda: torch.mm(a, b, out=c)}, warmup=3, reps=10)["mm"]
    bench.matmul_rate = 2 * n**3 / t
    print(f"{bench.dtype} matmul {n}^3: {t * 1e3:.3f} ms, {bench.matmul_rate / 1e12:.1f} TFLOP/s")
    return {"n": n, "dtype": str(bench.dtype), "seconds": t, "tflops": bench.matmul_rate / 1e12}


def matmul_rate(bench) -> float:
    """FLOP/s of the matmul section, measured now if it has not run."""
    if bench.matmul_rate is None:
        section_matmul(bench)
    return bench.matmul_rate
