"""PNG plots of a bench report (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

COLORS = {"adamw": "#1f77b4", "muon": "#d62728", "torch_muon": "#2ca02c"}
_OTHER_COLORS = ["#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]


def _color(name: str) -> str:
    """A fixed color per contender; others (variants, torch_muon_bf16) from a palette."""
    if name in COLORS:
        return COLORS[name]
    return _OTHER_COLORS[sum(map(ord, name)) % len(_OTHER_COLORS)]


LABELS = {"adamw": "AdamW", "muon": "muonscale Muon", "torch_muon": "torch.optim.Muon"}
BAR_LABELS = {"adamw": "AdamW", "muon": "muonscale\nMuon", "torch_muon": "torch.optim\nMuon"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(name: str, c: Mapping) -> str:
    return f"{LABELS.get(name, name)} (lr {c['lr']:.3g})"


def _loss_ylim(contenders: Mapping) -> tuple[float, float] | None:
    """Zoom on the part of the curves that differs: skip the first ~10% of evaluations."""
    tails, lows = [], []
    for c in contenders.values():
        losses = [x for x in c["curves"]["val_loss"] if x is not None]
        if len(losses) >= 5:
            tails.append(losses[max(1, len(losses) // 10)])
            lows.append(min(losses))
    if not tails:
        return None
    low, high = min(lows), max(tails)
    pad = 0.05 * (high - low) if high > low else 0.1
    return low - pad, high + pad


def _plot_losses(ax, contenders: Mapping, x_key: str, mark_target: bool) -> None:
    for name, c in contenders.items():
        curves = c["curves"]
        ax.plot(
            curves[x_key],
            [float("nan") if x is None else x for x in curves["val_loss"]],
            label=_label(name, c),
            color=_color(name),
            linewidth=1.8,
        )
    adamw = contenders.get("adamw")
    if adamw and adamw["final_val_loss"] is not None:
        ax.axhline(adamw["final_val_loss"], color="0.4", linestyle=":", linewidth=1)
        if mark_target:
            for name, c in contenders.items():
                reached = c.get("steps_to_adamw_final_loss")
                if name != "adamw" and reached is not None:
                    ax.plot([reached], [adamw["final_val_loss"]], "o", color=_color(name))
                    ax.annotate(
                        f"{c['steps_to_adamw_final_loss_ratio']:.2f}x AdamW's steps",
                        (reached, adamw["final_val_loss"]),
                        textcoords="offset points",
                        xytext=(8, -16),
                        ha="left",
                        color=_color(name),
                        fontweight="bold",
                    )
    ylim = _loss_ylim(contenders)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_ylabel("validation loss (nats/byte)")
    ax.grid(alpha=0.3)


def plot_report(report: Mapping, out_dir: Path, *, train_loss: bool = True) -> list[str]:
    """Write ``bench.png`` (val loss vs steps, vs wall-clock, throughput) and optionally
    ``train_loss.png``; return the file names written."""
    plt = _pyplot()
    contenders = report["contenders"]
    cfg = report["config"]["bench"]
    fig, (ax_steps, ax_time, ax_tput) = plt.subplots(
        1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [1.2, 1.2, 0.8]}
    )
    _plot_losses(ax_steps, contenders, "eval_steps", mark_target=True)
    ax_steps.set_xlabel("optimizer step")
    ax_steps.set_title("validation loss vs steps")
    ax_steps.legend(loc="upper right")
    _plot_losses(ax_time, contenders, "eval_train_seconds", mark_target=False)
    ax_time.set_xlabel("training wall-clock (s, evaluation excluded)")
    ax_time.set_title("validation loss vs wall-clock")

    names = list(contenders)
    tput = [contenders[n]["tokens_per_s"] or 0.0 for n in names]
    bars = ax_tput.bar(
        [BAR_LABELS.get(n, n) for n in names], tput, color=[_color(n) for n in names]
    )
    for bar, name in zip(bars, names):
        c = contenders[name]
        ax_tput.annotate(
            f"{c['tokens_per_s'] or 0:,.0f} tok/s\nopt {c['optimizer_step_ms'] or 0:.1f} ms",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            va="bottom",
            fontsize=9,
        )
    ax_tput.set_ylim(0, max(tput + [1.0]) * 1.25)
    ax_tput.set_ylabel("tokens / s (median after warm-up)")
    ratio = report.get("throughput_ratio")
    ax_tput.set_title("throughput" + ("" if ratio is None else f" (Muon / AdamW = {ratio:.3f})"))
    ax_tput.grid(axis="y", alpha=0.3)

    fig.suptitle(
        f"muonscale bench: model {cfg['model']}, {cfg['steps']} steps x "
        f"{cfg['tokens_per_step']} tokens, device {cfg['device']}, seed {cfg['seed']}"
    )
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "bench.png", dpi=110)
    plt.close(fig)
    written = ["bench.png"]

    if train_loss:
        fig, ax = plt.subplots(figsize=(8, 4.8))
        for name, c in contenders.items():
            losses = [float("nan") if x is None else x for x in c["curves"]["train_loss"]]
            steps = range(1, len(losses) + 1)
            ax.plot(steps, losses, color=_color(name), linewidth=0.6, alpha=0.3)
            ax.plot(steps, _smooth(losses), label=_label(name, c), color=_color(name), lw=1.5)
        ylim = _loss_ylim(contenders)
        if ylim is not None:
            ax.set_ylim(ylim[0], ylim[1] + 0.2)
        for step, rise in shared_spikes(contenders):
            ax.axvline(step, color="0.35", linestyle=":", linewidth=1)
            ax.annotate(
                f"step {step}: a harder batch, +{rise:.2f} for every contender\n"
                "(all train on the same batches; the EMA carries it on)",
                (step, ax.get_ylim()[1]),
                textcoords="offset points",
                xytext=(-4, -4),
                ha="right",
                va="top",
                fontsize=8,
                color="0.25",
            )
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("train loss (faint: per step; line: EMA 0.9)")
        ax.set_title("training loss")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left" if shared_spikes(contenders) else "upper right")
        fig.tight_layout()
        fig.savefig(out_dir / "train_loss.png", dpi=110)
        plt.close(fig)
        written.append("train_loss.png")
    return written


def plot_max_logits(report: Mapping, out_dir: Path) -> list[str]:
    """Write ``max_logit.png`` (each measured contender's maximum attention logit per step,
    QK-clip's tau dashed in the contender's color); ``[]`` when no contender measured it."""
    contenders = {
        n: c for n, c in report["contenders"].items() if c["curves"].get("max_attention_logit")
    }
    if not contenders:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8))
    for name, c in contenders.items():
        logits = [float("nan") if x is None else x for x in c["curves"]["max_attention_logit"]]
        ax.plot(
            range(1, len(logits) + 1),
            logits,
            label=_label(name, c),
            color=_color(name),
            linewidth=1.5,
        )
        if c.get("qk_clip_tau") is not None:
            ax.axhline(c["qk_clip_tau"], color=_color(name), linestyle="--", linewidth=1)
            ax.annotate(
                f"tau {c['qk_clip_tau']:.4g} ({c['qk_clip_steps']} steps clipped)",
                (1, c["qk_clip_tau"]),
                textcoords="offset points",
                xytext=(2, 4),
                color=_color(name),
            )
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("max attention logit (any head, before the update)")
    ax.set_title("maximum attention logit")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_dir / "max_logit.png", dpi=110)
    plt.close(fig)
    return ["max_logit.png"]


def shared_spikes(
    contenders: Mapping, *, window: int = 10, threshold: float = 6.0, most: int = 3
) -> list[tuple[int, float]]:
    """``[(step, rise)]``: the steps whose training loss stands out of its neighbourhood for
    every contender, at most ``most``, largest first.

    Every contender trains on the same batches (a pure function of seed and step), so one batch
    that is harder than the rest (say, windows of a line of underscores in the text) raises
    every curve at the same step; the EMA turns that into a jump that decays. ``rise`` is the
    smallest, over the contenders, of the loss minus the larger of the medians of the ``window``
    steps before and after it (NaN at either end); a step counts where every contender's rise
    exceeds ``threshold`` robust standard deviations (1.4826 x the median absolute rise) of its
    own curve."""
    rises_per_contender = []
    for c in contenders.values():
        losses = [float("nan") if x is None else float(x) for x in c["curves"]["train_loss"]]
        rises = []
        for i, loss in enumerate(losses):
            left = _median(losses[max(0, i - window) : i])
            right = _median(losses[i + 1 : i + 1 + window])
            # the larger side: a falling curve is no spike; NaN at either end (NaN - x is NaN)
            rises.append(loss - max(left, right) if math.isfinite(left + right) else math.nan)
        finite = sorted(abs(r) for r in rises if math.isfinite(r))
        if not finite:
            return []
        scale = 1.4826 * finite[len(finite) // 2]
        rises_per_contender.append((rises, threshold * scale))
    if not rises_per_contender:
        return []
    steps = min(len(rises) for rises, _ in rises_per_contender)
    found = []
    for i in range(steps):
        if all(rises[i] > limit for rises, limit in rises_per_contender):
            found.append((i + 1, min(rises[i] for rises, _ in rises_per_contender)))
    return sorted(found, key=lambda s: -s[1])[:most]


def _median(values: list[float]) -> float:
    finite = sorted(x for x in values if math.isfinite(x))
    return finite[len(finite) // 2] if finite else float("nan")


def _smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average, as training-loss plots usually show."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def plot_distributed(report: Mapping, out_dir: Path) -> list[str]:
    """``val_loss.png`` of a distributed bench report: each trained contender's validation
    loss against the optimizer step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, row in report["rows"].items():
        if not row.get("modelled"):
            ax.plot(row["eval_steps"], row["val_losses"], label=name, color=_color(name))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"--nproc {report['nproc']} --parallel {report['parallel']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "val_loss.png", dpi=120)
    plt.close(fig)
    return ["val_loss.png"]
