"""Distributed side-by-side bench: Muon vs AdamW on N gloo processes (``muonscale bench
--nproc N``).

:func:`run_distributed_bench` spawns ``nproc`` CPU processes (gloo) and trains the bench's
contenders there, **interleaved step by step** on the same data. Each contender is the
``TrainConfig`` the single-process bench trains (:func:`muonscale.bench.runner.train_config_for`:
model, data, tokenizer, schedule, learning rates, weight decay, momentum, dtypes, micro-batches,
``--variants``), parallelized by :mod:`muonscale.train.parallel`; each step's global batch (a
pure function of ``(seed, step)``) is split across the data-parallel ranks, so every contender
sees exactly the tokens of the single-process run.

``parallel="dp"`` (model replicated, gradients averaged across ranks):

* ``muon``: :class:`muonscale.DistributedMuon`, float32 gradient reduction;
* ``muon-bf16reduce``: the same with ``reduce_dtype=torch.bfloat16`` (its loss difference vs
  ``muon`` is reported: the convergence effect of the bf16 reduction);
* every ``--variants`` contender: ``DistributedMuon`` with the variant's options;
* ``adamw-zero1``: :class:`~muonscale.DistributedMuon` with every parameter routed to AdamW,
  i.e. ZeRO-1 AdamW (reduce-scatter + all-gather) through the same machinery;
* ``adamw-ddp``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``, its
  gradient buckets all-reduced by a comm hook through :mod:`muonscale.distributed.comm`;
* ``zero-redundancy-optimizer`` (**modelled**, not trained): ``adamw-ddp``'s all-reduce plus
  ``ZeroRedundancyOptimizer``'s per-step broadcast of every parameter, ring model.

``parallel="fsdp"`` (FSDP2 ``fully_shard`` per block and at the root): ``muon`` (and each
variant) = :class:`muonscale.DTensorMuon` vs ``adamw`` = ``torch.optim.AdamW`` on the same
sharded model. Reported wire bytes are the **optimizer's own** (DTensorMuon's owner all-to-all
and its non-finite flag all-reduce; AdamW on shards sends nothing); FSDP's all-gathers and
reduce-scatters are the framework's and the same for both contenders, so they are not counted.

``parallel="tp"`` (all ranks one TP group) and ``"fsdp+tp"`` (2 x 2 mesh, nproc 4): Megatron-
style TP of the reference GPT (:func:`muonscale.train.parallel.apply_tensor_parallel`), then
FSDP2 over the "dp" axis for ``fsdp+tp``; contenders and wire bytes as for ``fsdp``. The data
is split over the data-parallel ranks only.

Every byte count uses the ring model of :mod:`muonscale.distributed.comm`; per-rank numbers are
reported as mean and max over ranks.

This module is the driver (spawn, collect, report); what each rank builds and measures is in
:mod:`muonscale.bench.distributed_worker`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import socket
import sys
import time
from pathlib import Path
from typing import Any

from muonscale.bench.config import PARALLEL_MODES, BenchConfig
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
    config: BenchConfig,
    *,
    lrs: dict[str, float] | None = None,
    reduce_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    timeout_s: float = 900.0,
    print_table: bool = True,
) -> dict:
    """Train every contender of ``config.parallel`` on ``config.nproc`` gloo processes, side by
    side, for each of ``config.seeds`` seeds.

    Args:
        config: the bench (``nproc >= 2``); its model, data, schedule and optimizer flags
            are the single-process bench's.
        lrs: peak learning rates by contender (``muon``, ``adamw`` and each variant; default:
            ``config.lr_for``); ``muon-bf16reduce`` trains at ``muon``'s, ``adamw-zero1``
            and ``adamw-ddp`` at ``adamw``'s.
        reduce_dtypes: gradient-reduction dtypes of the dp Muon contenders ("float32" gives
            ``muon``, "bfloat16" gives ``muon-bf16reduce``).
        timeout_s: seconds to wait for the ranks' results of one seed.

    Returns the report dict (also written to ``config.out`` when set); its ``rows`` map
    contender names to final_train_loss, val_loss, val_losses at eval_steps, tokens_per_s
    (global), optimizer_step_ms (median over steps, max over ranks), wire_bytes_per_step and
    optimizer_state_bytes ({"mean", "max"} over ranks); with ``seeds > 1`` ``seeds`` holds
    every seed's rows and ``seed_spread`` the spread of the final losses.
    """
    from muonscale.bench.runner import train_config_for

    nproc, parallel = config.nproc, config.parallel
    muon = train_config_for(config, "muon", config.lr_muon)
    for name in config.parsed_variants:  # a bad variant option fails here, before any spawn
        train_config_for(config, name, config.lr_for(name))
    _check_parallel(parallel, nproc, muon.model_config())
    dp_size = mesh_shape(parallel, nproc)[0]
    if muon.micro_batch_size % dp_size:
        raise ValueError(
            f"the micro-batch ({muon.micro_batch_size} sequences: --micro-batch-size, or "
            f"--tokens-per-step / context length) must be divisible by the {dp_size} "
            "data-parallel ranks"
        )
    if parallel == "dp" and "float32" not in reduce_dtypes:
        raise ValueError("reduce_dtypes must include 'float32' (the muon reference row)")
    for name in reduce_dtypes:
        if name not in DTYPES:
            raise ValueError(f"unknown reduce dtype {name!r}; choose from {tuple(DTYPES)}")
    reduce_dtypes = ("float32", *[d for d in reduce_dtypes if d != "float32"])
    lrs = {name: config.lr_for(name) for name in ("muon", "adamw", *config.parsed_variants)} | (
        lrs or {}
    )
    start = time.perf_counter()
    per_seed = {}
    for seed in range(config.seed, config.seed + config.seeds):
        spec = {
            "bench": dataclasses.replace(config, seed=seed).to_dict(),
            "lrs": lrs,
            "reduce_dtypes": reduce_dtypes,
            "threads": config.threads,
            "progress": config.progress,
            "pg_timeout_s": 120.0,
        }
        per_seed[seed] = _launch(nproc, spec, timeout_s)
    result = per_seed[config.seed]
    report = _build_report(result, config, lrs, time.perf_counter() - start)
    if config.seeds > 1:
        report["seeds"] = {seed: r["rows"] for seed, r in per_seed.items()}
        report["seed_spread"] = _seed_spread(per_seed)
    table = format_table(report)
    if print_table:
        print(table)
    if config.out is not None:
        _write_outputs(report, table, config, per_seed)
    return report


def _seed_spread(per_seed: dict) -> dict:
    """Per contender: the spread over seeds of its final train and validation losses."""
    from muonscale.bench.seeds import spread

    first = next(iter(per_seed.values()))["rows"]
    return {
        name: {
            key: spread([r["rows"][name][key] for r in per_seed.values()])
            for key in ("final_train_loss", "val_loss")
        }
        for name, row in first.items()
        if not row.get("modelled")
    }


def _write_outputs(report: dict, table: str, config: BenchConfig, per_seed: dict) -> None:
    """report.json, report.md, and with --plots / --tensorboard the curves."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_files = []
    if config.plots:
        from muonscale.bench.plots import plot_distributed

        plot_files = plot_distributed(report, out)
        table += "".join(f"\n![{name}]({name})" for name in plot_files)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(table + "\n")
    if config.tensorboard is not None:
        from muonscale.bench.tensorboard_log import write_tensorboard_or_say_why

        records = {seed: _records(r["rows"]) for seed, r in per_seed.items()}
        write_tensorboard_or_say_why(
            records, config.tensorboard, lambda text: print(text, file=sys.stderr, flush=True)
        )


