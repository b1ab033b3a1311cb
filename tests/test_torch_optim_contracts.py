"""muonscale.Muon against the contracts torch's own optimizer tests check.

Each test names the torch test it mirrors (``test/test_optim.py::TestOptimRenewed`` or torch's
older helpers in ``torch/testing/_internal/common_optim*``); none of their code is copied. Inputs
come from an ``OptimizerInfo`` built from ``torch.testing._internal.common_optimizers``: torch's
own Muon inputs and error inputs plus muonscale's options.
"""

import copy
import io
import math
import pickle
import warnings

import pytest
import torch
from torch import nn
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerErrorEnum,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
    optim_inputs_func_muon,
)

from muonscale import COEFFICIENT_PRESETS, Muon, QKVLayout, newton_schulz
from muonscale.newton_schulz import (
    DIVERGENCE_BOUND,
    _composed_range,
    resolve_schedule,
    validate_coefficients,
)


def _inputs(device, dtype=None):
    """torch's Muon inputs, then muonscale's own options."""
    return optim_inputs_func_muon(device, dtype) + [
        OptimizerInput(None, {"adjust_lr_fn": "original", "adamw_lr": 1e-3}, "torch scale"),
        OptimizerInput(None, {"ns_coefficients": "polar_express", "ns_steps": 8}, "preset"),
        OptimizerInput(None, {"betas": (0.8, 0.9), "nesterov": False}, "AdamW betas"),
        OptimizerInput(None, {"momentum_dtype": torch.bfloat16}, "bf16 momentum"),
    ]


def _error_inputs(device, dtype):
    p = torch.rand(2, 3, device=device, dtype=dtype)
    complex_p = torch.rand(2, 3, device=device, dtype=torch.complex64)
    errors = [
        ((dict(adjust_lr_fn="arbitrary"), [p]), ValueError, "Adjust learning rate function"),
        ((dict(ns_coefficients=(1.0, 1.0, 1.0)), [p]), ValueError, "diverge"),
        ((dict(ns_coefficients=(math.nan, 1.0, 1.0)), [p]), ValueError, "finite"),
        ((dict(coefficients="keller", ns_coefficients="keller"), [p]), ValueError, "not both"),
        ((dict(), [{"params": [complex_p], "algorithm": "muon"}]), ValueError, "complex"),
    ]
    return get_error_inputs_for_all_optims(device, dtype) + [
        ErrorOptimizerInput(
            OptimizerInput(params, kwargs, desc=regex),
            error_type=kind,
            error_regex=regex,
            error_on=OptimizerErrorEnum.CONSTRUCTION_ERROR,
        )
        for (kwargs, params), kind, regex in errors
    ]


MUONSCALE_INFO = OptimizerInfo(
    Muon,
    optim_inputs_func=_inputs,
    optim_error_inputs_func=_error_inputs,
    supported_impls=(),
    not_og_supported_flags=(),
    supports_complex=True,  # routed to AdamW, which follows torch.optim.AdamW
)
INPUTS = MUONSCALE_INFO.optim_inputs_func("cpu", torch.float32)
IDS = [i.desc for i in INPUTS]
pytestmark = [
    pytest.mark.filterwarnings("ignore:muonscale.Muon. .* unnamed"),
    # torch's tests pass a convolution without its model: flattened on purpose (its 4-D weight
    # is one (out, in·k·k) matrix, Keller Jordan's convention), which muonscale points out
    pytest.mark.filterwarnings("ignore::muonscale.optimizer_groups.UnknownLayoutWarning"),
]


