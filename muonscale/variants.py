"""Published Muon variants as small pure functions on plain local tensors.

* NorMuon (row-wise second-moment normalisation after Newton–Schulz, arXiv:2510.05491):
  :func:`row_statistics`, :func:`update_row_moments_`, :func:`row_factors` (with
  :func:`row_scales`), :func:`row_normalize_`.
* Cautious weight decay (arXiv:2510.12402): :func:`cautious_weight_decay_`.
* Turbo-Muon's AOL preconditioner is the first step of the Newton–Schulz iteration
  (:mod:`muonscale.kernels.first_step`).

Equations, constants and their sources are in *Variants* in the docs. A variant that keeps
state declares it here (:data:`ROW_MOMENT`); nothing here holds state or knows about
``torch.distributed``: the matrix step and the optimizers call these functions on the tensors
they hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from .state_tensor import StateTensor

Normalize = Literal["none", "row"]
"""``"row"``: NorMuon's row-wise normalisation after Newton–Schulz; ``"none"``: plain Muon."""

NORMALIZE_MODES: tuple[str, ...] = ("none", "row")

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


ROW_MOMENT = StateTensor(
    key="row_second_moment",
    what="NorMuon's row second moment, one float32 per row of the parameter's matrices",
    kept=lambda settings: settings.normalize == "row",
    shape=lambda view: row_moment_shape(view.matrix_shapes),
    dtype=lambda settings, dtype: torch.float32,
    placement="replicated",
    row_statistics=row_statistics,
    step_replica_=lambda settings, v, stats: update_row_moments_(v, stats, settings.row_beta2),
)
"""NorMuon's state, declared (:mod:`muonscale.declared_state` reads the declarations)."""

VARIANT_STATE: tuple[StateTensor, ...] = (ROW_MOMENT,)
"""The state the variants keep (beyond the momentum every Muon parameter holds)."""


# ------------------------------------------------------------------------ cautious decay
def cautious_weight_decay_(
    param: torch.Tensor, update: torch.Tensor, *, lr: float, weight_decay: float
) -> torch.Tensor:
    """W ← W − η λ 𝟙[u ⊙ W ≥ 0] ⊙ W, in place: decoupled decay only where the update u (the
    direction that is subtracted, W ← W − η u) and the weight agree in sign. Returns W."""
    mask = (update * param) >= 0
    return param.addcmul_(param, mask, value=-lr * weight_decay)
