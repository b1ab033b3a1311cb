"""Turn side-by-side records into ``report.json``, ``report.md`` and the terminal table.

``report.json`` layout (``schema_version`` 1)::

    steps_to_adamw_final_loss_ratio   muon steps to AdamW's final val loss / AdamW's steps
    throughput_ratio                  muon tokens/s / adamw tokens/s
    peak_memory_ratio, optimizer_state_ratio      muon / adamw
    contenders: {adamw: {...}, muon: {...}, torch_muon: {...}}   one dict per contender
    figures: [{name, value, note, published}]   this run's headline figures; ``published``
                                      is {value, source} of a figure reported elsewhere for
                                      the same quantity (context, not a pass mark), or null
    contenders.*: max_attention_logit, final_max_attention_logit, qk_clip_tau, qk_clip_steps,
        max_logit_ms, max_logit_step_fraction    the measured maximum attention logit (QK-clip
                                      contenders, or all with --track-max-logit), else null
    seeds                             --seeds > 1: per contender, mean/std/min/max over seeds of
                                      final_val_loss and steps_to_adamw_final_loss(_ratio)
    moe                               --mlp moe: per contender over seeds, the MoE table and how
                                      its optimizer holds the experts (muonscale.bench.moe)
    config, machine, sweep, wall_seconds

Per-contender fields are flat numbers plus a ``curves`` dict, so a distributed run can add
e.g. ``wire_bytes_per_step`` next to them without changing anything else.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Mapping
from pathlib import Path

from muonscale.bench.config import SHORT_RUN_STEPS, BenchConfig, report_key
from muonscale.bench.metrics import (
    median_after_warmup,
    ratio,
    steps_to_final_loss_ratio,
    steps_to_reach,
)
from muonscale.bench.side_by_side import ContenderRecord

SCHEMA_VERSION = 2

PUBLISHED_FIGURES = {
    "steps_to_adamw_final_loss_ratio": {
        "value": "~0.52 of AdamW's training FLOPs for the same loss",
        "source": "Moonshot AI, Muon is Scalable for LLM Training (Moonlight), arXiv:2502.16982",
    },
    "throughput_ratio": {
        "value": "0.979 (about 98% of AdamW's tokens/s), Kimi K2 on 256 GB300 GPUs",
        "source": "NVIDIA, Muon in Megatron-Core",
    },
}
"""Figures other implementations report for the quantities the bench measures, shown next to
this run's as context (different models, scales and machines)."""

OPTIMIZER_DESCRIPTIONS = {
    "adamw": "torch.optim.AdamW (fused when available) for every parameter",
    "muon": "muonscale.Muon (hidden matrices) + AdamW (the rest), one optimizer",
    "torch-muon": "torch.optim.Muon (hidden matrices; Newton-Schulz in float32 on CPU) "
    "+ torch.optim.AdamW (the rest)",
}


def describe_optimizer(config: BenchConfig, name: str) -> str:
    options = config.variant_options(name)
    if options is not None:
        args = ", ".join(f"{k}={v!r}" for k, v in options.items())
        return f"muonscale.Muon({args}) (hidden matrices) + AdamW (the rest), one optimizer"
    if name == "torch-muon-bf16":
        return "torch.optim.Muon, its own bfloat16 Newton-Schulz, + torch.optim.AdamW"
    return OPTIMIZER_DESCRIPTIONS.get(name, name)


