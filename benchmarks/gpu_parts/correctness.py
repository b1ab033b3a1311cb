"""``correctness``: the Triton symmetric kernel and fast NS in bf16 on the card vs float64
references (float64 NS and the polar factor from an eigendecomposition)."""

from __future__ import annotations

import torch

from muonscale.kernels import newton_schulz_fast
from muonscale.newton_schulz import newton_schulz


def section_correctness(bench) -> dict:
    from muonscale.kernels import triton_symmetric as ts  # needs triton

    dev, dt = bench.device, bench.dtype
    rows = []
    kshapes = [(2, 32, 48)] if bench.smoke else [(4, 256, 1024), (2, 768, 3072), (3, 200, 520)]
    for shape in kshapes:
        X = torch.randn(shape, device=dev).to(dt)
        C = ts.sym_matmul(X)
        ref = X.double() @ X.double().mT
        A = (C / C.norm(dim=(-2, -1), keepdim=True)).to(dt)
        B = ts.sym_matmul(A, alpha=2.0315, Z=A, beta=-4.775)
        refB = -4.775 * A.double() + 2.0315 * A.double() @ A.double()
        rows.append(
            {
                "kernel": "sym_matmul",
                "shape": shape,
                "dtype": str(dt),
                "xxt_max_rel": ((C.double() - ref).abs().max() / ref.abs().max()).item(),
                "poly_max_rel": ((B.double() - refB).abs().max() / refB.abs().max()).item(),
                "symmetric": bool(torch.equal(C, C.mT)),
            }
        )
    nshapes = (
        [(2, 32, 48), (2, 48, 32)]
        if bench.smoke
        else [(2, 768, 768), (2, 768, 3072), (2, 3072, 768), (2, 1600, 6400)]
    )
    for shape in nshapes:
        G = torch.randn(shape, device=dev)
        ref64 = newton_schulz(G.double(), ns_dtype=torch.float64)
        Gw = G.double() if shape[-2] <= shape[-1] else G.double().mT
        lam, V = torch.linalg.eigh(Gw @ Gw.mT)
        polar = (V * lam.clamp_min(1e-300).rsqrt().unsqueeze(-2)) @ V.mT @ Gw
        polar = polar if shape[-2] <= shape[-1] else polar.mT

        def err(o, r):
            return ((o.double() - r).norm(dim=(-2, -1)) / r.norm(dim=(-2, -1))).max().item()

        variants = {
            "reference": lambda G=G: newton_schulz(G, ns_dtype=dt),
            "fast_plain": lambda G=G: newton_schulz_fast(G, ns_dtype=dt, method="plain"),
            "fast_plain_torch": lambda G=G: newton_schulz_fast(
                G, ns_dtype=dt, method="plain", backend="torch"
            ),
            "fast_gram": lambda G=G: newton_schulz_fast(G, ns_dtype=dt, method="gram"),
            "fast_gram_r2": lambda G=G: newton_schulz_fast(
                G, ns_dtype=dt, method="gram", restart_every=2
            ),
            "fast_auto": lambda G=G: newton_schulz_fast(G, ns_dtype=dt, method="auto"),
        }
        row = {"ns": list(shape), "dtype": str(dt), "ns64_vs_polar": err(ref64, polar)}
        for name, fn in variants.items():
            o = fn()
            row[f"{name}_vs_ns64"] = err(o, ref64)
            row[f"{name}_vs_polar"] = err(o, polar)
        rows.append(row)
    for r in rows:
        print({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in r.items()})
    return {"rows": rows}
