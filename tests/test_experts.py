"""Mixture-of-experts stacks: every expert matrix (gate and up apart) is orthogonalized on its
own, in each storage layout.

Oracle: after a step, each expert matrix's update, cut out of the stacked parameter by hand
(below, from each layout's own indexing, not from the view under test), equals the update a
fresh ``muonscale.Muon`` gives a standalone (out, in) parameter equal to that matrix with the
same gradient. Float64 Newton–Schulz: the two do the same arithmetic on the same matrices, so
they agree to a few ulp (the tolerance of ``tests/test_transposed_weights.py``).
"""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

import muonscale
from muonscale import ExpertLayout
from muonscale.optimizer_groups import UnknownLayoutWarning

E, F, D = 3, 4, 6
OPTIONS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float64, adamw_lr=0.01)
TOL = dict(rtol=0, atol=16 * torch.finfo(torch.float64).eps)


def _contiguous(w):  # (E, 2F, D) (out, in), [gate; up] rows
    return [m for e in range(E) for m in (w[e, :F], w[e, F:])]


def _interleaved_in_out(w):  # (E, D, 2F) (in, out), gate = even columns (GPT-OSS)
    return [m for e in range(E) for m in (w[e][:, ::2].T, w[e][:, 1::2].T)]


def _contiguous_in_out(w):  # (E, D, 2F) (in, out), [gate | up] columns (Llama 4)
    return [m for e in range(E) for m in (w[e][:, :F].T, w[e][:, F:].T)]


def _plain(w):  # (E, D, F) (out, in)
    return list(w.unbind(0))


def _in_out(w):  # (E, F, D) (in, out)
    return [w[e].T for e in range(E)]


def _concatenated(w):  # (E·F, D), expert e's (out, in) block (DBRX w1, v1)
    return list(w.view(E, F, D).unbind(0))


def _concatenated_in_out(w):  # (E·F, D), expert e's block used as h @ W (DBRX w2)
    return [b.T for b in w.view(E, F, D).unbind(0)]


def _dense_gate_up(w):  # (2F, D): Phi-3's gate_up_proj, [gate; up]
    return [w[:F], w[F:]]


LAYOUTS = {  # name: (shape, layout, the expert matrices of a tensor of that shape)
    "contiguous": ((E, 2 * F, D), ExpertLayout(n_experts=E, gate_up="contiguous"), _contiguous),
    "interleaved_in_out": (
        (E, D, 2 * F),
        ExpertLayout(n_experts=E, transposed=True, gate_up="interleaved"),
        _interleaved_in_out,
    ),
    "contiguous_in_out": (
        (E, D, 2 * F),
        ExpertLayout(n_experts=E, transposed=True, gate_up="contiguous"),
        _contiguous_in_out,
    ),
    "plain": ((E, D, F), ExpertLayout(n_experts=E), _plain),
    "in_out": ((E, F, D), ExpertLayout(n_experts=E, transposed=True), _in_out),
    "concatenated": ((E * F, D), ExpertLayout(n_experts=E), _concatenated),
    "concatenated_in_out": (
        (E * F, D),
        ExpertLayout(n_experts=E, transposed=True),
        _concatenated_in_out,
    ),
    "dense_gate_up": ((2 * F, D), ExpertLayout(n_experts=1, gate_up="contiguous"), _dense_gate_up),
}

VARIANTS = {
    "muon": {},
    "shape": dict(scale="shape"),
    "spectral": dict(scale="spectral"),
    "normuon": dict(normalize="row"),
    "cautious": dict(cautious_weight_decay=True),
    "aol": dict(preconditioner="aol"),
}


def _standalone_updates(matrices, grads, options, steps):
    """Each matrix stepped by a fresh Muon as its own (out, in) parameter: its updates."""
    out = []
    for m, g in zip(matrices, grads):
        p = nn.Parameter(m.detach().clone().contiguous())
        opt = muonscale.Muon([("w", p)], **OPTIONS, **options)
        for step in range(steps):
            p.grad = (g * (step + 1)).contiguous()
            opt.step()
        out.append(p.detach() - m)
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_expert_matrix_steps_as_a_standalone_parameter(layout, variant):
    shape, expert_layout, matrices_of = LAYOUTS[layout]
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    grad = torch.randn(shape, dtype=torch.float64)
    before = w.detach().clone()
    opt = muonscale.Muon(
        [("experts.w", w)], splits={"experts.w": expert_layout}, **OPTIONS, **VARIANTS[variant]
    )
    steps = 2  # the second step reads the momentum (and NorMuon's row state) of the first
    for step in range(steps):
        w.grad = grad * (step + 1)
        opt.step()
    got = [a - b for a, b in zip(matrices_of(w.detach()), matrices_of(before))]
    want = _standalone_updates(matrices_of(before), matrices_of(grad), VARIANTS[variant], steps)
    assert len(got) == len(want) == len(opt.param_table.view(w, "flatten").matrix_shapes)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m, i=i: f"matrix {i}: {m}")


