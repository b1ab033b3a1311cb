"""Single-process checks of the Megatron adapter: flag mapping against the installed
megatron-core / emerging_optimizers, and the construction-time errors."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from muonscale import Muon
from muonscale.integrations.megatron import (
    MEGATRON_COEFFICIENT_SETS,
    MEGATRON_SCALE_MODES,
    MegatronGroups,
    MegatronMuonConfig,
    megatron_coefficients,
    plan_parameters,
)
from muonscale.integrations.megatron.config import muon_arguments
from muonscale.scaling import update_scale


def test_coefficient_tables_match_installed_emerging_optimizers():
    from emerging_optimizers.orthogonalized_optimizers import muon_utils

    for name, (table, mode) in MEGATRON_COEFFICIENT_SETS.items():
        assert [tuple(t) for t in muon_utils._COEFFICIENT_SETS[name]] == list(table), name
        # walked like emerging's get_coefficient_iterator
        expected = list(
            muon_utils.get_coefficient_iterator(12, muon_utils._COEFFICIENT_SETS[name], mode=mode)
        )
        assert megatron_coefficients(name, 12) == [tuple(t) for t in expected]
    # types only emerging knows are read from it
    assert len(megatron_coefficients("cans", 7)) == 7


def test_scale_modes_match_emerging_get_muon_scale_factor():
    from emerging_optimizers.orthogonalized_optimizers.muon import get_muon_scale_factor

    for megatron_name, ours in MEGATRON_SCALE_MODES.items():
        for m, n in [(64, 256), (256, 64), (128, 128)]:
            assert math.isclose(
                get_muon_scale_factor(m, n, megatron_name), update_scale(ours, m, n)
            )


def test_from_megatron_reads_optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    cfg = MegatronMuonConfig.from_megatron(
        OptimizerConfig(optimizer="muon", lr=3e-4, weight_decay=0.1)
    )
    # Megatron's config defaults: muon_nesterov=False, spectral scale (= unit_rms), 0.95, quintic
    assert cfg.muon_nesterov is False and cfg.muon_momentum == 0.95
    assert cfg.scale == "unit_rms" and cfg.adam_lr == 3e-4
    assert cfg.coefficients == megatron_coefficients("quintic", 5)
    assert cfg.muon_tp_mode == "exact"  # Megatron's default "blockwise" is not carried over
    assert cfg.ns_dtype == torch.bfloat16  # muon_fp32_matmul_prec="medium"
    assert cfg.adam_beta2 == 0.999 and cfg.weight_decay == 0.1
    approx = MegatronMuonConfig.from_megatron(
        OptimizerConfig(lr=1e-3), muon_tp_mode="approximate_blockwise"
    )
    assert approx.muon_tp_mode == "approximate_blockwise"


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("muon_scale_mode", "spectal", "muon_scale_mode 'spectal'.*'unit_rms_norm'"),
        ("muon_extra_scale_factor", float("nan"), "muon_extra_scale_factor must be a positive"),
        ("muon_extra_scale_factor", -1.0, "muon_extra_scale_factor must be a positive"),
    ],
)
def test_from_megatron_refuses_a_bad_field_by_name(field, value, match):
    """Megatron's own OptimizerConfig takes these values; the adapter names them."""
    from megatron.core.optimizer import OptimizerConfig

    with pytest.raises(ValueError, match=match):
        MegatronMuonConfig.from_megatron(OptimizerConfig(optimizer="muon", **{field: value}))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(muon_tp_mode="blockwise"), "approximate_blockwise"),
        (dict(muon_tp_mode="duplicated"), "exact"),
        (dict(scale="unit_rms_norm"), "muonscale's 'spectral'"),
        (dict(coefficients="quintic"), "megatron_coefficients"),
        (dict(qkv_split="group"), "qkv_split"),
        (dict(normalize="column"), "normalize"),
        (dict(row_beta2=1.0), "row_beta2"),
        (dict(cautious_weight_decay="yes"), "cautious_weight_decay"),
        (dict(preconditioner="spectral"), "preconditioner"),
        (dict(qk_lr_scale=-1.0), "qk_lr_scale"),
    ],
)
def test_config_errors_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MegatronMuonConfig().replaced(**kwargs)


