"""The update math of Muon and AdamW on lists of plain local tensors.

Nothing here knows about param groups, optimizer state or ``torch.distributed``: the optimizer
classes (single-process and distributed) gather the right tensors and call these functions, so
every layout runs exactly the same arithmetic.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence

import torch

from . import variants  # [variants]
from .kernels.newton_schulz_fast import (
    GRAM_POLICY,
    NSMethodChoice,
    choose_method,
    newton_schulz_fast,
    orthogonalize_stack_,
)
from .kernels.process_state import (
    DEFAULT_ELEMENTWISE_BACKEND,
    ElementwiseBackend,
    NSWorkspace,
    disable_triton_elementwise,
    elementwise_kernels,
    get_workspace,
    workspace_bytes,
)
from .matrices import MatrixView
from .memory import (
    DEFAULT_NS_WORKSPACE_BYTES,
    PER_DEVICE,
    ChunkBytes,
    chunk_bytes_for,
    group_by_budget,
    split_by_budget,
)
from .newton_schulz import CoefficientSpec, default_ns_dtype, resolve_schedule
from .scaling import matrix_update_scales, update_scale
from .settings import PLAIN_MUON, MuonSettings, NewtonSchulzSettings


def update_momentum_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    *,
    momentum: float,
    out: Sequence[torch.Tensor] | None = None,
) -> None:
    """B ← B + (1 − μ)(G − B) (``B.lerp_(G, 1 − μ)``, torch.optim.Muon's form), one foreach
    over every buffer (views into stacked momentum are fine). With ``out``, the new momentum
    is written there (the same lerp, out of place) and ``momentum_buffers`` keep their values."""
    if not momentum_buffers:
        return
    grads = [g if g.dtype == b.dtype else g.to(b.dtype) for g, b in zip(grads, momentum_buffers)]
    if out is None:
        torch._foreach_lerp_(list(momentum_buffers), grads, 1 - momentum)
        return
    for buf, grad, dst in zip(momentum_buffers, grads, out):
        torch.lerp(buf, grad, 1 - momentum, out=dst)


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


ApplyUpdates = Callable[..., None]
"""A function with :func:`apply_updates_`'s arguments (params, updates, alphas, lr=,
weight_decay=, cautious=)."""


def apply_updates_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    alphas: Sequence[float],
    *,
    lr: float | torch.Tensor,
    weight_decay: float,
    cautious: bool = False,  # [variants]
) -> None:
    """W ← W · (1 − lr · λ) + lr · αᵢ · Oᵢ (decoupled weight decay with the unadjusted lr;
    αᵢ = −s(m, n) for an unscaled update, −1 for one scaled already). Foreach kernels, one
    per distinct α; the same arithmetic as ``W.mul_(1 − lr λ); W.add_(O, alpha=lr α)``. A
    tensor ``lr`` (capturable step) stays on the device. ``cautious``: the decay only where
    the update and the weight agree in sign (:func:`~muonscale.variants.cautious_weight_decay_`,
    per tensor)."""
    if not params:
        return
    params = list(params)
    updates = [u if u.shape == p.shape else u.view(p.shape) for p, u in zip(params, updates)]
    if weight_decay != 0 and cautious:  # [variants]
        for param, update in zip(params, updates):
            variants.cautious_weight_decay_(param, update, lr=lr, weight_decay=weight_decay)
    elif weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    by_alpha: dict[float, list[int]] = defaultdict(list)
    for i, alpha in enumerate(alphas):
        by_alpha[alpha].append(i)
    for alpha, indices in by_alpha.items():
        if isinstance(lr, torch.Tensor):
            for i in indices:
                _add_scaled_(params[i], updates[i], lr * alpha)
        else:
            torch._foreach_add_(
                [params[i] for i in indices], [updates[i] for i in indices], alpha=lr * alpha
            )


def ns_method_for(
    m: int,
    n: int,
    dtype: torch.dtype,
    method: NSMethodChoice,
    coefficients: CoefficientSpec,
    steps: int,
) -> str:
    """The formulation ``method`` means for an m×n matrix (``"auto"``: :func:`choose_method`)."""
    return choose_method(m, n, dtype, coefficients, steps)[0] if method == "auto" else method


def orthogonalize_matrices(
    matrices: Sequence[torch.Tensor],
    ns: NewtonSchulzSettings,
    *,
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
) -> list[torch.Tensor]:
    """Newton–Schulz of every matrix, batched: matrices with the same shape are stacked (in
    their own orientation: tall stacks are iterated as transposed views) and orthogonalized in
    one call of :func:`muonscale.kernels.newton_schulz_fast` (workspace reuse; Triton symmetric
    products on CUDA; ``method="auto"``: :func:`~muonscale.kernels.choose_method`;
    ``max_workspace_bytes`` bounds its scratch). For matrices assembled one by one (split
    views, owners of sharded matrices); :func:`muon` writes its stacks directly. Returns
    matrices in the input's shapes, in ``ns.dtype``."""
    ns_steps, coefficients, ns_dtype, eps = ns.steps, ns.coefficients, ns.dtype, ns.eps
    method, preconditioner = ns.method, ns.preconditioner
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, mat in enumerate(matrices):
        dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(mat.device)
        buckets[(tuple(mat.shape), mat.device, dtype)].append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for ((rows, cols), device, dtype), indices in buckets.items():
        stack = torch.empty((len(indices), rows, cols), dtype=dtype, device=device)
        torch._foreach_copy_(list(stack.unbind(0)), [matrices[i] for i in indices])
        short, long = min(rows, cols), max(rows, cols)
        method_here = ns_method_for(short, long, dtype, method, coefficients, ns_steps)
        ortho = newton_schulz_fast(
            stack,
            ns_steps,
            coefficients,
            dtype,
            eps,
            out=stack,
            method=method_here,
            backend="auto",
            max_workspace_bytes=max_workspace_bytes,
            preconditioner=preconditioner,  # [variants] "aol": Turbo-Muon's first step
        )
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
    """Whether the view is one matrix that is a reshape of the parameter (stackable in place;
    a transposed view is not)."""
    return len(view.matrix_shapes) == 1 and view.row_partition is None and not view.transposed


