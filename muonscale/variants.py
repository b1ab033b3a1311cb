"""Published Muon variants as small pure functions on plain local tensors.

* NorMuon (row-wise second-moment normalisation after Newton–Schulz, arXiv:2510.05491):
  :func:`row_statistics`, :func:`update_row_moments_`, :func:`row_factors` (and its parts
  :func:`row_scales`, :func:`row_factor_sums`, :func:`row_factors_from_sums` for split
  matrices), :func:`row_normalize_`.
* Cautious weight decay (arXiv:2510.12402): :func:`cautious_weight_decay_`.
* Turbo-Muon's AOL preconditioner (arXiv:2512.04632): :func:`aol_newton_schulz_`, the plain
  and the Gram form of the iteration started from an AOL-scaled matrix.

Equations, constants and their sources are in *Variants* in the docs. Nothing here knows about
optimizer state or ``torch.distributed``: :mod:`muonscale.functional` and the optimizers call
these functions on the tensors they hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

from .flops import gram_plan
from .newton_schulz import Coefficients

Normalize = Literal["none", "row"]
"""``"row"``: NorMuon's row-wise normalisation after Newton–Schulz; ``"none"``: plain Muon."""

Preconditioner = Literal["frobenius", "aol"]
"""How the Newton–Schulz input is scaled: ``"frobenius"`` X/‖X‖_F (Muon), ``"aol"`` Turbo-Muon."""

NORMALIZE_MODES: tuple[str, ...] = ("none", "row")
PRECONDITIONERS: tuple[str, ...] = ("frobenius", "aol")

NORMUON_BETA2 = 0.95
"""β₂ of NorMuon's row second moment (the official implementation's default,
github.com/zichongli5/NorMuon ``normuon.py``, ``beta2=0.95``)."""

NORMUON_EPS = 1e-10
"""ε of NorMuon's divisions (the official implementation: ``add_(1e-10)``)."""


# ---------------------------------------------------------------------------------- NorMuon
def row_statistics(O: torch.Tensor) -> torch.Tensor:  # (m, n) -> (m,) float32
    """Mean of squares of each row of an orthogonalized update O (NorMuon's per-neuron
    statistic ``mean_cols(O ⊙ O)``), in float32 at least."""
    O = O if O.dtype in (torch.float32, torch.float64) else O.float()
    return (O * O).mean(dim=-1)


def update_row_moments_(v: torch.Tensor, stats: torch.Tensor, beta2: float) -> torch.Tensor:
    """v ← β₂ v + (1 − β₂) stats, in place (``v.lerp_(stats, 1 − β₂)``); returns v."""
    return v.lerp_(stats.to(v.dtype), 1 - beta2)


def row_scales(v: torch.Tensor, eps: float = NORMUON_EPS) -> torch.Tensor:  # (m,) -> (m,)
    """NorMuon's per-row divisor d_r = 1 / (√v_r + ε)."""
    return 1 / (v.sqrt() + eps)


