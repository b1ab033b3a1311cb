"""``--variants``: parsing, refusal of bad options (naming them), and the variant optimizer."""

from __future__ import annotations

import pytest
import torch
from bench_tiny import BENCH_TINY

from muonscale.bench.config import BenchConfig, parse_variant
from muonscale.bench.runner import make_run, train_config_for
from muonscale.bench.variants import build_variant_optimizer, check_options, muon_option_names
from muonscale.cli import main

TINY = dict(
    n_layer=1, d_model=32, n_head=2, tokens_per_step=256, eval_batches=1, lr_warmup_steps=1, steps=3
)


def test_parse_variant_values():
    name, options = parse_variant("pe4=coefficients:polar_express,ns_steps:4,nesterov:false")
    assert name == "pe4"
    assert options == {"coefficients": "polar_express", "ns_steps": 4, "nesterov": False}
    assert parse_variant("x=lr:0.02,ns_eps:none") == ("x", {"lr": 0.02, "ns_eps": None})


@pytest.mark.parametrize(
    "spec, message",
    [
        ("normuon", "expected NAME=OPTION:VALUE"),
        ("normuon=", "expected NAME=OPTION:VALUE"),
        ("normuon=normalize", "bad item 'normalize'"),
        ("Bad=ns_steps:4", "name 'Bad' must be lowercase"),
        ("x=ns_steps:4,ns_steps:5", "option 'ns_steps' given twice"),
        ("x=lr:-1", "lr must be a number > 0"),
        ("muon=ns_steps:4", "name 'muon' is taken"),
    ],
)
def test_variant_syntax_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        BenchConfig(variants=[spec])


def test_same_variant_name_twice_is_refused():
    with pytest.raises(ValueError, match="names a contender twice"):
        BenchConfig(variants=["a=ns_steps:4", "a=ns_steps:3"])


def test_options_are_checked_against_muons_signature():
    known = muon_option_names()
    assert "coefficients" in known and "momentum_dtype" in known
    with pytest.raises(ValueError, match="--variants nrm: unknown option 'normalise'"):
        check_options("nrm", {"normalise": "row"})
    with pytest.raises(ValueError, match="option 'splits' is not allowed"):
        check_options("s", {"splits": "x"})
    with pytest.raises(ValueError, match="--variants bad:.*coefficients"):
        check_options("bad", {"coefficients": "no_such_preset"})
    with pytest.raises(ValueError, match="momentum_dtype: expected one of"):
        check_options("md", {"momentum_dtype": "int8"})
    check_options("ok", {"coefficients": "polar_express", "momentum_dtype": "bfloat16"})


def test_train_config_for_refuses_an_unknown_option():
    bench = BenchConfig(**TINY, variants=["nrm=no_such_option:1"])
    with pytest.raises(ValueError, match="unknown option 'no_such_option'"):
        train_config_for(bench, "nrm", 0.01)


def test_cli_refuses_an_unknown_option_before_training(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *BENCH_TINY, "--variants", "x=bogus_option:1", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "unknown option 'bogus_option'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # nothing trained


def test_variant_lr_and_contenders():
    bench = BenchConfig(**TINY, variants=["pe=coefficients:polar_express,lr:0.02", "md=ns_steps:4"])
    assert bench.contenders == ["adamw", "muon", "pe", "md"]
    assert bench.lr_for("pe") == 0.02 and bench.lr_for("md") == bench.lr_muon
    assert bench.variant_options("pe") == {"coefficients": "polar_express"}
    assert bench.variant_options("muon") is None


def _params_after_steps(run, steps):
    for _ in range(steps):
        run.step()
    return [p.detach().clone() for p in run.model.parameters()]


def test_variant_without_options_trains_like_muon():
    """The variant optimizer is built like muonscale.train's muon: same steps, bit for bit."""
    bench = BenchConfig(**TINY)
    muon = make_run(bench, "muon", 0.02)
    variant = make_run(bench, "muon", 0.02)
    variant.optimizer = build_variant_optimizer(variant.model, variant.config, {})
    from muonscale.train.schedule import build_scheduler

    variant.scheduler = build_scheduler(variant.optimizer, variant.schedule)
    for a, b in zip(_params_after_steps(muon, 3), _params_after_steps(variant, 3)):
        assert torch.equal(a, b)


def test_variant_options_reach_the_optimizer():
    bench = BenchConfig(**TINY, variants=["pe=coefficients:polar_express,momentum_dtype:bfloat16"])
    run = make_run(bench, "pe", 0.02)
    muon_groups = [g for g in run.optimizer.param_groups if g["algorithm"] == "muon"]
    assert muon_groups and all(g["momentum_dtype"] == torch.bfloat16 for g in muon_groups)
    plain = make_run(bench, "muon", 0.02)
    plain_groups = [g for g in plain.optimizer.param_groups if g["algorithm"] == "muon"]
    assert muon_groups[0]["coefficients"] != plain_groups[0]["coefficients"]
    # and the run trains with it: the parameters differ from muon's after the same steps
    differ = [
        not torch.equal(a, b)
        for a, b in zip(_params_after_steps(run, 2), _params_after_steps(plain, 2))
    ]
    assert any(differ)
