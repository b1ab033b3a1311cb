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

from .kernels.newton_schulz_fast import (
    GRAM_POLICY,
    NSMethodChoice,
    choose_method,
    newton_schulz_fast,
    orthogonalize_stack_,
)
from .kernels.process_state import get_workspace, workspace_bytes
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


def update_momentum_(
    grads: Sequence[torch.Tensor], momentum_buffers: Sequence[torch.Tensor], *, momentum: float
) -> None:
    """B ← B + (1 − μ)(G − B) (``B.lerp_(G, 1 − μ)``, torch.optim.Muon's form), one foreach
    over every buffer (views into stacked momentum are fine)."""
    if not momentum_buffers:
        return
    grads = [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, momentum_buffers)]
    torch._foreach_lerp_(list(momentum_buffers), grads, 1 - momentum)


def write_directions_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor],
    *,
    momentum: float,
    nesterov: bool,
) -> None:
    """U = G + μ(B − G) with Nesterov (``G.lerp(B, μ)``), else U = B, written into ``out``
    (slots of a Newton–Schulz input stack: the cast to its dtype happens in the same pass)."""
    for grad, buf, dst in zip(grads, momentum_buffers, out):
        full = buf if buf.dtype == grad.dtype else buf.to(grad.dtype)
        if nesterov:
            torch.lerp(grad, full, momentum, out=dst)
        else:
            dst.copy_(full)


def momentum_directions_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    momentum: float,
    nesterov: bool,
) -> list[torch.Tensor]:
    """:func:`update_momentum_`, then return the directions U (new tensors, the gradient's
    dtype): for layouts whose matrices are assembled elsewhere (sharded parameters)."""
    update_momentum_(grads, momentum_buffers, momentum=momentum)
    directions = [torch.empty_like(g) for g in grads]
    write_directions_(grads, momentum_buffers, directions, momentum=momentum, nesterov=nesterov)
    return directions


def apply_updates_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    alphas: Sequence[float],
    *,
    lr: float,
    weight_decay: float,
) -> None:
    """W ← W · (1 − lr · λ) + lr · αᵢ · Oᵢ (decoupled weight decay with the unadjusted lr;
    αᵢ = −s(m, n) for an unscaled update, −1 for one scaled already). Foreach kernels, one
    per distinct α; the same arithmetic as ``W.mul_(1 − lr λ); W.add_(O, alpha=lr α)``."""
    if not params:
        return
    params = list(params)
    updates = [u if u.shape == p.shape else u.view(p.shape) for p, u in zip(params, updates)]
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    by_alpha: dict[float, list[int]] = defaultdict(list)
    for i, alpha in enumerate(alphas):
        by_alpha[alpha].append(i)
    for alpha, indices in by_alpha.items():
        torch._foreach_add_(
            [params[i] for i in indices], [updates[i] for i in indices], alpha=lr * alpha
        )


def ns_method_for(
    m: int, n: int, dtype: torch.dtype, method: NSMethodChoice, coefficients: CoefficientSpec,
    steps: int,
) -> str:  # fmt: skip
    """The formulation ``method`` means for an m×n matrix (``"auto"``: :func:`choose_method`)."""
    return choose_method(m, n, dtype, coefficients, steps)[0] if method == "auto" else method


def orthogonalize_matrices(
    matrices: Sequence[torch.Tensor],
    *,
    ns_steps: int,
    coefficients: CoefficientSpec,
    ns_dtype: torch.dtype | None,
    eps: float = DEFAULT_EPS,
    method: NSMethodChoice = "auto",
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
) -> list[torch.Tensor]:
    """Newton–Schulz of every matrix, batched: matrices with the same shape are stacked (in
    their own orientation: tall stacks are iterated as transposed views) and orthogonalized in
    one call of :func:`muonscale.kernels.newton_schulz_fast` (workspace reuse; Triton symmetric
    products on CUDA; ``method="auto"``: :func:`~muonscale.kernels.choose_method`;
    ``max_workspace_bytes`` bounds its scratch). For matrices assembled one by one (split
    views, owners of sharded matrices); :func:`muon` writes its stacks directly. Returns
    matrices in the input's shapes, in ``ns_dtype``."""
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, mat in enumerate(matrices):
        dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(mat.device)
        buckets[(tuple(mat.shape), mat.device, dtype)].append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for ((rows, cols), device, dtype), indices in buckets.items():
        stack = torch.empty((len(indices), rows, cols), dtype=dtype, device=device)
        torch._foreach_copy_(list(stack.unbind(0)), [matrices[i] for i in indices])
        method_here = ns_method_for(rows, cols, dtype, method, coefficients, ns_steps)
        ortho = newton_schulz_fast(
            stack, ns_steps, coefficients, dtype, eps, out=stack, method=method_here,
            backend="auto", max_workspace_bytes=max_workspace_bytes,
        )  # fmt: skip
        for slot, i in enumerate(indices):
            out[i] = ortho[slot]
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


def _single_matrix(view: MatrixView) -> bool:
    """Whether the view is one matrix that is a reshape of the parameter (stackable in place)."""
    return len(view.matrix_shapes) == 1 and view.row_partition is None


