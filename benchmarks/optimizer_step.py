"""CPU optimizer-step time on GPT-2-small-shaped parameters: muonscale.Muon vs torch.optim.Muon
(+ AdamW for the non-matrix parameters, as users must pair it) vs AdamW for everything.

Contenders are timed interleaved (A, B, C, A, B, C, …) and reported as medians and ratios, so
machine noise cancels. ``torch.optim.Muon`` always runs Newton–Schulz in bfloat16; for a
comparison at equal dtype its iteration is also run with float32 (its own code path, with
only the cast changed), marked ``torch-muon[fp32]``.

    # 1 layer of GPT-2-small shapes
    PYTHONPATH=. python3 benchmarks/optimizer_step.py
    PYTHONPATH=. python3 benchmarks/optimizer_step.py --layers 12 --reps 3 --json out.json
    # int8 optimizer state against full-precision state, same run (--torch-path: also int8
    # without the compiled CPU loop)
    PYTHONPATH=. python3 benchmarks/optimizer_step.py --dtypes float32 --state-precision int8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.optim._muon as torch_muon_module

import muonscale
from muonscale import newton_schulz_flops
from muonscale.kernels.cpu_quantization import cpu_kernels
from muonscale.settings import STATE_PRECISIONS


def gpt2_small_parameters(layers: int, d: int = 768, vocab: int = 50304, context: int = 1024):
    """(name, tensor) pairs with GPT-2-small shapes (nn.Linear weights are (out, in))."""
    g = torch.Generator().manual_seed(0)

    def p(*shape):
        return torch.nn.Parameter(torch.randn(*shape, generator=g) * 0.02)

    named = [("wte.weight", p(vocab, d)), ("wpe.weight", p(context, d))]
    for i in range(layers):
        named += [
            (f"h.{i}.ln_1.weight", p(d)),
            (f"h.{i}.ln_1.bias", p(d)),
            (f"h.{i}.attn.c_attn.weight", p(3 * d, d)),
            (f"h.{i}.attn.c_attn.bias", p(3 * d)),
            (f"h.{i}.attn.c_proj.weight", p(d, d)),
            (f"h.{i}.attn.c_proj.bias", p(d)),
            (f"h.{i}.ln_2.weight", p(d)),
            (f"h.{i}.ln_2.bias", p(d)),
            (f"h.{i}.mlp.c_fc.weight", p(4 * d, d)),
            (f"h.{i}.mlp.c_fc.bias", p(4 * d)),
            (f"h.{i}.mlp.c_proj.weight", p(d, 4 * d)),
            (f"h.{i}.mlp.c_proj.bias", p(d)),
        ]
    named += [("ln_f.weight", p(d)), ("ln_f.bias", p(d))]
    return named


class TorchMuonPair:
    """torch.optim.Muon for hidden matrices + torch.optim.AdamW for the rest."""

    def __init__(self, named, lr: float):
        decisions = muonscale.route(named)
        hidden = [p for n, p in named if decisions[n].algorithm == "muon"]
        rest = [p for n, p in named if decisions[n].algorithm == "adamw"]
        self.muon = torch.optim.Muon(hidden, lr=lr, adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW(rest, lr=lr, betas=(0.9, 0.95))

    def step(self):
        self.muon.step()
        self.adamw.step()


def _torch_zeropower_in(dtype: torch.dtype, original: Callable) -> Callable:
    """torch's own iteration with the initial cast changed from bfloat16 to ``dtype``."""

    def zeropower(grad, ns_coefficients, ns_steps, eps):
        a, b, c = ns_coefficients
        X = grad.to(dtype)
        if grad.size(0) > grad.size(1):
            X = X.T
        X = X.div(X.norm().clamp(min=eps))
        for _ in range(ns_steps):
            A = X @ X.T
            B = torch.addmm(A, A, A, beta=b, alpha=c)
            X = torch.addmm(X, B, X, beta=a)
        return X.T if grad.size(0) > grad.size(1) else X

    return zeropower if dtype != torch.bfloat16 else original


