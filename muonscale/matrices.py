"""How one parameter is seen as a list of 2-D matrices for Newton–Schulz.

* 2-D parameter (m, n): one matrix.
* More dims, ``mode="flatten"`` (default): (m, k1, k2, …) → one (m, k1·k2·…) matrix, the usual
  treatment of a conv kernel (out_channels × fan-in).
* More dims, ``mode="batch"``: (e1, …, m, n) → e1·… separate (m, n) matrices, for stacked
  expert weights whose leading dim indexes independent matrices.
* ``row_partition``: disjoint row-index sets of the 2-D view, each orthogonalized as its own
  matrix (a fused QKV weight split into Q, K, V or into heads; see :class:`muonscale.QKVLayout`).
* ``transposed``: a 2-D weight stored as (in, out), as GPT-2's ``Conv1D`` does: the matrix is
  its transpose (out, in), so scale rules see the true aspect and a row partition cuts output
  features (Q/K/V of a fused ``c_attn``), i.e. columns of the stored tensor.
* ``block_roles``: with a row partition from a QKV layout, ``"q"``, ``"k"`` or ``"v"`` per block
  (the ``qk_lr_scale`` option reads it).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

MATRIX_MODES = ("flatten", "batch")


@dataclass(frozen=True)
class MatrixView:
    """Parameter shape → matrices. Immutable; build once per parameter."""

    param_shape: tuple[int, ...]
    mode: str = "flatten"
    row_partition: tuple[torch.Tensor, ...] | None = None
    _contiguous_blocks: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)
    transposed: bool = False
    block_roles: tuple[str, ...] | None = None

    @staticmethod
    def build(
        param_shape: Sequence[int],
        *,
        mode: str = "flatten",
        row_partition: Sequence[torch.Tensor] | Sequence[Sequence[int]] | None = None,
        block_roles: Sequence[str] | None = None,
        transposed: bool = False,
    ) -> MatrixView:
        shape = tuple(int(s) for s in param_shape)
        if len(shape) < 2:
            raise ValueError(f"a Muon parameter needs >= 2 dims, got shape {shape}")
        if mode not in MATRIX_MODES:
            raise ValueError(f"matrix_mode must be one of {MATRIX_MODES}, got {mode!r}")
        if transposed and len(shape) != 2:
            raise ValueError(
                f"transposed: only a 2-D (in, out) weight can be transposed, got shape {shape}"
            )
        if row_partition is None:
            if block_roles is not None:
                raise ValueError("block_roles: a view without a row partition has no blocks")
            return MatrixView(shape, mode, transposed=bool(transposed))
        if block_roles is not None and len(block_roles) != len(row_partition):
            raise ValueError(
                f"block_roles: {len(block_roles)} roles for {len(row_partition)} row blocks"
            )
        if mode == "batch" and len(shape) > 2:
            raise ValueError(
                "a row partition (split) applies to 2-D or flattened parameters, "
                "not matrix_mode='batch'"
            )
        parts = tuple(torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in row_partition)
        rows = shape[1] if transposed else shape[0]
        covered = torch.cat(parts).sort().values
        if covered.numel() != rows or not torch.equal(covered, torch.arange(rows)):
            what = (
                "output features (columns of the stored (in, out) weight)" if transposed else "rows"
            )
            raise ValueError(
                f"split: the row blocks must cover each of the {rows} {what} exactly once "
                f"(got {covered.numel()} row indices for a parameter of shape {shape})"
            )
        blocks, start = [], 0  # fast path: consecutive blocks in row order
        for p in parts:
            if torch.equal(p, torch.arange(start, start + p.numel())):
                blocks.append((start, p.numel()))
                start += p.numel()
            else:
                blocks = None
                break
        contiguous = tuple(blocks) if blocks is not None else None
        roles = tuple(block_roles) if block_roles is not None else None
        return MatrixView(shape, mode, parts, contiguous, bool(transposed), roles)

    @property
    def matrix_2d_shape(self) -> tuple[int, int]:
        if self.transposed:
            return self.param_shape[1], self.param_shape[0]
        return self.param_shape[0], math.prod(self.param_shape[1:])

    def _as_matrix(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.mT if self.transposed else tensor.reshape(self.matrix_2d_shape)

    def _as_stored(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix.mT if self.transposed else matrix.reshape(self.param_shape)

    @property
    def matrix_shapes(self) -> list[tuple[int, int]]:
        if self.mode == "batch" and len(self.param_shape) > 2:
            count = math.prod(self.param_shape[:-2])
            return [tuple(self.param_shape[-2:])] * count
        m, n = self.matrix_2d_shape
        if self.row_partition is None:
            return [(m, n)]
        return [(int(p.numel()), n) for p in self.row_partition]

    def lr_factors(self, qk_lr_scale: float) -> list[float]:
        """Learning-rate multiplier of each matrix: ``qk_lr_scale`` for query and key blocks,
        1 for the rest."""
        roles = self.block_roles or (None,) * len(self.matrix_shapes)
        return [qk_lr_scale if role in ("q", "k") else 1.0 for role in roles]

    def to_matrices(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Views (or gathered copies for a non-contiguous partition) of ``tensor`` as matrices."""
        if self.mode == "batch" and len(self.param_shape) > 2:
            return list(tensor.reshape(-1, *self.param_shape[-2:]).unbind(0))
        flat = self._as_matrix(tensor)
        if self.row_partition is None:
            return [flat]
        if self._contiguous_blocks is not None:
            return [flat.narrow(0, start, length) for start, length in self._contiguous_blocks]
        return [flat.index_select(0, p.to(flat.device)) for p in self.row_partition]

    def from_matrices(self, matrices: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_matrices`: a tensor of ``param_shape``."""
        if self.mode == "batch" and len(self.param_shape) > 2:
            return torch.stack(list(matrices)).reshape(self.param_shape)
        if self.row_partition is None:
            return self._as_stored(matrices[0])
        if self._contiguous_blocks is not None:
            return self._as_stored(torch.cat(list(matrices), dim=0))
        first = matrices[0]
        out = first.new_empty(self.matrix_2d_shape)
        for p, mat in zip(self.row_partition, matrices):
            out.index_copy_(0, p.to(out.device), mat)
        return self._as_stored(out)


def row_blocks(sizes: Sequence[int]) -> list[torch.Tensor]:
    """Row-index sets of consecutive blocks of the given sizes."""
    out, start = [], 0
    for s in sizes:
        if int(s) < 1:
            raise ValueError(f"split: row-block sizes must be positive, got {list(sizes)}")
        out.append(torch.arange(start, start + int(s)))
        start += int(s)
    return out


class IdleOptionWarning(UserWarning):
    """An option of a param group that acts on none of its parameters."""


def warn_idle_role_factors(
    split_roles: Mapping[int, tuple[str, ...]],
    param_groups: Sequence[Mapping[str, Any]],
    stacklevel: int = 3,
) -> None:
    """Warn (:class:`IdleOptionWarning`) for each Muon group whose ``qk_lr_scale`` has no query
    or key block to act on; ``split_roles``: ``id(param)`` -> the roles of its row blocks
    (``stacklevel``: ``warnings.warn``'s, counted from here)."""
    for i, group in enumerate(param_groups):
        if group["algorithm"] != "muon" or group["qk_lr_scale"] == 1.0:
            continue
        factor = group["qk_lr_scale"]
        roles = {r for p in group["params"] for r in split_roles.get(id(p), ())}
        if not roles & {"q", "k"}:
            warnings.warn(
                f"qk_lr_scale={factor} (param group {i}) acts on no parameter: it scales "
                "the query and key blocks of fused QKV weights given in splits with a "
                "QKVLayout. Give separate q/k projections a param group with their own lr.",
                IdleOptionWarning,
                stacklevel=stacklevel,
            )
