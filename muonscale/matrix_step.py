"""The matrix step: what happens to a Muon matrix where it is whole.

    O = NS(U)                 precondition (Frobenius or AOL), then Newton–Schulz, batched
    v ← step(v, stats(O))     every replicated row state the group keeps (its declaration)
    O ← f ⊙_rows O            NorMuon: row factors from the row second moment
    O ← s(m, n) · q · O       the scale rule, times the Q/K factor (and an extra factor)

and the rule with which a rank then applies O to its copy (or shard) of the parameter::

    W ← W · (1 − lr λ) + lr α O      (α = −1, or −s(m, n) for the unscaled fast path;
                                      cautious decay: λ only where O and W agree in sign)

Every layout runs this chain where a matrix is whole: one process (the per-matrix path of
:func:`muonscale.functional.muon`), ``DistributedMuon``'s owners, and the owners of
``DTensorMuon`` and Megatron tensor parallelism after their exchange. Plain Muon of one matrix
takes the stacked fast path instead (:func:`stack_key`), which is this chain with the scale
left to the apply pass. Nothing here knows about optimizer state or ``torch.distributed``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from . import variants
from .declared_state import replicated_declarations
from .kernels.newton_schulz_fast import choose_method, newton_schulz_fast
from .matrices import MatrixView
from .memory import DEFAULT_NS_WORKSPACE_BYTES
from .newton_schulz import CoefficientSpec, default_ns_dtype
from .scaling import update_scale
from .settings import PLAIN_MUON, MuonSettings, NewtonSchulzSettings
from .state_tensor import StateTensor

RowStates = Mapping[StateTensor, torch.Tensor]
"""Replicated row states (or their row statistics) by declaration: a matrix's rows of each,
or a parameter's (its matrices' rows in order)."""


@dataclass(frozen=True)
class MatrixRule:
    """What the matrix step does to one whole matrix after Newton–Schulz."""

    ns: NewtonSchulzSettings
    scale: float | None = None
    """The factor O is multiplied by (s(m, n) × Q/K factor × extra); None: left unscaled."""
    settings: MuonSettings | None = None
    """The group's options: the replicated row states they keep are read and stepped with them
    (NorMuon's row second moment with its β₂, then its row factors); None: no row state."""

    @property
    def row_state(self) -> list[StateTensor]:
        """The replicated row states the step reads and steps (in declaration order)."""
        return [] if self.settings is None else replicated_declarations(self.settings)


@dataclass(frozen=True)
class ApplyRule:
    """How a rank adds a matrix step's result O to its copy of the parameter."""

    alpha: float
    """W ← W (1 − lr λ) + lr α O."""
    cautious_decay: bool = False
    """Decay only where O and W agree in sign."""


def ns_method_for(
    m: int,
    n: int,
    dtype: torch.dtype,
    method: str,
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
    one call of :func:`muonscale.kernels.newton_schulz_fast` (its preconditioner first;
    workspace reuse; Triton symmetric products on CUDA; ``max_workspace_bytes`` bounds its
    scratch). Returns matrices in the input's shapes, in ``ns.dtype``."""
    buckets: dict[tuple, list[int]] = defaultdict(list)
    for i, mat in enumerate(matrices):
        dtype = ns.dtype if ns.dtype is not None else default_ns_dtype(mat.device)
        buckets[(tuple(mat.shape), mat.device, dtype)].append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for ((rows, cols), device, dtype), indices in buckets.items():
        stack = torch.empty((len(indices), rows, cols), dtype=dtype, device=device)
        torch._foreach_copy_(list(stack.unbind(0)), [matrices[i] for i in indices])
        short, long = min(rows, cols), max(rows, cols)
        ortho = newton_schulz_fast(
            stack,
            ns.steps,
            ns.coefficients,
            dtype,
            ns.eps,
            out=stack,
            method=ns_method_for(short, long, dtype, ns.method, ns.coefficients, ns.steps),
            backend="auto",
            max_workspace_bytes=max_workspace_bytes,
            preconditioner=ns.preconditioner,
        )
        for slot, i in enumerate(indices):
            out[i] = ortho[slot]
    return out  # type: ignore[return-value]


def matrix_updates(
    matrices: Sequence[torch.Tensor],
    rules: Sequence[MatrixRule],
    row_states: Sequence[RowStates | None] | None = None,
    *,
    step_row_state: bool = True,
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
) -> tuple[list[torch.Tensor], list[dict[StateTensor, torch.Tensor]]]:
    """The matrix step of whole directions U (one rule each; ``row_states[i]``: matrix i's
    rows of the replicated row states its rule keeps). Returns the updates (in Newton–Schulz's
    dtype) and each matrix's row statistics, by declaration (empty without row state).

    ``step_row_state``: step the row states in place; False leaves them as they are (NorMuon's
    factors come from a stepped copy) for a caller that steps replicas held elsewhere from the
    returned statistics (:func:`step_row_replicas_`: the same bits)."""
    by_ns: dict[NewtonSchulzSettings, list[int]] = defaultdict(list)
    for i, rule in enumerate(rules):
        by_ns[rule.ns].append(i)
    out: list[torch.Tensor | None] = [None] * len(matrices)
    for ns, indices in by_ns.items():
        ortho = orthogonalize_matrices(
            [matrices[i] for i in indices], ns, max_workspace_bytes=max_workspace_bytes
        )
        for i, o in zip(indices, ortho):
            out[i] = o
    stats: list[dict[StateTensor, torch.Tensor]] = [{} for _ in matrices]
    for i, rule in enumerate(rules):
        O = out[i]
        held = (row_states[i] if row_states is not None else None) or {}
        stepped: dict[StateTensor, torch.Tensor] = {}
        for spec in rule.row_state:  # statistics of O as Newton–Schulz left it
            if spec not in held:
                raise ValueError(f"a matrix rule keeping {spec.what} needs the matrix's rows")
            stepped[spec] = held[spec] if step_row_state else held[spec].clone()
            stats[i][spec] = spec.row_statistics(O)
            spec.step_replica_(rule.settings, stepped[spec], stats[i][spec])
        moment = stepped.get(variants.ROW_MOMENT)
        if moment is not None:  # NorMuon: rows scaled by factors from the stepped moment
            O.mul_(variants.row_factors(moment, stats[i][variants.ROW_MOMENT]).to(O.dtype)[:, None])
        if rule.scale is not None:
            out[i] = O * rule.scale
    return out, stats  # type: ignore[return-value]


def takes_stacked_path(view: MatrixView, settings: MuonSettings) -> bool:
    """Whether a parameter's step is plain Muon of matrices that are slices of a reshape of it
    (one matrix, or the experts of a stack; a transposed or split view is not): the stacked
    fast path, with the scale in the apply pass."""
    return (
        settings.variant == PLAIN_MUON.variant
        and not replicated_declarations(settings)
        and settings.preconditioner == "frobenius"
        and (len(view.matrix_shapes) == 1 or view.stacked_shape is not None)
        and view.row_partition is None
        and not view.transposed
    )


def stack_key(
    param: torch.Tensor,
    view: MatrixView,
    ns: NewtonSchulzSettings,
    options: MuonSettings = PLAIN_MUON,
) -> tuple | None:
    """(matrix shape, device, Newton–Schulz dtype) of the stack the fast path puts ``param``
    in (one slot per matrix: E consecutive slots for an expert stack), or None when it takes
    the matrix step (split or transposed views, variants)."""
    if ns.preconditioner != "frobenius" or not takes_stacked_path(view, options):
        return None
    dtype = ns.dtype if ns.dtype is not None else default_ns_dtype(param.device)
    return (view.matrix_shapes[0], param.device, dtype)


def apply_rule(
    view: MatrixView, settings: MuonSettings, extra_scale: float = 1.0, *, scaled: bool = False
) -> ApplyRule:
    """The rule the update of a parameter with ``view`` is applied with: α = −s(m, n) (times
    ``extra_scale``) for the unscaled fast path, α = −1 and the group's cautious decay for an
    update the matrix step scaled (always, with ``scaled``: see :func:`matrix_rules`)."""
    if not scaled and takes_stacked_path(view, settings):
        return ApplyRule(-update_scale(settings.scale, *view.matrix_shapes[0]) * extra_scale)
    return ApplyRule(-1.0, settings.cautious_weight_decay)


def matrix_rules(
    view: MatrixView,
    settings: MuonSettings,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    extra_scale: float = 1.0,
    scaled: bool = False,
) -> list[MatrixRule]:
    """The rule of each matrix of ``view``: scaled by s(m, n) of its shape (``shapes``: the
    global shapes where the view's are pieces) × Q/K factor × ``extra_scale``, unless the
    parameter takes the stacked path (never with ``scaled``: a caller whose apply pass does
    not know the global shapes); the group's replicated row states read and stepped."""
    if not scaled and takes_stacked_path(view, settings):
        return [MatrixRule(settings.ns, None, settings)] * len(view.matrix_shapes)
    shapes = view.matrix_shapes if shapes is None else shapes
    factors = view.lr_factors(settings.qk_lr_scale)
    return [
        MatrixRule(settings.ns, update_scale(settings.scale, *shape) * q * extra_scale, settings)
        for shape, q in zip(shapes, factors)
    ]


def row_state_slices(
    view: MatrixView, held: RowStates | None
) -> list[dict[StateTensor, torch.Tensor]]:
    """Each matrix of ``view``'s rows of a parameter's replicated row states (consecutive)."""
    out: list[dict[StateTensor, torch.Tensor]] = [{} for _ in view.matrix_shapes]
    for spec, state in (held or {}).items():
        start = 0
        for rows_of, (rows, _) in zip(out, view.matrix_shapes):
            rows_of[spec] = state[start : start + rows]
            start += rows
    return out


def parameter_updates(
    directions: Sequence[torch.Tensor],
    views: Sequence[MatrixView],
    settings: Sequence[MuonSettings],
    row_states: Sequence[RowStates | None] | None = None,
    *,
    step_row_state: bool = True,
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
) -> tuple[list[torch.Tensor], list[ApplyRule], list[dict[StateTensor, torch.Tensor]]]:
    """The matrix step of whole parameters: each direction U (parameter-shaped, whole) →
    its view's matrices → :func:`matrix_updates` → the update, parameter-shaped, with the
    :class:`ApplyRule` it is applied with, and the parameter's row statistics by declaration
    (its matrices' in order, concatenated; empty without row state). ``row_states[i]``:
    parameter i's replicated row states (:func:`~muonscale.declared_state.replicated_state`)."""
    matrices, rules, held, owner = [], [], [], []
    for i, (u, view, s) in enumerate(zip(directions, views, settings)):
        mats = view.to_matrices(u)
        matrices += mats
        rules += matrix_rules(view, s)
        held += row_state_slices(view, None if row_states is None else row_states[i])
        owner += [i] * len(mats)
    out, stats = matrix_updates(
        matrices,
        rules,
        held,
        step_row_state=step_row_state,
        max_workspace_bytes=max_workspace_bytes,
    )
    per_param: list[list[torch.Tensor]] = [[] for _ in directions]
    per_stats: list[dict[StateTensor, list[torch.Tensor]]] = [{} for _ in directions]
    for i, o, st in zip(owner, out, stats):
        per_param[i].append(o)
        for spec, rows in st.items():
            per_stats[i].setdefault(spec, []).append(rows)
    updates = [view.from_matrices(mats) for view, mats in zip(views, per_param)]
    applies = [apply_rule(view, s) for view, s in zip(views, settings)]
    row_stats = [{spec: torch.cat(parts) for spec, parts in st.items()} for st in per_stats]
    return updates, applies, row_stats


def step_row_replicas_(
    replicas: Sequence[RowStates],
    row_stats: Sequence[RowStates | None],
    settings: Sequence[MuonSettings],
) -> None:
    """Step every replica of a replicated row state in place (``replicas[i]``: entry i's, by
    declaration) from the row statistics its owner's matrix step returned with
    ``step_row_state=False`` (and the exchange shared), with entry i's ``settings``: the bits
    the owner's own step gives."""
    for held, stats, entry_settings in zip(replicas, row_stats, settings):
        for spec, replica in held.items():
            if stats is None or spec not in stats:
                raise ValueError(f"a replica of {spec.what} needs its owner's row statistics")
            spec.step_replica_(entry_settings, replica, stats[spec].to(replica.device))


def unscaled_apply_rule(settings: MuonSettings, shape: tuple[int, int]) -> ApplyRule:
    """The rule of an update O that no matrix step scaled, for a matrix of (global) ``shape``:
    α = −s(m, n), with the group's decay."""
    return ApplyRule(-update_scale(settings.scale, *shape), settings.cautious_weight_decay)


ApplyUpdates = Callable[..., None]
"""A function with :func:`apply_updates_by_rule_`'s arguments (params, updates, rules, lr=,
weight_decay=): Muon's last pass, for a caller that also sends the updates elsewhere."""


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


def apply_updates_by_rule_(
    params: Sequence[torch.Tensor],
    updates: Sequence[torch.Tensor],
    rules: Sequence[ApplyRule],
    *,
    lr: float | torch.Tensor,
    weight_decay: float,
) -> None:
    """:func:`apply_updates_` of each update with its :class:`ApplyRule` (one call per kind
    of decay)."""
    for cautious in sorted({r.cautious_decay for r in rules}):
        chosen = [i for i, r in enumerate(rules) if r.cautious_decay == cautious]
        apply_updates_(
            [params[i] for i in chosen],
            [updates[i] for i in chosen],
            [rules[i].alpha for i in chosen],
            lr=lr,
            weight_decay=weight_decay,
            cautious=cautious,
        )


def _add_scaled_(param: torch.Tensor, update: torch.Tensor, alpha: float | torch.Tensor) -> None:
    """``param += alpha · update``; a tensor ``alpha`` stays on the device (``addcmul_`` rounds
    as ``add_(alpha=...)`` does: one multiply-add in the parameter's dtype)."""
    if isinstance(alpha, torch.Tensor):
        param.addcmul_(update, alpha.to(param.dtype))
    else:
        param.add_(update, alpha=alpha)
