"""benchmarks/megatron_gpu.py: flag errors, and its CPU smoke end to end (one gloo process).

The smoke covers the harness and the muonscale arm; Megatron's DDP and ``get_megatron_optimizer``
need CUDA and run only on a GPU (see the script's docstring)."""

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


@pytest.mark.timeout(120)
def test_cpu_smoke_runs_both_arms_and_writes_json(tmp_path):
    out = tmp_path / "megatron_gpu.json"
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--smoke", "--rounds", "1", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["arms"]) == {"muonscale", "adamw_cpu_standin"}
    assert result["sanity"]["ok"], result["sanity"]
    assert result["sanity"]["same_initial_loss"] and result["sanity"]["same_first_grad_norm"]
    assert result["meta"]["muonscale_dp_mode"] == "replicated"
    assert result["phases_done"] == ["build+warmup", "one_micro", "accum", "loss"]
    for key in ("throughput_ratio_one_micro", "throughput_ratio_accum_measured"):
        assert result[key] > 0
    assert "throughput_ratio_one_micro" in proc.stdout