def contender_summary(
    record: ContenderRecord,
    config: BenchConfig,
    reference: ContenderRecord | None,
    peak_memory: Mapping | None,
) -> dict:
    """One contender's entry in report.json."""
    warmup = config.timing_warmup_steps
    step_s = median_after_warmup(record.step_seconds, warmup) if record.step_seconds else None
    opt_s = median_after_warmup(record.optimizer_seconds, warmup) if record.step_seconds else None
    tokens_per_step = median_after_warmup(record.tokens, 0) if record.tokens else None
    summary = {
        "optimizer": describe_optimizer(config, record.name),
        "lr": record.lr,
        "steps": len(record.step_seconds),
        "tokens": int(sum(record.tokens)),
        "final_val_loss": _finite(record.val_losses[-1]) if record.val_losses else None,
        "final_train_loss": _finite(record.train_losses[-1]) if record.train_losses else None,
        "tokens_per_s": tokens_per_step / step_s if step_s else None,
        "step_ms": None if step_s is None else step_s * 1e3,
        "optimizer_step_ms": None if opt_s is None else opt_s * 1e3,
        "optimizer_state_bytes": int(record.optimizer_state_bytes),
        "peak_memory_bytes": None if peak_memory is None else peak_memory.get("peak_memory_bytes"),
        "peak_memory_source": None if peak_memory is None else peak_memory.get("source"),
        "train_seconds": record.train_seconds,
        "eval_seconds": record.eval_seconds,
        "diverged_at_step": record.diverged_at_step,
        "wire_bytes_per_step": None,  # single process: nothing crosses ranks
    }
    if reference is not None and reference.val_losses and record.val_losses:
        target = reference.val_losses[-1]
        summary["steps_to_adamw_final_loss"] = _finite_or_none(
            steps_to_reach(record.eval_steps, record.val_losses, target)
        )
        summary["steps_to_adamw_final_loss_ratio"] = _finite_or_none(
            steps_to_final_loss_ratio(
                reference.eval_steps, reference.val_losses, record.eval_steps, record.val_losses
            )
        )
    summary.update(max_logit_summary(record, config))
    if record.expert_tokens:  # --mlp moe
        from muonscale.bench.moe import expert_load

        summary["expert_load"] = expert_load(record.expert_tokens)
    summary["curves"] = {
        "eval_steps": record.eval_steps,
        "val_loss": [_finite(x) for x in record.val_losses],
        "eval_train_seconds": record.eval_train_seconds,
        "train_loss": [_finite(x) for x in record.train_losses],
        "max_attention_logit": [_finite(x) for x in record.max_attention_logits],
    }
    return summary


def max_logit_summary(record: ContenderRecord, config: BenchConfig) -> dict:
    """A contender's maximum attention logit (all ``None`` when its run did not measure it):
    the largest over the run and at the last step, QK-clip's tau and the number of steps where
    the clip acted (some head's maximum above tau), and the measurement's cost per step (median
    after warm-up, in ms and as a fraction of the step's time)."""
    tau = config.qk_clip_for(record.name)
    logits = record.max_attention_logits
    if not logits:
        return {
            "qk_clip_tau": tau,
            "max_attention_logit": None,
            "final_max_attention_logit": None,
            "qk_clip_steps": None,
            "max_logit_ms": None,
            "max_logit_step_fraction": None,
        }
    warmup = config.timing_warmup_steps
    fractions = [p / s for p, s in zip(record.max_logit_seconds, record.step_seconds) if s > 0]
    return {
        "qk_clip_tau": tau,
        "max_attention_logit": _finite(max(logits)),
        "final_max_attention_logit": _finite(logits[-1]),
        "qk_clip_steps": None if tau is None else sum(x > tau for x in logits),
        "max_logit_ms": median_after_warmup(record.max_logit_seconds, warmup) * 1e3,
        "max_logit_step_fraction": median_after_warmup(fractions, warmup) if fractions else None,
    }


def build_report(
    records: Mapping[str, ContenderRecord],
    config: BenchConfig,
    *,
    peak_memory: Mapping[str, Mapping] | None = None,
    resolved: Mapping | None = None,
    sweep: Mapping | None = None,
    seeds: Mapping | None = None,
    wall_seconds: float | None = None,
    machine: Mapping | None = None,
) -> dict:
    """The whole report.json as a dict (see the module docstring for the layout)."""
    peak_memory = peak_memory or {}
    reference = records.get("adamw")
    contenders = {
        report_key(name): contender_summary(record, config, reference, peak_memory.get(name))
        for name, record in records.items()
    }
    adamw, muon = contenders.get("adamw", {}), contenders.get("muon", {})
    report = {
        "schema_version": SCHEMA_VERSION,
        "steps_to_adamw_final_loss_ratio": muon.get("steps_to_adamw_final_loss_ratio"),
        "throughput_ratio": ratio(muon.get("tokens_per_s"), adamw.get("tokens_per_s")),
        "optimizer_step_ratio": ratio(
            muon.get("optimizer_step_ms"), adamw.get("optimizer_step_ms")
        ),
        "peak_memory_ratio": ratio(muon.get("peak_memory_bytes"), adamw.get("peak_memory_bytes")),
        "optimizer_state_ratio": ratio(
            muon.get("optimizer_state_bytes"), adamw.get("optimizer_state_bytes")
        ),
        "contenders": contenders,
    }
    report["figures"] = headline_figures(report)
    report["config"] = {"bench": config.to_dict(), **(resolved or {})}
    report["machine"] = dict(machine) if machine is not None else machine_info()
    report["sweep"] = sweep
    report["seeds"] = json_safe(seeds) if seeds is not None else None
    report["wall_seconds"] = wall_seconds
    return report


