"""Float64 references of the Muon variants, written from the papers' equations (see
docs/variants.md), independent of muonscale's implementation."""

from __future__ import annotations

import torch

TURBO_MUON_STEPS = [  # arXiv:2512.04632's code, four steps after AOL
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]


def ns_frobenius(G: torch.Tensor, schedule, eps: float = 1e-7, margin: float = 1.0):
    """Muon's Newton–Schulz: X₀ = G/(margin·‖G‖_F) on the short side, X ← aX + (bA + cA²)X."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    X = X / max(margin * float(torch.linalg.matrix_norm(X)), eps)
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def ns_aol(G: torch.Tensor, schedule, eps: float = 1e-7) -> torch.Tensor:
    """Turbo-Muon: X₁ = diag(s) X₀ with s_i = (Σ_j |X₀X₀ᵀ|_ij)^(−1/2), then the quintic steps."""
    X = G.double()
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    s = (X @ X.T).abs().sum(dim=1).clamp_min(eps).rsqrt()
    X = torch.diag(s) @ X
    for a, b, c in schedule:
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def normuon_rows(O: torch.Tensor, v: torch.Tensor, beta2: float, eps: float = 1e-10):
    """NorMuon after NS: v ← β₂v + (1−β₂) mean_cols(O⊙O); Ô = O/(√v + ε), rescaled to ‖O‖_F.
    Returns (Ô, v)."""
    O = O.double()
    v = beta2 * v.double() + (1 - beta2) * (O * O).mean(dim=1)
    Oh = O / (v.sqrt() + eps)[:, None]
    Oh = Oh * (torch.linalg.matrix_norm(O) / (torch.linalg.matrix_norm(Oh) + eps))
    return Oh, v


def muon_step(W, G, B, v, *, lr, wd, mu, nesterov, orth, scale, normalize, cautious, beta2=0.95):
    """One Muon step in float64 for one 2-D matrix; returns (W, B, v)."""
    W, G, B = W.double(), G.double(), B.double()
    B = mu * B + (1 - mu) * G
    U = (1 - mu) * G + mu * B if nesterov else B
    O = orth(U)
    if normalize:
        O, v = normuon_rows(O, v, beta2)
    u = scale * O  # the update subtracted: W ← W − lr·u
    if wd:
        mask = ((u * W) >= 0).double() if cautious else torch.ones_like(W)
        W = W - lr * wd * mask * W
    return W - lr * u, B, v
