"""The update math of Muon on lists of plain local tensors (AdamW's is in
:mod:`muonscale.adamw_update`, re-exported here).

Nothing here knows about param groups, optimizer state or ``torch.distributed``: the optimizer
classes (single-process and distributed) gather the right tensors and call these functions, so
every layout runs exactly the same arithmetic.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from .adamw_update import adamw as adamw
from .adamw_update import adamw_on_device as adamw_on_device
from .kernels.newton_schulz_fast import GRAM_POLICY, orthogonalize_stack_
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
from .matrix_step import (
    ApplyRule,
    ApplyUpdates,
    RowStates,
    apply_updates_by_rule_,
    ns_method_for,
    parameter_updates,
    stack_key,
)
from .memory import (
    DEFAULT_NS_WORKSPACE_BYTES,
    PER_DEVICE,
    ChunkBytes,
    chunk_bytes_for,
    group_by_budget,
)
from .newton_schulz import default_ns_dtype, resolve_schedule
from .quantized_state import QuantizedMomentum
from .scaling import update_scale
from .settings import PLAIN_MUON, MuonSettings


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


def update_chunks(
    params: Sequence[torch.Tensor],
    views: Sequence[MatrixView],
    *,
    ns_dtype: torch.dtype | None,
    max_chunk_bytes: int | None,
    momentum_values: bool = False,
) -> list[list[int]]:
    """Indices of ``params`` in chunks whose transient bytes (the direction in the gradient's
    dtype + its Newton–Schulz copy) stay under ``max_chunk_bytes`` (a parameter bigger than
    that is a chunk alone; None: one chunk, in the given order). Parameters with the same
    matrix shapes are adjacent, so each chunk still batches them."""
    order = sorted(range(len(params)), key=lambda i: (tuple(views[i].matrix_shapes), i))
    costs = []
    for i in order:
        p = params[i]
        dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(p.device)
        itemsizes = p.element_size() + torch.finfo(dtype).bits // 8 + 4 * momentum_values
        costs.append(p.numel() * itemsizes)
    chunks = group_by_budget(costs, max_chunk_bytes)
    if len(chunks) == 1:
        return [list(range(len(params)))]
    return [[order[j] for j in chunk] for chunk in chunks]


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
    workspace's iterate (one (rows, cols) slot per matrix, cast on the way; ``input_written``: a
    kernel already wrote them), then Newton–Schulz of that stack; returns the tensor holding
    the (k, rows, cols) result (in the workspace)."""
    k, rows, cols = workspace.shape
    X = workspace.get("x", (k, rows, cols))
    slots, start = [], 0
    for g in grads:  # one slot per matrix: an expert stack's E matrices are consecutive
        count = g.numel() // (rows * cols)
        slot = X[start] if count == 1 else X[start : start + count]
        slots.append(slot.view(g.shape))
        start += count

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
    settings: MuonSettings = PLAIN_MUON,
    max_chunk_bytes: ChunkBytes = PER_DEVICE,
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
    elementwise_backend: ElementwiseBackend = DEFAULT_ELEMENTWISE_BACKEND,
    row_state: Sequence[RowStates] | None = None,
    apply_updates: ApplyUpdates | None = None,
) -> None:
    """One Muon step, in place on ``params`` and ``momentum_buffers``::

        B ← B.lerp(G, 1 − μ);  U = G.lerp(B, μ) (Nesterov) or B
        O = NS(U) per matrix of the view (batched over same-shape matrices)
        W ← W · (1 − lr · λ)                 # decoupled weight decay, unadjusted lr
        W ← W − lr · s(m, n) · O             # s: scale rule of each matrix (× the Q/K factor
                                             # for the Q and K blocks of a split QKV weight)

    Plain Muon of single matrices and of expert stacks (one slot per expert) takes the
    stacked fast path (:func:`stacked_muon_`: two
    elementwise passes besides Newton–Schulz, the directions written straight into the
    Newton–Schulz input stacks); every other parameter (split or transposed views, the
    variants of ``settings``, with each parameter's replicated ``row_state`` by declaration,
    :func:`~muonscale.declared_state.replicated_state`) takes the matrix step
    (:func:`muonscale.matrix_step.parameter_updates`). ``elementwise_backend``
    (:data:`~muonscale.kernels.ElementwiseBackend`) says whether the fast path's passes are
    Triton kernels (the optimizers pass the value they read from ``MUONSCALE_ELEMENTWISE``
    when they were built; this function never reads the environment). Parameters are
    processed in chunks of at most ``max_chunk_bytes`` of transient memory (a number of
    bytes, :data:`~muonscale.memory.PER_DEVICE` or :data:`~muonscale.memory.UNCHUNKED`);
    every parameter's update is independent of the others, so chunking does not change the
    result. ``max_workspace_bytes`` bounds the Newton–Schulz scratch. ``lr`` may be a 0-dim
    tensor on the parameters' device (a capturable step: no host read of it); ``settings``:
    the group's other options (momentum, Newton–Schulz, scale rule, variants), whose ``lr``
    and ``weight_decay`` the two arguments of this step replace.
    ``apply_updates``: called instead of :func:`~muonscale.matrix_step.apply_updates_by_rule_`
    (same arguments; the Triton apply pass then does not run), for a caller that also sends
    the updates elsewhere. A momentum buffer may be a
    :class:`~muonscale.quantized_state.QuantizedMomentum` (``state_precision="int8"``): it is
    read as float32 in its chunk, and its new value is written back once, after the update.
    """
    if not params:
        return
    ns = settings.ns
    budget = chunk_bytes_for(max_chunk_bytes, params[0].device)
    apply = apply_updates or apply_updates_by_rule_
    stored = momentum_buffers
    quantized = any(isinstance(b, QuantizedMomentum) for b in stored)
    chunks = update_chunks(
        params, views, ns_dtype=ns.dtype, max_chunk_bytes=budget, momentum_values=quantized
    )
    for chunk in chunks:
        # quantized momentum: read as float32 for this chunk, written back once at its end
        momentum_buffers = _chunk_momentum(stored, chunk) if quantized else stored
        _muon_chunk(
            params,
            grads,
            momentum_buffers,
            chunk,
            views=views,
            lr=lr,
            weight_decay=weight_decay,
            settings=settings,
            max_workspace_bytes=max_workspace_bytes,
            elementwise_backend=elementwise_backend,
            row_state=row_state,
            apply_updates=apply_updates,
            apply=apply,
        )
        if quantized:
            for i in chunk:
                if isinstance(stored[i], QuantizedMomentum):
                    stored[i].store_(momentum_buffers[i])


