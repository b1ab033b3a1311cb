"""``--seeds N``: mean and spread of each contender's figures over seeds (pure Python).

For every seed, AdamW's final validation loss *of that seed* is the target that the other
contenders' curves of that seed must reach; the per-seed steps (and steps ratios) are then
aggregated. A seed whose curve never reaches the target is counted in ``reached`` and left
out of the statistics, which are ``None`` when no seed reached it.

When ``torch-muon`` ran, every other Muon contender is also compared with it seed by seed
(:func:`fewer_steps_than`): the same seed shares model initialization and data order, so the
paired figure is what a claim "x% fewer steps than torch.optim.Muon" rests on.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from muonscale.bench.metrics import steps_to_final_loss_ratio, steps_to_reach
from muonscale.bench.side_by_side import ContenderRecord


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def spread(values: Sequence[float | None]) -> dict:
    """``{n, reached, mean, std, min, max, values}`` of the finite values (``std``: sample
    standard deviation, 0 for a single value; ``None`` fields when no value is finite)."""
    finite = [float(v) for v in values if _finite(v)]
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


BASELINE = "torch-muon"
"""The contender every Muon contender is compared with, seed by seed, when it ran."""

COMPARISON_KEY = "fewer_steps_than_torch_muon"
"""Key of a contender's paired comparison with :data:`BASELINE` (:func:`fewer_steps_than`)."""

NOT_COMPARED = ("adamw", BASELINE, "torch-muon-bf16")
"""Contenders not compared with :data:`BASELINE` (AdamW is the target; the other two are it)."""


T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip
"""Student's t 0.975 quantile for 1 … 30 degrees of freedom (the standard two-sided 95% table,
e.g. NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.2)."""


def t_quantile_975(dof: int) -> float:
    """Student's t 0.975 quantile: :data:`T_975` up to 30 degrees of freedom, beyond it the
    Cornish–Fisher expansion around the normal quantile 1.959964 (error < 1e-3 there)."""
    if dof < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {dof}")
    if dof <= len(T_975):
        return T_975[dof - 1]
    z = 1.959964
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def paired_interval(fractions: Sequence[float]) -> tuple[float, float] | None:
    """95% confidence interval of the mean of per-seed paired figures (Student's t over the
    seeds; None for fewer than two)."""
    n = len(fractions)
    if n < 2:
        return None
    mean = statistics.fmean(fractions)
    half = t_quantile_975(n - 1) * statistics.stdev(fractions) / math.sqrt(n)
    return (mean - half, mean + half)


def fewer_steps_than(steps: Sequence[float | None], baseline: Sequence[float | None]) -> dict:
    """How many fewer steps ``steps`` needs than ``baseline`` (both per seed, aligned), over the
    seeds where both reached the target: ``{"seeds_compared", "per_seed", "of_means",
    "per_seed_mean", "per_seed_ci95"}``; ``per_seed[i] = 1 - steps[i] / baseline[i]`` (None
    where either never reached), ``of_means = 1 - mean(steps) / mean(baseline)`` over the
    compared seeds, and the mean of the compared ``per_seed`` figures with its 95% interval
    (:func:`paired_interval`); None where there is too little to compute them."""
    if len(steps) != len(baseline):
        raise ValueError(f"per-seed lists differ in length: {len(steps)} != {len(baseline)}")
    compared = [_finite(s) and _finite(b) and b > 0 for s, b in zip(steps, baseline, strict=True)]
    per_seed = [1.0 - s / b if ok else None for s, b, ok in zip(steps, baseline, compared)]
    pairs = [(s, b) for s, b, ok in zip(steps, baseline, compared) if ok]
    of_means = 1.0 - sum(s for s, _ in pairs) / sum(b for _, b in pairs) if pairs else None
    fractions = [f for f in per_seed if f is not None]
    return {
        "seeds_compared": len(pairs),
        "per_seed": per_seed,
        "of_means": of_means,
        "per_seed_mean": statistics.fmean(fractions) if fractions else None,
        "per_seed_ci95": paired_interval(fractions),
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
    steps_by_seed: dict[str, dict[int, float | None]] = {}
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
        steps_by_seed[name] = dict(zip(ran, steps, strict=True))
        contenders[name] = {
            "seeds": ran,
            "final_val_loss": spread(finals),
            "steps_to_adamw_final_loss": spread(steps),
            "steps_to_adamw_final_loss_ratio": spread(ratios),
        }
    if BASELINE in steps_by_seed:
        baseline = steps_by_seed[BASELINE]
        for name, c in contenders.items():
            if name in NOT_COMPARED:
                continue
            both = [seed for seed in c["seeds"] if seed in baseline]
            mine = steps_by_seed[name]
            c[COMPARISON_KEY] = {
                "seeds": both,
                **fewer_steps_than([mine[s] for s in both], [baseline[s] for s in both]),
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

    compared = any(COMPARISON_KEY in c for c in summary["contenders"].values())

    def versus(c: Mapping) -> str:
        if COMPARISON_KEY not in c:
            return "-"
        figure = c[COMPARISON_KEY]
        if figure["of_means"] is None:
            return "no seed where both reached"
        per_seed = "/".join("-" if v is None else f"{100 * v:.1f}" for v in figure["per_seed"])
        text = f"{100 * figure['of_means']:.1f}% (per seed {per_seed}"
        interval = figure.get("per_seed_ci95")
        if interval is not None:
            low, high = interval
            text += (
                f"; their mean {100 * figure['per_seed_mean']:.1f}%, "
                f"95% CI {100 * low:.1f} to {100 * high:.1f}%"
            )
        return text + ")"

    header = "| contender | seeds | final val loss | steps to AdamW final | ratio |"
    if compared:
        header += f" fewer steps than {BASELINE} |"
    lines = [
        f"Across seeds {', '.join(map(str, summary['seeds']))} "
        "(mean ± std [min–max]; each seed against AdamW's final loss of that seed):",
        "",
        header,
        "|" + "---|" * header.count(" |"),
    ]
    for name, c in summary["contenders"].items():
        row = (
            f"| {name} | {len(c['seeds'])} | {cell(c['final_val_loss'], '.4f')} "
            f"| {cell(c['steps_to_adamw_final_loss'], '.1f')} "
            f"| {cell(c['steps_to_adamw_final_loss_ratio'], '.3f')} |"
        )
        if compared:
            row += f" {versus(c)} |"
        lines.append(row)
    if compared:
        lines += [
            "",
            f"Fewer steps than {BASELINE}: 1 − mean steps ÷ {BASELINE}'s mean steps, over the "
            "seeds where both reached AdamW's final loss (per seed: 1 − steps ÷ its steps; "
            "95% CI: Student's t interval of the per-seed figures' mean, from two seeds on).",
        ]
    return "\n".join(lines)