def test_gate_up_together_orthogonalizes_each_expert_whole():
    shape, layout, _ = LAYOUTS["contiguous"]
    torch.manual_seed(1)
    w = nn.Parameter(torch.randn(shape, dtype=torch.float64))
    grad = torch.randn(shape, dtype=torch.float64)
    before = w.detach().clone()
    opt = muonscale.Muon(
        [("experts.w", w)], splits={"experts.w": layout}, gate_up="together", **OPTIONS
    )
    w.grad = grad
    opt.step()
    want = _standalone_updates(list(before.unbind(0)), list(grad.unbind(0)), {}, 1)
    for a, b in zip((w.detach() - before).unbind(0), want):
        torch.testing.assert_close(a, b, **TOL)
    assert "(E=3) × gate+up (8, 6)" in opt.summary()


class DecoratedExperts(nn.Module):
    """The attributes Hugging Face's ``@use_experts_implementation`` sets, GPT-OSS's values:
    (in, out) storage, interleaved gate/up, per-expert biases."""

    is_transposed, is_concatenated, has_gate, has_bias = True, False, True, True

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, D, 2 * F))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * F))
        self.down_proj = nn.Parameter(torch.randn(E, F, D))
        self.down_proj_bias = nn.Parameter(torch.zeros(E, D))


class MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)
        self.experts = DecoratedExperts()
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, D)
        self.mlp = MoEBlock()
        self.gate_up_proj = nn.Linear(D, 2 * F, bias=False)  # dense fused (Phi-3)
        self.conv = nn.Conv2d(2, 3, 3)


def test_routing_and_summary_of_a_decorated_expert_module():
    model = Model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is flattened without a source
        opt = muonscale.Muon(model, **OPTIONS)
    routing = opt.routing
    for bias in ("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias"):
        assert routing[bias].algorithm == "adamw", routing[bias]
        assert "per-expert bias" in routing[bias].reason
    assert routing["mlp.router.weight"].algorithm == "muon"
    assert routing["mlp.router.weight"].reason.startswith("router (E=3)")
    assert not routing["mlp.shared_expert_gate.weight"].reason.startswith("router")
    summary = opt.summary()
    assert "(E=3) × gate|up (4, 6) stored (in, out); interleaved" in summary
    assert "(E=3) × (6, 4) stored (in, out)" in summary  # down_proj: (out, in) = (D, F)
    assert "fused gate/up weight" in summary and "gate|up (4, 6)]" in summary
    rules = [("router", "adamw")]  # rules= overrides the router decision
    assert muonscale.Muon(model, rules=rules, **OPTIONS).routing["mlp.router.weight"].algorithm == (
        "adamw"
    )


def test_an_explicit_matrix_mode_beats_a_found_layout():
    model = Model()
    opt = muonscale.Muon(
        [
            {"params": [("w", model.mlp.experts.down_proj)], "matrix_mode": "flatten"},
        ],
        experts={"w": ExpertLayout(n_experts=E, transposed=True)},
        **OPTIONS,
    )
    assert opt.param_table.view(model.mlp.experts.down_proj, "flatten").experts is None
    opt = muonscale.Muon(
        [("w", model.mlp.experts.down_proj)],
        experts={"w": ExpertLayout(n_experts=E, transposed=True)},
        **OPTIONS,
    )
    view = opt.param_table.view(model.mlp.experts.down_proj, "flatten")
    assert view.experts == E and view.matrix_shapes == [(D, F)] * E


