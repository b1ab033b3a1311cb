"""The first step of the Newton–Schulz iteration: how its input X is scaled (the
preconditioner), folded into the m×m products of the first step where it can be.

* ``"frobenius"`` (Muon): X/ν with ν = margin·‖X‖_F. The scalar 1/ν (k, 1, 1) is folded into
  the first step; a :class:`FirstStepNorm` takes the norm of the matrices that
  :func:`prescale_` shrank from the first Gram matrix's trace (‖X‖²_F = tr X Xᵀ). In float16,
  whose range would not hold the unnormalized X Xᵀ, and under ``torch.compile``, X is divided
  first instead.
* ``"aol"`` (Turbo-Muon, arXiv:2512.04632): D X with Turbo-Muon's diagonal D = diag(s) read off
  the first Gram matrix (:func:`aol_scales`, an :class:`AOLScaling`); the first step then has
  D X Xᵀ D as its Gram matrix, and no pass over the stack either.

Equations and sources are in *Variants* and *Newton–Schulz* in the docs.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from muonscale.kernels.process_state import NSWorkspace

Preconditioner = Literal["frobenius", "aol"]
"""How the Newton–Schulz input is scaled: ``"frobenius"`` X/‖X‖_F (Muon), ``"aol"`` Turbo-Muon."""

PRECONDITIONERS: tuple[str, ...] = ("frobenius", "aol")


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


class FirstStepNorm:
    """The 1/ν folded into the first step: ``inv_norm`` (k, 1, 1), except for the matrices
    ``from_trace`` marks, whose 1/(margin·‖X‖_F) is read off the first Gram matrix."""

    def __init__(self, inv_norm: torch.Tensor, from_trace: torch.Tensor, margin: float) -> None:
        self.inv_norm, self.from_trace, self.margin = inv_norm, from_trace, margin

    def of(self, gram: torch.Tensor) -> torch.Tensor:  # gram: (k, m, m) = X Xᵀ
        trace = gram.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True).unsqueeze(-1)
        traced = trace.sqrt_().mul_(self.margin).clamp_(min=torch.finfo(gram.dtype).tiny)
        return torch.where(self.from_trace, traced.reciprocal_(), self.inv_norm)


class AOLScaling:
    """The D = diag(s) folded into the first step instead of 1/ν (``preconditioner="aol"``):
    :func:`aol_scales` of the first Gram matrix, as a (k, 1, m) row."""

    def __init__(self, eps: float) -> None:
        self.eps = eps

    def of(self, gram: torch.Tensor) -> torch.Tensor:  # gram: (k, m, m) = X Xᵀ
        return aol_scales(gram, self.eps).unsqueeze(-2)


FirstStepScale = torch.Tensor | FirstStepNorm | AOLScaling
"""What the first step folds in: 1/ν (k, 1, 1), a :class:`FirstStepNorm` or an AOL D."""


def first_scale(scale: FirstStepScale, gram: torch.Tensor) -> torch.Tensor:
    """1/ν (k, 1, 1) or the AOL diagonal s (k, 1, m) of the first Gram matrix ``gram``."""
    return scale if isinstance(scale, torch.Tensor) else scale.of(gram)


def scale_gram_(gram: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """X Xᵀ → (D X)(D X)ᵀ = D X Xᵀ D in place, D = 1/ν (one multiply by 1/ν²) or diag(s)."""
    if scale.shape[-1] == 1:
        return gram.mul_(scale * scale)
    return gram.mul_(scale.mT).mul_(scale)


def prescale_(X: torch.Tensor, inv_norm: torch.Tensor, margin: float) -> FirstStepNorm:
    """Keep the unnormalized X Xᵀ of the first step finite: its entries reach ‖X‖²_F, so a
    matrix whose norm squared could exceed a quarter of the dtype's range (or whose norm
    overflowed) is multiplied by a power of two 2⁻ˢ small enough for any finite entries; the
    others are multiplied by 1, which is exact, and keep their folded ``inv_norm`` bits."""
    info = torch.finfo(X.dtype)
    limit = 2.0 / (margin * math.sqrt(info.max))  # inv_norm below it: margin·ν > √max / 2
    from_trace = inv_norm < limit
    # ‖2⁻ˢ X‖²_F <= rows·cols·max²·4⁻ˢ <= max / 4
    s = math.ceil((math.log2(info.max) + math.log2(max(1, X.shape[-2] * X.shape[-1]))) / 2) + 1
    X.mul_(torch.where(from_trace, torch.full_like(inv_norm, 2.0**-s), 1.0))
    return FirstStepNorm(inv_norm, from_trace, margin)


def inverse_norms(X: torch.Tensor, ws: NSWorkspace, margin: float, eps: float) -> torch.Tensor:
    """1 / max(margin · ‖X_i‖_F, eps) per matrix, (k, 1, 1), the norm taken in X's dtype
    like the reference's."""
    norm = ws.get("norm", (X.shape[0], 1, 1))
    torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, out=norm)
    if margin != 1.0:
        norm.mul_(margin)
    return norm.clamp_(min=eps).reciprocal_()


def unless_overflowed(
    X: torch.Tensor, inv_norm: torch.Tensor, margin: float, eps: float
) -> torch.Tensor:
    """``inv_norm``, except where the norm overflowed X's dtype (inv_norm 0: float16 from
    ‖X‖_F > 65504): there 1/ν from a float64 norm, which X / ν fits. The others keep their
    values (a float16 multiply by them is exact in float64, so it rounds the same)."""
    wide = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=torch.float64)
    wide = wide.mul_(margin).clamp_(min=eps).reciprocal_()
    return torch.where(inv_norm == 0, wide, inv_norm)


def prepare_first_step_(
    X: torch.Tensor,
    preconditioner: Preconditioner,
    workspace: NSWorkspace,
    margin: float,
    eps: float,
    *,
    fold: bool,
) -> FirstStepScale | None:
    """Prepare the stack ``X`` (k, rows, cols), in place, for the first step of the iteration
    and return what that step folds in (None: X was scaled here). ``fold``: whether the
    Frobenius 1/ν may be folded in (not in float16 nor under ``torch.compile``)."""
    if preconditioner == "aol":
        shrink_huge_(X)
        return AOLScaling(eps)
    inv_norm = inverse_norms(X, workspace, margin, eps)
    if not fold:
        X.mul_(unless_overflowed(X, inv_norm, margin, eps))
        return None
    return prescale_(X, inv_norm, margin)