def _model(seed=0):
    """Conv (4-D → Muon) + BatchNorm (1-D → AdamW): routing splits one group."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(4, 2, 1, stride=2), nn.BatchNorm2d(2))


def _build(model: nn.Module, named: bool, **kwargs) -> Muon:
    """``Muon`` on the parameters as torch's tests pass them: named, or ``model.parameters()``,
    which needs ``strict=False`` (routing by tensor rank alone, accepted with a warning)."""
    if named:
        return Muon(model.named_parameters(), **kwargs)
    return Muon(model.parameters(), strict=False, **kwargs)


_WEIGHTS = torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(7))


def _fwd_bwd(opt, model, x):
    opt.zero_grad()
    loss = (model(x) * _WEIGHTS).sum()  # a plain sum after BatchNorm has zero gradient
    loss.backward()
    return loss


def _steps(opt, model, n=3, seed=1):
    x = torch.rand(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))
    for _ in range(n):
        _fwd_bwd(opt, model, x)
        opt.step()


# ------------------------------------------------------------------ TestOptimRenewed mirrors
@pytest.mark.parametrize(
    "err",
    MUONSCALE_INFO.optim_error_inputs_func("cpu", torch.float32),
    ids=lambda e: e.optimizer_error_input.desc,
)
def test_errors(err):
    """TestOptimRenewed.test_errors."""
    inp = err.optimizer_error_input
    params = [torch.rand(2, 3, requires_grad=True)] if inp.params is None else inp.params
    if err.error_type is UserWarning:
        with pytest.warns(UserWarning, match=err.error_regex):
            Muon(params, **inp.kwargs)
        return
    with pytest.raises(err.error_type, match=err.error_regex):
        Muon(params, **inp.kwargs)


@pytest.mark.parametrize("named1", [True, False])
@pytest.mark.parametrize("named0", [True, False])
def test_can_load_from_to_named_state_dict(named0, named1):
    """TestOptimRenewed.test_can_load_from_to_named_state_dict: names survive, aligned with
    params in every routed group."""
    for inp in INPUTS:
        model = _model()
        opt = _build(model, named0, **inp.kwargs)
        _steps(opt, model)
        opt2 = _build(model, named1, **inp.kwargs)
        opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
        _steps(opt2, model, n=1)
        groups = opt2.state_dict()["param_groups"]
        if named0 or named1:
            names = dict(model.named_parameters())
            assert [n for g in groups for n in g["param_names"]] == [
                "0.weight",
                "0.bias",
                "1.weight",
                "1.bias",
            ]
            for g, live in zip(groups, opt2.param_groups):
                assert [names[n] for n in g["param_names"]] == live["params"]
        else:
            assert all("param_names" not in g for g in groups)


def test_deepcopy_copies_all_public_attrs():
    """TestOptimRenewed.test_deepcopy_copies_all_public_attrs."""
    for inp in INPUTS:
        model = _model()
        opt = Muon(model.named_parameters(), **inp.kwargs)
        _steps(opt, model)

        def public(o):
            return {k for k in o.__dict__ if not k.startswith("_")}

        assert public(copy.deepcopy(opt)) == public(opt)


@pytest.mark.parametrize("inp", INPUTS, ids=IDS)
def test_forloop_goes_right_direction(inp):
    """TestOptimRenewed.test_forloop_goes_right_direction: a quadratic loss falls."""
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(4, 3))
    bias = nn.Parameter(torch.randn(4))
    x = torch.randn(3)
    opt = Muon([("fc.weight", weight), ("fc.bias", bias)], **dict(inp.kwargs, lr=1e-2))
    initial = None
    for _ in range(5):
        opt.zero_grad()
        loss = (weight.mv(x) + bias).pow(2).sum()
        loss.backward()
        initial = loss.item() if initial is None else initial
        opt.step()
    assert (weight.mv(x) + bias).pow(2).sum().item() < initial


def test_tensor_lr():
    """TestOptimRenewed.test_tensor_lr: a tensor lr gives the float lr's result (the float is
    the tensor's float32 value, so the comparison is exact)."""
    results = []
    for lr in (float(torch.tensor(0.01)), torch.tensor(0.01)):
        model = _model()
        opt = Muon(model.named_parameters(), lr=lr)
        _steps(opt, model)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("zero", [False, True])
