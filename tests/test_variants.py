"""Muon variants (NorMuon, cautious weight decay, AOL / Turbo-Muon, Polar Express) against
float64 references written from their papers (tests/reference_variants.py)."""

from __future__ import annotations

import math

import pytest
import torch
from reference_variants import TURBO_MUON_STEPS, muon_step, normuon_rows, ns_aol, ns_frobenius

from muonscale import Muon
from muonscale.kernels import newton_schulz_fast
from muonscale.newton_schulz import COEFFICIENT_PRESETS, resolve_coefficients
from muonscale.scaling import update_scale
from muonscale.variants import row_normalize_

# float32 Newton–Schulz of ≤ 5 steps on ≤ 64-wide matrices: each step's products add up
# n terms with relative error ~ n·2⁻²⁴ ≈ 4e-6, amplified by the polynomial's slope (≤ ~10)
# over 4–5 steps: 1e-4 absolute on entries of size ~1/√n keeps a 10× margin over that.
F32_NS_TOL = 1e-4


def aol_newton_schulz(G, method="plain"):
    """Turbo-Muon's four steps from the AOL-scaled G, in G's dtype (torch backend)."""
    steps = len(TURBO_MUON_STEPS)
    return newton_schulz_fast(
        G, steps, TURBO_MUON_STEPS, G.dtype, method=method, backend="torch", preconditioner="aol"
    )


def test_turbo_muon_preset_is_the_published_four_steps():
    assert list(COEFFICIENT_PRESETS["turbo_muon"].steps) == TURBO_MUON_STEPS


@pytest.mark.parametrize("method", ["plain", "gram"])
@pytest.mark.parametrize("shape", [(8, 24), (16, 16), (24, 8)])
def test_aol_newton_schulz_matches_float64_reference(method, shape):
    g = torch.Generator().manual_seed(0)
    G = torch.randn(3, *shape, generator=g)
    out = aol_newton_schulz(G.double(), method)
    for k in range(3):
        ref = ns_aol(G[k], TURBO_MUON_STEPS)
        # float64 both: the plain form is the same arithmetic (1e-12), the Gram form
        # reassociates the products (still ~1e-13 relative at this size)
        assert torch.allclose(out[k], ref, atol=1e-10, rtol=0)
    out32 = aol_newton_schulz(G, method)
    assert torch.allclose(
        out32.double(),
        torch.stack([ns_aol(G[k], TURBO_MUON_STEPS) for k in range(3)]),
        atol=F32_NS_TOL,
    )


def test_aol_gives_spectral_norm_at_most_one_and_orthogonalizes():
    g = torch.Generator().manual_seed(1)
    G = torch.randn(1, 32, 96, generator=g, dtype=torch.float64)
    A = G @ G.mT
    s = A.abs().sum(-1).rsqrt()
    assert torch.linalg.matrix_norm(s[..., None] * G, ord=2).item() <= 1 + 1e-12
    out = aol_newton_schulz(G)
    sv = torch.linalg.svdvals(out[0])
    # four Turbo-Muon steps leave a Gaussian matrix's singular values near 1, as Keller's five
    assert sv.min() > 0.5 and sv.max() < 1.3


def test_row_normalize_matches_float64_reference():
    g = torch.Generator().manual_seed(2)
    O = torch.randn(12, 20, generator=g)
    v = torch.rand(12, generator=g)
    ref, ref_v = normuon_rows(O, v, 0.9)
    out, v32 = O.clone(), v.clone()
    row_normalize_(out, v32, beta2=0.9)
    assert torch.allclose(v32.double(), ref_v, rtol=1e-6)  # one lerp in float32
    # float32 sums of 20 squares and a square root: a few ulps (2⁻²⁴ ≈ 6e-8) per entry
    assert torch.allclose(out.double(), ref, rtol=1e-5, atol=1e-6)
    assert math.isclose(out.norm().item(), O.norm().item(), rel_tol=1e-5)