def stack_key(
    param: torch.Tensor,
    view: MatrixView,
    ns: NewtonSchulzSettings,
    options: MuonSettings = PLAIN_MUON,
) -> tuple | None:
    """(matrix shape, device, Newton–Schulz dtype) of the stack :func:`muon` puts ``param`` in,
    or None when it takes the per-matrix path (split or transposed views, variants)."""
    if not _plain_variant(options, ns) or not _single_matrix(view):
        return None
    return _plain_stack_key(param, view, ns)


def update_rule(
    param: torch.Tensor,
    view: MatrixView,
    ns: NewtonSchulzSettings,
    options: MuonSettings = PLAIN_MUON,
    scale: str = PLAIN_MUON.scale,
) -> tuple[float, bool]:
    """(α, cautious) with which :func:`muon` applies ``param``'s update O through
    :func:`apply_updates_`: α = −s(m, n) and no cautious decay on the stacked path, α = −1
    (scaled per matrix already) and the group's cautious decay on the per-matrix path."""
    key = stack_key(param, view, ns, options)
    if key is None:
        return -1.0, options.cautious_weight_decay
    (rows, cols), _, _ = key
    return -update_scale(scale, rows, cols), False


def _plain_variant(options: MuonSettings, ns: NewtonSchulzSettings) -> bool:
    return options.variant == _PLAIN_VARIANT and ns.preconditioner == "frobenius"


_PLAIN_VARIANT = PLAIN_MUON.variant


def _plain_stack_key(param: torch.Tensor, view: MatrixView, ns: NewtonSchulzSettings) -> tuple:
    dtype = ns.dtype if ns.dtype is not None else default_ns_dtype(param.device)
    return (view.matrix_shapes[0], param.device, dtype)


