"""Newton–Schulz orthogonalization: the pure math of Muon, on plain tensors.

Muon replaces each matrix update G by the nearest semi-orthogonal matrix, the polar factor
U Vᵀ of G = U S Vᵀ. A quintic Newton–Schulz iteration approximates it with matmuls only, so it
runs fast in low precision on accelerators. This module is the reference implementation (and
the coefficient presets); :mod:`muonscale.kernels` computes the same function faster. The
iteration, the presets and their cost are described in *Newton–Schulz* in the docs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

Coefficients = tuple[float, float, float]
"""One quintic step's (a, b, c): σ ↦ aσ + bσ³ + cσ⁵."""

CoefficientSpec = str | Coefficients | Sequence[Coefficients]
"""A preset name (see :data:`COEFFICIENT_PRESETS`), one (a, b, c) for every step, or a list."""

DEFAULT_EPS = 1e-7
"""Floor of the Frobenius norm when normalizing (same as torch.optim.Muon's ``eps``)."""


@dataclass(frozen=True)
class CoefficientPreset:
    """A named Newton–Schulz schedule: one (a, b, c) per step, with the normalization margin
    its authors use (X₀ = G / (margin · ‖G‖_F)). Past the end of the list ``tail`` repeats (the
    last tuple when ``tail`` is None); with fewer steps than tuples, the first ``steps`` are
    used."""

    steps: tuple[Coefficients, ...]
    normalization_margin: float
    source: str
    tail: Coefficients | None = None


NEWTON_SCHULZ_QUINTIC: Coefficients = (15 / 8, -10 / 8, 3 / 8)
"""The classical quintic Newton–Schulz step p(σ) = (15σ − 10σ³ + 3σ⁵)/8: p(1) = 1, p'(1) = p''(1)
= 0, so it converges to the polar factor (Higham, "Functions of Matrices", 2008, §8.3;
Björck & Bowie, 1971). Used past the end of schedules tuned for a fixed number of steps."""


