"""TrainConfig / ModelConfig, CLI flags generated from dataclasses, LR schedules."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from dataclasses import dataclass, fields
from typing import Literal

import pytest
import torch

from muonscale.train.config import (
    ModelConfig,
    TrainConfig,
    add_dataclass_arguments,
    dataclass_from_args,
    field_docstrings,
    model_preset,
)
from muonscale.train.schedule import LRSchedule, build_scheduler


def test_every_field_has_a_docstring():
    for cls in (ModelConfig, TrainConfig, LRSchedule):
        docs = field_docstrings(cls)
        missing = [f.name for f in fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without docstring: {missing}"


def test_presets_have_the_published_shapes():
    assert (model_preset("gpt2-small").n_layer, model_preset("gpt2-small").d_model) == (12, 768)
    medium = model_preset("gpt2-medium")
    assert (medium.n_layer, medium.d_model, medium.n_head, medium.context_length) == (
        24,
        1024,
        16,
        1024,
    )
    xl = model_preset("gpt2-xl")
    assert (xl.n_layer, xl.d_model, xl.n_head, xl.vocab_size) == (48, 1600, 25, 50304)
    tiny = model_preset("tiny")
    assert tiny.vocab_size == 256 and tiny.n_layer == 4
    assert model_preset("tiny", n_layer=2).n_layer == 2
    with pytest.raises(ValueError, match="unknown model preset"):
        model_preset("gpt5")


def test_model_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="n_kv_head=4 must divide n_head=6"):
        ModelConfig(n_head=6, n_kv_head=4, d_model=192)
    with pytest.raises(ValueError, match="must divide d_model"):
        ModelConfig(n_head=5, d_model=192)
    with pytest.raises(ValueError, match="norm must be one of"):
        ModelConfig(norm="batchnorm")


def test_train_config_overrides_and_accumulation():
    config = TrainConfig(
        n_layer=2, d_model=64, n_head=4, context_length=32, micro_batch_size=4, tokens_per_step=512
    )
    model = config.model_config()
    assert (model.n_layer, model.d_model, model.context_length) == (2, 64, 32)
    assert config.gradient_accumulation_steps == 4  # 512 / (4 * 32)
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        TrainConfig(context_length=32, micro_batch_size=4, tokens_per_step=200)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        TrainConfig(optimizer="sgd")
    assert TrainConfig.from_dict(config.to_dict()) == config


def test_cli_round_trip_of_train_config():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, TrainConfig)
    args = parser.parse_args(
        [
            "--optimizer",
            "adamw",
            "--lr",
            "0.01",
            "--n-layer",
            "3",
            "--tie-embeddings",
            "--adamw-betas",
            "0.8",
            "0.9",
            "--ns-dtype",
            "bfloat16",
            "--grad-clip",
            "none",
            "--schedule",
            "wsd",
            "--out-dir",
            "none",
        ]
    )
    config = dataclass_from_args(TrainConfig, args)
    assert config.optimizer == "adamw" and config.lr == 0.01 and config.n_layer == 3
    assert config.tie_embeddings is True and config.adamw_betas == (0.8, 0.9)
    assert config.ns_dtype == "bfloat16" and config.grad_clip is None and config.schedule == "wsd"
    assert config.out_dir is None
    assert dataclass_from_args(TrainConfig, parser.parse_args([])) == TrainConfig()
    with pytest.raises(SystemExit):
        parser.parse_args(["--schedule", "linear"])
    help_text = parser.format_help()
    assert "Peak learning rate" in help_text and "(default: 0.003)" in help_text


@dataclass(kw_only=True)
class _BenchLikeConfig:
    """A config of another module: generic dataclass support with a prefix."""

    name: str
    """Required: no default."""
    sizes: tuple[int, ...] = (1, 2)
    """A variable-length tuple."""
    mode: Literal["a", "b"] = "a"
    """A choice."""
    verbose: bool = False
    """A switch."""


def test_cli_is_generic_and_prefixable():
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, _BenchLikeConfig, prefix="bench-")
    args = parser.parse_args(
        ["--bench-name", "x", "--bench-sizes", "3", "4", "5", "--bench-verbose"]
    )
    config = dataclass_from_args(_BenchLikeConfig, args, prefix="bench-")
    assert config == _BenchLikeConfig(name="x", sizes=(3, 4, 5), mode="a", verbose=True)
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --bench-name is required


@pytest.mark.parametrize(
    "schedule, step, expected",
    [
        # warm-up (w=4): (t + 1) / w
        ("cosine", 0, 0.25),
        ("cosine", 3, 1.0),
        # cosine over t in [4, 103], r = 0.1: p = (t - 4) / 99
        ("cosine", 4, 1.0),
        ("cosine", 4 + 99 // 2, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 49 / 99))),
        ("cosine", 103, 0.1),
        ("cosine", 500, 0.1),
        # wsd, D = round(0.2 * 104) = 21: stable until step 83, then linear to 0.1 at 103
        ("wsd", 50, 1.0),
        ("wsd", 82, 1.0),
        ("wsd", 83, 1.0 - 0.9 * 1 / 21),
        ("wsd", 103, 0.1),
        ("constant", 2, 0.75),
        ("constant", 103, 1.0),
    ],
)
def test_schedule_values(schedule, step, expected):
    lr_schedule = LRSchedule(
        schedule=schedule, total_steps=104, warmup_steps=4, min_lr_ratio=0.1, decay_fraction=0.2
    )
    assert lr_schedule(step) == pytest.approx(expected, abs=1e-12)


def test_lambda_lr_scales_every_param_group_from_its_own_peak():
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([{"params": [a], "lr": 1.0}, {"params": [b], "lr": 0.1}])
    scheduler = build_scheduler(
        optimizer, LRSchedule(schedule="constant", total_steps=10, warmup_steps=4)
    )
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.25, 0.025])
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 0.05])


def test_imports_stay_light():
    # tqdm is not checked: torch itself imports it (torch.hub).
    code = (
        "import sys, muonscale; print('muonscale.train' in sys.modules); import muonscale.train; "
        "print(sorted(m for m in ('matplotlib', 'tokenizers') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", "[]"]