def headline_figures(report: Mapping) -> list[dict]:
    """This run's headline figures, each with a note when it could not be computed and the
    published figure for the same quantity, if any (:data:`PUBLISHED_FIGURES`)."""
    contenders = report["contenders"]
    figures = []

    def add(name, value, note=""):
        published = PUBLISHED_FIGURES.get(name)
        figures.append({"name": name, "value": value, "note": note, "published": published})

    steps_ratio = report["steps_to_adamw_final_loss_ratio"]
    add(
        "steps_to_adamw_final_loss_ratio",
        steps_ratio,
        "" if steps_ratio is not None else "muon never reached AdamW's final validation loss",
    )
    if "torch_muon" in contenders:
        muon_loss = contenders.get("muon", {}).get("final_val_loss")
        torch_loss = contenders["torch_muon"].get("final_val_loss")
        delta = None if muon_loss is None or torch_loss is None else muon_loss - torch_loss
        add("muon_final_loss_minus_torch_muon", delta)
    add("throughput_ratio", report["throughput_ratio"])
    memory = report["peak_memory_ratio"]
    add("peak_memory_ratio", memory, "memory probes skipped" if memory is None else "")
    return figures


def machine_info() -> dict:
    """CPU, core count, torch version, accelerator and date of this run."""
    import torch

    info = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def json_safe(value):
    """Nested dicts/lists with every non-finite float as None (JSON has no NaN)."""
    if isinstance(value, Mapping):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float):
        return _finite(value)
    return value


def _finite(x: float) -> float | None:
    """JSON has no NaN/inf: a diverged loss is written as null."""
    x = float(x)
    return x if math.isfinite(x) else None


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None else _finite(x)


# ----------------------------------------------------------------------------- text output


def _fmt(x, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f}"


