"""The bench's honesty aids: the short-run note in its table (and report.md), and the label
train_loss.png puts on a step whose batch is harder for every contender."""

import math
import random

import pytest

from muonscale.bench.config import SHORT_RUN_STEPS, BenchConfig
from muonscale.bench.plots import plot_report, shared_spikes
from muonscale.bench.report import build_report, format_table
from muonscale.bench.side_by_side import ContenderRecord

MACHINE = {"date": "2026-01-01T00:00:00Z", "cpu": "test cpu", "cpu_count": 2, "torch": "x"}


def _report(steps: int, train_losses: dict[str, list[float]]) -> dict:
    records = {
        name: ContenderRecord(
            name=name,
            lr=1e-3,
            eval_steps=[0, steps],
            val_losses=[4.0, 3.0 if name == "adamw" else 3.5],
            eval_train_seconds=[0.0, 1.0],
            train_losses=losses,
            step_seconds=[0.1] * steps,
            optimizer_seconds=[0.01] * steps,
            tokens=[1024] * steps,
        )
        for name, losses in train_losses.items()
    }
    config = BenchConfig(steps=steps, timing_warmup_steps=0, memory_probe_steps=0)
    return build_report(records, config, machine=MACHINE, wall_seconds=1.0)


@pytest.mark.parametrize("steps", [10, SHORT_RUN_STEPS - 1])
def test_a_short_run_says_its_comparison_means_little(steps):
    table = format_table(_report(steps, {"adamw": [3.0] * steps, "muon": [3.2] * steps}))
    (note,) = [line for line in table.splitlines() if line.startswith("- note:")]
    assert f"{steps} steps are too short" in note
    assert f"--steps {SHORT_RUN_STEPS}" in note


def test_a_run_of_enough_steps_has_no_short_run_note():
    steps = SHORT_RUN_STEPS
    table = format_table(_report(steps, {"adamw": [3.0] * steps, "muon": [3.2] * steps}))
    assert "too short" not in table


def _noisy(n: int, seed: int, level: float) -> list[float]:
    rng = random.Random(seed)
    return [level + 2.0 * math.exp(-i / 40) + rng.gauss(0, 0.03) for i in range(n)]


def test_a_batch_harder_for_every_contender_is_found_at_its_step():
    adamw, muon = _noisy(320, 0, 2.5), _noisy(320, 1, 2.4)
    adamw[288] += 0.5  # step 289 (1-based): the same batch for both
    muon[288] += 0.45
    muon[150] += 0.6  # a spike of one contender only: its own, not the batch's
    ((step, rise),) = shared_spikes(
        {n: {"curves": {"train_loss": v}} for n, v in (("adamw", adamw), ("muon", muon))}
    )
    assert step == 289
    assert rise == pytest.approx(0.45, abs=0.1)  # the smaller rise, less the noise around it


def test_smooth_curves_have_no_spike():
    curves = {n: {"curves": {"train_loss": _noisy(320, s, 2.5)}} for n, s in (("a", 0), ("b", 1))}
    assert shared_spikes(curves) == []


def test_train_loss_plot_is_written_with_the_label(tmp_path):
    pytest.importorskip("matplotlib")
    adamw, muon = _noisy(320, 0, 2.5), _noisy(320, 1, 2.4)
    adamw[288] += 0.5
    muon[288] += 0.5
    report = _report(320, {"adamw": adamw, "muon": muon})
    assert plot_report(report, tmp_path) == ["bench.png", "train_loss.png"]
    assert (tmp_path / "train_loss.png").stat().st_size > 0
