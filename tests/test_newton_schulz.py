"""Newton–Schulz against the float64 SVD polar factor U Vᵀ (the oracle).

Inputs are built as U·diag(s)·Vᵀ with known singular values, so the output's action on each
singular direction, p_k(σ/‖G‖_F), can be read off as diag(Uᵀ O V). Each preset maps every
σ ≥ 2e-3·‖G‖_F into a known band (smaller σ grow by at most 3.4445⁵ ≈ 486× in 5 Keller steps,
so they cannot reach the band and are excluded). Bands measured with float64 on this suite's
inputs, then asserted with a 0.01 margin (0.015 for bfloat16):
  keller (5 steps)        [0.682, 1.202]  (Keller Jordan: "roughly [0.7, 1.2]")
  polar_express (5 steps) [0.859, 1.141]
  jiacheng (6 steps)      [0.996, 0.999]
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muonscale import COEFFICIENT_PRESETS, newton_schulz, newton_schulz_flops, resolve_coefficients

BANDS = {
    "keller": (5, 0.682, 1.202),
    "polar_express": (5, 0.859, 1.141),
    "jiacheng": (6, 0.996, 0.999),
}
SHAPES = [(64, 64), (32, 96), (96, 32), (1, 50), (50, 1), (128, 256), (7, 5)]


def _matrix_with_singular_values(m, n, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    U, _ = torch.linalg.qr(torch.randn(m, k, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, k, dtype=torch.float64, generator=g))
    return U @ torch.diag(s) @ V.T, U, V


@pytest.mark.parametrize("preset", sorted(BANDS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_singular_values_land_in_preset_band(preset, dtype, shape):
    steps, low, high = BANDS[preset]
    margin = 0.015 if dtype == torch.bfloat16 else 0.01
    m, n = shape
    k = min(m, n)
    s = torch.logspace(0, -2.5, k, dtype=torch.float64)
    G, U, V = _matrix_with_singular_values(m, n, s)
    O = newton_schulz(G, steps=steps, coefficients=preset, ns_dtype=dtype).double()
    mapped = torch.diagonal(U.T @ O @ V)  # p(σ_i) along each singular direction
    resolvable = s / s.norm() >= 2e-3
    assert mapped[resolvable].min() >= low - margin
    assert mapped[resolvable].max() <= high + margin
    # Nothing outside the singular subspace: O's spectrum is bounded too.
    assert torch.linalg.matrix_norm(O, ord=2) <= high + margin
    polar = U @ V.T
    cosine = (O * polar).sum() / (O.norm() * polar.norm())
    assert cosine >= 0.97


@pytest.mark.parametrize("shape", [(3, 16, 24), (2, 3, 24, 16)])
def test_batched_equals_per_matrix(shape):
    G = torch.randn(*shape, dtype=torch.float64)
    batched = newton_schulz(G, ns_dtype=torch.float64)
    flat = G.reshape(-1, *shape[-2:])
    singles = torch.stack([newton_schulz(M, ns_dtype=torch.float64) for M in flat]).reshape(shape)
    torch.testing.assert_close(batched, singles, rtol=0, atol=1e-12)


def test_tall_input_is_transpose_of_wide():
    G = torch.randn(40, 12, dtype=torch.float64)
    torch.testing.assert_close(
        newton_schulz(G, ns_dtype=torch.float64), newton_schulz(G.T, ns_dtype=torch.float64).T
    )


def test_returns_input_dtype_and_leaves_input_alone():
    G = torch.randn(8, 12, dtype=torch.float32)
    before = G.clone()
    out = newton_schulz(G, ns_dtype=torch.bfloat16)
    assert out.dtype == torch.float32 and out.shape == G.shape
    assert torch.equal(G, before)


def test_zero_matrix_maps_to_zero():
    assert torch.equal(newton_schulz(torch.zeros(5, 7)), torch.zeros(5, 7))


def test_default_dtype_on_cpu_is_float32():
    G = torch.randn(16, 16, dtype=torch.float64)
    torch.testing.assert_close(
        newton_schulz(G), newton_schulz(G, ns_dtype=torch.float32), rtol=0, atol=0
    )


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(ValueError, match="valid presets.*keller"):
        newton_schulz(torch.randn(4, 4), coefficients="kellr")


@pytest.mark.parametrize("bad", [(1.0, 2.0), [(1.0, 2.0, 3.0), (1.0,)], "", 3.0, []])
def test_bad_coefficients_raise(bad):
    with pytest.raises(ValueError, match="coefficients"):
        resolve_coefficients(bad, 5)


@pytest.mark.parametrize("steps", [0, -1, 2.5, True])
def test_bad_steps_raise(steps):
    with pytest.raises(ValueError, match="ns_steps"):
        newton_schulz(torch.randn(4, 4), steps=steps)


def test_bad_input_raises():
    with pytest.raises(ValueError, match=">= 2 dims"):
        newton_schulz(torch.randn(4))
    with pytest.raises(ValueError, match="real floating"):
        newton_schulz(torch.ones(3, 3, dtype=torch.long))


def test_schedules():
    assert resolve_coefficients("keller", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    pe = COEFFICIENT_PRESETS["polar_express"].steps
    # past its five tuples, Polar Express continues with the converging classical quintic
    assert resolve_coefficients("polar_express", 7) == list(pe) + [(15 / 8, -10 / 8, 3 / 8)] * 2
    assert resolve_coefficients("jiacheng", 2) == list(COEFFICIENT_PRESETS["jiacheng"].steps[:2])
    assert resolve_coefficients((1.5, -0.5, 0.0), 2) == [(1.5, -0.5, 0.0)] * 2
    assert resolve_coefficients([(1, 2, 3), (4, 5, 6)], 2) == [(1.0, 2.0, 3.0), (4.0, 5.0, 6.0)]


def test_flops():
    assert newton_schulz_flops(768, 3072, 5) == 5 * (4 * 768**2 * 3072 + 2 * 768**3)
    assert newton_schulz_flops(3072, 768, 5) == newton_schulz_flops(768, 3072, 5)


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 24),
    n=st.integers(1, 24),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**16),
)
def test_properties(m, n, scale, seed):
    G = torch.randn(m, n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    O = newton_schulz(G, ns_dtype=torch.float64)
    assert O.shape == G.shape and torch.isfinite(O).all()
    assert torch.linalg.matrix_norm(O, ord=2) <= 1.21  # Keller's band top
    torch.testing.assert_close(
        newton_schulz(G * scale, ns_dtype=torch.float64), O, rtol=1e-9, atol=1e-9
    )
    torch.testing.assert_close(
        newton_schulz(G.T, ns_dtype=torch.float64), O.T, rtol=1e-12, atol=1e-12
    )
    assert math.isclose(
        float((O * G).sum()), float((O * G).sum().abs())
    )  # <O, G> ≥ 0: same direction