def muon(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    views: Sequence[MatrixView],
    lr: float,
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
) -> None:
    """One Muon step, in place on ``params`` and ``momentum_buffers``::

        B ← B.lerp(G, 1 − μ);  U = G.lerp(B, μ) (Nesterov) or B
        O = NS(U) per matrix of the view (batched over same-shape matrices)
        W ← W · (1 − lr · λ)                 # decoupled weight decay, unadjusted lr
        W ← W − lr · s(m, n) · O             # s: scale rule of each matrix

    Two elementwise passes over the parameters besides Newton–Schulz: (a) the momentum update
    and the directions, written straight into the Newton–Schulz input stacks (one per matrix
    shape and chunk, in the parameter's orientation, cast on the way); the normalization is
    folded into the first Newton–Schulz step; (b) weight decay and update
    (:func:`apply_updates_`) from the stack the iteration ends in. Parameters are processed in
    chunks of at most ``max_chunk_bytes`` of transient memory (a number of bytes,
    :data:`~muonscale.memory.PER_DEVICE` or :data:`~muonscale.memory.UNCHUNKED`), so the
    step's peak memory does not grow with the model; ``max_workspace_bytes`` bounds the
    Newton–Schulz scratch. Every parameter's update is independent of the others, so chunking
    does not change the result.
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
                weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype, scale=scale,
                eps=eps, ns_method=ns_method, max_chunk_bytes=None,
                max_workspace_bytes=max_workspace_bytes,
            )  # fmt: skip
        return
    update_momentum_(grads, momentum_buffers, momentum=momentum)
    schedule, margin = resolve_schedule(coefficients, ns_steps)
    direction = dict(momentum=momentum, nesterov=nesterov)
    stacks: dict[tuple, list[int]] = defaultdict(list)
    split: list[int] = []
    for i, (p, view) in enumerate(zip(params, views)):
        if _single_matrix(view):
            dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(p.device)
            stacks[(view.matrix_shapes[0], p.device, dtype)].append(i)
        else:
            split.append(i)
    for ((rows, cols), device, dtype), indices in stacks.items():
        method = ns_method_for(rows, cols, dtype, ns_method, coefficients, ns_steps)
        alpha = -update_scale(scale, rows, cols)
        per_matrix = workspace_bytes(1, rows, cols, torch.finfo(dtype).bits // 8, method)
        for part in group_by_budget([per_matrix] * len(indices), max_workspace_bytes):
            members = [indices[j] for j in part]
            ws = get_workspace(
                (len(members), rows, cols), dtype, device, method,
                max_cached_bytes=max_workspace_bytes,
            )  # fmt: skip
            X = ws.get("x", (len(members), rows, cols))
            slots = [X[j].view(params[i].shape) for j, i in enumerate(members)]
            g_part = [grads[i] for i in members]
            b_part = [momentum_buffers[i] for i in members]

            def write(g_part=g_part, b_part=b_part, slots=slots) -> None:
                write_directions_(g_part, b_part, slots, **direction)

            write()
            result = orthogonalize_stack_(
                X, schedule, margin, eps, method=method, backend="auto",
                restart_every=GRAM_POLICY["restart_every"], workspace=ws, reload=write,
            )  # fmt: skip
            apply_updates_(
                [params[i] for i in members], list(result.unbind(0)), [alpha] * len(members),
                lr=lr, weight_decay=weight_decay,
            )  # fmt: skip
    if split:
        matrices, owner = [], []
        for i in split:
            u = torch.empty_like(grads[i])
            write_directions_([grads[i]], [momentum_buffers[i]], [u], **direction)
            for mat in views[i].to_matrices(u):
                matrices.append(mat)
                owner.append(i)
        orthogonal = orthogonalize_matrices(
            matrices, ns_steps=ns_steps, coefficients=coefficients, ns_dtype=ns_dtype, eps=eps,
            method=ns_method, max_workspace_bytes=max_workspace_bytes,
        )  # fmt: skip
        per_param: dict[int, list[torch.Tensor]] = defaultdict(list)
        for i, mat in zip(owner, orthogonal):
            per_param[i].append(mat * update_scale(scale, *mat.shape))
        apply_updates_(
            [params[i] for i in split], [views[i].from_matrices(per_param[i]) for i in split],
            [-1.0] * len(split), lr=lr, weight_decay=weight_decay,
        )  # fmt: skip


def adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    state_steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    max_chunk_bytes: ChunkBytes = PER_DEVICE,
) -> None:
    """One AdamW step (Loshchilov & Hutter), in place, the same arithmetic as
    ``torch.optim.AdamW``'s single-tensor path, run with foreach kernels::

        t ← t + 1;  W ← W · (1 − lr · λ)
        m ← m.lerp(G, 1 − β₁);  v ← β₂ v + (1 − β₂) G²
        W ← W − lr / (1 − β₁ᵗ) · m / (√v / √(1 − β₂ᵗ) + ε)

    The denominators are computed ``max_chunk_bytes`` at a time (as in :func:`muon`), the
    same bits either way.
    """
    if not params:
        return
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