def test_variant_options_by_name_or_in_their_field():
    by_name = MegatronMuonConfig().replaced(normalize="row", qk_lr_scale=2.0)
    in_field = MegatronMuonConfig(variant_options=dict(normalize="row", qk_lr_scale=2.0))
    assert by_name == in_field and by_name.variant_options["normalize"] == "row"
    assert in_field.variant_options["cautious_weight_decay"] is False  # the table's default
    with pytest.raises(TypeError, match="unknown options \\['normalise'\\]"):
        MegatronMuonConfig().replaced(normalise="row")
    with pytest.raises(TypeError, match="'normalise'.*variant options are normalize"):
        MegatronMuonConfig(variant_options=dict(normalise="row"))


def test_schedule_defaults_follow_the_preconditioner_as_muon():
    """None → muonscale.Muon's defaults: Keller's 5 steps, or Turbo-Muon's 4 with AOL;
    explicit values are kept, and a preconditioner set later still takes its own."""

    def schedule(config):  # what the optimizer built from the config runs
        _, options = muon_arguments([], config)
        group = Muon([("h.weight", nn.Parameter(torch.zeros(4, 4)))], **options).param_groups[0]
        return group["ns_steps"], group["coefficients"]

    plain = MegatronMuonConfig()
    aol = MegatronMuonConfig(variant_options=dict(preconditioner="aol"))
    assert schedule(plain) == (5, "keller")
    assert schedule(aol) == (4, "turbo_muon")
    assert schedule(plain.replaced(preconditioner="aol")) == (4, "turbo_muon")
    mine = aol.replaced(muon_num_ns_steps=6, coefficients="keller")
    assert schedule(mine) == (6, "keller")


class _Chunk(nn.Module):
    def __init__(self, **config):
        super().__init__()
        self.config = SimpleNamespace(
            num_attention_heads=4, num_query_groups=2, kv_channels=8, hidden_size=32, **config
        )
        self.linear_qkv = nn.Linear(32, 2 * (2 + 2) * 8, bias=False)
        self.fc = nn.Linear(32, 32)


NO_GROUPS = MegatronGroups(None, None, None, None)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(multi_latent_attention=True), "multi-latent attention"),
        (dict(attention_output_gate=True), "gated attention"),
    ],
)
def test_unsupported_attention_variants_raise_at_construction(config, match):
    with pytest.raises(NotImplementedError, match=match):
        plan_parameters([_Chunk(**config)], NO_GROUPS)
    if "gate" in match:  # without the QKV split a gated QKV weight is one plain matrix
        plan_parameters([_Chunk(**config)], NO_GROUPS, split_qkv=False)


def test_plan_routes_by_megatron_flags():
    chunk = _Chunk()
    chunk.fc.weight.is_embedding_or_output_parameter = True
    plans = {p.name: p for p in plan_parameters([chunk], NO_GROUPS)}
    assert (
        plans["linear_qkv.weight"].algorithm == "muon"
        and plans["linear_qkv.weight"].qkv_layout is not None
    )
    assert (
        plans["fc.weight"].algorithm == "adamw"
        and "is_embedding_or_output_parameter" in plans["fc.weight"].reason
    )
    assert plans["fc.bias"].algorithm == "adamw"


def test_distributed_optimizer_ddp_is_refused():
    chunk = _Chunk()
    chunk.ddp_config = SimpleNamespace(use_distributed_optimizer=True)
    with pytest.raises(NotImplementedError, match="use_distributed_optimizer"):
        plan_parameters([chunk], NO_GROUPS)
