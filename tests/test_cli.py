"""`muonscale` command line: help, flag parsing, errors, and one tiny end-to-end bench."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from muonscale.bench.config import DEFAULT_LR, BenchConfig
from muonscale.cli import build_parser, main
from muonscale.train.config import dataclass_from_args


def parse_bench(argv):
    args = build_parser().parse_args(["bench", *argv])
    return dataclass_from_args(BenchConfig, args)


def test_top_level_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "bench" in out and "train" in out


@pytest.mark.parametrize("command", ["bench", "train"])
def test_every_flag_has_help_text(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    parser = build_parser()
    sub = parser._subparsers._group_actions[0].choices[command]
    for action in sub._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 10, action.option_strings
    assert "--steps" in out


def test_bench_defaults_match_benchconfig():
    assert parse_bench([]) == BenchConfig()
    assert BenchConfig().lr_adamw == DEFAULT_LR["adamw"]


def test_bench_flags_parse_into_benchconfig():
    config = parse_bench(
        [
            "--steps",
            "50",
            "--model",
            "tiny",
            "--tokens-per-step",
            "512",
            "--lr-adamw",
            "2e-3",
            "--lr-muon",
            "5e-3",
            "--ns-dtype",
            "bfloat16",
            "--momentum-dtype",
            "bfloat16",
            "--device",
            "cpu",
            "--out",
            "somewhere",
            "--no-plots",
            "--seed",
            "7",
            "--baselines",
            "torch-muon",
            "--sweep",
            "--sweep-factors",
            "0.5",
            "2",
        ]
    )
    assert config.steps == 50 and config.tokens_per_step == 512
    assert config.lr_for("adamw") == 2e-3 and config.lr_for("muon") == 5e-3
    assert config.ns_dtype == "bfloat16" and config.momentum_dtype == "bfloat16"
    assert config.out == "somewhere" and config.plots is False and config.seed == 7
    assert config.contenders == ["adamw", "muon", "torch-muon"]
    assert config.sweep and config.sweep_factors == [0.5, 2.0]
    assert BenchConfig.from_json(config.to_json()) == config
    assert parse_bench(["--muon-adamw-lr", "none"]).muon_adamw_lr is None
    assert parse_bench(["--muon-adamw-lr", "3e-4"]).muon_adamw_lr == 3e-4
    assert parse_bench([]).muon_weight_decay is None
    assert parse_bench(["--muon-weight-decay", "0"]).muon_weight_decay == 0.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parallel", "fsdp"], "needs --nproc >= 2"),
        (["--nproc", "2", "--parallel", "pp"], "--parallel must be one of"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--lr-muon", "-1"], "--lr-muon must be > 0"),
        (["--baselines", "sgd"], "unknown baseline 'sgd'"),
        (["--tokens-per-step", "100"], "multiple of"),
        (["--ns-dtype", "int8"], "invalid choice"),
        (["--steps", "many"], "invalid int value"),
        (["--no-such-flag"], "unrecognized arguments"),
        (["--model", "gpt5"], "unknown model preset"),
        (["--momentum", "1"], "--momentum must be in [0, 1)"),
        (["--muon-adamw-lr", "0"], "--muon-adamw-lr must be > 0"),
        (["--muon-weight-decay", "-1"], "--muon-weight-decay must be a finite number >= 0"),
        (["--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
        (["--nproc", "2", "--baselines", "torch-muon"], "has no distributed form"),
        (["--nproc", "2", "--workers", "2"], "--workers 2 does not apply with --nproc > 1"),
        (["--nproc", "2", "--device", "auto"], "ranks are gloo processes on the CPU"),
        (["--nproc", "2", "--parallel", "tp", "--track-max-logit"], "only its own heads"),
    ],
)
def test_bad_bench_flags_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_train_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--optimizer", "sgd"])
    assert exit_info.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


TINY = [
    "--n-layer",
    "1",
    "--d-model",
    "32",
    "--n-head",
    "2",
    "--steps",
    "4",
    "--tokens-per-step",
    "256",
    "--eval-batches",
    "1",
    "--lr-warmup-steps",
    "1",
    "--memory-probe-steps",
    "1",
    "--timing-warmup-steps",
    "1",
    "--no-progress",
]


def test_bench_end_to_end_tiny(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", *TINY, "--out", str(out)]) == 0
    assert {"report.json", "report.md", "bench.png", "train_loss.png"} <= {
        p.name for p in out.iterdir()
    }
    assert all((out / name).stat().st_size > 1000 for name in ("bench.png", "train_loss.png"))
    report = json.loads((out / "report.json").read_text())
    for key in (
        "steps_to_adamw_final_loss_ratio",
        "throughput_ratio",
        "contenders",
        "figures",
        "config",
        "machine",
    ):
        assert key in report
    assert report["throughput_ratio"] > 0
    assert set(report["contenders"]) == {"adamw", "muon"}
    for contender in report["contenders"].values():
        for key in (
            "final_val_loss",
            "tokens_per_s",
            "optimizer_step_ms",
            "optimizer_state_bytes",
            "peak_memory_bytes",
        ):
            assert contender[key] is not None and contender[key] > 0, key
        assert contender["curves"]["eval_steps"] == [0, 1, 2, 3, 4]
    # AdamW keeps exp_avg and exp_avg_sq for every parameter: 2 float32 copies of the model
    assert (
        report["contenders"]["muon"]["optimizer_state_bytes"]
        < (report["contenders"]["adamw"]["optimizer_state_bytes"])
    )
    assert report["config"]["same_initial_val_loss"] is True
    assert report["config"]["bench"]["steps"] == 4
    assert report["config"]["model"]["d_model"] == 32
    assert {"date", "torch", "cpu"} <= set(report["machine"])
    assert {f["name"] for f in report["figures"]} == {
        "steps_to_adamw_final_loss_ratio",
        "throughput_ratio",
        "peak_memory_ratio",
    }
    assert all("published" in f for f in report["figures"])
    table = capsys.readouterr().out
    assert "| adamw |" in table and "| muon |" in table
    assert "steps_to_adamw_final_loss_ratio" in (out / "report.md").read_text()


def test_train_end_to_end_tiny(tmp_path):
    argv = [
        "train",
        "--n-layer",
        "1",
        "--d-model",
        "32",
        "--n-head",
        "2",
        "--steps",
        "2",
        "--micro-batch-size",
        "2",
        "--eval-every",
        "1",
        "--eval-batches",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        "--out-dir",
        str(tmp_path),
    ]
    assert main(argv) == 0
    assert (tmp_path / "checkpoint.pt").exists()
    events = [json.loads(line)["event"] for line in (tmp_path / "metrics.jsonl").open()]
    assert events.count("eval") == 2


def test_bench_nproc_runs_the_distributed_bench(tmp_path):
    out = tmp_path / "dist"
    main(
        [
            "bench",
            "--nproc",
            "2",
            "--steps",
            "2",
            "--n-layer",
            "1",
            "--d-model",
            "32",
            "--n-head",
            "2",
            "--out",
            str(out),
        ]
    )
    report = json.loads((out / "report.json").read_text())
    rows = report["rows"]
    assert rows["muon"]["wire_bytes_per_step"]["mean"] > 0
    assert (
        rows["muon-bf16reduce"]["wire_bytes_per_step"]["mean"]
        < rows["muon"]["wire_bytes_per_step"]["mean"]
    )


def test_train_parallel_outside_torchrun_names_what_is_missing(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--parallel", "dp", "--out-dir", "none", "--steps", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "torchrun" in err and "RANK" in err and "MASTER_PORT" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--parallel", "dp", "--optimizer", "torch-muon"], "torch-muon"),
        (["--parallel", "fsdp", "--pg-timeout-s", "0"], "pg_timeout_s"),
        (["--parallel", "dp", "--pg-timeout-s", "-5"], "pg_timeout_s"),
        (["--parallel", "ddp"], "invalid choice"),
    ],
)
def test_train_parallel_flags_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out-dir", "none", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_route_finds_a_model_module_in_the_current_directory(tmp_path):
    """``muonscale route my_models:build`` (the console script, not ``python -m``) imports
    ``my_models.py`` from the folder it runs in."""
    (tmp_path / "my_models.py").write_text(
        "import torch\n\n\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
    )
    script = Path(sys.executable).parent / "muonscale"
    done = subprocess.run(
        [str(script), "route", "my_models:build"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0.weight" in done.stdout