def test_step_is_noop_without_or_with_zero_grads(zero):
    """TestOptimRenewed.test_step_is_noop_when_params_have_no_grad and
    test_step_is_noop_for_zero_grads (without weight decay, as there)."""
    for inp in INPUTS:
        model = _model()
        before = [p.detach().clone() for p in model.parameters()]
        opt = Muon(model.named_parameters(), **dict(inp.kwargs, weight_decay=0.0))
        for p in model.parameters():
            p.grad = torch.zeros_like(p) if zero else None
        opt.step()
        for a, b in zip(before, model.parameters()):
            assert torch.equal(a, b)


def test_optimizer_can_be_printed():
    """TestOptimRenewed.test_optimizer_can_be_printed."""
    text = repr(Muon(_model().named_parameters()))
    assert "Muon (" in text and "algorithm: adamw" in text and "algorithm: muon" in text


@pytest.mark.parametrize("inp", INPUTS, ids=IDS)
def test_state_dict_deterministic(inp):
    """TestOptimRenewed.test_state_dict_deterministic: a copy loaded from the state dict steps
    like the original, bit for bit."""
    a, b = _model(), _model()
    opt_a = Muon(a.named_parameters(), **inp.kwargs)
    _steps(opt_a, a)
    b.load_state_dict(a.state_dict())
    opt_b = Muon(b.named_parameters(), **inp.kwargs)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    _steps(opt_a, a, seed=2)
    _steps(opt_b, b, seed=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("named", [True, False])
def test_save_load_equality_with_weights_only(named):
    """TestOptimRenewed.test_save_load_equality_with_weights_only."""
    for inp in INPUTS:
        model = _model()
        opt = _build(model, named, **inp.kwargs)
        _steps(opt, model)
        sd = opt.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        assert loaded["param_groups"] == sd["param_groups"]
        for k, s in sd["state"].items():
            for key, value in s.items():
                assert torch.equal(loaded["state"][k][key], value)


def test_load_nontensor_step():
    """TestOptimRenewed.test_load_nontensor_step: AdamW's step saved as a Python number."""
    model = _model()
    opt = Muon(model.named_parameters())
    _steps(opt, model)
    sd = copy.deepcopy(opt.state_dict())
    for s in sd["state"].values():
        if "step" in s:
            s["step"] = s["step"].item()
    opt.load_state_dict(sd)
    _steps(opt, model, n=1)
    assert all(float(s["step"]) == 4 for s in opt.state.values() if "step" in s)


def test_hooks_run():
    """TestOptimRenewed.test_step_pre_hook/test_step_post_hook/test_state_dict_post_hook: torch's
    hooks work through the subclass (the load_state_dict hooks: the two ports below)."""
    model = _model()
    opt = Muon(model.named_parameters())
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: calls.append("sd"))
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load"))
    _steps(opt, model, n=1)
    opt.load_state_dict(opt.state_dict())
    assert calls == ["pre", "post", "sd", "load"]


def _load_pre_hook_returning_a_copy(optimizer, state_dict):
    """torch's _load_state_dict_pre_hook2: the hook returns a modified deep copy."""
    mine = copy.deepcopy(state_dict)
    mine["param_groups"][0]["lr"] = 0.003
    return mine


def _load_post_hook_writing_state(optimizer):
    """torch's _load_state_dict_post_hook: writes non-parameter keys into optimizer.state."""
    optimizer.state["ran_load_state_dict_pre_hook2"] = optimizer.param_groups[0]["lr"] == 0.003
    optimizer.state["ran_load_state_dict_post_hook"] = True


def test_load_state_dict_post_hook():
    """TestOptimRenewed.test_load_state_dict_post_hook."""
    for inp in INPUTS:
        param = torch.rand(2, 3, requires_grad=True)
        opt = Muon([param], **inp.kwargs)
        opt.register_load_state_dict_post_hook(_load_post_hook_writing_state)
        opt.load_state_dict(opt.state_dict())
        assert not opt.state["ran_load_state_dict_pre_hook2"]
        assert opt.state["ran_load_state_dict_post_hook"]


