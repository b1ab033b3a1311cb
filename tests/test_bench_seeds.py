"""``--seeds N``: mean and spread over seeds, from fake per-seed results and a real tiny run;
and a longer budget (``--steps 1000``) through the whole pipeline."""

from __future__ import annotations

import json
import math

import pytest
from bench_tiny import TINY_CONFIG, LinearRun

from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig
from muonscale.bench.metrics import steps_to_reach
from muonscale.bench.seeds import (
    T_975,
    fewer_steps_than,
    format_seed_table,
    paired_interval,
    seed_summary,
    spread,
    t_quantile_975,
)
from muonscale.bench.side_by_side import ContenderRecord
from muonscale.bench.store import record_from_dict


def test_spread_is_mean_sample_std_min_max():
    values = [2.0, 4.0, 9.0]
    mean = sum(values) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    stats = spread(values)
    assert stats["mean"] == pytest.approx(mean, rel=1e-15)
    assert stats["std"] == pytest.approx(std, rel=1e-15)
    assert (stats["min"], stats["max"], stats["n"], stats["reached"]) == (2.0, 9.0, 3, 3)


def test_spread_leaves_out_seeds_that_never_reached():
    stats = spread([3.0, None, math.nan, 5.0])
    assert (stats["n"], stats["reached"], stats["mean"], stats["min"]) == (4, 2, 4.0, 3.0)
    assert spread([None])["mean"] is None and spread([7.0])["std"] == 0.0


def linear(name, start, rate, steps=40, every=10):
    """A straight validation curve: loss = start - rate * step."""
    eval_steps = list(range(0, steps + 1, every))
    return ContenderRecord(
        name=name, lr=1e-3, eval_steps=eval_steps, val_losses=[start - rate * s for s in eval_steps]
    )


def test_seed_summary_uses_each_seeds_own_adamw_target():
    # adamw final loss per seed: 5 - 40 r_a; muon reaches it at 40 r_a / r_m exactly (linear)
    rates = {0: (0.05, 0.10), 1: (0.04, 0.16), 2: (0.05, 0.0001)}  # seed 2: never reaches
    per_seed = {
        seed: {"adamw": linear("adamw", 5.0, ra), "muon": linear("muon", 5.0, rm)}
        for seed, (ra, rm) in rates.items()
    }
    summary = seed_summary(per_seed)
    assert summary["seeds"] == [0, 1, 2]
    muon = summary["contenders"]["muon"]
    expected_steps = [40 * 0.05 / 0.10, 40 * 0.04 / 0.16]
    assert muon["steps_to_adamw_final_loss"]["values"][:2] == pytest.approx(expected_steps)
    assert muon["steps_to_adamw_final_loss"]["values"][2] is None
    assert muon["steps_to_adamw_final_loss"]["reached"] == 2
    assert muon["steps_to_adamw_final_loss"]["mean"] == pytest.approx(sum(expected_steps) / 2)
    assert muon["steps_to_adamw_final_loss_ratio"]["mean"] == pytest.approx(
        sum(expected_steps) / 2 / 40
    )
    finals = [5.0 - 40 * rm for _, rm in rates.values()]
    assert muon["final_val_loss"]["mean"] == pytest.approx(sum(finals) / 3)
    assert muon["final_val_loss"]["max"] == pytest.approx(max(finals))
    table = format_seed_table(summary)
    assert "(2/3 seeds reached)" in table and "| muon | 3 |" in table


def test_seed_summary_with_a_contender_run_for_the_first_seed_only():
    per_seed = {
        0: {"adamw": linear("adamw", 5, 0.05), "torch-muon-bf16": linear("t", 5, 0.1)},
        1: {"adamw": linear("adamw", 5, 0.05)},
    }
    bf16 = seed_summary(per_seed)["contenders"]["torch-muon-bf16"]
    assert bf16["seeds"] == [0] and bf16["final_val_loss"]["n"] == 1


def test_each_muon_contender_is_compared_with_torch_muon_seed_by_seed():
    # steps to AdamW's final loss (5 - 40 ra) on a straight curve of rate r: 40 ra / r
    ra = 0.05
    rates = {  # seed: (muon, torch-muon); seed 2: torch-muon never reaches the target
        0: (0.10, 0.08),
        1: (0.16, 0.10),
        2: (0.10, 0.0001),
    }
    per_seed = {
        seed: {
            "adamw": linear("adamw", 5.0, ra),
            "muon": linear("muon", 5.0, rm),
            "torch-muon": linear("torch-muon", 5.0, rt),
            **({"torch-muon-bf16": linear("b", 5.0, rt)} if seed == 0 else {}),
        }
        for seed, (rm, rt) in rates.items()
    }
    summary = seed_summary(per_seed)
    figure = summary["contenders"]["muon"]["fewer_steps_than_torch_muon"]
    muon = [40 * ra / rates[s][0] for s in (0, 1)]
    torch_muon = [40 * ra / rates[s][1] for s in (0, 1)]
    assert figure["seeds"] == [0, 1, 2] and figure["seeds_compared"] == 2
    assert figure["per_seed"][:2] == pytest.approx([1 - m / t for m, t in zip(muon, torch_muon)])
    assert figure["per_seed"][2] is None
    assert figure["of_means"] == pytest.approx(1 - sum(muon) / sum(torch_muon))
    for name in ("adamw", "torch-muon", "torch-muon-bf16"):
        assert "fewer_steps_than_torch_muon" not in summary["contenders"][name]
    table = format_seed_table(summary)
    assert "fewer steps than torch-muon |" in table
    fractions = [1 - m / t for m, t in zip(muon, torch_muon)]
    percents = "/".join(f"{100 * f:.1f}" for f in fractions)
    low, high = paired_interval(fractions)
    assert figure["per_seed_ci95"] == pytest.approx((low, high))
    assert (
        f"| {100 * figure['of_means']:.1f}% (per seed {percents}/-; their mean "
        f"{100 * sum(fractions) / 2:.1f}%, 95% CI {100 * low:.1f} to {100 * high:.1f}%) |"
    ) in table
    # without torch-muon there is no such column
    alone = {
        seed: {k: v for k, v in r.items() if k in ("adamw", "muon")} for seed, r in per_seed.items()
    }
    assert "torch-muon" not in format_seed_table(seed_summary(alone))


