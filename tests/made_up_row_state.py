"""A made-up variant's replicated row state, for the tests that a second replicated state costs
no layout code: declared as a variant declares its state (:mod:`muonscale.variants`), beside
NorMuon's row second moment and kept with it, and registered only inside :func:`declared`.

Its statistic is each row's L1 norm of the orthogonalized matrix O (a sum over the whole row,
so a statistic of a piece would differ) and a replica steps as v ← max(β₂ v, ‖O_r‖₁), with
NorMuon's β₂ from the group's settings (so the step reads the settings and the replica's
history)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from muonscale import variants
from muonscale.state_tensor import StateTensor


def row_l1(O: torch.Tensor) -> torch.Tensor:  # (m, n) -> (m,) float32
    return O.abs().sum(dim=-1).float()


def step_row_peak_(settings, v: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    return v.copy_(torch.maximum(v * settings.row_beta2, stats.to(v.dtype)))


ROW_PEAK = StateTensor(
    key="row_peak",
    what="a made-up row state (a decaying maximum of each row's L1 norm)",
    kept=lambda settings: settings.normalize == "row",
    shape=lambda view: variants.row_moment_shape(view.matrix_shapes),
    dtype=lambda settings, dtype: torch.float32,
    placement="replicated",
    row_statistics=row_l1,
    step_replica_=step_row_peak_,
)


@contextmanager
def declared(spec: StateTensor = ROW_PEAK) -> Iterator[StateTensor]:
    """``spec`` among the variants' declared state while the block runs (this process)."""
    saved = variants.VARIANT_STATE
    variants.VARIANT_STATE = (*saved, spec)
    try:
        yield spec
    finally:
        variants.VARIANT_STATE = saved