CASES = {
    "normuon": dict(normalize="row"),
    "cautious": dict(cautious_weight_decay=True),
    "aol": dict(preconditioner="aol"),
    "aol_gram": dict(preconditioner="aol", ns_method="gram"),
    "polar_express": dict(coefficients="polar_express"),
    "all": dict(normalize="row", cautious_weight_decay=True, preconditioner="aol"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("shape", [(16, 48), (48, 16)])
def test_muon_option_matches_float64_reference_update(case, shape):
    kw = CASES[case]
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(*shape, generator=g))
    W, B = w.detach().double().clone(), torch.zeros(shape, dtype=torch.float64)
    v = torch.zeros(shape[0], dtype=torch.float64)
    opt = Muon([("h.weight", w)], lr=0.05, weight_decay=0.5, ns_dtype=torch.float32, **kw)
    group = opt.param_groups[0]
    schedule = resolve_coefficients(group["coefficients"], group["ns_steps"])
    margin = COEFFICIENT_PRESETS.get(group["coefficients"], None)
    margin = margin.normalization_margin if margin else 1.0
    if kw.get("preconditioner") == "aol":
        orth = lambda U: ns_aol(U, schedule)  # noqa: E731
    else:
        orth = lambda U: ns_frobenius(U, schedule, margin=margin)  # noqa: E731
    for _ in range(3):
        G = torch.randn(*shape, generator=g)
        w.grad = G.clone()
        opt.step()
        W, B, v = muon_step(
            W,
            G,
            B,
            v,
            lr=0.05,
            wd=0.5,
            mu=0.95,
            nesterov=True,
            orth=orth,
            scale=update_scale("match_rms_adamw", *shape),
            normalize="normalize" in kw,
            cautious=kw.get("cautious_weight_decay", False),
        )
    # three steps of float32 NS (F32_NS_TOL each) times lr · scale ≈ 0.05 · 0.2 · √48 ≈ 0.07
    assert torch.allclose(w.detach().double(), W, atol=F32_NS_TOL)
    if "normalize" in kw:
        assert torch.allclose(opt.state[w]["row_second_moment"].double(), v, rtol=1e-4)


def test_cautious_decay_differs_from_plain_decay():
    g = torch.Generator().manual_seed(4)
    ws = [torch.nn.Parameter(torch.randn(8, 8, generator=g)) for _ in range(2)]
    ws[1].data.copy_(ws[0].data)
    grad = torch.randn(8, 8, generator=g)
    for w, cautious in zip(ws, (False, True)):
        opt = Muon([("h.weight", w)], lr=0.1, weight_decay=1.0, cautious_weight_decay=cautious)
        w.grad = grad.clone()
        opt.step()
    assert not torch.equal(ws[0], ws[1])


def test_normuon_state_dict_round_trip_resumes_bitwise():
    g = torch.Generator().manual_seed(5)
    init = torch.randn(12, 20, generator=g)
    grads = [torch.randn(12, 20, generator=g) for _ in range(4)]

    def make(w):
        return Muon([("h.weight", w)], lr=0.02, normalize="row", row_beta2=0.9)

    w = torch.nn.Parameter(init.clone())
    opt = make(w)
    for grad in grads:
        w.grad = grad.clone()
        opt.step()
    w2 = torch.nn.Parameter(init.clone())
    opt2 = make(w2)
    for grad in grads[:2]:
        w2.grad = grad.clone()
        opt2.step()
    saved = opt2.state_dict()
    assert saved["state"][0]["row_second_moment"].shape == (12,)
    w3 = torch.nn.Parameter(w2.detach().clone())
    opt3 = make(w3)
    opt3.load_state_dict(saved)
    assert opt3.state[w3]["row_second_moment"].dtype == torch.float32
    for grad in grads[2:]:
        w3.grad = grad.clone()
        opt3.step()
    assert torch.equal(w3, w)
    assert torch.equal(opt3.state[w3]["row_second_moment"], opt.state[w]["row_second_moment"])


def test_row_moment_covers_every_matrix_of_a_batched_view():
    w = torch.nn.Parameter(torch.randn(3, 4, 6))
    opt = Muon([("experts.w", w)], normalize="row", matrix_mode="batch")
    w.grad = torch.randn(3, 4, 6)
    opt.step()
    assert opt.state[w]["row_second_moment"].shape == (12,)
    assert (opt.state[w]["row_second_moment"] > 0).all()


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(normalize="rows"), "normalize"),
        (dict(row_beta2=1.0), "row_beta2"),
        (dict(row_beta2=-0.1), "row_beta2"),
        (dict(cautious_weight_decay=1), "cautious_weight_decay"),
        (dict(preconditioner="AOL"), "preconditioner"),
    ],
)
def test_bad_variant_options_name_the_parameter(kw, name):
    with pytest.raises(ValueError, match=name):
        Muon([("h.weight", torch.nn.Parameter(torch.randn(4, 4)))], **kw)


