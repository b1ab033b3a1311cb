"""``--variants``: parsing, refusal of bad options (naming them), and the variant optimizer."""

from __future__ import annotations

import pytest
import torch
from bench_tiny import BENCH_TINY

from muonscale.bench.config import DEFAULT_MUON_ADAMW_LR, BenchConfig, parse_variant
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
        ("x=lr:-1", "lr must be a finite number > 0"),
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
    assert "normalize" in known and "qk_lr_scale" in known  # Muon's **variant_options
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


def test_bench_momentum_reaches_every_muon_contender_and_a_variant_overrides_it():
    bench = BenchConfig(
        **TINY,
        momentum=0.9,
        baselines=["torch-muon"],
        variants=["n=normalize:row", "m=momentum:0.8"],
    )

    def muon_momenta(contender):
        optimizer = make_run(bench, contender, 0.02).optimizer
        if contender == "torch-muon":
            optimizer = optimizer.optimizers["muon"]
            return {g["momentum"] for g in optimizer.param_groups}
        return {g["momentum"] for g in optimizer.param_groups if g["algorithm"] == "muon"}

    assert muon_momenta("muon") == {0.9}
    assert muon_momenta("torch-muon") == {0.9}
    assert muon_momenta("n") == {0.9}
    assert muon_momenta("m") == {0.8}
    # AdamW's run does not depend on it: the same key at every --momentum
    assert train_config_for(bench, "adamw", 2e-3) == train_config_for(
        BenchConfig(**TINY), "adamw", 2e-3
    )
    # the default is the optimizers' own 0.95, so runs saved before the option stay valid
    assert train_config_for(BenchConfig(**TINY), "muon", 0.02).momentum == 0.95


def test_bench_muon_adamw_lr_reaches_every_muon_contender_and_a_variant_overrides_it():
    bench = BenchConfig(
        **TINY,
        muon_adamw_lr=4e-3,
        baselines=["torch-muon"],
        variants=["n=normalize:row", "a=adamw_lr:0.001"],
    )

    def adamw_half_lrs(contender, bench=bench):
        optimizer = make_run(bench, contender, 0.02).optimizer
        if contender == "torch-muon":
            muon = optimizer.optimizers["muon"].param_groups
            adamw = optimizer.optimizers["adamw"].param_groups
            return {g["lr"] for g in muon}, {g["lr"] for g in adamw}
        groups = optimizer.param_groups
        return (
            {g["lr"] for g in groups if g["algorithm"] == "muon"},
            {g["lr"] for g in groups if g["algorithm"] == "adamw"},
        )

    assert adamw_half_lrs("muon") == ({0.02}, {4e-3})
    assert adamw_half_lrs("torch-muon") == ({0.02}, {4e-3})
    assert adamw_half_lrs("n") == ({0.02}, {4e-3})
    assert adamw_half_lrs("a") == ({0.02}, {1e-3})
    # the AdamW contender's own lr is untouched, and its run key does not depend on the option
    assert train_config_for(bench, "adamw", 2e-3) == train_config_for(
        BenchConfig(**TINY), "adamw", 2e-3
    )
    # none: each Muon contender's AdamW half runs at its own lr (the keys saved before the option)
    unset = BenchConfig(**TINY, baselines=["torch-muon"], muon_adamw_lr=None)
    assert train_config_for(unset, "muon", 0.02).adamw_lr is None
    assert adamw_half_lrs("muon", unset) == ({0.02}, {0.02})
    assert adamw_half_lrs("torch-muon", unset) == ({0.02}, {0.02})
    # the bench's default, measured (config.DEFAULT_MUON_ADAMW_LR), reaches both Muons
    default = BenchConfig(**TINY, baselines=["torch-muon"])
    assert adamw_half_lrs("muon", default) == ({0.02}, {DEFAULT_MUON_ADAMW_LR})
    assert adamw_half_lrs("torch-muon", default) == ({0.02}, {DEFAULT_MUON_ADAMW_LR})