def _chunk_momentum(
    stored: Sequence[torch.Tensor | QuantizedMomentum], chunk: Sequence[int]
) -> list[torch.Tensor | QuantizedMomentum]:
    """``stored`` with the quantized momentum of ``chunk``'s parameters read as float32."""
    out = list(stored)
    for i in chunk:
        if isinstance(out[i], QuantizedMomentum):
            out[i] = out[i].values()
    return out


def _muon_chunk(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    chunk: Sequence[int],
    *,
    views: Sequence[MatrixView],
    lr: float | torch.Tensor,
    weight_decay: float,
    settings: MuonSettings,
    max_workspace_bytes: int,
    elementwise_backend: ElementwiseBackend,
    row_state: Sequence[RowStates] | None,
    apply_updates: ApplyUpdates | None,
    apply: ApplyUpdates,
) -> None:
    """:func:`muon` on the parameters of one ``chunk`` (indices)."""
    ns = settings.ns
    momentum, nesterov = settings.momentum, settings.nesterov
    stacks: dict[tuple, list[int]] = defaultdict(list)
    others: list[int] = []
    for i in chunk:
        key = stack_key(params[i], views[i], ns, settings)
        if key is not None:
            stacks[key].append(i)
        else:
            others.append(i)
    if stacks:
        stacked_muon_(
            params,
            grads,
            momentum_buffers,
            stacks,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            settings=settings,
            max_workspace_bytes=max_workspace_bytes,
            elementwise_backend=elementwise_backend,
            apply_updates=apply_updates,
        )
    if not others:
        return
    g_part = [grads[i] for i in others]
    b_part = [momentum_buffers[i] for i in others]
    directions = momentum_directions_(g_part, b_part, momentum=momentum, nesterov=nesterov)
    updates, rules, _ = parameter_updates(
        directions,
        [views[i] for i in others],
        [settings] * len(others),
        None if row_state is None else [row_state[i] for i in others],
        max_workspace_bytes=max_workspace_bytes,
    )
    del directions
    for i, update, rule in zip(others, updates, rules):
        apply([params[i]], [update], [rule], lr=lr, weight_decay=weight_decay)


