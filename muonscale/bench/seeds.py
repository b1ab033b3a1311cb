"""``--seeds N``: mean and spread of each contender's figures over seeds (pure Python).

For every seed, AdamW's final validation loss *of that seed* is the target that the other
contenders' curves of that seed must reach; the per-seed steps (and steps ratios) are then
aggregated. A seed whose curve never reaches the target is counted in ``reached`` and left
out of the statistics, which are ``None`` when no seed reached it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from muonscale.bench.metrics import steps_to_final_loss_ratio, steps_to_reach
from muonscale.bench.side_by_side import ContenderRecord


def spread(values: Sequence[float | None]) -> dict:
    """``{n, reached, mean, std, min, max, values}`` of the finite values (``std``: sample
    standard deviation, 0 for a single value; ``None`` fields when no value is finite)."""
    finite = [float(v) for v in values if v is not None and math.isfinite(v)]
    stats = {"n": len(values), "reached": len(finite), "values": list(values)}
    if not finite:
        return {**stats, "mean": None, "std": None, "min": None, "max": None}
    return {
        **stats,
        "mean": statistics.fmean(finite),
        "std": statistics.stdev(finite) if len(finite) > 1 else 0.0,
        "min": min(finite),
        "max": max(finite),
    }


def seed_summary(per_seed: Mapping[int, Mapping[str, ContenderRecord]]) -> dict:
    """``{"seeds": [...], "contenders": {name: {final_val_loss, steps_to_adamw_final_loss,
    steps_to_adamw_final_loss_ratio}}}``, each a :func:`spread` over the seeds that ran the
    contender (AdamW's run of the same seed is the reference)."""
    seeds = list(per_seed)
    names: list[str] = []
    for records in per_seed.values():
        names += [n for n in records if n not in names]
    contenders = {}
    for name in names:
        finals, steps, ratios, ran = [], [], [], []
        for seed, records in per_seed.items():
            record = records.get(name)
            if record is None:
                continue
            ran.append(seed)
            finals.append(record.val_losses[-1] if record.val_losses else None)
            reference = records.get("adamw")
            reached = ratio = None
            if reference is not None and reference.val_losses and record.val_losses:
                target = reference.val_losses[-1]
                if math.isfinite(target):
                    reached = steps_to_reach(record.eval_steps, record.val_losses, target)
                    ratio = steps_to_final_loss_ratio(
                        reference.eval_steps,
                        reference.val_losses,
                        record.eval_steps,
                        record.val_losses,
                    )
            steps.append(reached)
            ratios.append(ratio)
        contenders[name] = {
            "seeds": ran,
            "final_val_loss": spread(finals),
            "steps_to_adamw_final_loss": spread(steps),
            "steps_to_adamw_final_loss_ratio": spread(ratios),
        }
    return {"seeds": seeds, "contenders": contenders}


def format_seed_table(summary: Mapping) -> str:
    """Markdown table: mean ± std [min–max] per contender over the seeds."""

    def cell(stats: Mapping, spec: str) -> str:
        if stats["mean"] is None:
            return "never" if stats["n"] else "-"
        text = (
            f"{stats['mean']:{spec}} ± {stats['std']:{spec}} "
            f"[{stats['min']:{spec}}–{stats['max']:{spec}}]"
        )
        if stats["reached"] < stats["n"]:
            text += f" ({stats['reached']}/{stats['n']} seeds reached)"
        return text

    lines = [
        f"Across seeds {', '.join(map(str, summary['seeds']))} "
        "(mean ± std [min–max]; each seed against AdamW's final loss of that seed):",
        "",
        "| contender | seeds | final val loss | steps to AdamW final | ratio |",
        "|---|---|---|---|---|",
    ]
    for name, c in summary["contenders"].items():
        lines.append(
            f"| {name} | {len(c['seeds'])} | {cell(c['final_val_loss'], '.4f')} "
            f"| {cell(c['steps_to_adamw_final_loss'], '.1f')} "
            f"| {cell(c['steps_to_adamw_final_loss_ratio'], '.3f')} |"
        )
    return "\n".join(lines)