def test_bench_muon_weight_decay_reaches_every_muon_contender_and_a_variant_overrides_it():
    bench = BenchConfig(
        **TINY,
        weight_decay=0.1,
        muon_weight_decay=0.03,
        baselines=["torch-muon"],
        variants=["n=normalize:row", "w=weight_decay:0.07"],
    )

    def decays(contender, bench=bench):
        """(Muon half's decays, AdamW half's decays on >= 2-D, on < 2-D) of a contender."""
        optimizer = make_run(bench, contender, 0.02).optimizer
        if contender == "adamw":
            groups = [dict(g, algorithm="adamw") for g in optimizer.param_groups]
        elif contender == "torch-muon":
            groups = [dict(g, algorithm="muon") for g in optimizer.optimizers["muon"].param_groups]
            groups += [
                dict(g, algorithm="adamw") for g in optimizer.optimizers["adamw"].param_groups
            ]
        else:
            groups = optimizer.param_groups

        def of(algorithm, matrices):
            return {
                g["weight_decay"]
                for g in groups
                if g["algorithm"] == algorithm
                and any((p.ndim >= 2) == matrices for p in g["params"])
            }

        return of("muon", True), of("adamw", True), of("adamw", False)

    assert decays("muon") == ({0.03}, {0.03}, {0.0})
    assert decays("torch-muon") == ({0.03}, {0.03}, {0.0})
    assert decays("n") == ({0.03}, {0.03}, {0.0})
    assert decays("w") == ({0.07}, {0.07}, {0.0})
    assert decays("adamw") == (set(), {0.1}, {0.0})  # the AdamW contender keeps --weight-decay
    # AdamW's run key does not depend on the option; unset, every contender has --weight-decay
    assert train_config_for(bench, "adamw", 2e-3) == train_config_for(
        BenchConfig(**TINY), "adamw", 2e-3
    )
    unset = BenchConfig(**TINY, weight_decay=0.1)
    assert train_config_for(unset, "muon", 0.02) == train_config_for(
        BenchConfig(**TINY), "muon", 0.02
    )
    assert decays("muon", unset) == ({0.1}, {0.1}, {0.0})


@pytest.mark.parametrize("value", [-0.1, float("inf"), float("nan")])
def test_bad_muon_weight_decay_is_refused_by_name(value):
    with pytest.raises(ValueError, match="--muon-weight-decay must be a finite number >= 0"):
        BenchConfig(**TINY, muon_weight_decay=value)


# ---- qk_clip:TAU, a training option of a variant ------------------------------------------------
def test_qk_clip_option_reaches_the_train_config_not_muon():
    bench = BenchConfig(**TINY, variants=["clip=qk_clip:100", "nclip=normalize:row,qk_clip:50"])
    assert bench.variant_options("clip") == {}  # nothing for muonscale.Muon
    assert bench.variant_options("nclip") == {"normalize": "row"}
    assert train_config_for(bench, "clip", 0.02).qk_clip == 100.0
    assert train_config_for(bench, "nclip", 0.02).qk_clip == 50.0
    assert train_config_for(bench, "muon", 0.02).qk_clip is None


@pytest.mark.parametrize("tau", ["-1", "0", "inf", "true", "big"])
def test_bad_qk_clip_is_refused_by_name(tau):
    with pytest.raises(ValueError, match="qk_clip must be a finite number > 0"):
        BenchConfig(variants=[f"clip=qk_clip:{tau}"])


def test_qk_clip_is_part_of_the_run_key():
    """Runs with and without QK-clip, or with another tau, never share a saved result."""
    from muonscale.bench.store import RunStore, run_key

    def key(spec):
        return run_key(BenchConfig(**TINY, variants=[spec]), "v", 0.02, kind="run", steps=3)

    with_clip, other_tau, without = key("v=qk_clip:100"), key("v=qk_clip:50"), key("v=ns_steps:5")
    assert with_clip["train"]["qk_clip"] == 100.0 and without["train"]["qk_clip"] is None
    store = RunStore("unused")
    assert len({store.path(k) for k in (with_clip, other_tau, without)}) == 3


def test_qk_clip_variant_clips_every_step_below_its_logits():
    """tau far below the tiny model's initial logits: every step measures a maximum above tau
    and rescales W_q/W_k, so the variant's parameters leave muon's (same seed and batches)."""
    tau = 1e-3
    bench = BenchConfig(**TINY, variants=[f"clip=qk_clip:{tau}"])
    clip, plain = make_run(bench, "clip", 0.02), make_run(bench, "muon", 0.02)
    records = [clip.step() for _ in range(2)]
    assert all(r.max_attention_logit is not None and r.max_attention_logit > tau for r in records)
    assert all(plain.step().max_attention_logit is None for _ in range(2))
    qkv = "blocks.0.attn.qkv.weight"
    ours = dict(clip.model.named_parameters())[qkv]
    theirs = dict(plain.model.named_parameters())[qkv]
    assert not torch.equal(ours, theirs)


def test_cli_compares_with_and_without_qk_clip(tmp_path):
    """``muonscale bench --variants clip=qk_clip:TAU``: the clipped contender beside muon in
    the report, its saved run keyed with its tau."""
    import json

    out = tmp_path / "bench"
    assert main(["bench", *BENCH_TINY, "--variants", "clip=qk_clip:0.001", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert {"muon", "clip"} <= set(report["contenders"])
    keys = [json.loads(f.read_text())["key"] for f in (out / "runs").glob("run-*.json")]
    taus = {k["contender"]: k["train"]["qk_clip"] for k in keys}
    assert taus["clip"] == 0.001 and taus["muon"] is None
