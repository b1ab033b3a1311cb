"""QK-clip (the "Clip" of MuonClip, Kimi K2, arXiv 2507.20534, section 2.1, Algorithm 1).

After ``optimizer.step()``, every attention head whose maximum logit exceeded ``tau`` has its
query and key projection rows shrunk so that logit would have been ``tau``::

    S_max^h = max over the batch and over attended pairs (i, j) of  q_i^h . k_j^h / sqrt(d)
    gamma_h = min(1, tau / S_max^h)
    head h owns its key (MHA):          W_q^h <- sqrt(gamma_h) W_q^h,  W_k^h <- sqrt(gamma_h) W_k^h
    key shared by a group (GQA, MQA):   W_q^h <- gamma_h W_q^h,        W_k^g unchanged

The first rule is K2's for head-specific components (q^C, k^C). The second is K2's rule for its
shared rotary key k^R (q^R <- gamma_h q^R, k^R untouched): a key shared by several query heads
is left alone so that clipping one head never changes another head's logits. Either way the
logits of head h scale by exactly gamma_h. Biases of the clipped rows scale with them.

Model-agnostic: a model hands over its projection weights as :class:`FusedQKV` (rows
interleaved by key/value group, :class:`~muonscale.qkv.QKVLayout`; the full matrix, a
tensor-parallel row shard holding whole groups, or a DTensor such as FSDP2's, whose local
rows are rescaled by their global heads' factors) or :class:`SeparateQK` targets, and the per-head
maxima its attention measured (:func:`max_attention_logits` computes them exactly, in chunks).
:class:`QKClip` all-reduces the maxima (MAX) over the data-parallel group, so every rank applies
the same rescale. A tensor-parallel DTensor rank measures its own heads only:
:func:`full_head_maxima` places them among ``-inf`` for the others, and the MAX over a group
spanning the tensor-parallel ranks fills those in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .distributed.comm import Communicator
from .distributed.setup_checks import is_dtensor
from .qkv import QKVLayout

DEFAULT_CHUNK_ELEMENTS = 1 << 22
"""Logits held at once by :func:`max_attention_logits` (16 MiB in float32)."""


@torch.no_grad()
def max_attention_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Exact maximum logit ``scale * q_i . k_j`` of every query head, over the batch and the
    attended pairs (``j <= i`` when ``causal``, as ``is_causal=True`` attends).

    ``q``: (B, H, T, hd); ``k``: (B, G, T, hd) with G dividing H (query head ``h`` uses key
    head ``h // (H // G)``). ``scale`` defaults to ``1/sqrt(hd)``. Computed in float32 (float64
    inputs stay float64), a block of query rows at a time so that at most about
    ``chunk_elements`` logits exist at once. Returns (H,).
    """
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (B, heads, T, head_dim), got {q.shape} and {k.shape}")
    batch, n_heads, seq_q, head_dim = q.shape
    n_groups, seq_k = k.shape[1], k.shape[2]
    if n_heads % n_groups or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} (G must divide H)")
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    scale = head_dim**-0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    q_grouped = q.to(dtype).unflatten(1, (n_groups, n_heads // n_groups))  # (B, G, p, T, hd)
    k_t = k.to(dtype).unsqueeze(2).transpose(-1, -2)  # (B, G, 1, hd, T)
    rows = max(1, chunk_elements // max(1, batch * n_heads * seq_k))
    best = torch.full((n_heads,), -math.inf, dtype=dtype, device=q.device)
    for start in range(0, seq_q, rows):
        stop = min(seq_q, start + rows)
        keys = k_t[..., :stop] if causal else k_t  # causal: keys past the block never attend
        logits = q_grouped[..., start:stop, :] @ keys  # (B, G, p, rows, keys)
        if causal:
            i = torch.arange(start, stop, device=q.device).unsqueeze(1)
            j = torch.arange(keys.shape[-1], device=q.device).unsqueeze(0)
            logits = logits.masked_fill(j > i, -math.inf)
        best = torch.maximum(best, logits.amax(dim=(0, 3, 4)).flatten())
    return best * scale


def clip_factors(
    max_logits: torch.Tensor, *, tau: float, q_per_group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row scale factors ``(q_factor (H,), k_factor (G,))`` for per-head maxima (H,).

    ``gamma_h = min(1, tau / S_max^h)``; ``q_per_group == 1``: ``sqrt(gamma_h)`` on query and
    key head ``h``; otherwise ``gamma_h`` on query head ``h`` and 1 on the shared keys.
    """
    gamma = torch.where(max_logits > tau, tau / max_logits, torch.ones_like(max_logits))
    if q_per_group == 1:
        root = gamma.sqrt()
        return root, root.clone()
    return gamma, torch.ones(max_logits.numel() // q_per_group, dtype=gamma.dtype)


def _scale_rows_(tensor: torch.Tensor | None, factors: torch.Tensor) -> None:
    """``tensor`` (blocks * rows_per_block, ...) *= factors (blocks,) block by block, in place.
    A DTensor (FSDP2, TP) scales the rows of its local shard by their global rows' factors: a
    block may straddle shards, and no rank communicates."""
    if tensor is None:
        return
    rows = factors.to(device=tensor.device, dtype=tensor.dtype).repeat_interleave(
        tensor.shape[0] // factors.numel()
    )  # (global rows,)
    if is_dtensor(tensor):
        from .distributed.dtensor import local_indices, local_tensor

        local = local_tensor(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor)
        rows = rows[local_indices(tensor, 0).to(rows.device)]
        tensor = local
    tensor.mul_(rows.view((-1,) + (1,) * (tensor.dim() - 1)))


@dataclass(frozen=True)
class FusedQKV:
    """A fused QKV projection, rows interleaved by key/value group (:class:`QKVLayout`): the
    full weight or a tensor-parallel row shard holding whole groups (its heads in order)."""

    weight: torch.Tensor
    """(groups * layout.rows_per_group, d_model), a plain local tensor."""
    layout: QKVLayout
    bias: torch.Tensor | None = None
    """(groups * layout.rows_per_group,) or None."""

    def __post_init__(self) -> None:
        if self.weight.shape[0] % self.layout.rows_per_group:
            raise ValueError(
                f"FusedQKV.weight has {self.weight.shape[0]} rows, not a multiple of the "
                f"layout's {self.layout.rows_per_group} rows per key/value group"
            )

    @property
    def q_per_group(self) -> int:
        return self.layout.q_per_group

    @property
    def n_heads(self) -> int:
        return self.weight.shape[0] // self.layout.rows_per_group * self.layout.q_per_group

    @torch.no_grad()
    def scale_(self, q_factor: torch.Tensor, k_factor: torch.Tensor) -> None:
        groups, p = self.weight.shape[0] // self.layout.rows_per_group, self.layout.q_per_group
        # one factor per head_dim block: [q_0 .. q_{p-1}, k, v] in every group
        factors = torch.ones(groups, p + 2, dtype=q_factor.dtype)
        factors[:, :p] = q_factor.view(groups, p)
        factors[:, p] = k_factor
        for tensor in (self.weight, self.bias):
            _scale_rows_(tensor, factors.flatten())


@dataclass(frozen=True)
class SeparateQK:
    """Separate query and key projections: ``q_weight`` (H * hd, d), ``k_weight`` (G * hd, d),
    query head ``h`` attending with key head ``h // (H // G)``."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    head_dim: int
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None

    def __post_init__(self) -> None:
        q_rows, k_rows = self.q_weight.shape[0], self.k_weight.shape[0]
        if q_rows % self.head_dim or k_rows % self.head_dim or q_rows % k_rows:
            raise ValueError(
                f"SeparateQK: q_weight rows ({q_rows}) and k_weight rows ({k_rows}) must be "
                f"multiples of head_dim ({self.head_dim}), the key heads dividing the query heads"
            )

    @property
    def q_per_group(self) -> int:
        return self.q_weight.shape[0] // self.k_weight.shape[0]

    @property
    def n_heads(self) -> int:
        return self.q_weight.shape[0] // self.head_dim

    @torch.no_grad()
    def scale_(self, q_factor: torch.Tensor, k_factor: torch.Tensor) -> None:
        for tensor in (self.q_weight, self.q_bias):
            _scale_rows_(tensor, q_factor)
        for tensor in (self.k_weight, self.k_bias):
            _scale_rows_(tensor, k_factor)


QKTarget = FusedQKV | SeparateQK


def local_heads(target: QKTarget) -> torch.Tensor:
    """Global indices of the query heads whose rows this rank holds, in order: all heads for
    plain tensors; for a tensor-parallel DTensor (e.g. ``ColwiseParallel``'s ``Shard(0)``) the
    heads of its local rows, which must be whole key/value groups (fused) or whole heads."""
    weight = target.weight if isinstance(target, FusedQKV) else target.q_weight
    if not is_dtensor(weight):
        return torch.arange(target.n_heads)
    from .distributed.dtensor import local_indices

    rows = local_indices(weight, 0)
    if isinstance(target, FusedQKV):
        block, per_block = target.layout.rows_per_group, target.q_per_group
    else:
        block, per_block = target.head_dim, 1
    first = rows[::block]
    whole = torch.equal(rows, (first.unsqueeze(1) + torch.arange(block)).flatten())
    if not (rows.numel() % block == 0 and bool((first % block == 0).all()) and whole):
        raise ValueError(
            f"local_heads: this rank holds rows {rows.tolist()[:8]}... of the projection, not "
            f"whole blocks of {block} rows (a key/value group or a head); shard by whole heads"
        )
    return ((first // block).unsqueeze(1) * per_block + torch.arange(per_block)).flatten()


def full_head_maxima(target: QKTarget, local_maxima: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel rank's (target.n_heads,) maxima for :class:`QKClip`: its own heads'
    ``local_maxima`` (in :func:`local_heads` order, as its attention measured them) in place
    and ``-inf`` for the heads of the other ranks, which the MAX all-reduce over a group that
    spans the tensor-parallel ranks fills in."""
    heads = local_heads(target)
    if local_maxima.numel() != heads.numel():
        raise ValueError(
            f"local_maxima has {local_maxima.numel()} values, this rank holds {heads.numel()} "
            "heads of the target"
        )
    full = torch.full((target.n_heads,), -math.inf, dtype=local_maxima.dtype)
    full[heads] = local_maxima.detach().reshape(-1).cpu()
    return full


class QKClip:
    """QK-clip over a fixed list of attention projections (see the module docstring).

    ``process_group``: the data-parallel group whose ranks see different batches of the same
    heads; the maxima are MAX-reduced over it in one all-reduce (counted by
    :class:`~muonscale.distributed.comm.Communicator` under tag ``"qk_clip"``). Tensor-parallel
    ranks hold different heads: with plain local row shards as targets they are not reduced
    over; with DTensor targets, ``process_group`` spans them too (e.g. the whole (dp, tp) mesh)
    and each passes :func:`full_head_maxima`.
    """

    def __init__(
        self,
        targets: Sequence[QKTarget],
        *,
        tau: float,
        process_group: dist.ProcessGroup | None = None,
        communicator: Communicator | None = None,
    ) -> None:
        if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
            raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
        if not isinstance(targets, (FusedQKV, SeparateQK)):
            targets = list(targets)
        if not isinstance(targets, list) or not targets:
            raise ValueError(
                "targets must be a non-empty list of FusedQKV or SeparateQK (the attention "
                f"layers to clip), got {targets!r}"
            )
        for target in targets:
            if not isinstance(target, (FusedQKV, SeparateQK)):
                raise TypeError(f"targets must be FusedQKV or SeparateQK, got {type(target)}")
        self.targets = targets
        self.tau = float(tau)
        self.comm = communicator if communicator is not None else Communicator(process_group)

    @torch.no_grad()
    def __call__(self, max_logits: Sequence[torch.Tensor]) -> torch.Tensor:
        """Rescale every target whose heads' maxima (this rank's, ``max_logits[i]`` of shape
        (heads of ``targets[i]``,)) exceed ``tau`` after the MAX over the data-parallel ranks.
        Call after ``optimizer.step()``. Returns the reduced maxima, concatenated (float64, as
        gamma is computed)."""
        if len(max_logits) != len(self.targets):
            raise ValueError(
                f"max_logits: expected {len(self.targets)} tensors (one per target), "
                f"got {len(max_logits)}"
            )
        for i, (target, logits) in enumerate(zip(self.targets, max_logits, strict=True)):
            if logits.numel() != target.n_heads:
                raise ValueError(
                    f"max_logits[{i}] has {logits.numel()} values, target {i} has "
                    f"{target.n_heads} heads"
                )
        device = self.comm.device
        reduced = torch.cat([m.detach().reshape(-1).to(device, torch.float64) for m in max_logits])
        self.comm.all_reduce(reduced, op=dist.ReduceOp.MAX, tag="qk_clip")
        reduced = reduced.cpu()
        offset = 0
        for target in self.targets:
            heads = reduced[offset : offset + target.n_heads]
            offset += target.n_heads
            if bool((heads > self.tau).any()):
                factors = clip_factors(heads, tau=self.tau, q_per_group=target.q_per_group)
                target.scale_(*factors)
        return reduced
