"""One state tensor of a Muon parameter, declared: its key, its shape as a function of the
parameter's matrix view, its dtype, its placement, and which settings keep it. The
declarations live with what keeps them (the momentum in :mod:`muonscale.declared_state`, a
variant's state with its math in :mod:`muonscale.variants`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

Placement = Literal["parameter", "replicated"]
"""``"parameter"``: laid out as the parameter (a DTensor parameter's state is a DTensor with
its placements; in ``DistributedMuon`` it lives with the matrix's owner); ``"replicated"``:
one value per row of the parameter's whole matrices (their rows in order), the whole tensor
wherever the matrix is updated (with the owner, or a replica on every rank that holds a shard
of a sharded matrix). A replicated state declares its row statistics and the step they give a
replica: the owner computes the statistics where the matrix is whole, the exchange shares them
and every replica takes the same step
(:func:`muonscale.distributed.exchange.step_through_exchange`)."""


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a Muon parameter. Its functions take a
    :class:`~muonscale.settings.MuonSettings` and a :class:`~muonscale.matrices.MatrixView`
    (typed ``Any`` here: :mod:`muonscale.settings` imports the variants, which declare their
    state with this class)."""

    key: str
    """Its key in the parameter's state (and in ``state_dict()``)."""
    what: str
    """What it holds, for messages."""
    kept: Callable[[Any], bool]
    """Whether a group with these settings keeps it."""
    shape: Callable[[Any], tuple[int, ...]]
    """Its (global) shape, from the parameter's matrix view."""
    dtype: Callable[[Any, torch.dtype], torch.dtype]
    """Its dtype, from the settings and the dtype of the parameter (or of its main copy)."""
    placement: Placement
    row_statistics: Callable[[torch.Tensor], torch.Tensor] | None = None
    """Replicated state only: its statistics per row of a whole orthogonalized matrix,
    O (m, n) → (m,), in float32 at least (what the exchange sends to every replica)."""
    step_replica_: Callable[[Any, torch.Tensor, torch.Tensor], Any] | None = None
    """Replicated state only: ``step_replica_(settings, replica, stats)`` steps a replica (the
    matrix's (m,) rows of this state) in place from the statistics, with the group's settings."""

    def __post_init__(self) -> None:
        declared = (self.row_statistics is not None, self.step_replica_ is not None)
        if declared != (self.placement == "replicated",) * 2:
            raise ValueError(
                f"StateTensor {self.key!r}: a replicated state declares row_statistics and "
                f"step_replica_, any other none (placement={self.placement!r})"
            )

    def zeros(
        self, settings: Any, view: Any, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zero tensor of this state for a plain (whole) parameter of ``dtype``."""
        return torch.zeros(self.shape(view), dtype=self.dtype(settings, dtype), device=device)
