"""The update math of Muon and AdamW on lists of plain local tensors.

Nothing here knows about param groups, optimizer state or ``torch.distributed``: the optimizer
classes (single-process and distributed) gather the right tensors and call these functions, so
every layout runs exactly the same arithmetic.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from . import variants  # [variants]
from .kernels.newton_schulz_fast import NSMethodChoice, choose_method, newton_schulz_fast
from .matrices import MatrixView
from .memory import (
    DEFAULT_NS_WORKSPACE_BYTES,
    PER_DEVICE,
    ChunkBytes,
    chunk_bytes_for,
    group_by_budget,
    split_by_budget,
)
from .newton_schulz import DEFAULT_EPS, CoefficientSpec, default_ns_dtype, resolve_schedule
from .scaling import update_scale


def momentum_directions_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    momentum: float,
    nesterov: bool,
) -> list[torch.Tensor]:
    """Update the EMA buffers in place and return the directions to orthogonalize.

    B ← B + (1 − μ)(G − B)   (``B.lerp_(G, 1 − μ)``, torch.optim.Muon's form)
    U = G + μ(B − G) with Nesterov (``G.lerp(B, μ)``), else U = B.
    """
    directions = []
    for grad, buf in zip(grads, momentum_buffers):
        buf.lerp_(grad if grad.dtype == buf.dtype else grad.to(buf.dtype), 1 - momentum)
        full = buf if buf.dtype == grad.dtype else buf.to(grad.dtype)
        directions.append(grad.lerp(full, momentum) if nesterov else full)
    return directions


def orthogonalize_matrices(
    matrices: Sequence[torch.Tensor],
    *,
    ns_steps: int,
    coefficients: CoefficientSpec,
    ns_dtype: torch.dtype | None,
    eps: float = DEFAULT_EPS,
    method: NSMethodChoice = "auto",
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
    preconditioner: variants.Preconditioner = "frobenius",  # [variants]
) -> list[torch.Tensor]:
    """Newton–Schulz of every matrix, batched: matrices with the same (short, long) shape are
    stacked (tall ones transposed) and orthogonalized in place in one call of
    :func:`muonscale.kernels.newton_schulz_fast` (workspace reuse; Triton symmetric products on
    CUDA; ``method="auto"`` takes the Gram form for wide float32 matrices, where it is as
    accurate and cheaper; ``max_workspace_bytes`` bounds its scratch). Returns matrices in the
    input's shapes, in ``ns_dtype``."""
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, mat in enumerate(matrices):
        m, n = mat.shape
        dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(mat.device)
        buckets[(min(m, n), max(m, n), mat.device, dtype)].append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for (short, long, device, dtype), indices in buckets.items():
        stack = torch.empty((len(indices), short, long), dtype=dtype, device=device)  # (k, s, l)
        for slot, i in enumerate(indices):
            mat = matrices[i]
            stack[slot].copy_(mat.mT if mat.shape[0] > mat.shape[1] else mat)
        if preconditioner == "aol":  # [variants] Turbo-Muon: AOL scaling, not X / ‖X‖_F
            aol_method, restart = choose_method(short, long, dtype)
            aol_method = aol_method if method == "auto" else method
            ortho = variants.aol_newton_schulz_(
                stack, resolve_schedule(coefficients, ns_steps)[0], eps=eps, method=aol_method,
                restart_every=restart or 2,
            )  # fmt: skip
        else:
            ortho = newton_schulz_fast(
                stack, ns_steps, coefficients, dtype, eps, out=stack, method=method,
                backend="auto", max_workspace_bytes=max_workspace_bytes,
            )  # fmt: skip
        for slot, i in enumerate(indices):
            o = ortho[slot]
            out[i] = o.mT if matrices[i].shape[0] > matrices[i].shape[1] else o
    return out  # type: ignore[return-value]


def update_chunks(
    params: Sequence[torch.Tensor],
    views: Sequence[MatrixView],
    *,
    ns_dtype: torch.dtype | None,
    max_chunk_bytes: int | None,
) -> list[list[int]]:
    """Indices of ``params`` in chunks whose transient bytes (the direction in the gradient's
    dtype + its Newton–Schulz copy) stay under ``max_chunk_bytes`` (a parameter bigger than
    that is a chunk alone; None: one chunk). Parameters with the same matrix shapes are
    adjacent, so each chunk still batches them."""
    order = sorted(range(len(params)), key=lambda i: (tuple(views[i].matrix_shapes), i))
    costs = []
    for i in order:
        p = params[i]
        dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(p.device)
        costs.append(p.numel() * (p.element_size() + torch.finfo(dtype).bits // 8))
    return [[order[j] for j in group] for group in group_by_budget(costs, max_chunk_bytes)]


def muon(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    views: Sequence[MatrixView],
    lr: float | torch.Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    coefficients: CoefficientSpec,
    ns_dtype: torch.dtype | None,
    scale: str,
    eps: float = DEFAULT_EPS,
    ns_method: NSMethodChoice = "auto",
    max_chunk_bytes: ChunkBytes = PER_DEVICE,
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
    options: variants.VariantOptions = variants.PLAIN_MUON,  # [variants]
    row_moments: Sequence[torch.Tensor] | None = None,  # [variants] NorMuon state, (rows,) each
) -> None:
    """One Muon step, in place on ``params`` and ``momentum_buffers``::

        B ← B.lerp(G, 1 − μ);  U = G.lerp(B, μ) (Nesterov) or B
        O = NS(U) per matrix of the view (batched over same-shape matrices)
        W ← W · (1 − lr · λ)                 # decoupled weight decay, unadjusted lr
        W ← W − lr · s(m, n) · O             # s: scale rule of each matrix

    Parameters are processed in chunks of at most ``max_chunk_bytes`` of transient memory
    (directions and their Newton–Schulz copies; a number of bytes,
    :data:`~muonscale.memory.PER_DEVICE` or :data:`~muonscale.memory.UNCHUNKED`), so the
    step's peak memory does not grow with the model; ``max_workspace_bytes`` bounds the
    Newton–Schulz scratch. Every parameter's update is independent of the others, so chunking
    does not change the result. ``lr`` may be a 0-dim tensor on the parameters' device (a
    capturable step: no host read of it).
    """
    if not params:
        return
    budget = chunk_bytes_for(max_chunk_bytes, params[0].device)
    chunks = update_chunks(params, views, ns_dtype=ns_dtype, max_chunk_bytes=budget)
    if len(chunks) > 1:
        for chunk in chunks:
            muon(
                [params[i] for i in chunk], [grads[i] for i in chunk],
                [momentum_buffers[i] for i in chunk], views=[views[i] for i in chunk], lr=lr,
                options=options,  # [variants]
                row_moments=None if row_moments is None else [row_moments[i] for i in chunk],
                weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype, scale=scale,
                eps=eps, ns_method=ns_method, max_chunk_bytes=None,
                max_workspace_bytes=max_workspace_bytes,
            )  # fmt: skip
        return
    directions = momentum_directions_(grads, momentum_buffers, momentum=momentum, nesterov=nesterov)
    matrices, owner = [], []
    for index, (direction, view) in enumerate(zip(directions, views)):
        for mat in view.to_matrices(direction):
            matrices.append(mat)
            owner.append(index)
    orthogonal = orthogonalize_matrices(
        matrices,
        ns_steps=ns_steps,
        coefficients=coefficients,
        ns_dtype=ns_dtype,
        eps=eps,
        method=ns_method,
        max_workspace_bytes=max_workspace_bytes,
        preconditioner=options.preconditioner,  # [variants]
    )
    if options.normalize == "row":  # [variants] NorMuon, per matrix, rows of each in turn
        variants.row_normalize_matrices_(orthogonal, owner, row_moments, beta2=options.row_beta2)
    per_param: list[list[torch.Tensor]] = [[] for _ in params]
    for index, mat in zip(owner, orthogonal):
        per_param[index].append(mat)
    for param, view, mats in zip(params, views, per_param):
        if len(mats) == 1 and view.row_partition is None:
            m, n = mats[0].shape
            update, alpha = view.from_matrices(mats), -lr * update_scale(scale, m, n)
        else:
            scaled = [mat * update_scale(scale, *mat.shape) for mat in mats]
            update, alpha = view.from_matrices(scaled), -lr
        if weight_decay != 0 and options.cautious_weight_decay:  # [variants]
            variants.cautious_weight_decay_(param, update, lr=lr, weight_decay=weight_decay)
        elif weight_decay != 0:
            param.mul_(1 - lr * weight_decay)
        _add_scaled_(param, update, alpha)


def _add_scaled_(param: torch.Tensor, update: torch.Tensor, alpha: float | torch.Tensor) -> None:
    """``param += alpha · update``; a tensor ``alpha`` stays on the device (``addcmul_`` rounds
    as ``add_(alpha=...)`` does: one multiply-add in the parameter's dtype)."""
    if isinstance(alpha, torch.Tensor):
        param.addcmul_(update, alpha.to(param.dtype))
    else:
        param.add_(update, alpha=alpha)


def adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_chunk_bytes: ChunkBytes = PER_DEVICE,
    finite: torch.Tensor | None = None,
) -> None:
    """One AdamW step (Loshchilov & Hutter), in place, the same arithmetic as
    ``torch.optim.AdamW``'s single-tensor path, run with foreach kernels::

        t ← t + 1;  W ← W · (1 − lr · λ)
        m ← m.lerp(G, 1 − β₁);  v ← β₂ v + (1 − β₂) G²
        W ← W − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)

    The denominators are computed ``max_chunk_bytes`` at a time (as in :func:`muon`), the
    same bits either way. A tensor ``lr`` (0-dim, on the device; step counters there too)
    makes the step capturable: bias corrections are computed on the device in float64, as the
    host path computes them in Python, and ``finite`` (a 0-dim bool) turns the step into a
    no-op where False (:func:`adamw_on_device`).
    """
    if not params:
        return
    if isinstance(lr, torch.Tensor):
        adamw_on_device(
            params, grads, exp_avgs, exp_avg_sqs, state_steps, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, max_chunk_bytes=max_chunk_bytes, finite=finite,
        )  # fmt: skip
        return
    if finite is not None:
        raise ValueError("adamw: finite= needs a tensor lr (the capturable path)")
    params, grads, exp_avgs, exp_avg_sqs = (
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
    )
    torch._foreach_add_(list(state_steps), 1)
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    steps = [float(s) for s in state_steps]
    step_sizes = [-(lr / (1 - beta1**t)) for t in steps]
    bias_correction2_sqrt = [math.sqrt(1 - beta2**t) for t in steps]
    # The denominators are the only temporaries: built for flat segments of at most
    # ``max_chunk_bytes`` at a time (elementwise, so the same bits as all at once).
    budget = chunk_bytes_for(max_chunk_bytes, params[0].device)
    tensors = list(zip(params, exp_avgs, exp_avg_sqs))
    nbytes = [p.numel() * p.element_size() for p in params]
    # a tuple that is not contiguous cannot be viewed flat: it is taken whole (itemsize 0)
    itemsizes = [
        p.element_size() if all(t.is_contiguous() for t in group) else 0
        for p, group in zip(params, tensors)
    ]
    for chunk in split_by_budget(nbytes, budget, itemsizes=itemsizes):
        seg_params, seg_avgs, seg_sqs, sizes, corrections = [], [], [], [], []
        for i, start, stop in chunk:
            for out, t in zip((seg_params, seg_avgs, seg_sqs), tensors[i]):
                out.append(t if start is None else t.view(-1)[start:stop])
            sizes.append(step_sizes[i])
            corrections.append(bias_correction2_sqrt[i])
        denoms = torch._foreach_sqrt(seg_sqs)
        torch._foreach_div_(denoms, corrections)
        torch._foreach_add_(denoms, eps)
        torch._foreach_addcdiv_(seg_params, seg_avgs, denoms, sizes)
        del denoms



def adamw_on_device(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    *,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_chunk_bytes: ChunkBytes = PER_DEVICE,
    finite: torch.Tensor | None = None,
) -> None:
    """:func:`adamw` with every step-dependent scalar a device tensor: no host read, so it can
    be captured in a CUDA graph. Same rounding as the host path on CPU (each scalar is made in
    float64 and rounded once to the parameter's dtype, as a Python scalar is).

    ``finite`` False: t, m, v and W keep their values (G is replaced by 0 and the scalars by
    identities: t += 0, m.lerp(0, 0), v · 1 + 0, W · 1 + 0 · …); its 0-dim bool never reaches
    the host."""
    params, grads, exp_avgs, exp_avg_sqs, state_steps = (
        list(t) for t in (params, grads, exp_avgs, exp_avg_sqs, state_steps)
    )
    lr = lr.to(torch.float64)
    if finite is None:
        torch._foreach_add_(state_steps, 1)
    else:
        grads = [torch.where(finite, g, 0) for g in grads]
        torch._foreach_add_(state_steps, finite.to(torch.float32))
    if weight_decay != 0:
        decay = 1 - lr * weight_decay
        if finite is not None:
            decay = torch.where(finite, decay, 1.0)
        torch._foreach_mul_(params, decay)
    if finite is None:
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
    else:
        weight = torch.where(finite, 1 - beta1, 0.0).to(torch.float32)
        for avg, grad in zip(exp_avgs, grads):
            avg.lerp_(grad, weight.to(avg.dtype))
        torch._foreach_mul_(exp_avg_sqs, torch.where(finite, beta2, 1.0))
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    # t ≥ 1 after a real step; a no-op first step leaves t = 0, clamped so nothing divides by 0
    steps = torch.stack([s.to(lr.device, torch.float64) for s in state_steps]).clamp_min(1)  # (P,)
    step_sizes = -(lr / (1 - torch.pow(beta1, steps)))
    if finite is not None:
        step_sizes = torch.where(finite, step_sizes, 0.0)
    bias_correction2_sqrt = torch.sqrt(1 - torch.pow(beta2, steps))
    budget = chunk_bytes_for(max_chunk_bytes, params[0].device)
    tensors = list(zip(params, exp_avgs, exp_avg_sqs))
    nbytes = [p.numel() * p.element_size() for p in params]
    itemsizes = [
        p.element_size() if all(t.is_contiguous() for t in group) else 0
        for p, group in zip(params, tensors)
    ]
    for chunk in split_by_budget(nbytes, budget, itemsizes=itemsizes):
        for i, start, stop in chunk:
            param, avg, avg_sq = (t if start is None else t.view(-1)[start:stop] for t in tensors[i])
            # (size · m) / (√v / c₂ + ε), each op rounded as addcdiv_'s (s·m)/d on the host path
            denom = avg_sq.sqrt().div_(bias_correction2_sqrt[i]).add_(eps)
            update = avg * step_sizes[i]
            param.add_(update.div_(denom))
            del denom, update
