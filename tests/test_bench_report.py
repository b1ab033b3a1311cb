"""report.json / report.md / plots from synthetic records, and run_bench wired to fake runs."""

import dataclasses
import json
import math

import pytest
from bench_tiny import LinearRun

from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig
from muonscale.bench.report import build_report, format_table, write_report
from muonscale.bench.side_by_side import ContenderRecord

MACHINE = {"date": "2026-01-01T00:00:00Z", "cpu": "test cpu", "cpu_count": 2, "torch": "x"}


def record(name, lr, losses, step_s, opt_s, state_bytes, every=10):
    steps = len(step_s)
    return ContenderRecord(
        name=name,
        lr=lr,
        eval_steps=[i * every for i in range(len(losses))],
        val_losses=list(losses),
        eval_train_seconds=[i * every * step_s[0] for i in range(len(losses))],
        train_losses=[3.0] * steps,
        step_seconds=list(step_s),
        optimizer_seconds=list(opt_s),
        tokens=[1000] * steps,
        optimizer_state_bytes=state_bytes,
    )


def synthetic_records():
    config = BenchConfig(steps=40, timing_warmup_steps=2)
    adamw = record(
        "adamw", 1e-3, [4.0, 3.5, 3.0, 2.8, 2.6], [9.0, 9.0] + [0.1] * 38, [0.01] * 40, 800
    )
    # muon reaches 2.6 between (10, 3.0) and (20, 2.5): 10 + 0.4 / 0.5 * 10 = 18 -> 18/40 = 0.45
    muon = record(
        "muon", 2e-3, [4.0, 3.0, 2.5, 2.2, 2.0], [9.0, 9.0] + [0.125] * 38, [0.03] * 40, 400
    )
    return config, {"adamw": adamw, "muon": muon}


def test_build_report_figures_and_published_references():
    config, records = synthetic_records()
    peak = {
        "adamw": {"peak_memory_bytes": 1000, "source": "test"},
        "muon": {"peak_memory_bytes": 900, "source": "test"},
    }
    report = build_report(records, config, peak_memory=peak, machine=MACHINE, wall_seconds=1.0)
    assert report["steps_to_adamw_final_loss_ratio"] == pytest.approx(0.45)
    # medians after the 2 warm-up steps: 1000 tokens / 0.1 s vs 1000 tokens / 0.125 s
    assert report["throughput_ratio"] == pytest.approx(0.8)
    assert report["peak_memory_ratio"] == pytest.approx(0.9)
    assert report["optimizer_state_ratio"] == pytest.approx(0.5)
    muon = report["contenders"]["muon"]
    assert muon["tokens_per_s"] == pytest.approx(8000.0)
    assert muon["optimizer_step_ms"] == pytest.approx(30.0)
    assert muon["steps_to_adamw_final_loss"] == pytest.approx(18.0)
    assert muon["final_val_loss"] == 2.0 and muon["optimizer_state_bytes"] == 400
    assert "wire_bytes_per_step" in muon
    figures = {f["name"]: f for f in report["figures"]}
    assert set(figures) == {  # torch-muon not run: no loss difference to report
        "steps_to_adamw_final_loss_ratio",
        "throughput_ratio",
        "peak_memory_ratio",
    }
    assert figures["steps_to_adamw_final_loss_ratio"]["value"] == pytest.approx(0.45)
    assert figures["throughput_ratio"]["value"] == pytest.approx(0.8)
    assert figures["peak_memory_ratio"]["published"] is None
    table = format_table(report)
    assert "18 (0.45x)" in table
    assert "- throughput_ratio = 0.800; published: 0.979" in table
    assert "NVIDIA" in table and "arXiv:2502.16982" in table  # each published figure's source
    assert "target" not in table.lower() and "MET" not in table
    # the Muon contenders' AdamW half is named with its rate, unless both halves share the lr
    half = (
        f"their AdamW half (embeddings, head, norms, biases) trains at {config.muon_adamw_lr:.3g}"
    )
    assert half in table
    shared = dataclasses.replace(config, muon_adamw_lr=None)
    assert "AdamW half" not in format_table(build_report(records, shared, machine=MACHINE))
    # the Muon contenders' own weight decay is named only when --muon-weight-decay set one
    assert "--muon-weight-decay" not in table
    apart = dataclasses.replace(config, muon_weight_decay=0.025)
    note = "Muon contenders: weight decay 0.025 (--muon-weight-decay"
    assert note in format_table(build_report(records, apart, machine=MACHINE))


def test_torch_muon_difference_and_never_reached():
    config, records = synthetic_records()
    records["muon"].val_losses[-4:] = [3.9, 3.8, 3.7, 3.6]  # never reaches AdamW's 2.6
    records["torch-muon"] = record(
        "torch-muon", 2e-3, [4.0, 3.0, 2.5, 2.2, 3.62], [0.1] * 40, [0.05] * 40, 400
    )
    report = build_report(records, config, machine=MACHINE)
    assert report["steps_to_adamw_final_loss_ratio"] is None
    assert report["contenders"]["muon"]["steps_to_adamw_final_loss"] is None
    assert report["peak_memory_ratio"] is None
    figures = {f["name"]: f for f in report["figures"]}
    assert figures["steps_to_adamw_final_loss_ratio"]["value"] is None
    assert "never reached" in figures["steps_to_adamw_final_loss_ratio"]["note"]
    assert figures["muon_final_loss_minus_torch_muon"]["value"] == pytest.approx(-0.02)
    assert figures["peak_memory_ratio"]["value"] is None
    assert "never" in format_table(report)