def row_factor_sums(stats: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # (m,), (m,) -> (2,)
    """(Σ_r stats_r, Σ_r stats_r d_r²): ‖O‖²_F and ‖d ⊙_rows O‖²_F, each divided by the column
    count. Sums over rows, so a matrix split by rows adds its ranks' pairs (one all-reduce)."""
    stats = stats.to(d.dtype)
    return torch.stack([stats.sum(), (stats * d * d).sum()])


def row_factors_from_sums(
    d: torch.Tensor, sums: torch.Tensor, eps: float = NORMUON_EPS
) -> torch.Tensor:  # (m,), (2,) -> (m,)
    """f_r = d_r · ‖O‖_F / (‖d ⊙_rows O‖_F + ε) from :func:`row_factor_sums` (of all rows)."""
    norm, norm_new = sums.sqrt().unbind(0)
    return d * (norm / (norm_new + eps))


def row_factors(
    v: torch.Tensor, stats: torch.Tensor, eps: float = NORMUON_EPS
) -> torch.Tensor:  # (m,), (m,) -> (m,)
    """Per-row factor f with Ô = f ⊙_rows O (NorMuon after its norm-preserving rescale):

        d_r = 1 / (√v_r + ε),  f_r = d_r · ‖O‖_F / (‖d ⊙_rows O‖_F + ε)

    Both norms come from the row statistics (‖O‖²_F = n Σ_r stats_r; the column count n
    cancels in the ratio), so a rank that holds only a shard of O's columns and the
    statistics computes the same factors as the owner of the whole matrix; a rank that holds
    a shard of O's rows needs the other ranks' :func:`row_factor_sums`."""
    d = row_scales(v, eps)
    return row_factors_from_sums(d, row_factor_sums(stats, d), eps)


def row_normalize_(
    O: torch.Tensor, v: torch.Tensor, *, beta2: float = NORMUON_BETA2, eps: float = NORMUON_EPS
) -> torch.Tensor:
    """NorMuon on one orthogonalized matrix O (m, n), in place on O and on its row second
    moment v (m,): statistics → v update → rows scaled by :func:`row_factors`. Returns O."""
    stats = row_statistics(O)
    update_row_moments_(v, stats, beta2)
    return O.mul_(row_factors(v, stats, eps).to(O.dtype)[:, None])


def row_moment_shape(matrix_shapes: Sequence[tuple[int, int]]) -> tuple[int]:
    """Shape of a parameter's NorMuon state: one entry per row of each of its matrices."""
    return (sum(int(rows) for rows, _ in matrix_shapes),)


def row_normalize_matrices_(
    matrices: Sequence[torch.Tensor],
    owner: Sequence[int],
    row_moments: Sequence[torch.Tensor],
    *,
    beta2: float,
) -> None:
    """:func:`row_normalize_` of each matrix in place; ``owner[i]`` is the index (into
    ``row_moments``) of the parameter matrix i belongs to. A parameter's matrices take
    consecutive slices of its row moment, in order."""
    offsets = [0] * len(row_moments)
    for mat, index in zip(matrices, owner):
        rows, start = mat.shape[0], offsets[index]
        row_normalize_(mat, row_moments[index][start : start + rows], beta2=beta2)
        offsets[index] = start + rows


# ------------------------------------------------------------------------ cautious decay
def cautious_weight_decay_(
    param: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float
) -> torch.Tensor:
    """W ← W − η λ 𝟙[u ⊙ W ≥ 0] ⊙ W, in place: decoupled decay only where the update u (the
    direction that is subtracted, W ← W − η u) and the weight agree in sign. Returns W."""
    mask = (update * param) >= 0
    return param.addcmul_(param, mask, value=-lr * weight_decay)


# ---------------------------------------------------------------------------- AOL / Turbo
def aol_scale_(
    X: torch.Tensor, A: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:  # (k, m, n), (k, m, m)
    """AOL rescaling from the first Gram product A = X Xᵀ, in place:
    s_i = (Σ_j |A_ij|)^(−1/2) (floored at ε before the root), X ← diag(s) X,
    A ← diag(s) A diag(s). Guarantees ‖X‖₂ ≤ 1 (Prach & Lampert, arXiv:2208.03160)."""
    s = torch.rsqrt(A.abs().sum(dim=-1).clamp_min(eps))  # (k, m)
    X.mul_(s[..., :, None])
    A.mul_(s[..., :, None]).mul_(s[..., None, :])
    return X, A


def shrink_huge_(X: torch.Tensor) -> torch.Tensor:
    """Keep X Xᵀ of a (k, m, n) stack finite: a matrix with m·n·max|x|² above a quarter of the
    dtype's range is divided by the power of two at or below its largest entry (AOL does not
    depend on the scale); the others are multiplied by 1, which is exact. Returns X."""
    largest = torch.linalg.vector_norm(X, ord=math.inf, dim=(-2, -1), keepdim=True)
    huge = largest * largest * (X.shape[-2] * X.shape[-1]) > torch.finfo(X.dtype).max / 4
    return X.mul_(torch.where(huge, torch.exp2(-torch.floor(torch.log2(largest))), 1.0))


def aol_newton_schulz_(
    X: torch.Tensor,  # (k, m, n), m <= n, NOT normalized; overwritten with the result
    schedule: Sequence[Coefficients],
    *,
    eps: float,
    method: Literal["plain", "gram"] = "plain",
    restart_every: int | None = 2,
) -> torch.Tensor:
    """Newton–Schulz started from the AOL-scaled X instead of X/‖X‖_F (Turbo-Muon): the Gram
    product of the first step is computed once, gives the AOL scales, and is reused rescaled.

    ``method="plain"``: X ← a X + (b A + c A²) X with A = X Xᵀ (first A reused).
    ``method="gram"``: iterate on R = X Xᵀ (R₀ the rescaled first product), accumulating
    Q = Π (a I + b R + c R²) and restarting X = Q X₀ before steps r, 2r, … (``restart_every``),
    as :mod:`muonscale.kernels.newton_schulz_fast` does without AOL. Returns X."""
    if X.dim() != 3 or X.shape[-2] > X.shape[-1]:
        raise ValueError(f"aol_newton_schulz_: X must be (k, m, n), m <= n, got {tuple(X.shape)}")
    shrink_huge_(X)
    A = torch.bmm(X, X.mT)
    aol_scale_(X, A, eps)
    if method == "plain":
        cur = X
        for t, (a, b, c) in enumerate(schedule):
            if t > 0:
                A = torch.bmm(cur, cur.mT)
            B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A²
            cur = torch.baddbmm(cur, B, cur, beta=a)  # a X + B X
        return X.copy_(cur)
    if method != "gram":
        raise ValueError(f"method must be 'plain' or 'gram', got {method!r}")
    eye = torch.eye(X.shape[-2], dtype=X.dtype, device=X.device)
    x0, R, Q = X, A, None
    for (a, b, c), (restart, update_r) in zip(schedule, gram_plan(len(schedule), restart_every)):
        if restart:
            x0 = torch.bmm(Q, x0)
            R, Q = torch.bmm(x0, x0.mT), None
        P = torch.baddbmm(R, R, R, beta=b, alpha=c) + a * eye  # a I + b R + c R²
        Q = P if Q is None else torch.bmm(Q, P)
        if update_r:
            R = torch.bmm(R, torch.bmm(P, P))  # P R P = R P² (P is a polynomial in R)
    return X.copy_(torch.bmm(Q, x0))
