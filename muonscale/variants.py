"""Published Muon variants as small pure functions on plain local tensors.

* NorMuon (row-wise second-moment normalisation after Newton–Schulz, arXiv:2510.05491):
  :func:`row_statistics`, :func:`update_row_moments_`, :func:`row_factors` (with
  :func:`row_scales`), :func:`row_normalize_`.
* Cautious weight decay (arXiv:2510.12402): :func:`cautious_weight_decay_`.
* Turbo-Muon's AOL preconditioner (arXiv:2512.04632): :func:`aol_scales` and
  :func:`shrink_huge_`, folded into the first Newton–Schulz step by
  :mod:`muonscale.kernels.newton_schulz_fast` (``preconditioner="aol"``).

Equations, constants and their sources are in *Variants* in the docs. Nothing here knows about
optimizer state or ``torch.distributed``: :mod:`muonscale.functional` and the optimizers call
these functions on the tensors they hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch

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


def row_factors(
    v: torch.Tensor, stats: torch.Tensor, eps: float = NORMUON_EPS
) -> torch.Tensor:  # (m,), (m,) -> (m,)
    """Per-row factor f with Ô = f ⊙_rows O (NorMuon after its norm-preserving rescale):

        d_r = 1 / (√v_r + ε),  f_r = d_r · ‖O‖_F / (‖d ⊙_rows O‖_F + ε)

    Both norms come from the row statistics of the whole matrix (‖O‖²_F = n Σ_r stats_r; the
    column count n cancels in the ratio), so every layout computes them where O is whole."""
    d = row_scales(v, eps)
    stats = stats.to(d.dtype)
    norm, norm_new = torch.stack([stats.sum(), (stats * d * d).sum()]).sqrt().unbind(0)
    return d * (norm / (norm_new + eps))


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


# ------------------------------------------------------------------------ cautious decay
def cautious_weight_decay_(
    param: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float
) -> torch.Tensor:
    """W ← W − η λ 𝟙[u ⊙ W ≥ 0] ⊙ W, in place: decoupled decay only where the update u (the
    direction that is subtracted, W ← W − η u) and the weight agree in sign. Returns W."""
    mask = (update * param) >= 0
    return param.addcmul_(param, mask, value=-lr * weight_decay)


# ---------------------------------------------------------------------------- AOL / Turbo
def aol_scales(A: torch.Tensor, eps: float) -> torch.Tensor:  # A: (k, m, m) = X Xᵀ
    """Turbo-Muon's AOL row scales of X from its Gram matrix A = X Xᵀ, (k, m):
    s_i = (Σ_j |A_ij|)^(−1/2), the sum floored at ε before the root. diag(s) X has
    ‖diag(s) X‖₂ ≤ 1 (Prach & Lampert, arXiv:2208.03160); the Newton–Schulz iteration of
    :mod:`muonscale.kernels.newton_schulz_fast` starts from it with ``preconditioner="aol"``."""
    return torch.rsqrt(A.abs().sum(dim=-1).clamp_min(eps))


def shrink_huge_(X: torch.Tensor) -> torch.Tensor:
    """Keep X Xᵀ of a (k, m, n) stack finite: a matrix with m·n·max|x|² above a quarter of the
    dtype's range is divided by the power of two at or below its largest entry (AOL does not
    depend on the scale); the others are multiplied by 1, which is exact. Returns X."""
    largest = torch.linalg.vector_norm(X, ord=math.inf, dim=(-2, -1), keepdim=True)
    huge = largest * largest * (X.shape[-2] * X.shape[-1]) > torch.finfo(X.dtype).max / 4
    return X.mul_(torch.where(huge, torch.exp2(-torch.floor(torch.log2(largest))), 1.0))