class Unknown(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stack = nn.Parameter(torch.randn(3, 4, 8))
        self.fc = nn.Linear(8, 8)


def test_an_unknown_3d_parameter_warns_once_and_keeps_the_flatten_view():
    torch.manual_seed(2)
    model = Unknown()
    reference = copy.deepcopy(model)
    with pytest.warns(UnknownLayoutWarning, match=r"stack \(3, 4, 8\).*ExpertLayout") as record:
        opt = muonscale.Muon(model, **OPTIONS)
    assert len([w for w in record if w.category is UnknownLayoutWarning]) == 1
    with pytest.raises(ValueError, match=r"strict=True.*stack \(3, 4, 8\)"):
        muonscale.Muon(model, strict=True, **OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        explicit = muonscale.Muon(reference, matrix_mode="flatten", **OPTIONS)
    for o, m in ((opt, model), (explicit, reference)):
        for p in m.parameters():
            p.grad = torch.ones_like(p)
        o.step()
    assert torch.equal(model.stack, reference.stack)  # the flatten view, bitwise
    assert opt.param_table.view(model.stack, "flatten").matrix_shapes == [(3, 32)]


def test_a_split_with_matrix_mode_batch_cuts_each_matrix():
    torch.manual_seed(3)
    w = nn.Parameter(torch.randn(E, 2 * F, D, dtype=torch.float64))
    grad = torch.randn(E, 2 * F, D, dtype=torch.float64)
    before = w.detach().clone()
    opt = muonscale.Muon([("w", w)], splits={"w": 2}, matrix_mode="batch", **OPTIONS)
    w.grad = grad
    opt.step()
    want = _standalone_updates(_contiguous(before), _contiguous(grad), {}, 1)
    for a, b in zip(_contiguous(w.detach() - before), want):
        torch.testing.assert_close(a, b, **TOL)


def _expert_model_and_optimizer(seed: int, **options):
    torch.manual_seed(seed)
    model = Model().double()
    return model, muonscale.Muon(model, **OPTIONS, **options)


def _train(model, opt, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("options", [{}, dict(normalize="row")], ids=["muon", "normuon"])
def test_expert_state_saves_and_resumes_bitwise(options):
    model, opt = _expert_model_and_optimizer(4, **options)
    _train(model, opt, range(2))
    saved, weights = copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict())
    pickled = pickle.loads(pickle.dumps(opt))
    _train(model, opt, range(2, 4))
    resumed, resumed_opt = _expert_model_and_optimizer(5, **options)
    resumed.load_state_dict(weights)
    resumed_opt.load_state_dict(saved)
    _train(resumed, resumed_opt, range(2, 4))
    for (name, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name
    view = pickled.param_table.view(pickled.param_groups[0]["params"][1], "flatten")
    assert view.experts == E  # the pickle keeps the expert layouts


def test_a_flatten_viewed_normuon_state_is_refused_by_name_by_the_expert_view():
    """A state saved under the flatten view (earlier versions' view of an HF expert stack):
    plain Muon's momentum is parameter-shaped and loads; NorMuon's row state (E rows flattened,
    E·2F rows as expert matrices) is refused, naming the parameter."""
    for options, loads in (({}, True), (dict(normalize="row"), False)):
        model, flat = _expert_model_and_optimizer(6, matrix_mode="flatten", **options)
        _train(model, flat, range(1))
        _, expert = _expert_model_and_optimizer(6, **options)
        if loads:
            expert.load_state_dict(flat.state_dict())
            continue
        with pytest.raises(ValueError, match="mlp.experts.gate_up_proj"):
            expert.load_state_dict(flat.state_dict())


def test_plain_expert_stacks_take_the_stacked_fast_path_one_slot_per_expert():
    """Plain Muon of an (E, A, B) stack (and of a 2-D concatenation) goes through the stacked
    fast path, one Newton–Schulz slot per expert: the same bits as E separate (A, B) matrices
    stepped together."""
    from muonscale.matrix_step import stack_key

    torch.manual_seed(7)
    stack = nn.Parameter(torch.randn(E, D, F))
    concat = nn.Parameter(torch.randn(E * D, F))
    singles = [nn.Parameter(m.detach().clone()) for m in (*stack.unbind(0), *concat.view(E, D, F))]
    layouts = {"stack": ExpertLayout(n_experts=E), "concat": ExpertLayout(n_experts=E)}
    opt = muonscale.Muon([("stack", stack), ("concat", concat)], experts=layouts, lr=0.02)
    reference = muonscale.Muon([(f"m{i}", p) for i, p in enumerate(singles)], lr=0.02)
    settings = muonscale.settings.MuonSettings.from_group(opt.param_groups[0])
    for p in (stack, concat):
        assert stack_key(p, opt.param_table.view(p, "flatten"), settings.ns, settings) is not None
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        grads = torch.randn(2 * E, D, F, generator=g)
        stack.grad, concat.grad = grads[:E].clone(), grads[E:].reshape(E * D, F).clone()
        for p, grad in zip(singles, grads):
            p.grad = grad.clone()
        opt.step()
        reference.step()
    got = torch.cat([stack.detach(), concat.detach().view(E, D, F)])
    assert torch.equal(got, torch.stack([p.detach() for p in singles]))


def test_summary_says_how_a_stack_without_a_layout_is_cut():
    model = Unknown()
    with pytest.warns(UnknownLayoutWarning):
        assert "[flattened to (3, 32)]" in muonscale.Muon(model, **OPTIONS).summary()
    batched = muonscale.Muon(model, matrix_mode="batch", **OPTIONS).summary()
    assert "[3 × (4, 8)]" in batched
