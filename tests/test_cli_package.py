"""What a user of the installed package meets first: ``--help`` and ``--version`` without
torch, ``bench`` without matplotlib, ``train`` without tqdm, the final summary line, and
``muonscale route``."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

import muonscale
from muonscale.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY_TRAIN = (
    "--n-layer 1 --d-model 32 --n-head 2 --steps 2 --micro-batch-size 2 --eval-every 1 "
    "--eval-batches 1 --device cpu"
).split()


def _python(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_no_torch(flag):
    probe = _python(
        "import sys\n"
        "from muonscale.cli import main\n"
        "try:\n"
        f"    main([{flag!r}])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n"
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip().endswith("NO TORCH"), probe.stdout


def test_import_muonscale_is_lazy_and_names_resolve():
    probe = _python(
        "import sys, muonscale\n"
        "assert 'torch' not in sys.modules\n"
        "import muonscale.optimizer\n"  # binds the submodule newton_schulz in the package
        "assert callable(muonscale.newton_schulz), muonscale.newton_schulz\n"
        "missing = [n for n in muonscale.__all__ if getattr(muonscale, n, None) is None]\n"
        "assert not missing, missing\n"
        "print('ok')\n"
    )
    assert probe.returncode == 0 and "ok" in probe.stdout, probe.stderr


def test_version_is_the_package_metadata(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"muonscale {version('muonscale')}"
    assert muonscale.__version__ == version("muonscale")


def _without(monkeypatch, *modules: str) -> None:
    """Make ``modules`` look uninstalled: import fails and find_spec finds nothing."""
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name.split(".")[0] in modules:
            return None
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    for name in list(sys.modules):
        if name.split(".")[0] in modules:
            monkeypatch.delitem(sys.modules, name)
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


def test_bench_without_matplotlib_writes_the_report_and_names_the_install(
    tmp_path, capsys, monkeypatch
):
    from bench_tiny import BENCH_TINY

    _without(monkeypatch, "matplotlib", "tqdm")  # what a plain install lacks
    argv = [a for a in BENCH_TINY if a not in ("--no-plots", "--no-progress")]
    assert main(["bench", *argv, "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert 'pip install "muonscale[bench]"' in err
    lines = err.splitlines()
    notes = [i for i, line in enumerate(lines) if "matplotlib is not installed" in line]
    progress = [i for i, line in enumerate(lines) if "steps," in line and "ETA" in line]
    assert len(notes) == 2 and progress, err
    assert notes[0] < progress[0] and notes[1] > progress[-1], "said before training and after"
    assert (tmp_path / "report.md").is_file() and (tmp_path / "report.json").is_file()
    assert not list(tmp_path.glob("*.png"))


def test_train_without_tqdm_shows_progress_and_ends_with_a_summary(tmp_path, capsys, monkeypatch):
    _without(monkeypatch, "tqdm")
    assert main(["train", *TINY_TRAIN, "--log-every", "1", "--out-dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert "train: 1/2 steps" in captured.err and "train: 2/2 steps" in captured.err
    last = captured.out.strip().splitlines()[-1]
    checkpoint = tmp_path / "checkpoint.pt"
    assert last.startswith("muonscale train: 2 steps,"), last
    assert "val loss" in last and str(checkpoint) in last
    assert checkpoint.is_file()


def test_train_summary_without_out_dir(capsys):
    assert main(["train", *TINY_TRAIN, "--no-progress", "--out-dir", "none"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("muonscale train: 2 steps,") and "checkpoint none" in last


def test_route_prints_splits_of_a_callable_model(capsys):
    assert main(["route", "route_models:tiny_gpt"]) == 0
    out = capsys.readouterr().out
    qkv = next(line for line in out.splitlines() if "attn.qkv.weight" in line)
    assert "split: 3 row blocks q k v" in qkv
    assert "adamw" in next(line for line in out.splitlines() if "wte" in line)
    assert main(["route", "route_models:tiny_gpt", "--qkv-split", "head"]) == 0
    qkv = next(line for line in capsys.readouterr().out.splitlines() if "attn.qkv" in line)
    assert "split: 6 row blocks 2xq 2xk 2xv" in qkv  # 2 heads of q, k and v


def test_route_marks_transposed_weights(capsys):
    assert main(["route", "route_models:conv1d_model"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "transposed (stored in, out)" in next(line for line in lines if " 0.weight" in line)
    assert "transposed" not in next(line for line in lines if " 1.weight" in line)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("route_models", "package.module:callable"),
        ("route_models:nothing_here", "has no attribute"),
        ("route_models:not_a_model", "expected the callable to return a torch.nn.Module"),
        ("no_such_module_xyz:f", "cannot import"),
        ("muonscale.train.model:GPT", "with no arguments failed"),
        ("missing/config.json", "no Hugging Face config file"),
    ],
)
def test_route_refuses_bad_specs(spec, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["route", spec])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_route_hf_config_names_the_install_without_transformers(tmp_path, capsys, monkeypatch):
    _without(monkeypatch, "transformers")
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "gpt2", "n_layer": 1, "n_embd": 16, "n_head": 2}')
    with pytest.raises(SystemExit):
        main(["route", str(config)])
    assert 'pip install "muonscale[hf]"' in capsys.readouterr().err