def orthogonalize_directions_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    workspace: NSWorkspace,
    *,
    momentum: float,
    nesterov: bool,
    schedule: Sequence[tuple[float, float, float]],
    margin: float,
    eps: float,
    method: str,
    input_written: bool = False,
) -> torch.Tensor:
    """The directions of ``grads`` (their momentum already updated) written into the
    workspace's iterate (one (rows, cols) slot each, cast on the way; ``input_written``: a
    kernel already wrote them), then Newton–Schulz of that stack; returns the tensor holding
    the (k, rows, cols) result (in the workspace)."""
    k, rows, cols = workspace.shape
    X = workspace.get("x", (k, rows, cols))
    slots = [X[j].view(g.shape) for j, g in enumerate(grads)]

    def write() -> None:
        write_directions_(grads, momentum_buffers, slots, momentum=momentum, nesterov=nesterov)

    if not input_written:
        write()
    return orthogonalize_stack_(
        X,
        schedule,
        margin,
        eps,
        method=method,
        backend="auto",
        restart_every=GRAM_POLICY["restart_every"],
        workspace=workspace,
        reload=write,
    )


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
    scale: str,
    ns: NewtonSchulzSettings = PLAIN_MUON.ns,
    max_chunk_bytes: ChunkBytes = PER_DEVICE,
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
    elementwise_backend: ElementwiseBackend = DEFAULT_ELEMENTWISE_BACKEND,
    options: MuonSettings = PLAIN_MUON,  # [variants] its normalize, row_beta2, cautious decay
    row_moments: Sequence[torch.Tensor] | None = None,  # [variants] NorMuon state, (rows,) each
    qk_lr_scale: float = 1.0,
    apply_updates: ApplyUpdates | None = None,
) -> None:
    """One Muon step, in place on ``params`` and ``momentum_buffers``::

        B ← B.lerp(G, 1 − μ);  U = G.lerp(B, μ) (Nesterov) or B
        O = NS(U) per matrix of the view (batched over same-shape matrices)
        W ← W · (1 − lr · λ)                 # decoupled weight decay, unadjusted lr
        W ← W − lr · s(m, n) · O             # s: scale rule of each matrix (× qk_lr_scale
                                             # for the Q and K blocks of a split QKV weight)

    Two elementwise passes over the parameters besides Newton–Schulz: (a) the momentum update
    and the directions, written straight into the Newton–Schulz input stacks (one per matrix
    shape and chunk, in the parameter's orientation, cast on the way); the normalization is
    folded into the first Newton–Schulz step; (b) weight decay and update
    (:func:`apply_updates_`) from the stack the iteration ends in. ``elementwise_backend``
    (:data:`~muonscale.kernels.ElementwiseBackend`) says whether each pass is one Triton kernel
    per stack instead (:func:`~muonscale.kernels.elementwise_kernels`; the same formulas; a
    tensor ``lr`` and the variants keep the foreach passes); the optimizers pass the value
    they read from ``MUONSCALE_ELEMENTWISE`` when they were built, and this function never
    reads the environment. Parameters
    are processed in chunks of at most ``max_chunk_bytes`` of transient memory (a number of bytes,
    :data:`~muonscale.memory.PER_DEVICE` or :data:`~muonscale.memory.UNCHUNKED`), so the
    step's peak memory does not grow with the model; ``max_workspace_bytes`` bounds the
    Newton–Schulz scratch. Every parameter's update is independent of the others, so chunking
    does not change the result. ``lr`` may be a 0-dim tensor on the parameters' device (a
    capturable step: no host read of it). ``ns``: the Newton–Schulz settings (with the
    preconditioner); ``options``: the group's settings, of which the variants are read.
    ``apply_updates``: called instead of :func:`apply_updates_` (same arguments; the Triton
    apply pass then does not run), for a caller that also sends the updates elsewhere.
    """
    if not params:
        return
    ns_steps, coefficients, ns_dtype, eps, ns_method = (
        ns.steps,
        ns.coefficients,
        ns.dtype,
        ns.eps,
        ns.method,
    )
    budget = chunk_bytes_for(max_chunk_bytes, params[0].device)
    chunks = update_chunks(params, views, ns_dtype=ns_dtype, max_chunk_bytes=budget)
    if len(chunks) > 1:
        for chunk in chunks:
            muon(
                [params[i] for i in chunk],
                [grads[i] for i in chunk],
                [momentum_buffers[i] for i in chunk],
                views=[views[i] for i in chunk],
                lr=lr,
                options=options,  # [variants]
                row_moments=None if row_moments is None else [row_moments[i] for i in chunk],
                qk_lr_scale=qk_lr_scale,
                weight_decay=weight_decay,
                momentum=momentum,
                nesterov=nesterov,
                ns=ns,
                scale=scale,
                max_chunk_bytes=None,
                max_workspace_bytes=max_workspace_bytes,
                elementwise_backend=elementwise_backend,
                apply_updates=apply_updates,
            )
        return
    schedule, margin = resolve_schedule(coefficients, ns_steps)
    direction = dict(momentum=momentum, nesterov=nesterov)
    stacks: dict[tuple, list[int]] = defaultdict(list)
    split: list[int] = []
    plain = _plain_variant(options, ns)  # variants take the per-matrix path below
    for i, (p, view) in enumerate(zip(params, views)):
        key = _plain_stack_key(p, view, ns) if plain and _single_matrix(view) else None
        if key is not None:
            stacks[key].append(i)
        else:
            split.append(i)
    # Stacks whose two passes run as Triton kernels (one launch each per stack); the rest,
    # and every layout the kernels do not take, use the foreach passes.
    kernels = (
        None
        if isinstance(lr, torch.Tensor)
        else elementwise_kernels(params[0].device, elementwise_backend)
    )
    fused = set()
    if kernels is not None:
        for key, indices in stacks.items():
            if _kernels_take(kernels, [params, grads, momentum_buffers], indices):
                fused.add(key)
    rest = [i for key, indices in stacks.items() if key not in fused for i in indices] + split
    update_momentum_(
        [grads[i] for i in rest], [momentum_buffers[i] for i in rest], momentum=momentum
    )
    for key, indices in stacks.items():
        (rows, cols), device, dtype = key
        method = ns_method_for(rows, cols, dtype, ns_method, coefficients, ns_steps)
        alpha = -update_scale(scale, rows, cols)
        per_matrix = workspace_bytes(1, rows, cols, torch.finfo(dtype).bits // 8, method)
        for part in group_by_budget([per_matrix] * len(indices), max_workspace_bytes):
            members = [indices[j] for j in part]
            ws = get_workspace(
                (len(members), rows, cols),
                dtype,
                device,
                method,
                max_cached_bytes=max_workspace_bytes,
            )
            g_part = [grads[i] for i in members]
            b_part = [momentum_buffers[i] for i in members]
            written = False
            if key in fused and kernels is not None:
                X = ws.get("x", (len(members), rows, cols))
                try:
                    kernels.momentum_and_ns_input_(g_part, b_part, X, **direction)
                    written = True
                except Exception as exc:  # fails to compile: before anything is written
                    disable_triton_elementwise(exc, elementwise_backend)
                    kernels = None
            if key in fused and not written:  # the kernels failed on this or a former part
                update_momentum_(g_part, b_part, momentum=momentum)
            result = orthogonalize_directions_(
                g_part,
                b_part,
                ws,
                schedule=schedule,
                margin=margin,
                eps=eps,
                input_written=written,
                method=method,
                **direction,
            )
            p_part = [params[i] for i in members]
            if key in fused and kernels is not None and apply_updates is None:
                try:
                    kernels.apply_update_(
                        p_part, result, lr=lr, weight_decay=weight_decay, alpha=alpha
                    )
                    continue
                except Exception as exc:  # fails to compile: before anything is written
                    disable_triton_elementwise(exc, elementwise_backend)
                    kernels = None
            (apply_updates or apply_updates_)(
                p_part,
                list(result.unbind(0)),
                [alpha] * len(members),
                lr=lr,
                weight_decay=weight_decay,
            )
    if split:
        matrices, owner = [], []
        for i in split:
            u = torch.empty_like(grads[i])
            write_directions_([grads[i]], [momentum_buffers[i]], [u], **direction)
            for mat in views[i].to_matrices(u):
                matrices.append(mat)
                owner.append(i)
        orthogonal = orthogonalize_matrices(matrices, ns, max_workspace_bytes=max_workspace_bytes)
        if options.normalize == "row":  # [variants] NorMuon, per matrix, rows of each in turn
            variants.row_normalize_matrices_(
                orthogonal, owner, row_moments, beta2=options.row_beta2
            )
        per_param: dict[int, list[torch.Tensor]] = defaultdict(list)
        scales = {i: matrix_update_scales(scale, views[i], qk_lr_scale) for i in split}
        for i, mat in zip(owner, orthogonal):
            per_param[i].append(mat * scales[i][len(per_param[i])])
        for i in split:  # one at a time: a single split update alive at once
            (apply_updates or apply_updates_)(
                [params[i]],
                [views[i].from_matrices(per_param[i])],
                [-1.0],  # scaled above, per matrix
                lr=lr,
                weight_decay=weight_decay,
                cautious=options.cautious_weight_decay,  # [variants]
            )


def _kernels_take(kernels, tensor_lists: Sequence[Sequence[torch.Tensor]], indices) -> bool:
    """Whether the Triton elementwise kernels take a stack: every member's tensors
    contiguous, and one dtype per list (parameters, gradients, momentum buffers)."""
    for tensors in tensor_lists:
        members = [tensors[i] for i in indices]
        if not kernels.supports(members) or len({t.dtype for t in members}) != 1:
            return False
    return True


def _add_scaled_(param: torch.Tensor, update: torch.Tensor, alpha: float | torch.Tensor) -> None:
    """``param += alpha · update``; a tensor ``alpha`` stays on the device (``addcmul_`` rounds
    as ``add_(alpha=...)`` does: one multiply-add in the parameter's dtype)."""
    if isinstance(alpha, torch.Tensor):
        param.addcmul_(update, alpha.to(param.dtype))
    else:
        param.add_(update, alpha=alpha)


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