def _records(rows: dict) -> dict:
    """The trained rows as :class:`~muonscale.bench.side_by_side.ContenderRecord` s (the
    curves that --tensorboard writes)."""
    from itertools import accumulate

    from muonscale.bench.side_by_side import ContenderRecord

    records = {}
    for name, row in rows.items():
        if row.get("modelled"):
            continue
        elapsed = [0.0, *accumulate(row["step_seconds"])]
        records[name] = ContenderRecord(
            name=name,
            lr=row["lr"],
            eval_steps=list(row["eval_steps"]),
            val_losses=list(row["val_losses"]),
            eval_train_seconds=[elapsed[step] for step in row["eval_steps"]],
            train_losses=list(row["train_losses"]),
            step_seconds=list(row["step_seconds"]),
            max_attention_logits=list(row.get("max_attention_logits", [])),
            expert_tokens=list(row.get("expert_tokens", [])),
        )
    return records


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


def _build_report(result: dict, config: BenchConfig, lrs: dict, seconds: float) -> dict:
    rows = result["rows"]
    notes = []
    nproc = config.nproc
    report: dict[str, Any] = {
        "parallel": config.parallel,
        "nproc": nproc,
        "steps": config.steps,
        "seed": config.seed,
        "tokens_per_step": config.tokens_per_step,
        "lrs": lrs,
        "bench": config.to_dict(),
        "model": {"preset": config.model, **result["model_config"]},
        "n_params": result["n_params"],
        "torch_threads": result["torch_threads"],
        "single_process_muon_state_bytes": result["single_process_muon_state_bytes"],
        "wall_seconds": seconds,
        "rows": rows,
        "wire_model": "ring: all-reduce 2(N-1)/N*S; reduce-scatter, all-gather, all-to-all, "
        "broadcast (N-1)/N*S; bytes sent per rank per optimizer step",
    }
    for row in rows.values():
        row["modelled"] = False
    if config.parallel == "dp":
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
        dp_size, tp_size = mesh_shape(config.parallel, nproc)
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


def _flag_lines(report: dict) -> list[str]:
    """The bench flags set apart from their defaults (one line), when any."""
    defaults = BenchConfig().to_dict()
    skip = {"nproc", "parallel", "steps", "seed", "out", "n_layer", "d_model", "n_head"}
    changed = {
        name: value
        for name, value in report.get("bench", {}).items()
        if name not in skip and value != defaults.get(name)
    }
    if not changed:
        return []
    return ["flags: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in changed.items())]


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
    lines = [head, *_flag_lines(report), "", "| " + " | ".join(cols) + " |"]
    lines.append("|" + "---|" * len(cols))
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
    moe = [(name, row) for name, row in rows.items() if row.get("expert_load")]
    if moe:
        from muonscale.bench.moe import facts_lines, load_text

        lines += ["", "Expert load (tokens per expert ÷ the uniform share, least–most loaded):"]
        for name, row in moe:
            lines.append(f"- {name}: {load_text(row['expert_load'])}")
            lines += facts_lines(name, row.get("moe", {}), row["optimizer_step_ms"])
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