def test_report_files_are_strict_json_with_nan_as_null(tmp_path):
    config, records = synthetic_records()
    records["muon"].val_losses[-1] = math.nan  # a diverged evaluation
    report = build_report(records, config, machine=MACHINE)
    write_report(report, tmp_path, [])
    loaded = json.loads((tmp_path / "report.json").read_text())
    assert loaded["contenders"]["muon"]["final_val_loss"] is None
    assert loaded["contenders"]["muon"]["curves"]["val_loss"][-1] is None
    assert "| muon |" in (tmp_path / "report.md").read_text()


def test_run_bench_with_fake_runs_writes_report_and_plots(tmp_path, capsys):
    def make_run(config, contender, lr, steps=None):
        return LinearRun({"adamw": 0.05, "muon": 0.15}[contender] * lr / config.lr_for(contender))

    config = BenchConfig(
        steps=40, tokens_per_step=256, memory_probe_steps=0, progress=False, out=str(tmp_path)
    )
    report = run_bench(config, make_run=make_run)
    # adamw final: 5 - 0.05 * 40 = 3; muon: 5 - 0.15 s = 3 at s = 40 / 3 -> ratio 1 / 3
    assert report["steps_to_adamw_final_loss_ratio"] == pytest.approx(1 / 3, rel=1e-9)
    assert report["config"]["same_initial_val_loss"] is True
    assert {p.name for p in tmp_path.iterdir()} == {
        "report.json",
        "report.md",
        "bench.png",
        "train_loss.png",
        "runs",  # the finished runs, for resuming (tests/test_bench_resume.py)
    }
    assert "| muon |" in capsys.readouterr().out


def test_run_bench_sweep_picks_the_best_lr(tmp_path):
    def make_run(config, contender, lr, steps=None):
        return LinearRun(0.1 * (1 - abs(math.log2(lr / 2e-3))))  # best at 2e-3

    config = BenchConfig(
        steps=20,
        tokens_per_step=256,
        lr_adamw=1e-3,
        lr_muon=1e-3,
        sweep=True,
        sweep_factors=[1.0, 2.0, 4.0],
        memory_probe_steps=0,
        plots=False,
        progress=False,
        out=str(tmp_path),
    )
    report = run_bench(config, make_run=make_run)
    assert report["sweep"]["best"] == {"adamw": 2e-3, "muon": 2e-3}
    assert report["sweep"]["steps"] == 5
    assert report["contenders"]["muon"]["lr"] == 2e-3


TINY_PROBE = dict(n_layer=1, d_model=32, n_head=2, tokens_per_step=256, eval_batches=1)


def test_memory_probes_run_one_per_cpu_at_one_thread_and_one_on_cuda(monkeypatch):
    import os

    from muonscale.bench import memory_probe
    from muonscale.bench.memory_probe import parallel_probes

    monkeypatch.setattr(memory_probe, "_memory_slots", lambda: 1)  # memory for one child
    assert parallel_probes(BenchConfig(**TINY_PROBE, threads=1)) == 1
    monkeypatch.setattr(memory_probe, "_memory_slots", lambda: 1 << 20)  # memory for many
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert parallel_probes(BenchConfig(**TINY_PROBE, threads=1)) == cpus
    assert parallel_probes(BenchConfig(**TINY_PROBE, threads=2)) == max(1, cpus // 2)
    assert parallel_probes(BenchConfig(**TINY_PROBE, threads=None)) == 1
    assert parallel_probes(BenchConfig(**TINY_PROBE, device="cuda")) == 1


@pytest.mark.slow  # two child processes, each importing torch
def test_memory_probes_side_by_side_each_report_their_own_child(monkeypatch):
    from muonscale.bench import memory_probe
    from muonscale.bench.runner import make_run

    config = BenchConfig(**TINY_PROBE, threads=1)
    monkeypatch.setattr(memory_probe, "parallel_probes", lambda bench: 2)  # even on 1 CPU
    lrs = {"adamw": 2e-3, "muon": 1.6e-2}
    results = memory_probe.probe_all(config, lrs, steps=1)
    assert list(results) == list(lrs)
    for name, result in results.items():
        assert result["contender"] == name and result["steps"] == 1
        run = make_run(config, name, lrs[name])  # the same run in this process: same state
        run.step()
        assert result["optimizer_state_bytes"] == run.optimizer_state_bytes()
        if result["vmhwm_bytes"] is not None:  # Linux
            assert result["peak_memory_bytes"] == result["vmhwm_bytes"] > 0
    states = [r["optimizer_state_bytes"] for r in results.values()]
    assert states[0] != states[1]  # AdamW keeps two moments, Muon one: not swapped