def test_aol_defaults_to_turbo_muon_four_steps_unless_given():
    w = torch.nn.Parameter(torch.randn(4, 4))
    g = Muon([("h.weight", w)], preconditioner="aol").param_groups[0]
    assert (g["coefficients"], g["ns_steps"]) == ("turbo_muon", 4)
    g = Muon([("h.weight", w)], preconditioner="aol", ns_steps=5, coefficients="keller")
    assert (g.param_groups[0]["coefficients"], g.param_groups[0]["ns_steps"]) == ("keller", 5)
    assert Muon([("h.weight", w)]).param_groups[0]["ns_steps"] == 5


def _schedule(group):
    return group["preconditioner"], group["coefficients"], group["ns_steps"]


def test_a_param_groups_preconditioner_resolves_its_schedule_as_the_constructor():
    """A group (given to the constructor or to ``add_param_group``) that sets its own
    preconditioner gets that preconditioner's schedule unless it or the constructor gives one;
    its step is then the one of an optimizer built with that preconditioner (bitwise)."""
    aol, frobenius = ("aol", "turbo_muon", 4), ("frobenius", "keller", 5)
    torch.manual_seed(0)
    w = [torch.nn.Parameter(torch.randn(8, 12)) for _ in range(3)]
    grads = [torch.randn(8, 12) for _ in w]
    by_group = Muon([{"params": [("a.weight", w[0])], "preconditioner": "aol"}], lr=0.02)
    assert _schedule(by_group.param_groups[0]) == aol
    by_group.add_param_group({"params": [("b.weight", w[1])], "preconditioner": "aol"})
    assert _schedule(by_group.param_groups[1]) == aol
    built_aol = Muon([("a.weight", w[2])], lr=0.02, preconditioner="aol")
    built_aol.add_param_group({"params": [("c.weight", w[0])], "preconditioner": "frobenius"})
    assert _schedule(built_aol.param_groups[1]) == frobenius
    # a schedule the group or the constructor gives is kept, key by key
    given = dict(preconditioner="aol", ns_steps=5, coefficients="keller")
    by_group.add_param_group({"params": [("d.weight", w[2])], **given})
    assert _schedule(by_group.param_groups[2]) == ("aol", "keller", 5)
    pe = Muon([("e.weight", w[0])], coefficients="polar_express")
    pe.add_param_group({"params": [("f.weight", w[1])], "preconditioner": "aol"})
    assert _schedule(pe.param_groups[1]) == ("aol", "polar_express", 4)
    assert _schedule(
        Muon([("e.weight", w[0])], coefficients="polar_express", preconditioner="aol").param_groups[
            0
        ]
    ) == ("aol", "polar_express", 4)

    # the step: a group's aol equals the constructor's
    stepped = []
    for opt_of in (
        lambda p: Muon([{"params": [("a.weight", p)], "preconditioner": "aol"}], lr=0.02),
        lambda p: Muon([("a.weight", p)], lr=0.02, preconditioner="aol"),
    ):
        p = torch.nn.Parameter(w[0].detach().clone())
        opt = opt_of(p)
        p.grad = grads[0].clone()
        opt.step()
        stepped.append(p.detach())
    assert torch.equal(*stepped)
