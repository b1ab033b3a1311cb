"""``MuonSettings``: one table of defaults behind the constructor, the fill-ins and the
snapshot of ``orthogonalize_in_backward``; frozen and hashable; validation that names the
option and says what it accepts."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from muonscale import Muon
from muonscale.backward_ns import SNAPSHOT_KEYS
from muonscale.integrations.megatron.config import MegatronMuonConfig
from muonscale.settings import (
    OPTION_DEFAULTS,
    VARIANT_KEYWORDS,
    MuonSettings,
    NewtonSchulzSettings,
)


def _opt(**kw) -> Muon:
    return Muon([("h.weight", torch.nn.Parameter(torch.randn(6, 8)))], **kw)


def test_the_constructor_defaults_are_the_table():
    group = _opt().param_groups[0]
    options = {k: v for k, v in group.items() if k not in ("params", "param_names", "algorithm")}
    assert options == OPTION_DEFAULTS
    signature = inspect.signature(Muon.__init__).parameters
    for name, value in OPTION_DEFAULTS.items():
        if name in signature and signature[name].default is not None:
            assert signature[name].default == value, name


def test_settings_are_frozen_hashable_and_read_from_the_group():
    group = _opt(normalize="row", ns_coefficients=[(3.4445, -4.775, 2.0315)] * 5).param_groups[0]
    settings = MuonSettings.from_group(group)
    assert settings.normalize == "row" and settings.ns_steps == 5
    assert hash(settings) == hash(MuonSettings.from_group(group))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.normalize = "none"
    ns = settings.ns
    assert isinstance(ns, NewtonSchulzSettings) and hash(ns) == hash(settings.ns)
    assert (ns.steps, ns.dtype, ns.eps, ns.method) == (5, None, group["ns_eps"], "auto")


def test_an_old_group_takes_the_table_defaults():
    old = {"lr": 0.1, "ns_steps": 3, "coefficients": "keller"}  # before most options existed
    settings = MuonSettings.from_group(old)
    assert settings.lr == 0.1 and settings.ns_steps == 3
    assert settings.matrix_mode == OPTION_DEFAULTS["matrix_mode"]
    assert settings.normalize == OPTION_DEFAULTS["normalize"]


def test_backward_snapshot_holds_every_option_but_the_step_scalars():
    assert set(SNAPSHOT_KEYS) == set(OPTION_DEFAULTS) - {"lr", "weight_decay"}


def test_megatron_config_shares_the_table_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(MegatronMuonConfig)}
    shared = set(fields) & set(OPTION_DEFAULTS)
    variant = MegatronMuonConfig().variant_options
    assert variant == {k: OPTION_DEFAULTS[k] for k in VARIANT_KEYWORDS}
    for name in shared:
        if fields[name] is not None and name not in ("lr", "weight_decay", "scale"):
            assert fields[name] == OPTION_DEFAULTS[name], name


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(lr=math.inf), "lr"),
        (dict(lr=-1.0), "lr"),
        (dict(weight_decay=math.nan), "weight_decay"),
        (dict(momentum=1.0), "momentum"),
        (dict(qk_lr_scale=math.inf), "qk_lr_scale"),
        (dict(eps=math.inf), "ns_eps"),
        (dict(row_beta2=1.0), "row_beta2"),
        (dict(matrix_mode="rows"), "matrix_mode"),
        (dict(ns_method="fast"), "ns_method"),
        (dict(momentum_dtype=torch.int8), "momentum_dtype"),
    ],
)
def test_bad_options_are_named_with_the_range_they_accept(kw, name):
    with pytest.raises(ValueError, match=name) as err:
        _opt(**kw)
    message = str(err.value)
    assert "inf]" not in message  # a range must not seem to admit the value it refuses
    if kw.get("lr") == math.inf:
        assert "finite number >= 0" in message


def test_a_pickle_from_before_an_option_gets_its_default_everywhere():
    import copy

    opt = _opt()
    state = copy.deepcopy(opt.__getstate__())
    for key in ("qk_lr_scale", "normalize", "preconditioner"):  # written before they existed
        del state["_muonscale"]["muon_defaults"][key]
        for group in state["param_groups"]:
            group.pop(key, None)
    restored = Muon.__new__(Muon)
    restored.__setstate__(state)
    assert restored.muon_defaults == opt.muon_defaults
    w = torch.nn.Parameter(torch.randn(4, 4))
    restored.add_param_group({"params": [w], "param_names": ["extra.w"], "algorithm": "muon"})
    assert MuonSettings.from_group(restored.param_groups[-1]) == MuonSettings.from_group(
        {**OPTION_DEFAULTS, "lr": opt.param_groups[0]["lr"]}
    )