def format_table(report: Mapping) -> str:
    """The results as a Markdown table plus the headline figures, each next to the published
    figure for the same quantity where there is one (terminal and report.md)."""
    header = (
        "| contender | lr | final val loss | steps to AdamW final | tokens/s | step ms "
        "| optimizer ms | state MiB | peak MiB |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, c in report["contenders"].items():
        reached = c.get("steps_to_adamw_final_loss")
        reached_ratio = c.get("steps_to_adamw_final_loss_ratio")
        reached_text = "never" if reached is None else f"{reached:.0f} ({reached_ratio:.2f}x)"
        lines.append(
            f"| {name} | {c['lr']:.3g} | {_fmt(c['final_val_loss'], '.4f')} | {reached_text} "
            f"| {_fmt(c['tokens_per_s'], ',.0f')} | {_fmt(c['step_ms'], '.1f')} "
            f"| {_fmt(c['optimizer_step_ms'], '.2f')} | {_mib(c['optimizer_state_bytes'])} "
            f"| {_mib(c['peak_memory_bytes'])} |"
        )
    lines.append("")
    lines += _adamw_half_note(report)
    lines += _muon_weight_decay_note(report)
    lines += _short_run_note(report)
    for f in report["figures"]:
        line = f"- {f['name']} = {_fmt(f['value'], '.3f', 'null')}"
        if f["note"]:
            line += f" ({f['note']})"
        if f["published"]:
            line += f"; published: {f['published']['value']} ({f['published']['source']})"
        lines.append(line)
    max_logit_table = format_max_logit_table(report)
    if max_logit_table:
        lines += ["", max_logit_table]
    if report.get("seeds"):
        from muonscale.bench.seeds import format_seed_table

        lines += ["", format_seed_table(report["seeds"])]
    if report.get("moe"):
        from muonscale.bench.moe import format_moe_table

        lines += ["", format_moe_table(report["moe"])]
    return "\n".join(lines)


def _adamw_half_note(report: Mapping) -> list[str]:
    """The AdamW half's learning rate of the Muon contenders (the lr column is the Muon half's),
    when a single-process bench set one."""
    bench = (report.get("config") or {}).get("bench") or {}
    lr = bench.get("muon_adamw_lr")
    if lr is None:
        return []
    return [
        f"- Muon contenders: lr is the Muon half's; their AdamW half (embeddings, head, norms, "
        f"biases) trains at {lr:.3g} (--muon-adamw-lr; a variant's adamw_lr overrides it)"
    ]


def _muon_weight_decay_note(report: Mapping) -> list[str]:
    """The Muon contenders' weight decay, when --muon-weight-decay set one apart from AdamW's."""
    bench = (report.get("config") or {}).get("bench") or {}
    decay = bench.get("muon_weight_decay")
    if decay is None:
        return []
    return [
        f"- Muon contenders: weight decay {decay:.3g} (--muon-weight-decay; a variant's "
        f"weight_decay overrides it); AdamW's: {bench['weight_decay']:.3g}"
    ]


def _short_run_note(report: Mapping) -> list[str]:
    """Says so when ``--steps`` is too short for the comparison to mean anything."""
    steps = ((report.get("config") or {}).get("bench") or {}).get("steps")
    if steps is None or steps >= SHORT_RUN_STEPS:
        return []
    return [
        f"- note: {steps} steps are too short for this comparison to mean anything. The "
        f"learning rates and warm-up are tuned for the default {BenchConfig.steps} steps, and "
        "AdamW leads early: on the default model Muon never reaches AdamW's final loss in 10 "
        "or 30 steps, and needs 0.64x its steps in 100 and 0.28x in 320. Run --steps "
        f"{SHORT_RUN_STEPS} or more (about a minute on the default model on a CPU) for a quick "
        "look that shows the difference."
    ]


def format_max_logit_table(report: Mapping) -> str:
    """The maximum attention logit of the contenders that measured it ("" when none did)."""
    contenders = report["contenders"]
    rows = [(n, c) for n, c in contenders.items() if c.get("max_attention_logit") is not None]
    if not rows:
        return ""
    header = (
        "| contender | QK-clip tau | max attention logit | final | steps clipped "
        "| measuring it ms/step (% of step) |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for name, c in rows:
        fraction = c["max_logit_step_fraction"]
        clipped = "-" if c["qk_clip_steps"] is None else f"{c['qk_clip_steps']} of {c['steps']}"
        cost = f"{_fmt(c['max_logit_ms'], '.2f')} ({_fmt(fraction and 100 * fraction, '.1f')}%)"
        lines.append(
            f"| {name} | {_fmt(c['qk_clip_tau'], '.4g', 'off')} | "
            f"{_fmt(c['max_attention_logit'], '.2f')} | "
            f"{_fmt(c['final_max_attention_logit'], '.2f')} | "
            f"{clipped} | {cost} |"
        )
    return "\n".join(lines)


def format_markdown(report: Mapping, plot_files: list[str]) -> str:
    cfg = report["config"]["bench"]
    machine = report["machine"]
    parts = [
        "# muonscale bench",
        "",
        f"{machine.get('date', '')} - {machine.get('cpu', '')} ({machine.get('cpu_count')} cores)"
        f", torch {machine.get('torch', '')}, device {cfg['device']}",
        "",
        f"{cfg['steps']} steps x {cfg['tokens_per_step']} tokens per contender, model "
        f"`{cfg['model']}`, seed {cfg['seed']}; steps interleaved, timings are medians after "
        f"{cfg['timing_warmup_steps']} warm-up steps.",
        "",
        format_table(report),
        "",
    ]
    parts += [f"![{name}]({name})" for name in plot_files]
    if report.get("sweep"):
        parts += [
            "",
            "## Learning-rate sweep",
            "",
            "| contender | lr | final val loss |",
            "|---|---|---|",
        ]
        for name, rows in report["sweep"]["results"].items():
            for row in rows:
                parts.append(f"| {name} | {row['lr']:.3g} | {_fmt(row['final_val_loss'], '.4f')} |")
    parts += [
        "",
        "## Config",
        "",
        "```json",
        json.dumps(report["config"], indent=2, sort_keys=True),
        "```",
        "",
    ]
    return "\n".join(parts)


def write_report(report: Mapping, out_dir: Path, plot_files: list[str]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    (out_dir / "report.md").write_text(format_markdown(report, plot_files))