def test_load_state_dict_pre_post_hook():
    """TestOptimRenewed.test_load_state_dict_pre_post_hook."""
    for inp in INPUTS:
        param = torch.rand(2, 3, requires_grad=True)
        opt = Muon([param], **inp.kwargs)
        opt.register_load_state_dict_pre_hook(_load_pre_hook_returning_a_copy)
        opt.register_load_state_dict_post_hook(_load_post_hook_writing_state)
        opt.load_state_dict(opt.state_dict())
        assert opt.state["ran_load_state_dict_pre_hook2"]
        assert opt.state["ran_load_state_dict_post_hook"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-only case")
def test_state_dict_with_cuda_params():
    """TestOptimRenewed.test_state_dict_with_cuda_params: a CPU state dict loads on CUDA."""
    cpu, gpu = _model(), _model().cuda()
    opt = Muon(cpu.named_parameters())
    _steps(opt, cpu)
    opt_gpu = Muon(gpu.named_parameters())
    opt_gpu.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert all(s["step"].device.type == "cpu" for s in opt_gpu.state.values() if "step" in s)


# ------------------------------------------------------------------ torch's older helpers
def _fused_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 12), nn.Linear(12, 4))
    return model


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_copies_step_identically(how):
    """torch's _test_state_dict deepcopy/pickle round trip, plus torch.save(opt): the copy keeps
    ``splits`` and steps bit for bit like the original."""
    model = _fused_model()
    opt = Muon(model.named_parameters(), lr=0.02, splits={"0.weight": 3}, nonfinite="skip")
    x = torch.randn(5, 6)

    def step(m, o):
        o.zero_grad()
        m(x).square().sum().backward()
        o.step()

    step(model, opt)
    if how == "deepcopy":
        model2, opt2 = copy.deepcopy((model, opt))
    elif how == "pickle":
        model2, opt2 = pickle.loads(pickle.dumps((model, opt)))
    else:
        buf = io.BytesIO()
        torch.save((model, opt), buf)
        buf.seek(0)
        model2, opt2 = torch.load(buf, weights_only=False)
    assert opt2.nonfinite == "skip" and opt2.routing == opt.routing
    w2 = model2[0].weight
    assert opt2.split_rows[id(w2)][0].tolist() == opt.split_rows[id(model[0].weight)][0].tolist()
    for _ in range(2):
        step(model, opt)
        step(model2, opt2)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)


def test_zero_size_parameters_step():
    """torch's zero-size parameter helper: 0×5, 5×0 and (0,) step (as torch AdamW and Muon)."""
    params = [nn.Parameter(torch.zeros(*s)) for s in ((0, 5), (5, 0), (0,))]
    live = nn.Parameter(torch.randn(3, 4))
    opt = Muon([("a.w", params[0]), ("b.w", params[1]), ("c.b", params[2]), ("d.w", live)])
    for p in params + [live]:
        p.grad = torch.ones_like(p)
    before = live.detach().clone()
    opt.step()
    assert not torch.equal(before, live) and all(p in opt.state for p in params)


def test_reduce_lr_on_plateau_halves_each_routed_group_once():
    """torch's ReduceLROnPlateau test with a tensor lr: each routed group is cut once."""
    opt = Muon(_model().named_parameters(), lr=torch.tensor(1e-3))
    lrs = [g["lr"] for g in opt.param_groups]
    assert len({id(t) for t in lrs}) == len(lrs) > 1
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    for _ in range(2):
        sched.step(1.0)
    halved = float(torch.tensor(1e-3) * 0.5)  # float32 arithmetic, as the scheduler's
    assert [float(g["lr"]) for g in opt.param_groups] == [halved] * len(lrs)


