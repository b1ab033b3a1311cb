"""benchmarks/megatron_gpu.py: flag errors, and its CPU smoke end to end (one gloo process).

The smoke covers the harness, the muonscale arm and the construction of Megatron's Muon through
``get_megatron_optimizer`` from the same ``OptimizerConfig`` (its CUDA-only wrappers unwrapped);
Megatron's DDP and those wrappers run only on a GPU (see the script's docstring)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "megatron_gpu.py")


def _script_module():
    spec = importlib.util.spec_from_file_location("megatron_gpu_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--heads", "5"], "not a multiple of --heads"),
        (["--tp", "0"], "--tp must be >= 1"),
        (["--vocab", "100"], "--vocab must be >= 256"),
        (["--query-groups", "3"], "--query-groups"),
        (["--spec", "fast"], "invalid choice"),
        (["--muon-momentum", "1.0"], "--muon-momentum"),
        (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps must be >= 1"),
        (["--muon-scale-mode", "unit_rms"], "invalid choice"),
    ],
)
def test_bad_flags_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _script_module().parse_config(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_smoke_defaults_yield_to_explicit_flags():
    cfg = _script_module().parse_config(["--smoke", "--layers", "3"])
    assert cfg.smoke and cfg.layers == 3 and cfg.hidden == 64 and cfg.vocab == 256


def test_one_optimizer_config_carries_the_muon_flags():
    module = _script_module()
    cfg = module.parse_config(
        [
            "--no-muon-nesterov",
            "--muon-coefficient-type",
            "quintic",
            "--muon-num-ns-steps",
            "7",
            "--muon-momentum",
            "0.9",
        ]
    )
    config = module.muon_optimizer_config(cfg)
    assert config.optimizer == "muon" and config.muon_nesterov is False
    assert (config.muon_coefficient_type, config.muon_num_ns_steps) == ("quintic", 7)
    ours = module.muonscale_config(config)
    assert (ours.muon_nesterov, ours.muon_momentum, ours.muon_num_ns_steps) == (False, 0.9, 7)


@pytest.mark.timeout(120)
def test_cpu_smoke_runs_three_arms_and_writes_json(tmp_path):
    out = tmp_path / "megatron_gpu.json"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--rounds", "1", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"muonscale", "adamw_cpu_standin", "megatron_muon_unwrapped_cpu"}
    # GPU-only figures say so
    assert set(result["not_measured"]) == {"megatron_adam", "megatron_muon"}
    assert all(v.startswith("not measured: ") for v in result["not_measured"].values())
    assert result["arms"]["muonscale"]["peak_memory_bytes"].startswith("not measured: ")
    assert result["peak_memory_ratio_vs_megatron_muon"].startswith("not measured: ")
    # both Muon arms from one OptimizerConfig, settings read back from the built optimizers
    muon = result["muon_config"]
    assert muon["optimizer_config"]["optimizer"] == "muon"
    assert all(muon["same_settings"].values()) and len(muon["same_settings"]) == 10
    assert muon["megatron_tensor_parallel_muon_kwargs"]["coefficient_type"] == "simple"
    assert result["sanity"]["muon_arms_same_settings"]
    assert result["sanity"]["ok"], result["sanity"]
    assert result["sanity"]["same_initial_loss"] and result["sanity"]["same_first_grad_norm"]
    assert result["meta"]["muonscale_dp_mode"] == "replicated"
    assert result["phases_done"] == ["build+warmup", "one_micro", "accum", "loss"]
    for key in (
        "throughput_ratio_one_micro",
        "throughput_ratio_accum_measured",
        "throughput_ratio_vs_megatron_muon_one_micro",
        "optimizer_step_ratio_vs_megatron_muon",
    ):
        assert result[key] > 0
    assert "throughput_ratio_one_micro" in proc.stdout
    assert "throughput_ratio_vs_megatron_muon_one_micro" in proc.stdout