COEFFICIENT_PRESETS: dict[str, CoefficientPreset] = {
    # Keller Jordan, "Muon: An optimizer for hidden layers in neural networks" (2024),
    # https://github.com/KellerJordan/Muon/blob/f90a42b28e00b8d9d2d05865fe90d9f39abcbcbd/muon.py#L16
    # (also torch.optim.Muon's default). Chosen to maximize the slope at zero.
    "keller": CoefficientPreset(
        steps=((3.4445, -4.7750, 2.0315),),
        normalization_margin=1.0,
        source="Keller Jordan, Muon (2024)",
    ),
    # Amsel, Persson, Musco, Gower, "The Polar Express: Optimal Matrix Sign Methods and Their
    # Application to the Muon Algorithm" (2025), arXiv:2505.16932; the tuples for
    # num_iters=5, safety_factor=2e-2, cushion=2, as used by modded-nanogpt's train_gpt.py and
    # nanochat, which normalize by ‖G‖_F · (1 + 2e-2).
    "polar_express": CoefficientPreset(
        steps=(
            (8.156554524902461, -22.48329292557795, 15.878769915207462),
            (4.042929935166739, -2.808917465908714, 0.5000178451051316),
            (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
            (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
            (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        ),
        normalization_margin=1.02,
        source="Amsel et al. (2025), Polar Express; as in modded-nanogpt",
        # The five tuples leave σ in about [0.9, 1.14]; repeating the last one would settle
        # near 1.035 (its fixed point), so more steps use the converging classical quintic.
        tail=NEWTON_SCHULZ_QUINTIC,
    ),
    # Per-step quintic tuples by You Jiacheng, found by optimization with @leloykun's stability
    # loss, posted for modded-nanogpt (https://twitter.com/YouJiacheng/status/1893704552689303901,
    # gist 393c90cbdc23b09d5688815ba382288b). Six steps; use ns_steps=6 for the full schedule.
    "jiacheng": CoefficientPreset(
        steps=(
            (3955 / 1024, -8306 / 1024, 5008 / 1024),
            (3735 / 1024, -6681 / 1024, 3463 / 1024),
            (3799 / 1024, -6499 / 1024, 3211 / 1024),
            (4019 / 1024, -6385 / 1024, 2906 / 1024),
            (2677 / 1024, -3029 / 1024, 1162 / 1024),
            (2172 / 1024, -1833 / 1024, 682 / 1024),
        ),
        normalization_margin=1.0,
        source="You Jiacheng (2025), six-step schedule for modded-nanogpt",
    ),
}
COEFFICIENT_PRESETS["modded_nanogpt"] = COEFFICIENT_PRESETS["polar_express"]
# [variants] Turbo-Muon (Boissin, Massena, Mamalet, Serrurier, arXiv:2512.04632): four steps
# after the AOL preconditioner (preconditioner="aol"); the last four of the five tuples in the
# authors' code, github.com/thib-s/flash-newton-schulz newton_schulz_triton.py ``NS_ours``
# (iter=4, commit 1aa1f31b491e0512814f56bbdd7d2e89ad22807c). Its margin is unused with AOL.
COEFFICIENT_PRESETS["turbo_muon"] = CoefficientPreset(
    steps=(
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    normalization_margin=1.0,
    source="Boissin et al. (2025), Turbo-Muon, four steps after AOL",
)


def _check_tuple(t: object, where: str) -> Coefficients:
    if not isinstance(t, (tuple, list)) or len(t) != 3:
        raise ValueError(f"coefficients: {where} must be a tuple (a, b, c) of 3 floats, got {t!r}")
    try:
        out = (float(t[0]), float(t[1]), float(t[2]))
    except (TypeError, ValueError):
        raise ValueError(f"coefficients: {where} must hold 3 numbers, got {t!r}") from None
    if not all(math.isfinite(v) for v in out):
        raise ValueError(f"coefficients: {where} must hold finite numbers, got {t!r}")
    return out


def resolve_schedule(
    coefficients: str | Coefficients | Sequence[Coefficients], steps: int
) -> tuple[list[Coefficients], float]:
    """Turn a preset name, one (a, b, c) tuple or a list of tuples into ``steps`` tuples and the
    normalization margin. Raises ``ValueError`` naming the valid presets."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"ns_steps must be an int >= 1, got {steps!r}")
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_PRESETS:
            raise ValueError(
                f"coefficients: unknown preset {coefficients!r}; "
                f"valid presets: {sorted(COEFFICIENT_PRESETS)}"
            )
        preset = COEFFICIENT_PRESETS[coefficients]
        schedule, margin = list(preset.steps), preset.normalization_margin
        if steps > len(schedule) and preset.tail is not None:
            schedule += [preset.tail] * (steps - len(schedule))
    elif (
        isinstance(coefficients, (tuple, list))
        and len(coefficients) == 3
        and all(isinstance(c, (int, float)) for c in coefficients)
    ):
        schedule, margin = [_check_tuple(coefficients, "the tuple")], 1.0
    elif isinstance(coefficients, (tuple, list)) and len(coefficients) > 0:
        schedule = [_check_tuple(t, f"step {i}") for i, t in enumerate(coefficients)]
        margin = 1.0
    else:
        raise ValueError(
            "coefficients must be a preset name "
            f"{sorted(COEFFICIENT_PRESETS)}, one (a, b, c) tuple or a list of them; "
            f"got {coefficients!r}"
        )
    if steps <= len(schedule):
        return schedule[:steps], margin
    return schedule + [schedule[-1]] * (steps - len(schedule)), margin


DIVERGENCE_BOUND = 1.5
"""A schedule whose composed scalar map sends some σ in (0, 1] outside [0, this] is rejected."""


@lru_cache(maxsize=64)
def _composed_range(schedule: tuple[Coefficients, ...], margin: float) -> tuple[float, float]:
    """(min, max) of the composed map p_k ∘ … ∘ p_1 (σ / margin) over σ in (0, 1], on a grid
    dense near 0 (geometric) and on (0, 1] (uniform), in float64."""
    grid = torch.cat(
        [
            torch.logspace(-9, 0, 2049, dtype=torch.float64),
            torch.linspace(0, 1, 16385, dtype=torch.float64)[1:],
        ]
    )
    x = grid / margin
    for a, b, c in schedule:
        x2 = x * x
        x = x * (a + x2 * (b + c * x2))
        x = torch.nan_to_num(x, nan=math.inf).clamp(-1e30, 1e30)  # keep a diverging map finite
    return float(x.min()), float(x.max())


def validate_coefficients(
    coefficients: str | Coefficients | Sequence[Coefficients], steps: int
) -> list[Coefficients]:
    """:func:`resolve_coefficients` plus a check that the schedule keeps singular values bounded:
    the composed map σ ↦ aσ + bσ³ + cσ⁵ over the ``steps`` tuples must send every σ in (0, 1] into
    [0, :data:`DIVERGENCE_BOUND`]. Raises ``ValueError`` otherwise (construction-time check).
    Named presets are published schedules and are not checked here (cut short, Polar Express
    passes through σ ≈ 2 on purpose); the tests check each at its full length and beyond."""
    schedule, margin = resolve_schedule(coefficients, steps)
    if isinstance(coefficients, str):
        return schedule
    low, high = _composed_range(tuple(schedule), margin)
    if low < 0 or high > DIVERGENCE_BOUND:
        raise ValueError(
            f"coefficients: {coefficients!r} over ns_steps={steps} diverge: the composed map "
            f"x ↦ ax + bx³ + cx⁵ sends x in (0, 1] to [{low:.3g}, {high:.3g}], outside "
            f"[0, {DIVERGENCE_BOUND}]"
        )
    return schedule


def resolve_coefficients(
    coefficients: str | Coefficients | Sequence[Coefficients], steps: int
) -> list[Coefficients]:
    """The (a, b, c) used at each of ``steps`` steps."""
    return resolve_schedule(coefficients, steps)[0]


def default_ns_dtype(device: torch.device | str) -> torch.dtype:
    """bfloat16 on CUDA (tensor cores; the iteration tolerates it), float32 elsewhere.

    On CPU float32 is the default: it keeps the update independent of the layout to ~1e-7
    (the distributed tests rely on that) and many CPUs have no fast bfloat16 matmul. Pass
    ``ns_dtype=torch.bfloat16`` explicitly to trade accuracy for speed where they do.
    """
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def newton_schulz(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: CoefficientSpec = "keller",
    ns_dtype: torch.dtype | None = None,
    eps: float = DEFAULT_EPS,
) -> torch.Tensor:
    """Approximate the polar factor U Vᵀ of each matrix in ``G`` (shape ``(..., m, n)``).

    Args:
        G: real floating tensor with at least 2 dims; leading dims are a batch.
        steps: number of quintic steps (≥ 1).
        coefficients: preset name (see ``COEFFICIENT_PRESETS``), one (a, b, c), or a list.
        ns_dtype: dtype the iteration runs in; ``None`` → :func:`default_ns_dtype`.
        eps: floor of the Frobenius norm (a zero matrix maps to zero).

    Returns a new tensor with G's shape and dtype. Does not modify ``G``.
    """
    if not isinstance(G, torch.Tensor) or G.ndim < 2:
        raise ValueError(
            "newton_schulz: G must be a tensor with >= 2 dims, "
            f"got shape {getattr(G, 'shape', None)}"
        )
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(f"newton_schulz: G must be real floating point, got {G.dtype}")
    schedule, margin = resolve_schedule(coefficients, steps)
    dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(G.device)

    m, n = G.shape[-2], G.shape[-1]
    transposed = m > n
    X = G.reshape(-1, m, n).to(dtype)
    if transposed:
        X = X.mT
    # Spectral norm ≤ Frobenius norm, so after this every singular value is ≤ 1.
    norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True)
    if margin != 1.0:
        norm = norm * margin
    X = X / norm.clamp(min=eps)
    for a, b, c in schedule:
        A = torch.bmm(X, X.mT)  # (k, s, s), s = short side
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A²
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    if transposed:
        X = X.mT
    return X.to(G.dtype).reshape(G.shape)
