"""AdamW's update on lists of plain local tensors (the same arithmetic as ``torch.optim.AdamW``'s
single-tensor path, with foreach kernels): what every optimizer here runs for embeddings, head,
norms and biases. Nothing here knows about param groups or ``torch.distributed``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .memory import PER_DEVICE, ChunkBytes, chunk_bytes_for, split_by_budget


def eps_underflows(eps: float, dtype: torch.dtype) -> bool:
    """Whether AdamW's ε rounds to 0 in ``dtype`` (1e-8 in float16), so that a zero second
    moment gives 0/0."""
    info = torch.finfo(dtype)
    return 0 < eps <= info.smallest_normal * info.eps / 2  # half the smallest subnormal


def wide_denominator_update_(
    param: torch.Tensor,
    avg: torch.Tensor,
    avg_sq: torch.Tensor,
    step_size: float | torch.Tensor,
    correction: float | torch.Tensor,
    eps: float,
) -> None:
    """W ← W + s · m / (√v / c₂ + ε) with the quotient in float32, for a ``param`` dtype in
    which ε underflows (:func:`eps_underflows`); rounded once to the parameter's dtype."""
    denom = avg_sq.float().sqrt_().div_(correction).add_(eps)
    param.add_(avg.float().mul_(step_size).div_(denom))


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
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            state_steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            max_chunk_bytes=max_chunk_bytes,
            finite=finite,
        )
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
    wide = {i for i, p in enumerate(params) if eps_underflows(eps, p.dtype)}
    for chunk in split_by_budget(nbytes, budget, itemsizes=itemsizes):
        seg_params, seg_avgs, seg_sqs, sizes, corrections = [], [], [], [], []
        for i, start, stop in chunk:
            if i in wide:
                segment = [t if start is None else t.view(-1)[start:stop] for t in tensors[i]]
                wide_denominator_update_(*segment, step_sizes[i], bias_correction2_sqrt[i], eps)
                continue
            for out, t in zip((seg_params, seg_avgs, seg_sqs), tensors[i]):
                out.append(t if start is None else t.view(-1)[start:stop])
            sizes.append(step_sizes[i])
            corrections.append(bias_correction2_sqrt[i])
        if not seg_sqs:
            continue
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
        # alpha= binds the .Tensor overload: .Scalar would read the 0-dim tensor on the host
        torch._foreach_add_(state_steps, finite.to(torch.float32), alpha=1)
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
            param, avg, avg_sq = (
                t if start is None else t.view(-1)[start:stop] for t in tensors[i]
            )
            if eps_underflows(eps, param.dtype):
                wide_denominator_update_(
                    param, avg, avg_sq, step_sizes[i], bias_correction2_sqrt[i], eps
                )
                continue
            # (size · m) / (√v / c₂ + ε), each op rounded as addcdiv_'s (s·m)/d on the host path
            denom = avg_sq.sqrt().div_(bias_correction2_sqrt[i]).add_(eps)
            update = avg * step_sizes[i]
            param.add_(update.div_(denom))
            del denom, update
