"""How one parameter is seen as a list of 2-D matrices for Newton–Schulz.

* 2-D parameter (m, n): one matrix.
* More dims, ``mode="flatten"`` (default): (m, k1, k2, …) → one (m, k1·k2·…) matrix, the usual
  treatment of a conv kernel (out_channels × fan-in).
* More dims, ``mode="batch"``: (e1, …, m, n) → e1·… separate (m, n) matrices, for stacked
  expert weights whose leading dim indexes independent matrices.
* ``row_partition``: disjoint row-index sets of the 2-D view, each orthogonalized as its own
  matrix (a fused QKV weight split into Q, K, V or into heads; see :class:`muonscale.QKVLayout`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

MATRIX_MODES = ("flatten", "batch")


@dataclass(frozen=True)
class MatrixView:
    """Parameter shape → matrices. Immutable; build once per parameter."""

    param_shape: tuple[int, ...]
    mode: str = "flatten"
    row_partition: tuple[torch.Tensor, ...] | None = None
    _contiguous_blocks: tuple[tuple[int, int], ...] | None = field(default=None, repr=False)

    @staticmethod
    def build(
        param_shape: Sequence[int],
        *,
        mode: str = "flatten",
        row_partition: Sequence[torch.Tensor] | Sequence[Sequence[int]] | None = None,
    ) -> MatrixView:
        shape = tuple(int(s) for s in param_shape)
        if len(shape) < 2:
            raise ValueError(f"a Muon parameter needs >= 2 dims, got shape {shape}")
        if mode not in MATRIX_MODES:
            raise ValueError(f"matrix_mode must be one of {MATRIX_MODES}, got {mode!r}")
        if row_partition is None:
            return MatrixView(shape, mode)
        if mode == "batch" and len(shape) > 2:
            raise ValueError("a row partition (split) applies to 2-D or flattened parameters, not matrix_mode='batch'")
        parts = tuple(torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in row_partition)
        rows = shape[0]
        covered = torch.cat(parts).sort().values
        if covered.numel() != rows or not torch.equal(covered, torch.arange(rows)):
            raise ValueError(
                f"split: the row blocks must cover each of the {rows} rows exactly once "
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
        return MatrixView(shape, mode, parts, tuple(blocks) if blocks is not None else None)

    @property
    def matrix_2d_shape(self) -> tuple[int, int]:
        return self.param_shape[0], math.prod(self.param_shape[1:])

    @property
    def matrix_shapes(self) -> list[tuple[int, int]]:
        if self.mode == "batch" and len(self.param_shape) > 2:
            count = math.prod(self.param_shape[:-2])
            return [tuple(self.param_shape[-2:])] * count
        m, n = self.matrix_2d_shape
        if self.row_partition is None:
            return [(m, n)]
        return [(int(p.numel()), n) for p in self.row_partition]

    def to_matrices(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Views (or gathered copies for a non-contiguous partition) of ``tensor`` as matrices."""
        if self.mode == "batch" and len(self.param_shape) > 2:
            return list(tensor.reshape(-1, *self.param_shape[-2:]).unbind(0))
        flat = tensor.reshape(self.matrix_2d_shape)
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
            return matrices[0].reshape(self.param_shape)
        if self._contiguous_blocks is not None:
            return torch.cat(list(matrices), dim=0).reshape(self.param_shape)
        first = matrices[0]
        out = first.new_empty(self.matrix_2d_shape)
        for p, mat in zip(self.row_partition, matrices):
            out.index_copy_(0, p.to(out.device), mat)
        return out.reshape(self.param_shape)


def row_blocks(sizes: Sequence[int]) -> list[torch.Tensor]:
    """Row-index sets of consecutive blocks of the given sizes."""
    out, start = [], 0
    for s in sizes:
        if int(s) < 1:
            raise ValueError(f"split: row-block sizes must be positive, got {list(sizes)}")
        out.append(torch.arange(start, start + int(s)))
        start += int(s)
    return out
