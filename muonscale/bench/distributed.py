"""Distributed side-by-side bench: Muon vs AdamW on N gloo processes (issues 4 and 5).

:func:`run_distributed_bench` spawns ``nproc`` CPU processes (gloo), builds the reference GPT
once per contender from the same seed, and trains every contender **interleaved step by step**
on the same data: each step's global batch (``global_batch`` windows, a pure function of
``(seed, step)``) is split across ranks by rank, so every contender sees exactly the same tokens.

``parallel="dp"`` (model replicated, gradients averaged across ranks):

* ``muon``: :class:`muonscale.DistributedMuon`, float32 gradient reduction;
* ``muon-bf16reduce``: the same with ``reduce_dtype=torch.bfloat16`` (its loss difference vs
  ``muon`` is reported: the convergence effect of the bf16 reduction);
* ``adamw-zero1``: :class:`~muonscale.DistributedMuon` with every parameter routed to AdamW,
  i.e. ZeRO-1 AdamW (reduce-scatter + all-gather) through the same machinery;
* ``adamw-ddp``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``, its
  gradient buckets all-reduced by a comm hook through :mod:`muonscale.distributed.comm`;
* ``zero-redundancy-optimizer`` (**modelled**, not trained): ``adamw-ddp``'s all-reduce plus
  ``ZeroRedundancyOptimizer``'s per-step broadcast of every parameter, ring model.

``parallel="fsdp"`` (FSDP2 ``fully_shard`` per block and at the root): ``muon`` =
:class:`muonscale.DTensorMuon` vs ``adamw`` = ``torch.optim.AdamW`` on the same sharded model.
Reported wire bytes are the **optimizer's own** (DTensorMuon's owner all-to-all and its
non-finite flag all-reduce; AdamW on shards sends nothing); FSDP's all-gathers and
reduce-scatters are the framework's and the same for both contenders, so they are not counted.

``parallel="tp"`` (all ranks one TP group) and ``"fsdp+tp"`` (2 x 2 mesh, nproc 4): Megatron-
style TP of the reference GPT via ``parallelize_module`` (fused QKV and MLP fc column-parallel,
sharded by whole key/value groups; output projections row-parallel; embeddings, norms, head
replicated), then FSDP2 over the "dp" axis for ``fsdp+tp``; contenders and wire bytes as for
``fsdp``. The data is split over the data-parallel ranks only.

Every byte count uses the ring model of :mod:`muonscale.distributed.comm`; per-rank numbers are
reported as mean and max over ranks.

This module is the driver (spawn, collect, report); what each rank builds and measures is in
:mod:`muonscale.bench.distributed_worker`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from pathlib import Path
from typing import Any

from muonscale.bench.config import PARALLEL_MODES
from muonscale.bench.distributed_worker import (  # noqa: F401 - public names re-exported here
    DTYPES,
    mesh_shape,
    run_worker,
    single_process_muon_state_bytes,
    zero_redundancy_broadcast_bytes,
)

DP_CONTENDERS = ("muon", "muon-bf16reduce", "adamw-zero1", "adamw-ddp")
FSDP_CONTENDERS = ("muon", "adamw")
MODELLED_ZERO = "zero-redundancy-optimizer"

# Small enough that 30 interleaved steps of every dp contender take ~1-2 min on 2 CPU cores.
DEFAULT_MODEL = dict(n_layer=2, d_model=128, n_head=4, context_length=64)
# bench defaults (muonscale/bench/config.py DEFAULT_LR): muon 1.6e-2 (scale=match_rms_adamw,
# its AdamW half uses the same lr), AdamW 2e-3.
DEFAULT_LRS = {"muon": 1.6e-2, "adamw": 2e-3}


def _check_parallel(parallel: str, nproc: int, model_config=None) -> None:
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if nproc < 2:
        raise ValueError(f"the distributed bench needs nproc >= 2, got {nproc}")
    if parallel == "fsdp+tp" and nproc != 4:
        raise ValueError(f"parallel='fsdp+tp' runs on a 2 x 2 mesh: nproc must be 4, got {nproc}")
    if parallel in ("tp", "fsdp+tp") and model_config is not None:
        tp = mesh_shape(parallel, nproc)[1]
        if model_config.mlp != "gelu":
            raise NotImplementedError(
                f"the TP plan of the distributed bench covers the gelu MLP (fc, proj), not "
                f"mlp={model_config.mlp!r} (its gate projection would need its own rule)"
            )
        if model_config.tie_embeddings and parallel == "fsdp+tp":
            raise NotImplementedError(
                "fsdp+tp with tie_embeddings: replicating wte and lm_head on the tp axis "
                "module by module would untie them"
            )
        if model_config.kv_heads % tp:
            raise ValueError(
                f"tensor parallel over {tp} ranks shards the fused QKV by whole key/value groups: "
                f"the model's {model_config.kv_heads} key/value heads must be divisible by {tp}"
            )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ driver + report
def run_distributed_bench(
    *,
    nproc: int,
    parallel: str = "dp",
    steps: int = 30,
    model_overrides: dict | None = None,
    lrs: dict | None = None,
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
    reduce_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    preset: str = "tiny",
    global_batch: int = 8,
    warmup_steps: int = 5,
    eval_batches: int = 4,
    timeout_s: float = 900.0,
    print_table: bool = True,
) -> dict:
    """Train every contender of ``parallel`` on ``nproc`` gloo processes, side by side.

    Args:
        nproc: processes (ranks) to spawn, >= 2.
        parallel: "dp" (DistributedMuon / ZeRO-1 / DDP), or "fsdp", "tp", "fsdp+tp" (nproc 4)
            (DTensorMuon vs torch AdamW on the same DTensor model).
        steps: optimizer steps per contender (interleaved).
        model_overrides: ``ModelConfig`` overrides of ``preset`` (default: 2 layers, d_model
            128, 4 heads, context 64).
        lrs: peak learning rates ``{"muon": ..., "adamw": ...}`` (default: the bench's).
        seed: init and data seed (the same for every contender).
        out_dir: where to write ``report.json`` and ``report.md`` (None: nowhere).
        reduce_dtypes: gradient-reduction dtypes of the dp Muon contenders ("float32" gives
            ``muon``, "bfloat16" gives ``muon-bf16reduce``).
        global_batch: windows per step over all ranks (split over the data-parallel ranks).
        warmup_steps: linear lr warm-up, then constant.
        eval_batches: validation batches of 8 windows (fixed, evaluated at the end).

    Returns the report dict (also written to ``out_dir``); its ``rows`` map contender names to
    final_train_loss, val_loss, tokens_per_s (global), optimizer_step_ms (median over steps,
    max over ranks), wire_bytes_per_step and optimizer_state_bytes ({"mean", "max"} over ranks).
    """
    from muonscale.train.config import model_preset

    overrides = {**DEFAULT_MODEL, **(model_overrides or {})}
    _check_parallel(parallel, nproc, model_preset(preset, **overrides))
    dp_size = mesh_shape(parallel, nproc)[0]
    if global_batch % dp_size:
        raise ValueError(
            f"global_batch={global_batch} must be divisible by the {dp_size} data-parallel ranks"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if parallel == "dp" and "float32" not in reduce_dtypes:
        raise ValueError("reduce_dtypes must include 'float32' (the muon reference row)")
    for name in reduce_dtypes:
        if name not in DTYPES:
            raise ValueError(f"unknown reduce dtype {name!r}; choose from {tuple(DTYPES)}")
    reduce_dtypes = ("float32", *[d for d in reduce_dtypes if d != "float32"])
    spec = {
        "parallel": parallel,
        "steps": steps,
        "preset": preset,
        "model_overrides": overrides,
        "lrs": {**DEFAULT_LRS, **(lrs or {})},
        "seed": seed,
        "reduce_dtypes": reduce_dtypes,
        "global_batch": global_batch,
        "warmup_steps": warmup_steps,
        "eval_batches": eval_batches,
        "pg_timeout_s": 120.0,
    }
    start = time.perf_counter()
    result = _launch(nproc, spec, timeout_s)
    report = _build_report(result, spec, nproc, time.perf_counter() - start)
    table = format_table(report)
    if print_table:
        print(table)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "report.md").write_text(table + "\n")
    return report


def _launch(nproc: int, spec: dict, timeout_s: float) -> dict:
    import queue as queue_module

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=run_worker, args=(r, nproc, port, spec, results), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    out, errors = None, []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(nproc):
            try:
                status, rank, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_module.Empty:
                errors.append(f"no result from some rank within {timeout_s:.0f} s")
                break
            if status == "error":
                errors.append(f"rank {rank}: {payload}")
            elif rank == 0:
                out = payload
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    if errors or out is None:
        raise RuntimeError(
            "distributed bench failed:\n" + "\n".join(errors or ["no rank-0 result"])
        )
    return out


def _build_report(result: dict, spec: dict, nproc: int, seconds: float) -> dict:
    rows = result["rows"]
    notes = []
    report: dict[str, Any] = {
        "parallel": spec["parallel"],
        "nproc": nproc,
        "steps": spec["steps"],
        "seed": spec["seed"],
        "global_batch": spec["global_batch"],
        "tokens_per_step": spec["global_batch"] * result["model_config"]["context_length"],
        "lrs": spec["lrs"],
        "model": {"preset": spec["preset"], **result["model_config"]},
        "n_params": result["n_params"],
        "single_process_muon_state_bytes": result["single_process_muon_state_bytes"],
        "wall_seconds": seconds,
        "rows": rows,
        "wire_model": "ring: all-reduce 2(N-1)/N*S; reduce-scatter, all-gather, all-to-all, "
        "broadcast (N-1)/N*S; bytes sent per rank per optimizer step",
    }
    for row in rows.values():
        row["modelled"] = False
    if spec["parallel"] == "dp":
        ddp = rows["adamw-ddp"]
        zero_bytes = ddp["wire_bytes_per_step"]["mean"] + result["zero_broadcast_bytes"]
        zero_max = ddp["wire_bytes_per_step"]["max"] + result["zero_broadcast_bytes"]
        rows[MODELLED_ZERO] = {
            "modelled": True,
            "wire_bytes_per_step": {"mean": zero_bytes, "max": zero_max},
            "note": "modelled, not trained: adamw-ddp's counted all-reduce + ZeroRedundancy"
            "Optimizer's broadcast of every parameter from its owner (ring model)",
        }
        zero1 = rows["adamw-zero1"]["wire_bytes_per_step"]["mean"]
        ddp_bytes = ddp["wire_bytes_per_step"]["mean"]
        for row in rows.values():
            mean = row["wire_bytes_per_step"]["mean"]
            row["wire_vs_adamw_zero1"] = mean / zero1 if zero1 else math.nan
            row["wire_vs_adamw_ddp"] = mean / ddp_bytes if ddp_bytes else math.nan
        muon = rows["muon"]
        report["ratios"] = {
            "muon_wire_vs_adamw_zero1": muon["wire_vs_adamw_zero1"],
            "muon_wire_vs_adamw_ddp": muon["wire_vs_adamw_ddp"],
            "muon_state_max_vs_single_process": muon["optimizer_state_bytes"]["max"]
            / result["single_process_muon_state_bytes"],
        }
        for name, row in rows.items():
            if name.startswith("muon-") and name.endswith("reduce"):
                row["final_train_loss_minus_muon"] = (
                    row["final_train_loss"] - muon["final_train_loss"]
                )
                row["val_loss_minus_muon"] = row["val_loss"] - muon["val_loss"]
                row["wire_vs_muon"] = row["wire_bytes_per_step"]["mean"] / max(
                    1.0, muon["wire_bytes_per_step"]["mean"]
                )
    else:
        dp_size, tp_size = mesh_shape(spec["parallel"], nproc)
        report["mesh"] = {"dp": dp_size, "tp": tp_size}
        notes.append(
            "wire bytes are the optimizer's own (DTensorMuon's owner all-to-all + a non-finite "
            "flag all-reduce; torch AdamW on shards sends nothing); the framework's collectives "
            "(FSDP all-gathers / reduce-scatters, TP activation all-reduces) are not counted and "
            "are identical for both contenders"
        )
        if tp_size > 1:
            notes.append(
                "TP plan: attn.qkv and mlp.fc column-parallel (QKV rows by whole key/value "
                "group), attn.proj and mlp.proj row-parallel; embeddings, norms and head "
                "replicated; the TP ranks of one replica see the same batch"
            )
        muon = rows["muon"]
        report["ratios"] = {
            "muon_state_max_vs_single_process": muon["optimizer_state_bytes"]["max"]
            / result["single_process_muon_state_bytes"],
        }
    notes.append(
        "wall-clock figures come from processes sharing the same cores (interleaved contenders, "
        "so noise is shared); byte counts are exact under the ring model"
    )
    report["notes"] = notes
    return report


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f}"


def format_table(report: dict) -> str:
    """Markdown table of a :func:`run_distributed_bench` report."""
    rows = report["rows"]
    dp = report["parallel"] == "dp"
    head = (
        f"distributed bench: parallel={report['parallel']}, {report['nproc']} gloo ranks, "
        f"{report['steps']} steps x {report['tokens_per_step']} tokens, "
        f"{report['n_params'] / 1e6:.2f}M params (n_layer {report['model']['n_layer']}, "
        f"d_model {report['model']['d_model']}), seed {report['seed']}, lrs {report['lrs']}"
    )
    cols = [
        "contender",
        "train loss",
        "val loss",
        "tokens/s",
        "opt step ms",
        "wire B/step/rank mean",
        "max",
    ]
    if dp:
        cols += ["vs adamw-zero1", "vs adamw-ddp"]
    cols += ["state B/rank mean", "max"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, row in rows.items():
        wire = row["wire_bytes_per_step"]
        if row.get("modelled"):
            cells = [f"{name} (modelled)", "—", "—", "—", "—"]
        else:
            cells = [
                name,
                f"{row['final_train_loss']:.4f}",
                f"{row['val_loss']:.4f}",
                f"{row['tokens_per_s']:,.0f}",
                f"{row['optimizer_step_ms']:.1f}",
            ]
        cells += [_fmt_bytes(wire["mean"]), _fmt_bytes(wire["max"])]
        if dp:
            cells += [f"{row['wire_vs_adamw_zero1']:.3f}", f"{row['wire_vs_adamw_ddp']:.3f}"]
        if row.get("modelled"):
            cells += ["—", "—"]
        else:
            state = row["optimizer_state_bytes"]
            cells += [_fmt_bytes(state["mean"]), _fmt_bytes(state["max"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    single = report["single_process_muon_state_bytes"]
    muon_state = rows["muon"]["optimizer_state_bytes"]["max"]
    lines.append(
        f"optimizer state: single-process muonscale.Muon {single:,} B; distributed muon max per "
        f"rank {muon_state:,.0f} B ({muon_state / single:.3f}x)"
    )
    for name, row in rows.items():
        if "final_train_loss_minus_muon" in row:
            lines.append(
                f"{name}: train loss {row['final_train_loss_minus_muon']:+.4f}, val loss "
                f"{row['val_loss_minus_muon']:+.4f} vs muon (fp32 reduce); wire "
                f"{row['wire_vs_muon']:.3f}x muon's"
            )
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