@pytest.mark.parametrize("kind", ["onecycle", "cyclic"])
def test_momentum_cycling_reaches_adamw_betas(kind):
    """torch's OneCycleLR/CyclicLR momentum tests: β₁ of the AdamW half cycles, as with AdamW."""
    opt = Muon(_model().named_parameters(), lr=1e-3)
    if kind == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=1e-2, total_steps=10, base_momentum=0.8, max_momentum=0.9
        )
    else:
        sched = torch.optim.lr_scheduler.CyclicLR(
            opt, base_lr=1e-4, max_lr=1e-3, step_size_up=2, base_momentum=0.8, max_momentum=0.9
        )
    muon = [g for g in opt.param_groups if g["algorithm"] == "muon"]
    adamw = [g for g in opt.param_groups if g["algorithm"] == "adamw"]
    assert all(g["betas"] == (0.9, 0.95) for g in adamw)
    for _ in range(3):
        opt.step()
        sched.step()
    for g in adamw:
        assert g["betas"][0] == muon[0]["momentum"] < 0.9 and g["betas"][1] == 0.95
        assert "momentum" not in opt.state_dict()["param_groups"][opt.param_groups.index(g)]


def test_complex_parameters_on_adamw_follow_torch_adamw():
    """TestOptimRenewed.test_complex / torch's complex helpers: complex tensors route to AdamW
    and step as torch.optim.AdamW (real and imaginary parts as separate coordinates)."""
    g = torch.Generator().manual_seed(0)
    ours = nn.Parameter(torch.randn(4, 3, dtype=torch.complex128, generator=g))
    theirs = nn.Parameter(ours.detach().clone())
    opt = Muon([("layer.weight", ours)], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    assert opt.param_groups[0]["algorithm"] == "adamw"
    for _ in range(3):
        grad = torch.randn(4, 3, dtype=torch.complex128, generator=g)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    # float64, 3 elementwise steps: a few ulps of values O(1)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-14)


def test_single_tensor_params_is_a_type_error():
    """torch's constructor helper: a tensor is not an iterable of parameters."""
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        Muon(torch.randn(3, 3, requires_grad=True))


# ------------------------------------------------------------------ signature and routing
def test_positional_order_and_defaults_match_torch_muon():
    p = torch.randn(4, 4, requires_grad=True)
    q = p.detach().clone().requires_grad_()
    ours, theirs = Muon([p], 0.02, 0.2, 0.9, False), torch.optim.Muon([q], 0.02, 0.2, 0.9, False)
    for key in ("lr", "weight_decay", "momentum", "nesterov", "ns_steps"):
        assert ours.param_groups[0][key] == theirs.param_groups[0][key]
    assert ours.param_groups[0]["ns_eps"] == theirs.param_groups[0]["eps"]
    default = Muon([torch.randn(2, 2, requires_grad=True)]).defaults
    assert (default["lr"], default["weight_decay"], default["momentum"]) == (1e-3, 0.1, 0.95)


def test_torch_keyword_names_mean_ours():
    p = [("w", torch.randn(4, 4, requires_grad=True))]
    a = Muon(
        p,
        adjust_lr_fn="original",
        ns_coefficients=(3.4, -4.7, 2.0),
        eps=1e-6,
        betas=(0.8, 0.9),
        adamw_lr=1e-3,
    )
    g = a.param_groups[0]
    assert (g["scale"], g["coefficients"], g["ns_eps"]) == ("shape", (3.4, -4.7, 2.0), 1e-6)
    assert a.adamw_defaults["betas"] == (0.8, 0.9)
    assert Muon(p, adjust_lr_fn="match_rms_adamw").param_groups[0]["scale"] == "match_rms_adamw"


def test_adamw_half_inherits_weight_decay_except_vectors():
    opt = Muon(_model().named_parameters(), weight_decay=0.1)
    decay = {n: g["weight_decay"] for g in opt.param_groups for n in g["param_names"]}
    assert decay == {"0.weight": 0.1, "0.bias": 0.0, "1.weight": 0.0, "1.bias": 0.0}


def test_add_param_group_uses_constructor_defaults():
    opt = Muon([("fc.weight", torch.randn(4, 4, requires_grad=True))], weight_decay=0.1)
    new = [
        ("head.bias", torch.randn(4, requires_grad=True)),
        ("emb.weight", torch.randn(5, 4, requires_grad=True)),
    ]
    opt.add_param_group({"params": new, "algorithm": "adamw"})
    decay = {
        n: (g["algorithm"], g["weight_decay"]) for g in opt.param_groups for n in g["param_names"]
    }
    assert decay["head.bias"] == ("adamw", 0.0) and decay["emb.weight"] == ("adamw", 0.1)
    opt.add_param_group({"params": [("mlp.weight", torch.randn(4, 4, requires_grad=True))]})
    assert opt.param_groups[-1]["algorithm"] == "muon" and opt.param_groups[-1]["momentum"] == 0.95


def test_param_names_in_groups_route_by_name_and_unnamed_warn_once():
    emb, hidden = torch.randn(10, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    opt = Muon([{"params": [emb, hidden], "param_names": ["wte.weight", "h.0.mlp.weight"]}])
    assert {n: g["algorithm"] for g in opt.param_groups for n in g["param_names"]} == {
        "wte.weight": "adamw",
        "h.0.mlp.weight": "muon",
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Muon([emb, hidden, torch.randn(4, requires_grad=True)])
    messages = [str(w.message) for w in caught if "unnamed" in str(w.message)]
    assert len(messages) == 1 and "named_parameters()" in messages[0] and "2 unnamed" in messages[0]


def test_foreign_state_dict_is_rejected_and_nothing_changes():
    model = _model()
    opt = Muon(model.named_parameters())
    _steps(opt, model)
    before = copy.deepcopy(opt.state_dict())
    adamw = torch.optim.AdamW([model[0].weight, model[0].bias])
    foreign = copy.deepcopy(opt.state_dict())
    foreign["param_groups"] = [
        dict(g, params=o["params"])
        for g, o in zip(adamw.state_dict()["param_groups"] * 3, foreign["param_groups"])
    ]
    with pytest.raises(ValueError, match="not a muonscale.Muon"):
        opt.load_state_dict(foreign)
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"]
    _steps(opt, model, n=1)


# ------------------------------------------------------------------ coefficients
def test_polar_express_converges_past_its_five_steps():
    g = torch.Generator().manual_seed(0)
    G = torch.randn(32, 64, dtype=torch.float64, generator=g)
    X = newton_schulz(G, steps=16, coefficients="polar_express", ns_dtype=torch.float64)
    sv = torch.linalg.svdvals(X)
    assert (sv - 1).abs().max() < 1e-5


@pytest.mark.parametrize("preset", sorted(COEFFICIENT_PRESETS))
def test_presets_stay_bounded_at_full_length_and_beyond(preset):
    for steps in (len(COEFFICIENT_PRESETS[preset].steps), 8, 16):
        assert validate_coefficients(preset, steps)  # named presets skip the check: run it here
        schedule, margin = resolve_schedule(preset, steps)
        low, high = _composed_range(tuple(schedule), margin)
        assert 0 <= low and high <= DIVERGENCE_BOUND


def test_divergent_user_schedule_is_rejected_by_the_optimizer():
    # keller's tuple converges; scaling c up by 1.5 sends σ = 1 to 3.4445 − 4.775 + 3.047 ≈ 1.72
    # after one step and on to infinity
    with pytest.raises(ValueError, match="diverge"):
        Muon([torch.randn(3, 3, requires_grad=True)], ns_coefficients=(3.4445, -4.775, 3.047))
    Muon([torch.randn(3, 3, requires_grad=True)], ns_coefficients=(3.4445, -4.775, 2.0315))


def test_splits_survive_qkv_layout_copy():
    layout = QKVLayout(n_query_groups=2, q_per_group=2, head_dim=3)
    w = nn.Parameter(torch.randn(layout.rows, 8))
    opt = copy.deepcopy(Muon([("attn.qkv.weight", w)], splits={"attn.qkv.weight": layout}))
    (w2,) = opt.param_groups[0]["params"]
    assert len(opt.split_rows[id(w2)]) == 3