def stacked_muon_(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    stacks: dict[tuple, list[int]],
    *,
    lr: float | torch.Tensor,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    settings: MuonSettings,
    max_workspace_bytes: int,
    elementwise_backend: ElementwiseBackend,
    apply_updates: ApplyUpdates | None,
) -> None:
    """Plain Muon of single matrices, per stack (``stacks``: (shape, device, dtype) → indices,
    :func:`muonscale.matrix_step.stack_key`): (a) the momentum update and the directions,
    written straight into the Newton–Schulz input stack (cast on the way; the normalization
    is folded into the first Newton–Schulz step); (b) weight decay and update
    (:func:`~muonscale.matrix_step.apply_updates_` with α = −s(m, n)) from the stack the
    iteration ends in. Each pass is one Triton kernel per stack where the kernels take it (the
    same formulas)."""
    ns = settings.ns
    schedule, margin = resolve_schedule(ns.coefficients, ns.steps)
    direction = dict(momentum=momentum, nesterov=nesterov)
    kernels = (
        None
        if isinstance(lr, torch.Tensor)
        else elementwise_kernels(params[0].device, elementwise_backend)
    )
    fused = set()
    if kernels is not None:
        for key, indices in stacks.items():
            (rows, cols), _, _ = key
            one_each = all(params[i].numel() == rows * cols for i in indices)  # kernels: a slot
            if one_each and _kernels_take(kernels, [params, grads, momentum_buffers], indices):
                fused.add(key)
    rest = [i for key, indices in stacks.items() if key not in fused for i in indices]
    update_momentum_(
        [grads[i] for i in rest], [momentum_buffers[i] for i in rest], momentum=momentum
    )
    for key, indices in stacks.items():
        (rows, cols), device, dtype = key
        method = ns_method_for(rows, cols, dtype, ns.method, ns.coefficients, ns.steps)
        alpha = -update_scale(settings.scale, rows, cols)
        per_matrix = workspace_bytes(1, rows, cols, torch.finfo(dtype).bits // 8, method)
        counts = {i: params[i].numel() // (rows * cols) for i in indices}  # matrices of each
        costs = [per_matrix * counts[i] for i in indices]
        for part in group_by_budget(costs, max_workspace_bytes):
            members = [indices[j] for j in part]
            ws = get_workspace(
                (sum(counts[i] for i in members), rows, cols),
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
                eps=ns.eps,
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
            (apply_updates or apply_updates_by_rule_)(
                p_part,
                _per_parameter(result, [counts[i] for i in members]),
                [ApplyRule(alpha)] * len(members),
                lr=lr,
                weight_decay=weight_decay,
            )


def _per_parameter(result: torch.Tensor, counts: Sequence[int]) -> list[torch.Tensor]:
    """The slots of a Newton–Schulz result stack by parameter (``counts``: matrices of each)."""
    if all(c == 1 for c in counts):
        return list(result.unbind(0))
    return list(result.split(list(counts)))


def _kernels_take(kernels, tensor_lists: Sequence[Sequence[torch.Tensor]], indices) -> bool:
    """Whether the Triton elementwise kernels take a stack: every member's tensors
    contiguous, and one dtype per list (parameters, gradients, momentum buffers)."""
    for tensors in tensor_lists:
        members = [tensors[i] for i in indices]
        if not kernels.supports(members) or len({t.dtype for t in members}) != 1:
            return False
    return True
