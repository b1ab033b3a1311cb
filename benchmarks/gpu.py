"""GPU benchmark of the Newton–Schulz fast path, the Muon optimizer step (issue 6) and
muonscale under Megatron-Core vs Megatron's Adam (issue 7).

    PYTHONPATH=. python3 benchmarks/gpu.py                 # one H200, < 6 minutes
    PYTHONPATH=. python3 benchmarks/gpu.py --smoke         # tiny shapes, CPU, < 60 s
    PYTHONPATH=. python3 benchmarks/gpu.py --only ns --only optimizer --out runs/gpu

On the lent H200 (Python 3.12, CUDA torch, no megatron-core, no network)::

    bash .ci/megatron_site.sh     # here, once: megatron-core wheels unpacked into .megatron-site/
    # then the device tool's run with carry [".megatron-site"] and the command
    PYTHONPATH=. python3 benchmarks/gpu.py --out $OUT
    PYTHONPATH=. python3 benchmarks/gpu.py --only megatron --out $OUT    # that leg alone, ~1.5 min

Writes ``$OUT/gpu_bench.json`` (``--out`` > env ``OUT`` > ``./runs/gpu``; a folder) after every
section, and prints one table per section. Needs only torch, triton, numpy and muonscale;
the ``megatron`` section also needs megatron-core (``.megatron-site/`` or installed).

Sections (every one wrapped: a failure is recorded in the JSON and the rest still runs; a
global time guard skips what no longer fits):

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
* ``megatron``    ``benchmarks/megatron_gpu.py`` in a subprocess (``python3 -m
                  torch.distributed.run --nproc-per-node 1``, PYTHONPATH=<repo>:<site>, wall
                  limit ``--megatron-timeout-s``, outside the time guard): Megatron's GPTModel
                  (GPT-2-medium shapes, bf16) under Megatron's DDP, tokens/s of muonscale vs
                  ``get_megatron_optimizer`` Adam. Its JSON is merged into this section (also
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
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import muonscale
from muonscale.kernels import (
    choose_method,
    clear_workspaces,
    gram_flops,
    newton_schulz_fast,
    plain_flops,
    triton_available,
)
from muonscale.newton_schulz import newton_schulz, newton_schulz_flops, resolve_coefficients

KELLER = resolve_coefficients("keller", 1)[0]
GPT2 = {  # name: (n_layer, d_model, n_head)
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-xl": (48, 1600, 25),
}
VOCAB, CONTEXT = 50304, 1024
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON_SCRIPT = os.path.join(REPO, "benchmarks", "megatron_gpu.py")


# ---------------------------------------------------------------------------------------------
# Timing


class Clock:
    """Seconds of ``fn()``: CUDA events on CUDA (synchronized), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def interleaved(
        self, fns: dict[str, Callable[[], object]], *, warmup: int, reps: int, budget_s: float = 1e9
    ) -> dict[str, float]:
        """Median seconds per variant; rounds A B C, A B C, …; stops early past ``budget_s``."""
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        self.sync()
        times: dict[str, list[float]] = {k: [] for k in fns}
        t_end = time.perf_counter() + budget_s
        for r in range(reps):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for k in order:
                times[k].append(self.time(fns[k]))
            if time.perf_counter() > t_end and r >= 1:
                break
        return {k: _median(v) for k, v in times.items()}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


class Guard:
    """Global time guard: sections ask how much time is left before starting work."""

    def __init__(self, budget_s: float) -> None:
        self.t_end = time.perf_counter() + budget_s

    def left(self) -> float:
        return self.t_end - time.perf_counter()


# ---------------------------------------------------------------------------------------------
# Shapes, parameter sets, models


