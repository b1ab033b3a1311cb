"""Layout of a fused QKV projection weight, shared by the model, the optimizer, TP and Megatron.

The fused weight has shape ``(rows, d_model)`` with rows laid out **interleaved by key/value
group**, as Megatron-Core does (``linear_qkv``)::

    rows = [ group 0: q_0 .. q_{p-1}, k, v | group 1: q_0 .. q_{p-1}, k, v | ... ]
           each block is head_dim rows; p = q_per_group (queries sharing one K/V head)

Why interleaved: a tensor-parallel column shard (``Shard(0)`` of this weight) over a number of
ranks that divides ``n_query_groups`` then holds whole groups (whole heads), so attention runs
locally. A plain ``[Q; K; V]`` stack would split heads across ranks.

The optimizer uses :meth:`QKVLayout.row_partition` to orthogonalize the Q, K and V blocks (or
each head) as separate matrices instead of the fused matrix as one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QKV_SPLIT_MODES = ("qkv", "head")


@dataclass(frozen=True, kw_only=True)
class QKVLayout:
    """Fused QKV weight layout, interleaved by key/value (query) group."""

    n_query_groups: int
    """Number of key/value heads (``n_kv_heads``); equals ``n_heads`` without GQA."""
    q_per_group: int
    """Query heads per key/value head (``n_heads // n_query_groups``)."""
    head_dim: int
    """Rows per head."""

    def __post_init__(self) -> None:
        for name in ("n_query_groups", "q_per_group", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"QKVLayout.{name} must be a positive int, got {value!r}")

    @property
    def n_heads(self) -> int:
        return self.n_query_groups * self.q_per_group

    @property
    def rows_per_group(self) -> int:
        return (self.q_per_group + 2) * self.head_dim

    @property
    def rows(self) -> int:
        return self.n_query_groups * self.rows_per_group

    def _block_rows(self, group: int, block: int) -> torch.Tensor:
        """Row indices of block ``block`` (0..p-1 queries, p = K, p+1 = V) of ``group``."""
        start = group * self.rows_per_group + block * self.head_dim
        return torch.arange(start, start + self.head_dim)

    def q_rows(self) -> torch.Tensor:
        return torch.cat(
            [
                self._block_rows(g, j)
                for g in range(self.n_query_groups)
                for j in range(self.q_per_group)
            ]
        )

    def k_rows(self) -> torch.Tensor:
        return torch.cat(
            [self._block_rows(g, self.q_per_group) for g in range(self.n_query_groups)]
        )

    def v_rows(self) -> torch.Tensor:
        return torch.cat(
            [self._block_rows(g, self.q_per_group + 1) for g in range(self.n_query_groups)]
        )

    def row_partition(self, mode: str = "qkv") -> list[torch.Tensor]:
        """Row-index sets, each orthogonalized as its own matrix.

        ``"qkv"``: three matrices (all query heads, all key heads, all value heads), as
        Megatron's ``--muon-split-qkv`` does. ``"head"``: one matrix per head (q, k and v heads).
        """
        if mode == "qkv":
            return [self.q_rows(), self.k_rows(), self.v_rows()]
        if mode == "head":
            return [
                self._block_rows(g, j)
                for g in range(self.n_query_groups)
                for j in range(self.q_per_group + 2)
            ]
        raise ValueError(f"QKV split mode must be one of {QKV_SPLIT_MODES}, got {mode!r}")

    def block_roles(self, mode: str = "qkv") -> tuple[str, ...]:
        """``"q"``, ``"k"`` or ``"v"`` for each block of :meth:`row_partition` (same order)."""
        if mode == "qkv":
            return ("q", "k", "v")
        if mode == "head":
            return (("q",) * self.q_per_group + ("k", "v")) * self.n_query_groups
        raise ValueError(f"QKV split mode must be one of {QKV_SPLIT_MODES}, got {mode!r}")

    def split_activations(
        self, qkv: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``x @ W.T`` of shape ``(..., rows)`` into q ``(..., n_heads, head_dim)`` and
        k, v ``(..., n_query_groups, head_dim)``. Works on a TP shard holding whole groups."""
        groups = qkv.shape[-1] // self.rows_per_group
        grouped = qkv.unflatten(-1, (groups, self.q_per_group + 2, self.head_dim))
        q = grouped[..., : self.q_per_group, :].flatten(-3, -2)
        k = grouped[..., self.q_per_group, :]
        v = grouped[..., self.q_per_group + 1, :]
        return q, k, v