def _without_cpu_kernels(step: Callable) -> None:
    with cpu_kernels(False):
        step()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=1, help="transformer layers of GPT-2-small shapes"
    )
    parser.add_argument(
        "--reps", type=int, default=5, help="timed rounds per contender (after 1 warm-up)"
    )
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="Newton–Schulz dtypes to compare"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument(
        "--state-precision",
        default="param",
        choices=STATE_PRECISIONS,
        help="also time muonscale with this state_precision, interleaved with the others",
    )
    parser.add_argument(
        "--torch-path",
        action="store_true",
        help="with --state-precision: also time the quantized state's torch path, the compiled "
        "CPU loop off (muonscale.kernels.cpu_quantization), interleaved",
    )
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument(
        "--step-metrics",
        action="store_true",
        help="muonscale records its step metrics (opt.enable_step_metrics(timing=True)) and "
        "they are read after every step, inside the timing",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    original_zeropower = torch_muon_module._zeropower_via_newtonschulz
    contenders: dict[str, tuple[Callable, Callable | None]] = {}
    states = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        named = gpt2_small_parameters(args.layers)
        ours = muonscale.Muon(named, lr=1e-3, ns_dtype=dtype)
        step = ours.step
        if args.step_metrics:
            ours.enable_step_metrics(timing=True)
            step = lambda ours=ours: (ours.step(), ours.read_step_metrics())  # noqa: E731
        contenders[f"muonscale[{dtype_name}]"] = (step, None)
        states[f"muonscale[{dtype_name}]"] = (named, ours)
        if args.state_precision != "param":
            named_q = gpt2_small_parameters(args.layers)
            low = muonscale.Muon(
                named_q, lr=1e-3, ns_dtype=dtype, state_precision=args.state_precision
            )
            contenders[f"muonscale[{dtype_name},{args.state_precision}]"] = (low.step, None)
            states[f"muonscale[{dtype_name},{args.state_precision}]"] = (named_q, low)
            if args.torch_path:
                named_tp = gpt2_small_parameters(args.layers)
                slow = muonscale.Muon(
                    named_tp, lr=1e-3, ns_dtype=dtype, state_precision=args.state_precision
                )
                name = f"muonscale[{dtype_name},{args.state_precision},torch-path]"
                contenders[name] = (lambda slow=slow: _without_cpu_kernels(slow.step), None)
                states[name] = (named_tp, slow)
        named_t = gpt2_small_parameters(args.layers)
        theirs = TorchMuonPair(named_t, lr=1e-3)
        contenders[f"torch-muon[{dtype_name}]"] = (
            theirs.step,
            _torch_zeropower_in(dtype, original_zeropower),
        )
        states[f"torch-muon[{dtype_name}]"] = (named_t, theirs)
    named_a = gpt2_small_parameters(args.layers)
    adamw = torch.optim.AdamW([p for _, p in named_a], lr=1e-3, fused=True)
    contenders["adamw[fused]"] = (adamw.step, None)
    states["adamw[fused]"] = (named_a, adamw)

    g = torch.Generator().manual_seed(1)
    for named, _ in states.values():
        for _, p in named:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3

    times: dict[str, list[float]] = {name: [] for name in contenders}
    for rep in range(args.reps + 1):
        for name, (step, zeropower) in contenders.items():
            torch_muon_module._zeropower_via_newtonschulz = zeropower or original_zeropower
            start = time.perf_counter()
            step()
            elapsed = time.perf_counter() - start
            if rep > 0:
                times[name].append(elapsed)
        print(
            f"round {rep}/{args.reps} "
            + " ".join(f"{n}={t[-1] * 1e3:.0f}ms" for n, t in times.items() if t),
            flush=True,
        )
    torch_muon_module._zeropower_via_newtonschulz = original_zeropower

    medians = {name: statistics.median(t) for name, t in times.items()}
    matrices = [
        p.shape
        for n, p in gpt2_small_parameters(args.layers)
        if p.ndim == 2 and "wte" not in n and "wpe" not in n
    ]
    flops = sum(newton_schulz_flops(m, n, 5) for m, n in matrices)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": (
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        ),
        "torch": torch.__version__,
        "layers": args.layers,
        "ns_flops_per_step": flops,
        "median_ms": {n: m * 1e3 for n, m in medians.items()},
        "ratios": {},
    }
    print(f"\nGPT-2-small shapes, {args.layers} layer(s); NS FLOPs per step {flops / 1e9:.1f} G")
    print(f"{'contender':<24}{'median ms':>12}")
    for name, m in medians.items():
        print(f"{name:<24}{m * 1e3:>12.1f}")
    for dtype_name in args.dtypes.split(","):
        ratio = medians[f"muonscale[{dtype_name}]"] / medians[f"torch-muon[{dtype_name}]"]
        result["ratios"][f"muonscale/torch-muon[{dtype_name}]"] = ratio
        print(f"muonscale / torch.optim.Muon at {dtype_name}: {ratio:.3f}")
        if args.state_precision != "param":
            low = f"muonscale[{dtype_name},{args.state_precision}]"
            ratio = medians[low] / medians[f"muonscale[{dtype_name}]"]
            result["ratios"][f"{low}/muonscale[{dtype_name}]"] = ratio
            # Each round's pair ran back to back: their ratios see the same machine load.
            paired = [q / f for q, f in zip(times[low], times[f"muonscale[{dtype_name}]"])]
            result.setdefault("paired_ratios", {})[f"{low}/muonscale[{dtype_name}]"] = paired
            print(
                f"muonscale {args.state_precision} / full-precision state at {dtype_name}: "
                f"{ratio:.3f} (per round: median {statistics.median(paired):.3f}, "
                f"{min(paired):.3f}-{max(paired):.3f})"
            )
            if args.torch_path:
                slow = f"muonscale[{dtype_name},{args.state_precision},torch-path]"
                ratio = medians[slow] / medians[f"muonscale[{dtype_name}]"]
                result["ratios"][f"{slow}/muonscale[{dtype_name}]"] = ratio
                print(f"  the same with the torch path (no compiled CPU loop): {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