def test_fewer_steps_than_refuses_misaligned_seeds_and_handles_none_reached():
    with pytest.raises(ValueError, match="differ in length"):
        fewer_steps_than([1.0], [1.0, 2.0])
    assert fewer_steps_than([None, 3.0], [4.0, None]) == {
        "seeds_compared": 0,
        "per_seed": [None, None],
        "of_means": None,
        "per_seed_mean": None,
        "per_seed_ci95": None,
    }
    one = fewer_steps_than([9.0, None], [10.0, 5.0])  # one seed compared: no interval
    assert one["per_seed_mean"] == pytest.approx(0.1) and one["per_seed_ci95"] is None


def _student_t_cdf(q: float, dof: int) -> tuple[float, float]:
    """(P(T <= q), density at q) for q >= 0: Simpson's rule on the density in float64."""
    log_c = math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2) - 0.5 * math.log(dof * math.pi)

    def pdf(x: float) -> float:
        return math.exp(log_c - (dof + 1) / 2 * math.log1p(x * x / dof))

    n = 20_000
    h = q / n
    total = pdf(0.0) + pdf(q) + sum((4 if i % 2 else 2) * pdf(i * h) for i in range(1, n))
    return 0.5 + total * h / 3, pdf(q)


@pytest.mark.parametrize("dof", [*range(1, 31), 31, 40, 60, 120, 1000])
def test_t_quantile_is_students_0975_quantile(dof):
    q = t_quantile_975(dof)
    cdf, density = _student_t_cdf(q, dof)
    # the table is rounded to 3 decimals (and the expansion is as close beyond it): the
    # probability at the rounded quantile is within density * 5e-4 of 0.975 (+ Simpson's error)
    assert abs(cdf - 0.975) <= density * 5e-4 + 1e-9, (dof, q, cdf)
    assert len(T_975) == 30


def test_paired_interval_is_the_t_interval_of_the_mean():
    low, high = paired_interval([0.1, 0.2, 0.3])  # mean 0.2, sample std 0.1, 3 seeds
    half = 4.303 * 0.1 / math.sqrt(3)
    assert (low, high) == pytest.approx((0.2 - half, 0.2 + half))
    assert paired_interval([0.1]) is None and paired_interval([]) is None
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_quantile_975(0)


TINY = TINY_CONFIG


def test_real_tiny_run_over_two_seeds(tmp_path):
    config = BenchConfig(**TINY, steps=4, seeds=2, out=str(tmp_path))
    report = run_bench(config)
    seeds = report["seeds"]
    assert seeds["seeds"] == [0, 1]
    saved = {}
    for path in (tmp_path / "runs").glob("run-*.json"):
        data = json.loads(path.read_text())
        saved[(data["key"]["contender"], data["key"]["train"]["seed"])] = record_from_dict(
            data["result"]
        )
    assert set(saved) == {(c, s) for c in ("adamw", "muon") for s in (0, 1)}
    # different seeds really ran: different initial models, different curves
    assert saved[("adamw", 0)].val_losses != saved[("adamw", 1)].val_losses
    # the headline table is seed 0's
    assert report["contenders"]["muon"]["curves"]["val_loss"] == saved[("muon", 0)].val_losses
    finals = [saved[("muon", s)].val_losses[-1] for s in (0, 1)]
    stats = seeds["contenders"]["muon"]["final_val_loss"]
    assert stats["mean"] == pytest.approx(sum(finals) / 2, rel=1e-12)
    assert stats["std"] == pytest.approx(abs(finals[0] - finals[1]) / math.sqrt(2), rel=1e-9)
    reached = [
        steps_to_reach(
            saved[("muon", s)].eval_steps,
            saved[("muon", s)].val_losses,
            saved[("adamw", s)].val_losses[-1],
        )
        for s in (0, 1)
    ]
    assert seeds["contenders"]["muon"]["steps_to_adamw_final_loss"]["values"] == reached
    assert "Across seeds 0, 1" in (tmp_path / "report.md").read_text()


def test_a_1000_step_budget_runs_through_the_pipeline(tmp_path):
    def make_run(config, contender, lr, steps=None):
        return LinearRun({"adamw": 0.001, "muon": 0.0025}[contender])

    config = BenchConfig(
        steps=1000,
        tokens_per_step=256,
        memory_probe_steps=0,
        progress=False,
        plots=False,
        out=str(tmp_path),
    )
    report = run_bench(config, make_run=make_run)
    muon = report["contenders"]["muon"]
    assert muon["steps"] == 1000 and muon["curves"]["eval_steps"][-1] == 1000
    assert len(muon["curves"]["eval_steps"]) == 1000 // 25 + 1  # every 2.5% of the budget
    # adamw ends at 5 - 1 = 4; muon gets there at 1 / 0.0025 = 400 steps
    assert muon["steps_to_adamw_final_loss"] == pytest.approx(400)
    assert report["steps_to_adamw_final_loss_ratio"] == pytest.approx(0.4)
