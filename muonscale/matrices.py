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
* ``experts``: an expert view (:class:`muonscale.ExpertLayout`): a stack (E, A, B), or a 2-D
  concatenation (E·A, B) of E row blocks, is E matrices; ``transposed`` and the row partition
  (gate and up) then apply to each expert's matrix, in expert order.
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
    experts: int | None = None
    """Number of expert matrices of an expert view (None: not one)."""
    _strided_blocks: tuple[tuple[int, int, int], ...] | None = field(default=None, repr=False)

    @staticmethod
    def build(
        param_shape: Sequence[int],
        *,
        mode: str = "flatten",
        row_partition: Sequence[torch.Tensor] | Sequence[Sequence[int]] | None = None,
        block_roles: Sequence[str] | None = None,
        transposed: bool = False,
        experts: int | None = None,
    ) -> MatrixView:
        shape = tuple(int(s) for s in param_shape)
        if len(shape) < 2:
            raise ValueError(f"a Muon parameter needs >= 2 dims, got shape {shape}")
        if mode not in MATRIX_MODES:
            raise ValueError(f"matrix_mode must be one of {MATRIX_MODES}, got {mode!r}")
        if experts is not None:
            return _expert_view(shape, experts, transposed, row_partition, block_roles)
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
        parts = tuple(torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in row_partition)
        batched = mode == "batch" and len(shape) > 2  # the partition cuts each matrix's rows
        rows = shape[-2] if batched else shape[1] if transposed else shape[0]
        covered = torch.cat(parts).sort().values
        if covered.numel() != rows or not torch.equal(covered, torch.arange(rows)):
            what = (
                "output features (columns of the stored (in, out) weight)" if transposed else "rows"
            )
            raise ValueError(
                f"split: the row blocks must cover each of the {rows} {what} exactly once "
                f"(got {covered.numel()} row indices for a parameter of shape {shape})"
            )
        roles = tuple(block_roles) if block_roles is not None else None
        if batched:
            return MatrixView(shape, mode, parts, None, False, roles, None, _strided(parts))
        blocks, start = [], 0  # fast path: consecutive blocks in row order
        for p in parts:
            if torch.equal(p, torch.arange(start, start + p.numel())):
                blocks.append((start, p.numel()))
                start += p.numel()
            else:
                blocks = None
                break
        contiguous = tuple(blocks) if blocks is not None else None
        return MatrixView(shape, mode, parts, contiguous, bool(transposed), roles)

    def experts_view(self, count: int | None = None) -> MatrixView:
        """The view of ``count`` consecutive experts of this expert view (their sub-stack:
        each expert laid out as here), or with None of one expert alone, a plain matrix view
        (of its (A, B) slice of a stack, or its rows of a 2-D concatenation)."""
        if self.experts is None:
            raise ValueError(f"experts_view: the view of shape {self.param_shape} has no experts")
        rows = self.param_shape[0] // self.experts  # a stack: 1 (dim 0 indexes experts)
        if count is not None:
            shape = (count * rows, *self.param_shape[1:])
        elif len(self.param_shape) == 3:
            shape = self.param_shape[1:]
        else:
            shape = (rows, self.param_shape[1])
        return MatrixView.build(
            shape,
            experts=count,
            transposed=self.transposed,
            row_partition=self.row_partition,
            block_roles=self.block_roles,
        )

    @property
    def stacked_shape(self) -> tuple[int, int, int] | None:
        """(count, A, B) of a view whose matrices are the slices of a stack (an expert view,
        or ``"batch"`` of a parameter with more than 2 dims); None otherwise."""
        if self.experts is not None:
            if len(self.param_shape) == 2:
                return (self.experts, self.param_shape[0] // self.experts, self.param_shape[1])
            return (self.experts, *self.param_shape[-2:])
        if self.mode == "batch" and len(self.param_shape) > 2:
            return (math.prod(self.param_shape[:-2]), *self.param_shape[-2:])
        return None

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
        stacked = self.stacked_shape
        if stacked is not None:
            count, a, b = stacked
            m, n = (b, a) if self.transposed else (a, b)
            if self.row_partition is None:
                return [(m, n)] * count
            return [(int(p.numel()), n) for p in self.row_partition] * count
        m, n = self.matrix_2d_shape
        if self.row_partition is None:
            return [(m, n)]
        return [(int(p.numel()), n) for p in self.row_partition]

    def lr_factors(self, qk_lr_scale: float) -> list[float]:
        """Learning-rate multiplier of each matrix: ``qk_lr_scale`` for query and key blocks,
        1 for the rest."""
        roles = self.matrix_roles or (None,) * len(self.matrix_shapes)
        return [qk_lr_scale if role in ("q", "k") else 1.0 for role in roles]

    @property
    def matrix_roles(self) -> tuple[str, ...] | None:
        """The role of each matrix (the block roles, repeated for each matrix of a stack)."""
        if self.block_roles is None:
            return None
        stacked = self.stacked_shape
        return self.block_roles * (stacked[0] if stacked is not None else 1)

    def to_matrices(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Views (or gathered copies for a non-contiguous partition) of ``tensor`` as matrices."""
        stacked = self.stacked_shape
        if stacked is not None:
            mats = tensor.reshape(stacked)
            mats = mats.mT if self.transposed else mats
            if self.row_partition is None:
                return list(mats.unbind(0))
            return [block for mat in mats.unbind(0) for block in self._blocks_of(mat)]
        flat = self._as_matrix(tensor)
        if self.row_partition is None:
            return [flat]
        if self._contiguous_blocks is not None:
            return [flat.narrow(0, start, length) for start, length in self._contiguous_blocks]
        return [flat.index_select(0, p.to(flat.device)) for p in self.row_partition]

    def from_matrices(self, matrices: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`to_matrices`: a tensor of ``param_shape``."""
        stacked = self.stacked_shape
        if stacked is not None and self.row_partition is None and not self.transposed:
            return torch.stack(list(matrices)).reshape(self.param_shape)
        if stacked is not None:
            count, a, b = stacked
            m, n = (b, a) if self.transposed else (a, b)
            out = matrices[0].new_empty((count, m, n))
            if self.row_partition is None:
                torch._foreach_copy_(list(out.unbind(0)), list(matrices))
            else:
                per = len(self.row_partition)
                for e, mat in enumerate(out.unbind(0)):
                    self._fill_blocks(mat, matrices[e * per : (e + 1) * per])
            out = out.mT if self.transposed else out
            return out.reshape(self.param_shape)
        if self.row_partition is None:
            return self._as_stored(matrices[0])
        if self._contiguous_blocks is not None:
            return self._as_stored(torch.cat(list(matrices), dim=0))
        first = matrices[0]
        out = first.new_empty(self.matrix_2d_shape)
        for p, mat in zip(self.row_partition, matrices):
            out.index_copy_(0, p.to(out.device), mat)
        return self._as_stored(out)

    def _blocks_of(self, mat: torch.Tensor) -> list[torch.Tensor]:
        """The row blocks of one (out, in) matrix: views for strided blocks, else copies."""
        if self._strided_blocks is not None:
            return [mat[s : s + length * step : step] for s, length, step in self._strided_blocks]
        return [mat.index_select(0, p.to(mat.device)) for p in self.row_partition]

    def _fill_blocks(self, mat: torch.Tensor, blocks: Sequence[torch.Tensor]) -> None:
        """Write ``blocks`` into the rows of ``mat`` they came from (inverse of
        :meth:`_blocks_of`)."""
        if self._strided_blocks is not None:
            dests = [mat[s : s + n * step : step] for s, n, step in self._strided_blocks]
            torch._foreach_copy_(dests, list(blocks))
            return
        for p, block in zip(self.row_partition, blocks):
            mat.index_copy_(0, p.to(mat.device), block)


def _strided(parts: Sequence[torch.Tensor]) -> tuple[tuple[int, int, int], ...] | None:
    """(start, length, step) of each row block when every block is an arithmetic progression
    (contiguous halves, interleaved rows), else None."""
    out = []
    for p in parts:
        start = int(p[0]) if p.numel() else 0
        step = int(p[1] - p[0]) if p.numel() > 1 else 1
        if step < 1 or not torch.equal(p, torch.arange(p.numel()) * step + start):
            return None
        out.append((start, int(p.numel()), step))
    return tuple(out)


def _expert_view(
    shape: tuple[int, ...],
    experts: int,
    transposed: bool,
    row_partition: Sequence[torch.Tensor] | Sequence[Sequence[int]] | None,
    block_roles: Sequence[str] | None,
) -> MatrixView:
    """:meth:`MatrixView.build` of an expert view (see the module docstring)."""
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
        raise ValueError(f"experts: expected a positive number of experts, got {experts!r}")
    if len(shape) == 3 and shape[0] != experts:
        raise ValueError(
            f"experts: a stack of shape {shape} holds {shape[0]} experts, not {experts}"
        )
    if len(shape) == 2 and shape[0] % experts:
        raise ValueError(
            f"experts: {shape[0]} rows of a 2-D concatenation of shape {shape} do not split "
            f"into {experts} experts"
        )
    if len(shape) > 3:
        raise ValueError(f"experts: an expert view needs a 2-D or 3-D parameter, got {shape}")
    a, b = (shape[0] // experts, shape[1]) if len(shape) == 2 else shape[1:]
    rows = b if transposed else a
    parts = roles = None
    if row_partition is not None:
        parts = tuple(torch.as_tensor(p, dtype=torch.long).reshape(-1) for p in row_partition)
        covered = torch.cat(parts).sort().values
        if covered.numel() != rows or not torch.equal(covered, torch.arange(rows)):
            raise ValueError(
                f"split: the row blocks must cover each of the {rows} output features of each "
                f"expert exactly once (got {covered.numel()} for a stack of shape {shape})"
            )
        if block_roles is not None and len(block_roles) != len(parts):
            raise ValueError(f"block_roles: {len(block_roles)} roles for {len(parts)} row blocks")
        roles = tuple(block_roles) if block_roles is not None else None
    elif block_roles is not None:
        raise ValueError("block_roles: a view without a row partition has no blocks")
    strided = _strided(parts) if parts is not None else None
    return MatrixView(
        shape,
        "batch",
        parts,
        None,
        bool(transposed),
        roles,
        experts,
        strided,
    )


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