def gpt2_shapes(n_layer: int, d: int) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of the Muon matrices: qkv (3d, d), attn proj (d, d), mlp fc (4d, d),
    mlp proj (d, 4d), one each per layer."""
    return [(n_layer, 3 * d, d), (n_layer, d, d), (n_layer, 4 * d, d), (n_layer, d, 4 * d)]


def param_set(n_layer: int, d: int, device, vocab: int = VOCAB, context: int = CONTEXT):
    """Named fp32 parameters of GPT-2 shapes with random gradients:
    (muon list, adamw list) of (name, Parameter)."""
    torch.manual_seed(0)
    muon, adamw = [], []

    def make(name, shape, bucket):
        p = nn.Parameter(torch.empty(shape, device=device).normal_(0, 0.02))
        p.grad = torch.randn(shape, device=device) * 1e-3
        bucket.append((name, p))

    make("wte.weight", (vocab, d), adamw)
    make("wpe.weight", (context, d), adamw)
    for i in range(n_layer):
        make(f"blocks.{i}.attn.qkv.weight", (3 * d, d), muon)
        make(f"blocks.{i}.attn.proj.weight", (d, d), muon)
        make(f"blocks.{i}.mlp.fc.weight", (4 * d, d), muon)
        make(f"blocks.{i}.mlp.proj.weight", (d, 4 * d), muon)
        for norm in ("attn_norm", "mlp_norm"):
            make(f"blocks.{i}.{norm}.weight", (d,), adamw)
            make(f"blocks.{i}.{norm}.bias", (d,), adamw)
    make("final_norm.weight", (d,), adamw)
    make("lm_head.weight", (vocab, d), adamw)
    return muon, adamw


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.attn_norm, self.mlp_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_head, -1).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.mlp_norm(x))))


class MiniGPT(nn.Module):
    """Fallback GPT-2 (used only when muonscale.train.model does not import)."""

    def __init__(self, n_layer: int, d: int, n_head: int, vocab: int, context: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_Block(d, n_head) for _ in range(n_layer))
        self.final_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0, 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.final_norm(x))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(preset: str, dims: tuple[int, int, int], device, vocab: int, context: int):
    """(model, source): the library GPT when it imports, else the fallback."""
    n_layer, d, n_head = dims
    with torch.device(device):
        try:
            from muonscale.train.config import model_preset
            from muonscale.train.model import GPT

            cfg = model_preset(preset, n_layer=n_layer, d_model=d, n_head=n_head,
                               vocab_size=vocab, context_length=context)  # fmt: skip
            return GPT(cfg), "muonscale.train.model.GPT"
        except Exception as exc:  # missing module or changed API: fall back, say so
            return MiniGPT(n_layer, d, n_head, vocab, context), f"MiniGPT (fallback: {exc!r})"


def split_hidden(named) -> tuple[list, list]:
    """Muon (hidden 2-D matrices) vs AdamW (embeddings, head, norms, biases) by name/shape."""
    muon, adamw = [], []
    for name, p in named:
        embed = name.startswith(("wte", "wpe", "lm_head"))
        (muon if p.dim() == 2 and not embed else adamw).append((name, p))
    return muon, adamw


def make_optimizer(kind: str, muon_named, adamw_named, lr: float = 1e-3):
    """One object with .step() / .zero_grad(): "adamw", "torch_muon", "muonscale",
    "muonscale_bf16mom"."""
    if kind == "adamw":
        params = [p for _, p in muon_named + adamw_named]
        return torch.optim.AdamW(params, lr=lr, fused=params[0].is_cuda)
    if kind == "torch_muon":
        fused = adamw_named[0][1].is_cuda
        return _Pair(
            torch.optim.Muon([p for _, p in muon_named], lr=lr, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([p for _, p in adamw_named], lr=lr, fused=fused),
        )
    mom = torch.bfloat16 if kind == "muonscale_bf16mom" else None
    groups = [
        {"params": [p for _, p in muon_named], "algorithm": "muon"},
        {"params": [p for _, p in adamw_named], "algorithm": "adamw"},
    ]
    ns_dtype = torch.bfloat16 if muon_named[0][1].is_cuda else torch.float32
    return muonscale.Muon(groups, lr=lr, ns_dtype=ns_dtype, momentum_dtype=mom, nonfinite="ignore")


class _Pair:
    def __init__(self, *opts) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def state_bytes(opt) -> int:
    if hasattr(opt, "optimizer_state_bytes"):
        return int(opt.optimizer_state_bytes())
    opts = opt.opts if isinstance(opt, _Pair) else (opt,)
    return sum(
        t.numel() * t.element_size()
        for o in opts
        for st in o.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )


# ---------------------------------------------------------------------------------------------
# Sections


class Bench:
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

    def run(self, name: str, fn: Callable[[], dict], min_s: float, guarded: bool = True) -> None:
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
            out = fn()
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

    # -- matmul rate
    def section_matmul(self) -> dict:
        n = 256 if self.smoke else 8192
        a = torch.randn(n, n, device=self.device, dtype=self.dtype)
        b = torch.randn(n, n, device=self.device, dtype=self.dtype)
        c = torch.empty(n, n, device=self.device, dtype=self.dtype)
        t = self.clock.interleaved({"mm": lambda: torch.mm(a, b, out=c)}, warmup=3, reps=10)["mm"]
        self.matmul_rate = 2 * n**3 / t
        print(f"{self.dtype} matmul {n}^3: {t * 1e3:.3f} ms, {self.matmul_rate / 1e12:.1f} TFLOP/s")
        return {"n": n, "dtype": str(self.dtype), "seconds": t, "tflops": self.matmul_rate / 1e12}

    def _rate(self) -> float:
        if self.matmul_rate is None:
            self.section_matmul()
        return self.matmul_rate

    # -- correctness on the card (bf16) against float64
    def section_correctness(self) -> dict:
        from muonscale.kernels import triton_symmetric as ts  # needs triton

        dev, dt = self.device, self.dtype
        rows = []
        kshapes = [(2, 32, 48)] if self.smoke else [(4, 256, 1024), (2, 768, 3072), (3, 200, 520)]
        for shape in kshapes:
            X = torch.randn(shape, device=dev).to(dt)
            C = ts.sym_matmul(X)
            ref = X.double() @ X.double().mT
            A = (C / C.norm(dim=(-2, -1), keepdim=True)).to(dt)
            B = ts.sym_matmul(A, alpha=2.0315, Z=A, beta=-4.775)
            refB = -4.775 * A.double() + 2.0315 * A.double() @ A.double()
            rows.append({
                "kernel": "sym_matmul", "shape": shape, "dtype": str(dt),
                "xxt_max_rel": ((C.double() - ref).abs().max() / ref.abs().max()).item(),
                "poly_max_rel": ((B.double() - refB).abs().max() / refB.abs().max()).item(),
                "symmetric": bool(torch.equal(C, C.mT)),
            })  # fmt: skip
        nshapes = [(2, 32, 48), (2, 48, 32)] if self.smoke else [
            (2, 768, 768), (2, 768, 3072), (2, 3072, 768), (2, 1600, 6400)
        ]  # fmt: skip
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
                "fast_plain_torch": lambda G=G: newton_schulz_fast(G, ns_dtype=dt, method="plain", backend="torch"),
                "fast_gram": lambda G=G: newton_schulz_fast(G, ns_dtype=dt, method="gram"),
                "fast_gram_r2": lambda G=G: newton_schulz_fast(G, ns_dtype=dt, method="gram", restart_every=2),
                "fast_auto": lambda G=G: newton_schulz_fast(G, ns_dtype=dt, method="auto"),
            }  # fmt: skip
            row = {"ns": list(shape), "dtype": str(dt), "ns64_vs_polar": err(ref64, polar)}
            for name, fn in variants.items():
                o = fn()
                row[f"{name}_vs_ns64"] = err(o, ref64)
                row[f"{name}_vs_polar"] = err(o, polar)
            rows.append(row)
        for r in rows:
            print({k: (f"{v:.2e}" if isinstance(v, float) else v) for k, v in r.items()})
        return {"rows": rows}

    # -- NS per shape
    def section_ns(self) -> dict:
        dev, dt, rate = self.device, self.dtype, self._rate()
        from torch.optim._muon import _zeropower_via_newtonschulz

        shapes = []
        for n_layer, d, _ in self.models.values():
            shapes += gpt2_shapes(n_layer, d)
        shapes = list(dict.fromkeys(shapes))
        rows = []
        per_shape_budget = max(2.0, (self.guard.left() - 150) / max(len(shapes), 1))
        for k, r, c in shapes:
            if self.guard.left() < 60 and not self.smoke:
                rows.append({"shape": (k, r, c), "skipped": "time guard"})
                continue
            G = torch.randn(k, r, c, device=dev)
            out = torch.empty_like(G)
            fns = {
                "torch_muon_loop": lambda G=G: [
                    _zeropower_via_newtonschulz(G[i], KELLER, 5, 1e-7) for i in range(G.shape[0])
                ],
                "reference_batched": lambda G=G: newton_schulz(G, ns_dtype=dt),
                "fast_plain_torch": lambda G=G, o=out: newton_schulz_fast(G, ns_dtype=dt, out=o, backend="torch"),
                "fast_gram_torch": lambda G=G, o=out: newton_schulz_fast(G, ns_dtype=dt, out=o, method="gram", backend="torch", restart_every=2),
            }  # fmt: skip
            if triton_available() and dev.type == "cuda":
                fns["fast_plain_triton"] = lambda G=G, o=out: newton_schulz_fast(
                    G, ns_dtype=dt, out=o, backend="triton"
                )
                fns["fast_gram_triton"] = lambda G=G, o=out: newton_schulz_fast(G, ns_dtype=dt, out=o, method="gram", backend="triton", restart_every=2)  # fmt: skip
            fns["fast_auto"] = lambda G=G, o=out: newton_schulz_fast(
                G, ns_dtype=dt, out=o, method="auto"
            )
            times = self.clock.interleaved(
                fns,
                warmup=1 if self.smoke else 2,
                reps=2 if self.smoke else 10,
                budget_s=per_shape_budget,
            )
            flops = k * newton_schulz_flops(r, c, 5)
            m, n = min(r, c), max(r, c)
            row = {
                "shape": (k, r, c), "ns_flops": flops, "floor_s": flops / rate,
                "auto_method": choose_method(m, n, dt),
                "gram_r2_flops": k * gram_flops(m, n, 5, restart_every=2),
                "plain_sym_flops": k * plain_flops(m, n, 5, symmetric=True),
            }  # fmt: skip
            for name, t in times.items():
                row[f"{name}_ms"] = t * 1e3
                row[f"{name}_tflops"] = flops / t / 1e12  # nominal (plain) FLOPs / time
            rows.append(row)
            del G, out
            clear_workspaces()
        self._print_table(rows, ["shape"] + [f"{k}_ms" for k in fns] + ["floor_s"])
        return {"rows": rows, "matmul_tflops": rate / 1e12}

    # -- optimizer step on parameter sets
    def section_optimizer(self) -> dict:
        dev, dt, rate = self.device, self.dtype, self._rate()
        rows = []
        for name, (n_layer, d, _) in self.models.items():
            if self.guard.left() < 40 and not self.smoke:
                rows.append({"model": name, "skipped": "time guard"})
                continue
            vocab, ctx = (256, 32) if self.smoke else (VOCAB, CONTEXT)
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
            fns["ns_fast_plain_only"] = lambda st=stacks: [newton_schulz_fast(g, ns_dtype=dt) for g in st.values()]  # fmt: skip
            times = self.clock.interleaved(
                fns, warmup=1 if self.smoke else 2, reps=2 if self.smoke else 8, budget_s=30
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
            self.cleanup()
        self._print_table(rows, ["model", "floor_ms", "adamw_ms", "torch_muon_ms", "muonscale_ms",
                                 "ns_fast_auto_only_ms", "torch_muon_vs_floor", "muonscale_vs_floor"])  # fmt: skip
        return {"rows": rows, "matmul_tflops": rate / 1e12}

    # -- end to end tokens/s
    def section_e2e(self) -> dict:
        dev = self.device
        if self.smoke:
            preset, dims, vocab, ctx, micro, accum = "gpt2-medium", (1, 32, 2), 256, 32, 2, 2
        else:
            preset, dims, vocab, ctx, micro, accum = (
                "gpt2-medium",
                GPT2["gpt2-medium"],
                VOCAB,
                CONTEXT,
                16,
                32,
            )
        model, source = build_model(preset, dims, dev, vocab, ctx)
        muon_named, adamw_named = split_hidden(model.named_parameters())
        opts = {
            k: make_optimizer(k, muon_named, adamw_named)
            for k in ("adamw", "torch_muon", "muonscale")
        }
        gen = torch.Generator(device=dev).manual_seed(0)
        idx = torch.randint(0, vocab, (micro, ctx), device=dev, generator=gen)
        tgt = torch.randint(0, vocab, (micro, ctx), device=dev, generator=gen)
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

        def fwd_bwd():
            with autocast:
                _, loss = model(idx, tgt)
            loss.backward()

        def train_step(opt, n_micro):
            def fn():
                for _ in range(n_micro):
                    fwd_bwd()
                opt.step()
                opt.zero_grad(set_to_none=True)

            return fn

        tokens = micro * ctx
        fwd_bwd()  # creates grads, so the optimizer steps below have work
        parts = self.clock.interleaved({"fwd_bwd": fwd_bwd, **{f"opt_{k}": o.step for k, o in opts.items()}},
                                       warmup=1 if self.smoke else 2, reps=2 if self.smoke else 8, budget_s=40)  # fmt: skip
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        one = self.clock.interleaved({k: train_step(o, 1) for k, o in opts.items()},
                                     warmup=1, reps=2 if self.smoke else 6, budget_s=40)  # fmt: skip
        n_acc = accum if self.guard.left() > 120 or self.smoke else 0
        acc = {}
        if n_acc:
            acc = self.clock.interleaved({k: train_step(o, n_acc) for k, o in opts.items()},
                                         warmup=0, reps=2, budget_s=30)  # fmt: skip
        t_fb = parts["fwd_bwd"]
        res = {"model_source": source, "tokens_per_micro_batch": tokens, "accum": accum,
               "parts_ms": {k: v * 1e3 for k, v in parts.items()}}  # fmt: skip
        for k in ("torch_muon", "muonscale"):
            res[f"{k}_ratio_one_micro_measured"] = one["adamw"] / one[k]
            res[f"{k}_ratio_one_micro_composed"] = (t_fb + parts["opt_adamw"]) / (
                t_fb + parts[f"opt_{k}"]
            )
            res[f"{k}_ratio_accum_composed"] = (accum * t_fb + parts["opt_adamw"]) / (
                accum * t_fb + parts[f"opt_{k}"]
            )
            if acc:
                res[f"{k}_ratio_accum_measured"] = acc["adamw"] / acc[k]
        res["tokens_per_s_one_micro"] = {k: tokens / t for k, t in one.items()}
        if acc:
            res["tokens_per_s_accum"] = {k: n_acc * tokens / t for k, t in acc.items()}
        for k, v in res.items():
            print(f"{k:40s} {v}")
        return res

    # -- peak memory
    def section_memory(self) -> dict:
        dev = self.device
        if self.smoke:
            dims, vocab, ctx, micro = (1, 32, 2), 256, 32, 2
        else:
            dims, vocab, ctx, micro = GPT2["gpt2-xl"], VOCAB, CONTEXT, 8
        rows = []
        for kind in ("adamw", "muonscale", "muonscale_bf16mom", "torch_muon"):
            if self.guard.left() < 20 and not self.smoke:
                rows.append({"optimizer": kind, "skipped": "time guard"})
                continue
            self.cleanup()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                torch.manual_seed(0)
                model, source = build_model("gpt2-xl", dims, dev, vocab, ctx)
                muon_named, adamw_named = split_hidden(model.named_parameters())
                opt = make_optimizer(kind, muon_named, adamw_named)
                idx = torch.randint(0, vocab, (micro, ctx), device=dev)
                autocast = torch.autocast(
                    dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"
                )
                for _ in range(1 if self.smoke else 3):
                    with autocast:
                        _, loss = model(idx, idx)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                self.clock.sync()
                peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _peak_rss()
                rows.append({"optimizer": kind, "peak_bytes": peak, "state_bytes": state_bytes(opt),
                             "model_source": source})  # fmt: skip
                del model, opt, loss, muon_named, adamw_named
            except Exception as exc:
                rows.append({"optimizer": kind, "error": repr(exc)})
        base = next((r for r in rows if r["optimizer"] == "adamw" and "peak_bytes" in r), None)
        for r in rows:
            if base and "peak_bytes" in r:
                r["peak_vs_adamw"] = r["peak_bytes"] / base["peak_bytes"]
                r["state_vs_adamw"] = r["state_bytes"] / max(base["state_bytes"], 1)
        self._print_table(
            rows, ["optimizer", "peak_bytes", "peak_vs_adamw", "state_bytes", "state_vs_adamw"]
        )
        return {"rows": rows, "micro_batch": (micro, ctx), "peak_metric": "cuda max_memory_allocated" if dev.type == "cuda" else "process peak RSS (smoke)"}  # fmt: skip

    # -- Megatron-Core leg: benchmarks/megatron_gpu.py in a subprocess with its own wall limit
    def megatron_pythonpath(self) -> tuple[str | None, str | None]:
        """(PYTHONPATH for the leg, None) or (None, why it cannot run here)."""
        if self.device.type != "cuda" and not self.smoke:
            return None, "no CUDA device"
        if sys.version_info < (3, 12):
            return (
                None,
                f"megatron-core 0.19 needs Python >= 3.12, this is {sys.version.split()[0]}",
            )
        site = self.args.megatron_site or os.path.join(REPO, ".megatron-site")
        paths = [REPO]
        if os.path.isdir(site):
            paths.append(os.path.abspath(site))
        elif self.args.megatron_site:
            return None, f"--megatron-site {site} does not exist"
        elif importlib.util.find_spec("megatron") is None:
            return None, "megatron-core is not installed and there is no .megatron-site/ (run bash .ci/megatron_site.sh here and carry .megatron-site)"  # fmt: skip
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        return os.pathsep.join(paths), None

    def section_megatron(self) -> dict:
        pythonpath, reason = self.megatron_pythonpath()
        if reason:
            self.results["megatron_leg"] = f"not measured: {reason}"
            print(self.results["megatron_leg"])
            return {"status": "not_measured", "reason": reason}
        timeout = self.args.megatron_timeout_s or (300.0 if self.smoke else 85.0)
        os.makedirs(self.out_dir, exist_ok=True)
        json_path = os.path.join(self.out_dir, "megatron_gpu.json")
        log_path = os.path.join(self.out_dir, "megatron_gpu.log")
        if os.path.exists(json_path):
            os.remove(json_path)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               MEGATRON_SCRIPT, "--out", json_path, "--budget-s", str(max(10.0, timeout - 40.0))]  # fmt: skip
        if self.smoke:
            cmd.append("--smoke")
        print(f"PYTHONPATH={pythonpath} {' '.join(cmd)}  (limit {timeout:.0f}s)", flush=True)
        env = {**os.environ, "PYTHONPATH": pythonpath}
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                rc: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # torchrun starts its worker in a session of its own: SIGTERM lets torchrun stop
                # it; SIGKILL to the session we started (torchrun) if that does not suffice.
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = None
        seconds = time.perf_counter() - t0
        with open(log_path, errors="replace") as log:
            tail = log.read().splitlines()[-30:]
        print("\n".join(tail))
        data: dict = {}
        if os.path.exists(json_path):
            with open(json_path) as f:
                try:
                    data = json.load(f)
                except json.JSONDecodeError:  # killed while writing
                    data = {"unreadable_json": json_path}
        out = {"leg": data, "returncode": rc, "leg_seconds": round(seconds, 1), "log": log_path}
        if "import_error" in data:
            reason = data["import_error"]
        elif rc is None:
            reason = f"timed out after {timeout:.0f}s (phases done: {data.get('phases_done', [])})"
        elif rc != 0 or "sanity" not in data:
            sane = data.get("sanity", {}).get("ok", True)
            self.results["megatron_leg"] = f"failed: exit code {rc}" if sane else "measured, sanity check failed"  # fmt: skip
            return {**out, "status": "error", "log_tail": tail[-15:]}
        else:
            self.results["megatron_leg"] = "measured"
            return out
        self.results["megatron_leg"] = f"not measured: {reason}"
        return {**out, "status": "not_measured", "reason": reason, "log_tail": tail[-15:]}

    @staticmethod
    def _print_table(rows: list[dict], cols: list[str]) -> None:
        def fmt(v):
            if isinstance(v, float):
                return f"{v:.4g}"
            return str(v)

        widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


SECTIONS = ("matmul", "correctness", "ns", "optimizer", "e2e", "memory", "megatron")
MIN_SECONDS = {"matmul": 5, "correctness": 20, "ns": 40, "optimizer": 30, "e2e": 40, "memory": 30}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, < 60 s")
    parser.add_argument(
        "--only", action="append", choices=SECTIONS, help="run only this section (repeatable)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", os.path.join("runs", "gpu")),
                        help="output directory (default: $OUT or ./runs/gpu)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=None,
                        help="global time guard in seconds (default 270; none with --smoke)")  # fmt: skip
    parser.add_argument("--megatron-site", default=None,
                        help="folder of unpacked megatron-core wheels (default: <repo>/.megatron-site "
                             "when it exists; built by .ci/megatron_site.sh)")  # fmt: skip
    parser.add_argument("--megatron-timeout-s", type=float, default=None,
                        help="wall limit of the megatron section's subprocess (default 85; 300 with --smoke)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.budget_s is None:  # smoke runs every section whatever the clock says: it tests code
        args.budget_s = 1e6 if args.smoke else 270.0
    bench = Bench(args)
    print(f"device: {bench.results['meta']['device']}  dtype: {bench.dtype}  "
          f"triton: {triton_available()}  budget: {args.budget_s:.0f}s")  # fmt: skip
    bench.run("matmul", bench.section_matmul, MIN_SECONDS["matmul"])
    if triton_available():
        bench.run("correctness", bench.section_correctness, MIN_SECONDS["correctness"])
    else:
        bench.results["sections"]["correctness"] = {
            "status": "skipped",
            "reason": "triton not installed",
        }
    bench.run("ns", bench.section_ns, MIN_SECONDS["ns"])
    bench.run("optimizer", bench.section_optimizer, MIN_SECONDS["optimizer"])
    bench.run("e2e", bench.section_e2e, MIN_SECONDS["e2e"])
    bench.run("memory", bench.section_memory, MIN_SECONDS["memory"])
    bench.run("megatron", bench.section_megatron, 0, guarded=False)
    bench.save()
    status = {k: v["status"] for k, v in bench.results["sections"].items()}
    print(f"\nwrote {os.path.join(args.out, 'gpu_bench.json')}  sections: {status}")
    return 0 if all(s != "error" for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
