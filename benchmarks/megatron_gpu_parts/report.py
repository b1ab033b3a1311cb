"""Medians, tokens/s and ratios, sanity checks, the printed table and the JSON file."""

from __future__ import annotations

import json
import math
import os
import statistics
from typing import TYPE_CHECKING, Any

from .arms import CPU_STANDINS, Arm

if TYPE_CHECKING:  # the config lives in the entry script, benchmarks/megatron_gpu.py
    from megatron_gpu import BenchConfig


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(cfg: BenchConfig, arms: dict[str, Arm], result: dict, tokens_per_micro: int) -> None:
    """Medians, tokens/s and ratios into ``result``."""
    for arm in arms.values():
        one = arm.times["one_micro"]
        row = {
            "tokens_per_s_one_micro": tokens_per_micro / med(one["step"]),
            "step_ms": 1e3 * med(one["step"]),
            "fwd_bwd_ms": 1e3 * med(one["fwd_bwd"]),
            "optimizer_step_ms": 1e3 * med(one["opt"]),
            "timed_steps": len(one["step"]),
            "peak_memory_bytes": arm.memory["peak_bytes"],
            "resident_memory_bytes": arm.memory["resident_bytes"],
            "loss_before": arm.loss_before,
            "train_losses": arm.losses,
            "grad_norms": arm.grad_norms,
        }
        if cfg.accum:
            row["tokens_per_s_accum_composed"] = (
                cfg.accum * tokens_per_micro / (cfg.accum * med(one["fwd_bwd"]) + med(one["opt"]))
            )
        if "accum" in arm.times:
            row["tokens_per_s_accum_measured"] = (
                cfg.accum * tokens_per_micro / med(arm.times["accum"]["step"])
            )
        result["arms"].setdefault(arm.name, {}).update(row)
    on_cpu = cfg.smoke
    if on_cpu:  # per-arm peak memory needs torch.cuda's counters
        for arm in arms.values():
            row = result["arms"][arm.name]
            row["process_peak_rss_bytes"] = row.pop("peak_memory_bytes")
            row["peak_memory_bytes"] = "not measured: CPU (process RSS is not per arm)"
            row["resident_memory_bytes"] = "not measured: CPU"
    ours = result["arms"]["muonscale"]
    for reference, suffix in (("megatron_adam", ""), ("megatron_muon", "_vs_megatron_muon")):
        name = reference if reference in arms else CPU_STANDINS[reference]
        base = result["arms"][name]
        result["baseline" if not suffix else "baseline_muon"] = name
        for key in ("one_micro", "accum_composed", "accum_measured"):
            if f"tokens_per_s_{key}" in ours and f"tokens_per_s_{key}" in base:
                result[f"throughput_ratio{suffix}_{key}"] = (
                    ours[f"tokens_per_s_{key}"] / base[f"tokens_per_s_{key}"]
                )
        result[f"optimizer_step_ratio{suffix}"] = (
            ours["optimizer_step_ms"] / base["optimizer_step_ms"]
        )
        result[f"peak_memory_ratio{suffix}"] = (
            "not measured: CPU (no per-arm peak memory)"
            if on_cpu
            else ours["peak_memory_bytes"] / base["peak_memory_bytes"]
        )
    if cfg.accum:
        result["accum_tokens_per_step"] = cfg.accum * tokens_per_micro


def sanity(result: dict) -> dict:
    """Both arms: equal start (same weights), finite losses, loss on the fixed batch decreased,
    and equal first-step gradient norms (same weights, same batch, both clip the global norm)."""
    arms = result["arms"]
    out: dict[str, Any] = {}
    before = [a["loss_before"] for a in arms.values()]
    out["same_initial_loss"] = max(before) - min(before) <= 1e-3 * max(abs(b) for b in before)
    for name, a in arms.items():
        losses = a["train_losses"] + [a["loss_before"], a["loss_after"]]
        out[f"{name}_finite"] = all(math.isfinite(x) for x in losses)
        out[f"{name}_decreased"] = a["loss_after"] < a["loss_before"]
    first_norms = [
        a["grad_norms"][0]
        for a in arms.values()
        if a["grad_norms"] and a["grad_norms"][0] is not None
    ]
    if len(first_norms) == len(arms):
        out["first_grad_norms"] = first_norms
        out["same_first_grad_norm"] = max(first_norms) - min(first_norms) <= 1e-2 * max(first_norms)
    if "muon_config" in result:
        out["muon_arms_same_settings"] = all(result["muon_config"]["same_settings"].values())
    out["ok"] = all(v for k, v in out.items() if isinstance(v, bool))
    return out


def print_table(result: dict) -> None:
    cols = [
        ("arm", "{}"),
        ("tokens_per_s_one_micro", "{:,.0f}"),
        ("step_ms", "{:.1f}"),
        ("fwd_bwd_ms", "{:.1f}"),
        ("optimizer_step_ms", "{:.2f}"),
        ("peak_memory_bytes", "{:,}"),
        ("loss_before", "{:.3f}"),
        ("loss_after", "{:.3f}"),
        ("tokens_per_s_accum_composed", "{:,.0f}"),
        ("tokens_per_s_accum_measured", "{:,.0f}"),
    ]

    def cell(a: dict, c: str, fmt: str) -> str:
        return "-" if c not in a else fmt.format(a[c]) if isinstance(a[c], (int, float)) else "n/m"

    rows = [[name] + [cell(a, c, fmt) for c, fmt in cols[1:]] for name, a in result["arms"].items()]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, (c, _) in enumerate(cols)]
    print("  ".join(c.ljust(w) for (c, _), w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    for suffix, base in (("", result["baseline"]), ("_vs_megatron_muon", result["baseline_muon"])):
        for key in (
            "throughput_ratio{}_one_micro",
            "throughput_ratio{}_accum_composed",
            "throughput_ratio{}_accum_measured",
            "optimizer_step_ratio{}",
            "peak_memory_ratio{}",
        ):
            key = key.format(suffix)
            if isinstance(result.get(key), float):
                print(f"{key} (muonscale / {base}): {result[key]:.4f}")
    if "muon_config" in result:
        print(f"Muon arms, same settings: {result['muon_config']['same_settings']}")
    if "accum_point" in result:
        print(
            f"accumulation point ({result['accum_tokens_per_step']:,} tokens/step): "
            f"{result['accum_point']}"
        )
    print(f"sanity: {result.get('sanity')}")


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)
