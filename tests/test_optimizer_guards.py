"""Inputs at the edges of the optimizer: a changed ``momentum_dtype`` on load, float16 momentum,
huge finite gradients, a step interrupted inside ``optimizer.step()``, float16 AdamW parameters,
and named errors for bad calls (rebinding, groups, environment, learning rates, QK-clip).

Oracles: the step of the previous code path (bitwise), float64 polar factors and AdamW, an
uninterrupted run (bitwise), and error messages that name what was wrong.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from bench_tiny import BENCH_TINY
from torch import nn

import muonscale.functional as functional
from muonscale import Muon
from muonscale.cli import main
from muonscale.kernels.first_step import inverse_norms
from muonscale.kernels.newton_schulz_fast import iterate_, orthogonalize_stack_
from muonscale.kernels.process_state import get_workspace
from muonscale.memory import (
    DEFAULT_NS_WORKSPACE_BYTES,
    NS_WORKSPACE_ENV,
    UPDATE_CHUNK_ENV,
    MemoryBudget,
)
from muonscale.newton_schulz import DEFAULT_EPS, newton_schulz, resolve_schedule
from muonscale.qk_clip import QKClip
from muonscale.train.checkpoint import read_checkpoint
from muonscale.train.config import TrainConfig
from muonscale.train.data import load_corpus
from muonscale.train.trainer import TrainingRun

# the module (``muonscale.kernels.newton_schulz_fast`` is also the name of the function)
fast = importlib.import_module("muonscale.kernels.newton_schulz_fast")
first_step = importlib.import_module("muonscale.kernels.first_step")


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    threads = torch.get_num_threads()  # tiny models: threads only spin on a busy machine
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(dtype)


def _set_grads(model: nn.Module, seed: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(p.dtype)


# ------------------------------------------------------------------ momentum_dtype on load
@pytest.mark.parametrize(("saved", "now"), [(None, torch.bfloat16), (torch.bfloat16, None)])
def test_load_state_dict_casts_momentum_to_this_optimizers_dtype(saved, now):
    model = _model()
    first = Muon(model, momentum_dtype=saved)
    _set_grads(model, 1)
    first.step()
    state = first.state_dict()
    second = Muon(model, momentum_dtype=now)
    with pytest.warns(UserWarning, match="momentum_dtype differs from the state dict's"):
        second.load_state_dict(state)
    for group in second.param_groups:
        if group["algorithm"] != "muon":
            continue
        assert group["momentum_dtype"] == now
        for p in group["params"]:
            buf = second.state[p]["momentum_buffer"]
            assert buf.dtype == (now or p.dtype)
            assert torch.equal(buf, first.state[p]["momentum_buffer"].to(buf.dtype))
    _set_grads(model, 2)
    second.step()  # the stacks are rebuilt in the new dtype
    muon_params = [p for g in second.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    assert all(second.state[p]["momentum_buffer"].dtype == (now or p.dtype) for p in muon_params)


MICRO_FLAGS = (
    "--n-layer 1 --d-model 32 --n-head 2 --context-length 16 --micro-batch-size 2 "
    "--tokens-per-step 32 --eval-batches 1 --eval-every 0 --device cpu --no-progress "
    "--log-every 1 --optimizer muon"
).split()


def _momentum_dtypes(checkpoint) -> set[torch.dtype]:
    state = read_checkpoint(checkpoint)["optimizer"]["state"]
    return {s["momentum_buffer"].dtype for s in state.values() if "momentum_buffer" in s}


def test_cli_resume_applies_and_reports_a_new_momentum_dtype(tmp_path, capsys):
    out = ["--out-dir", str(tmp_path)]
    assert main(["train", *MICRO_FLAGS, *out, "--steps", "2", "--momentum-dtype", "bfloat16"]) == 0
    assert _momentum_dtypes(tmp_path / "checkpoint.pt") == {torch.bfloat16}
    capsys.readouterr()
    with pytest.warns(UserWarning, match="momentum_dtype differs from the state dict's"):
        assert main(["train", *MICRO_FLAGS, *out, "--steps", "3", "--resume", "auto"]) == 0
    assert "resuming with momentum_dtype=None (the checkpoint had bfloat16)" in (
        capsys.readouterr().err
    )
    assert _momentum_dtypes(tmp_path / "checkpoint.pt") == {torch.float32}


# ------------------------------------------------------------------ float16 momentum
def test_float16_momentum_is_refused_with_the_reason(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"momentum_dtype=torch.float16 is refused.*65504"):
        Muon(_model(), momentum_dtype=torch.float16)
    commands = [
        ["train", "--momentum-dtype", "float16", "--out-dir", "none"],
        ["bench", *BENCH_TINY, "--momentum-dtype", "float16", "--out", str(tmp_path)],
    ]
    for argv in commands:  # refused with the reason before anything runs
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "momentum_dtype float16 is refused" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ huge finite gradients
def _old_orthogonalize_stack_(X, schedule, margin, eps, *, method, workspace=None, **_):
    """The fast path before huge inputs were pre-scaled: 1/ν always folded into the first
    step (CPU, torch backend)."""
    if workspace is None:
        workspace = get_workspace(
            tuple(X.shape), X.dtype, X.device, method, max_cached_bytes=DEFAULT_NS_WORKSPACE_BYTES
        )
    inv_norm = inverse_norms(X, workspace, margin, eps)
    if X.dtype == torch.float16:
        X.mul_(inv_norm)
        inv_norm = None
    restart = 2 if method == "gram" else None
    return iterate_(
        X,
        schedule,
        workspace,
        method=method,
        use_triton=False,
        restart_every=restart,
        inv_norm=inv_norm,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["plain", "gram"])
@pytest.mark.parametrize("shape", [(3, 16, 48), (2, 48, 16), (2, 24, 24)])
def test_ordinary_stacks_keep_their_bits(shape, method, dtype):
    torch.manual_seed(0)
    G = torch.randn(shape).to(dtype)
    G[0] *= 1e-3  # a small matrix beside ordinary ones
    schedule, margin = resolve_schedule("keller", 5)
    new = orthogonalize_stack_(G.clone(), schedule, margin, DEFAULT_EPS, method=method).clone()
    old = _old_orthogonalize_stack_(G.clone(), schedule, margin, DEFAULT_EPS, method=method)
    assert torch.equal(new, old)


def test_a_default_step_keeps_its_bits(monkeypatch):
    model = _model()
    reference = _model()
    new_opt, old_opt = Muon(model), Muon(reference)
    for seed in (1, 2):
        _set_grads(model, seed)
        _set_grads(reference, seed)
        new_opt.step()
        with monkeypatch.context() as patch:
            patch.setattr(functional, "orthogonalize_stack_", _old_orthogonalize_stack_)
            old_opt.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("method", ["plain", "gram"])
@pytest.mark.parametrize("scale", [1e20, 1e30, 3e38])
@pytest.mark.parametrize("shape", [(16, 16), (16, 64), (64, 16)])
def test_huge_finite_gradients_are_orthogonalized(shape, scale, method):
    torch.manual_seed(0)
    G = torch.randn(2, *shape, dtype=torch.float64)
    G /= G.abs().amax()  # entries <= 1, so G * scale stays finite in float32
    exact = newton_schulz(G, ns_dtype=torch.float64)
    schedule, margin = resolve_schedule("keller", 5)
    X = (G * scale).float()
    assert torch.isfinite(X).all()
    got = orthogonalize_stack_(X, schedule, margin, DEFAULT_EPS, method=method)
    # float32 rounding, compounded over 5 steps of products of the short side
    bound = 64 * torch.finfo(torch.float32).eps * math.sqrt(max(shape))
    assert (got.double() - exact).abs().max() <= bound


def test_a_float16_norm_that_overflows_still_normalizes():
    torch.manual_seed(0)
    G = torch.randn(2, 64, 256, dtype=torch.float64)
    G /= G.abs().amax()
    exact = newton_schulz(G, ns_dtype=torch.float64)
    schedule, margin = resolve_schedule("keller", 5)

    def error(scale: float) -> float:
        X = (G * scale).half()  # 1e4: finite entries, ‖X‖_F ≈ 3e5 > 65504
        got = orthogonalize_stack_(X, schedule, margin, DEFAULT_EPS, method="plain")
        return float((got.double() - exact).abs().max())

    assert error(1e4) <= 2 * error(1.0) + torch.finfo(torch.float16).eps


@pytest.mark.parametrize("method", ["plain", "gram"])
def test_aol_keeps_ordinary_bits_and_takes_huge_inputs(method, monkeypatch):
    torch.manual_seed(0)
    G = torch.randn(2, 16, 64)
    G /= G.abs().amax()
    G[0] *= 1e-3
    schedule = resolve_schedule("keller", 5)[0]

    def aol(X):
        out = orthogonalize_stack_(
            X, schedule, 1.0, DEFAULT_EPS, method=method, preconditioner="aol"
        )
        return out.clone()

    new = aol(G.clone())
    with monkeypatch.context() as patch:
        patch.setattr(first_step, "shrink_huge_", lambda X: X)  # the code before the guard
        old = aol(G.clone())
    assert torch.equal(new, old)
    bound = 64 * torch.finfo(torch.float32).eps * math.sqrt(64)  # as for the fast path
    for scale in (1e20, 3e38):
        huge = aol(G * scale)
        assert (huge - new).abs().max() <= bound  # AOL does not depend on the scale


@pytest.mark.parametrize("scale", [1e20, 1e38])
def test_a_huge_gradient_step_stays_finite(scale):
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(32, 32))
    small = nn.Parameter(weight.detach().clone())
    G = torch.randn(32, 32)
    G /= G.abs().amax()
    opt, opt_small = Muon([("w", weight)]), Muon([("w", small)])
    weight.grad, small.grad = G * scale, G.clone()
    opt.step()
    opt_small.step()
    assert torch.isfinite(weight).all()
    # the direction does not depend on the gradient's scale: the same step as for G, up to
    # the rounding of W (2 ulp) and of Newton–Schulz (as above; the update scale is <= 2 here)
    eps, lr = torch.finfo(torch.float32).eps, opt.param_groups[0]["lr"]
    bound = 2 * eps * small.abs().max() + 2 * lr * 64 * eps * 32**0.5
    assert (weight - small).abs().max() <= bound


# ------------------------------------------------------------------ interrupted optimizer.step
def _config(**overrides) -> TrainConfig:
    micro = dict(
        n_layer=1,
        d_model=32,
        n_head=2,
        context_length=16,
        micro_batch_size=2,
        tokens_per_step=32,
        eval_batches=1,
        eval_every=0,
        device="cpu",
        log_every=1,
        optimizer="muon",
        steps=6,
        out_dir=None,
    )
    return TrainConfig(**{**micro, **overrides})


def test_interrupt_inside_optimizer_step_saves_no_half_step(tmp_path):
    corpus = load_corpus()
    straight = TrainingRun(_config(), text=corpus)
    straight.run(progress=False)

    config = _config(out_dir=str(tmp_path), checkpoint_every=2, resume="auto")
    run = TrainingRun(config, text=corpus)
    update_group = run.optimizer._update_group

    def interrupted_update(group, params, grads, **options):
        if run.step_count == 4 and group is not run.optimizer.param_groups[0]:
            raise KeyboardInterrupt  # after the first group was updated
        update_group(group, params, grads, **options)

    run.optimizer._update_group = interrupted_update
    with pytest.raises(KeyboardInterrupt) as info:
        run.run(progress=False)
    assert "inside optimizer.step() of step 5" in "".join(info.value.__notes__)
    assert read_checkpoint(tmp_path / "checkpoint.pt")["step"] == 4

    resumed = TrainingRun(config, text=corpus)
    assert resumed.run(progress=False).steps == 6
    for (name, a), b in zip(resumed.model.named_parameters(), straight.model.parameters()):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------ float16 AdamW parameters
@pytest.mark.parametrize("capturable", [False, True])
@pytest.mark.parametrize("zero", [True, False])
def test_float16_adamw_parameters_stay_finite(zero, capturable):
    torch.manual_seed(0)
    bias = nn.Parameter(torch.randn(64).half())
    before = bias.detach().clone()
    group = {"params": [("bias", bias)], "algorithm": "adamw", "weight_decay": 0.1}
    opt = Muon([group], lr=0.01, capturable=capturable)
    bias.grad = torch.zeros_like(bias) if zero else torch.randn(64).half()
    opt.step()
    assert torch.isfinite(bias).all()
    # from the float16 moments as stored: the rest is two roundings of W to float16
    state = opt.state[bias]
    m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()
    update = 0.01 / (1 - 0.9) * m / ((v / (1 - 0.95)).sqrt() + 1e-8)
    exact = before.double() * (1 - 0.01 * 0.1) - update
    bound = torch.finfo(torch.float16).eps * exact.abs() + 2**-24
    assert ((bias.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_keeps_torch_bits_where_eps_is_representable(dtype):
    torch.manual_seed(0)
    ours = nn.Parameter(torch.randn(64).to(dtype))
    theirs = nn.Parameter(ours.detach().clone())
    opt = Muon([{"params": [("b", ours)], "algorithm": "adamw", "weight_decay": 0.1}], lr=0.01)
    ref = torch.optim.AdamW([theirs], lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for grad in (torch.zeros(64), torch.randn(64)):
        ours.grad, theirs.grad = grad.to(dtype), grad.to(dtype)
        opt.step()
        ref.step()
        assert torch.equal(ours, theirs)


# ------------------------------------------------------------------ named errors
def test_rebind_refuses_a_dtype_change_and_bare_tensors():
    model = _model()
    opt = Muon(model)
    with pytest.raises(
        ValueError, match=r"'0.weight' changed dtype torch.float32 -> torch.float64"
    ):
        opt.rebind_parameters((n, p.detach().double()) for n, p in model.named_parameters())
    with pytest.raises(TypeError, match=r"expected \(name, tensor\) pairs"):
        opt.rebind_parameters(list(model.parameters()))
    copy = _model()
    assert opt.rebind_parameters(copy) == 4  # a module is taken by its named parameters


def test_add_param_group_with_named_pairs_and_an_algorithm():
    model = _model()
    opt = Muon(model)
    extra = nn.Parameter(torch.randn(6, 6))
    opt.add_param_group({"params": [("extra", extra)], "algorithm": "muon"})
    assert opt.param_groups[-1]["param_names"] == ["extra"]
    extra.grad = torch.randn(6, 6)
    before = extra.detach().clone()
    opt.step()
    assert not torch.equal(extra, before)


@pytest.mark.parametrize("name", [UPDATE_CHUNK_ENV, NS_WORKSPACE_ENV])
@pytest.mark.parametrize("value", ["inf", "1e400", "nan"])
def test_memory_variables_must_be_finite(name, value, monkeypatch, tmp_path, capsys):
    with pytest.raises(ValueError, match=f"{name} must be a finite positive number of MiB"):
        MemoryBudget.from_environment({name: value})
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        Muon(_model())
    with pytest.raises(SystemExit) as exit_info:  # before any contender trains
        main(["bench", *BENCH_TINY, "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert f"{name} must be a finite positive number of MiB" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_lr_message_states_the_range_it_checks():
    with pytest.raises(ValueError, match=r"^lr must be a finite number >= 0.0, got inf$"):
        Muon(_model(), lr=math.inf)


def test_bench_variant_with_an_infinite_lr_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *BENCH_TINY, "--variants", "x=lr:inf", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--variants 'x=lr:inf': lr must be a finite number > 0, got inf" in (
        capsys.readouterr().err
    )


def test_qk_clip_without_targets_is_refused():
    with pytest.raises(ValueError, match="targets must be a non-empty list"):
        QKClip([], tau=1.0)
