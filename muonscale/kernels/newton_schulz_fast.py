"""Fast Newton–Schulz for stacks of same-shape matrices: the same function as the reference
:func:`muonscale.newton_schulz.newton_schulz`, up to rounding, with less time and memory.

Two formulations (the reference's plain iteration, and a Gram-matrix form that iterates on
the m×m matrix X Xᵀ and is cheaper for wide matrices) on three backends (``torch.bmm`` into
preallocated workspaces, Triton kernels that compute symmetric products one triangle only, and
``torch.compile``). Tall stacks are iterated as transposed views, without a copy. ``method="auto"``
takes the Gram form only where it is cheaper and its measured error stays within the bound
:data:`GRAM_POLICY` states (in float32 0.7–2.0× the plain iteration's with Keller's
coefficients, up to 2.73× with Polar Express; in bfloat16 on an H200 at most 1.1×). The
derivation, FLOP counts, accuracy and timing measurements behind these choices are in
*Newton–Schulz* in the docs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from muonscale.flops import gram_plan
from muonscale.kernels.first_step import (
    PRECONDITIONERS,
    FirstStepScale,
    Preconditioner,
    first_scale,
    prepare_first_step_,
    scale_gram_,
)
from muonscale.kernels.process_state import (
    NSMethod,
    NSWorkspace,
    compiled,
    disable_triton,
    get_workspace,
    triton_available,
    triton_module,
    workspace_bytes,
)
from muonscale.memory import DEFAULT_NS_WORKSPACE_BYTES, group_by_budget
from muonscale.newton_schulz import (
    COEFFICIENT_PRESETS,
    DEFAULT_EPS,
    Coefficients,
    CoefficientSpec,
    default_ns_dtype,
    resolve_schedule,
)

NSBackend = Literal["auto", "torch", "triton", "compile"]
"""Where the iteration runs: ``"auto"`` is Triton on CUDA when it loads, torch elsewhere."""

NSMethodChoice = Literal["plain", "gram", "auto"]
"""A formulation, or ``"auto"``: :func:`choose_method`."""

RestartEvery = int | None | Literal["auto"]
"""Gram form only: restart before steps r, 2r, …; None never; ``"auto"``: the policy's."""

__all__ = [
    "GRAM_POLICY",
    "NSBackend",
    "NSMethodChoice",
    "choose_method",
    "newton_schulz_batched_",
    "newton_schulz_fast",
    "orthogonalize_stack_",
]

# Decision for method="auto" (the measurements are in *Newton–Schulz* in the docs).
GRAM_POLICY = {
    # float32/float64: Gram form when n >= 3m (CPU float32: error 0.7-2.0x the plain
    # iteration's with Keller, up to 2.73x with Polar Express, both ~1e-6; FLOPs -17 to -22%).
    "min_aspect_32bit": 3.0,
    # bfloat16: per coefficient preset, the aspect n/m from which the Gram form's error on an
    # H200 (tensor cores, sigma_i ~ 1/i and Gaussian spectra) was <= 1.1x the plain iteration's:
    # Keller at n = 4m: 0.95-1.01x. Polar Express is absent (1.14x), and so are square stacks
    # (1.53x with Keller) and aspects the card has not measured.
    "min_aspect_bf16": {"keller": 4.0},
    "restart_every": 2,  # restarting before steps 2 and 4 (also the default for method="gram")
}


def _resolve_backend(backend: NSBackend, X: torch.Tensor) -> str:
    if backend == "auto":
        return "triton" if X.is_cuda and triton_available() else "torch"
    if backend not in ("torch", "triton", "compile"):
        raise ValueError(f"backend must be 'auto', 'torch', 'triton' or 'compile', got {backend!r}")
    return backend


# ----------------------------------------------------------------------------------------------
# The iterations, in place on a (k, rows, cols) stack of either orientation. A tall stack
# (rows > cols) is iterated as its transpose X = Tᵀ without copying it: X Xᵀ = Tᵀ T and
# B X = (T Bᵀ)ᵀ, so every product reads T through a transposed operand and writes a contiguous
# result. ``inv_norm``, when given, is what ``first_step.prepare_first_step_`` returned for a
# stack that was not normalized: it is folded into m×m matrices of the first step (no pass
# over the stack).


class _Products:
    """The products of one iteration for a stack's orientation and backend."""

    def __init__(self, tall: bool, sym) -> None:
        self.tall, self.sym = tall, sym

    def gram(self, out: torch.Tensor, S: torch.Tensor) -> torch.Tensor:  # out = X Xᵀ
        W = S.mT if self.tall else S
        return self.sym.sym_matmul(W, out=out) if self.sym else torch.bmm(W, W.mT, out=out)

    def square(self, out, A, b, c, gamma=None):  # out = gamma I + b A + c A² (A symmetric)
        if self.sym:
            if gamma is None:
                return self.sym.sym_matmul(A, alpha=c, Z=A, beta=b, out=out)
            return self.sym.sym_matmul(A, alpha=c, Z=A, beta=b, gamma=gamma, out=out)
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=out)
        if gamma is not None:
            out.diagonal(dim1=-2, dim2=-1).add_(gamma)
        return out

    def prod(self, out, S, T):  # out = S T, S and T symmetric and commuting
        return self.sym.sym_matmul(S, T, out=out) if self.sym else torch.bmm(S, T, out=out)

    def left(self, out, M, S, beta=None):  # out = M X (+ beta X) for X = S, or Sᵀ when tall
        if self.tall:  # (M X)ᵀ = S Mᵀ
            if beta is None:
                return torch.bmm(S, M.mT, out=out)
            return torch.baddbmm(S, S, M.mT, beta=beta, out=out)
        if beta is None:
            return torch.bmm(M, S, out=out)
        return torch.baddbmm(S, M, S, beta=beta, out=out)


def _plain_(
    X: torch.Tensor,
    schedule: Sequence[Coefficients],
    ws: NSWorkspace,
    ops: _Products,
    inv_norm: FirstStepScale | None,
) -> torch.Tensor:
    """Returns the tensor holding the result (``X`` or the workspace's ``y``)."""
    k, m = X.shape[0], min(X.shape[-2:])
    A = ws.get("A", (k, m, m))
    B = ws.get("B", (k, m, m))
    cur, nxt = X, ws.get("y", tuple(X.shape))
    for t, (a, b, c) in enumerate(schedule):
        ops.gram(A, cur)  # A = X Xᵀ
        if t == 0 and inv_norm is not None:
            scale = first_scale(inv_norm, A)
            # X₁ = (a I + b A₀ + c A₀²) D X with A₀ = D A D, D = 1/ν or AOL's diag(s)
            scale_gram_(A, scale)
            ops.square(B, A, b, c, gamma=a)
            B.mul_(scale)  # (…) D: columns times s
            ops.left(nxt, B, cur)
        else:
            ops.square(B, A, b, c)  # B = b A + c A²
            ops.left(nxt, B, cur, beta=a)  # X ← a X + B X
        cur, nxt = nxt, cur
    return cur


def _gram_(
    X: torch.Tensor,
    schedule: Sequence[Coefficients],
    ws: NSWorkspace,
    ops: _Products,
    inv_norm: FirstStepScale | None,
    restart_every: int | None,
) -> torch.Tensor:
    """Returns the tensor holding the result (``X`` or the workspace's ``y``)."""
    k, m = X.shape[0], min(X.shape[-2:])
    R, Rn = ws.get("R", (k, m, m)), ws.get("Rn", (k, m, m))
    P, P2 = ws.get("P", (k, m, m)), ws.get("P2", (k, m, m))
    Q, Qn = ws.get("Q", (k, m, m)), ws.get("Qn", (k, m, m))
    Y = ws.get("y", tuple(X.shape))

    x0 = X  # X_k = Q X0
    ops.gram(R, x0)  # R0 = X0 X0ᵀ
    pending_norm = inv_norm  # X0 = D x0 until the first Q X0 takes the D (1/ν or diag(s))
    if pending_norm is not None:
        pending_norm = first_scale(pending_norm, R)
        scale_gram_(R, pending_norm)
    have_q = False
    for (a, b, c), (restart, update_r) in zip(schedule, gram_plan(len(schedule), restart_every)):
        if restart:  # re-form X = Q X0 and R = X Xᵀ, reset Q = I
            if pending_norm is not None:
                Q.mul_(pending_norm)
                pending_norm = None
            nx = Y if x0 is X else X
            ops.left(nx, Q, x0)
            x0 = nx
            ops.gram(R, x0)
            have_q = False
        ops.square(P, R, b, c, gamma=a)  # P = a I + b R + c R²
        if have_q:
            ops.prod(Qn, Q, P)  # Q ← Q P
            Q, Qn = Qn, Q
        else:
            Q.copy_(P)  # Q = P (m² copy instead of a product with I)
            have_q = True
        if update_r:
            ops.gram(P2, P)  # P² = P Pᵀ
            ops.prod(Rn, R, P2)  # R ← R P² (= P R P)
            R, Rn = Rn, R
    if pending_norm is not None:
        Q.mul_(pending_norm)
    out = Y if x0 is X else X
    ops.left(out, Q, x0)  # X_s = Q X0
    return out


def iterate_(
    X: torch.Tensor,
    schedule: Sequence[Coefficients],
    ws: NSWorkspace,
    *,
    method: NSMethod,
    use_triton: bool,
    restart_every: int | None,
    inv_norm: FirstStepScale | None = None,
) -> torch.Tensor:
    """The iteration on a (k, rows, cols) stack of either orientation, clobbering ``X``;
    returns the tensor that holds the result (``X`` or the workspace's ``y``, valid until the
    workspace is used again)."""
    ops = _Products(X.shape[-2] > X.shape[-1], triton_module() if use_triton else None)
    if method == "gram":
        return _gram_(X, schedule, ws, ops, inv_norm, restart_every)
    return _plain_(X, schedule, ws, ops, inv_norm)


def orthogonalize_stack_(
    X: torch.Tensor,
    schedule: Sequence[Coefficients],
    margin: float,
    eps: float,
    *,
    method: NSMethod,
    backend: NSBackend = "auto",
    restart_every: int | None = 2,
    workspace: NSWorkspace | None = None,
    reload: Callable[[], object] | None = None,
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
    preconditioner: Preconditioner = "frobenius",
) -> torch.Tensor:
    """Newton–Schulz of every matrix of a (k, rows, cols) stack that is *not* normalized yet
    (either orientation), clobbering ``X``; returns the tensor that holds the result (``X`` or
    the workspace's ``y``). The normalization is folded into the first step, except in
    float16, whose range would not hold the unnormalized X Xᵀ (there X is divided first),
    and for matrices whose X Xᵀ could overflow; another ``preconditioner`` folds its own
    scaling in instead (:mod:`muonscale.kernels.first_step`; not with ``backend="compile"``).
    ``reload`` refills ``X`` with the input: under ``backend="auto"`` a failing Triton kernel
    then falls back to torch (once, with a warning) instead of raising."""
    if workspace is None:
        workspace = get_workspace(
            tuple(X.shape), X.dtype, X.device, method, max_cached_bytes=max_workspace_bytes
        )
    use = _resolve_backend(backend, X)

    if preconditioner != "frobenius" and use == "compile":
        raise ValueError("backend='compile' supports preconditioner='frobenius' only")

    def run(use_triton: bool) -> torch.Tensor:
        fold = X.dtype != torch.float16 and use != "compile"
        inv_norm = prepare_first_step_(X, preconditioner, workspace, margin, eps, fold=fold)
        if use == "compile":
            if method != "plain":
                raise ValueError("backend='compile' supports method='plain' only")
            return _plain_compiled_(X, schedule)
        return iterate_(
            X,
            schedule,
            workspace,
            method=method,
            use_triton=use_triton,
            restart_every=restart_every,
            inv_norm=inv_norm,
        )

    if use == "triton" and backend == "auto" and reload is not None:
        try:
            return run(True)
        except Exception as exc:  # a kernel that does not compile/run on this GPU
            disable_triton(exc)
            reload()
            return run(False)
    return run(use == "triton")


def _plain_functional(X: torch.Tensor, schedule: tuple[Coefficients, ...]) -> torch.Tensor:
    for a, b, c in schedule:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X


def _plain_compiled_(X: torch.Tensor, schedule: Sequence[Coefficients]) -> torch.Tensor:
    X.copy_(compiled("plain", _plain_functional)(X, tuple(schedule)))
    return X


def newton_schulz_batched_(
    X: torch.Tensor,  # (k, m, n), m <= n, normalized, NS dtype; overwritten with the result
    schedule: Sequence[Coefficients],
    *,
    workspace: NSWorkspace | None = None,
    method: NSMethod = "plain",
    backend: NSBackend = "auto",
    restart_every: RestartEvery = "auto",
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
) -> torch.Tensor:
    """Run the Newton–Schulz steps ``schedule`` (one (a, b, c) per step) in place on a stack
    of already-normalized matrices; returns ``X``.

    ``method``: "plain" or "gram" (see *Newton–Schulz* in the docs). ``backend``: "auto" (Triton on
    CUDA when available, else torch), "torch", "triton", "compile" (plain only).
    ``workspace``: reused buffers; ``None`` takes the cached one for this stack.
    ``restart_every``: Gram form only; restart before steps r, 2r, …; ``None`` never;
    "auto" → ``GRAM_POLICY["restart_every"]`` (2). ``max_workspace_bytes``: bound of the
    workspace cache when ``workspace`` is None.
    """
    if X.dim() != 3 or X.shape[-2] > X.shape[-1]:
        raise ValueError(
            f"newton_schulz_batched_: X must be (k, m, n) with m <= n, got {tuple(X.shape)}"
        )
    if method not in ("plain", "gram"):
        raise ValueError(f"method must be 'plain' or 'gram', got {method!r}")
    backend = _resolve_backend(backend, X)
    if backend == "compile":
        if method != "plain":
            raise ValueError("backend='compile' supports method='plain' only")
        return _plain_compiled_(X, schedule)
    if restart_every == "auto":
        restart_every = GRAM_POLICY["restart_every"]
    if workspace is None:
        workspace = get_workspace(
            tuple(X.shape), X.dtype, X.device, method, max_cached_bytes=max_workspace_bytes
        )
    out = iterate_(
        X,
        schedule,
        workspace,
        method=method,
        use_triton=backend == "triton",
        restart_every=restart_every,
    )
    if out is not X:
        X.copy_(out)
    return X


def _preset_of(schedule: Sequence[Coefficients]) -> str | None:
    """The preset whose schedule ``schedule`` is (its first steps, or more of its tail)."""
    for name in COEFFICIENT_PRESETS:
        if list(schedule) == resolve_schedule(name, len(schedule))[0]:
            return name
    return None


def choose_method(
    m: int, n: int, dtype: torch.dtype, coefficients: CoefficientSpec = "keller", steps: int = 5
) -> tuple[str, int | None]:
    """``(method, restart_every)`` that ``method="auto"`` uses for an m×n matrix in ``dtype``
    with the schedule of ``coefficients`` over ``steps`` (see :data:`GRAM_POLICY`)."""
    m, n = min(m, n), max(m, n)
    if dtype in (torch.float32, torch.float64):
        min_aspect = GRAM_POLICY["min_aspect_32bit"]
    elif dtype == torch.bfloat16:
        preset = _preset_of(resolve_schedule(coefficients, steps)[0])
        min_aspect = GRAM_POLICY["min_aspect_bf16"].get(preset)
    else:  # float16: not measured
        min_aspect = None
    if min_aspect is not None and n >= min_aspect * m and n > m:
        return "gram", GRAM_POLICY["restart_every"]
    return "plain", None


def newton_schulz_fast(
    G: torch.Tensor,
    steps: int = 5,
    coefficients: CoefficientSpec = "keller",
    ns_dtype: torch.dtype | None = None,
    eps: float = DEFAULT_EPS,
    *,
    out: torch.Tensor | None = None,
    method: NSMethodChoice = "plain",
    backend: NSBackend = "auto",
    restart_every: RestartEvery = "auto",
    max_workspace_bytes: int = DEFAULT_NS_WORKSPACE_BYTES,
    preconditioner: Preconditioner = "frobenius",
) -> torch.Tensor:
    """Drop-in for :func:`muonscale.newton_schulz.newton_schulz` (same arguments, same result
    up to rounding), faster on stacks of same-shape matrices.

    Args beyond the reference's:
        out: tensor of G's shape to write the result into (any dtype; may be G itself).
            ``None`` allocates one of G's dtype.
        method: "plain" (the reference's iteration), "gram" (Gram-matrix form) or "auto"
            (:func:`choose_method`: Gram only where it saves FLOPs and its measured error stays
            within the bound of :data:`GRAM_POLICY`).
        backend: "auto" (Triton symmetric kernels on CUDA, torch elsewhere), "torch",
            "triton", "compile".
        restart_every: Gram form only: restart before steps r, 2r, …; ``None`` never restarts;
            "auto" takes ``GRAM_POLICY["restart_every"]`` (2).
        max_workspace_bytes: chunk the batch so one workspace stays under this many bytes
            (one matrix per chunk at least); also the bound of the workspace cache.
        preconditioner: "frobenius" (X / ‖X‖_F, the reference's) or "aol" (Turbo-Muon: the
            first step starts from the AOL-scaled X; the schedule's margin is unused).
    """
    if not isinstance(G, torch.Tensor) or G.ndim < 2:
        raise ValueError(
            "newton_schulz_fast: G must be a tensor with >= 2 dims, "
            f"got {getattr(G, 'shape', None)}"
        )
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(f"newton_schulz_fast: G must be real floating point, got {G.dtype}")
    _resolve_backend(backend, G)  # validates the name
    if preconditioner not in PRECONDITIONERS:
        raise ValueError(f"preconditioner must be one of {PRECONDITIONERS}, got {preconditioner!r}")
    schedule, margin = resolve_schedule(coefficients, steps)
    dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(G.device)
    if out is None:
        out = torch.empty_like(G, memory_format=torch.contiguous_format)
    elif out.shape != G.shape:
        raise ValueError(
            f"newton_schulz_fast: out shape {tuple(out.shape)} != G shape {tuple(G.shape)}"
        )
    rows, cols = G.shape[-2], G.shape[-1]
    m, n = min(rows, cols), max(rows, cols)
    if method == "auto":
        method, _ = choose_method(m, n, dtype, coefficients, steps)
    if restart_every == "auto":
        restart_every = GRAM_POLICY["restart_every"]
    src = G.reshape(-1, rows, cols)
    dst = out.view(-1, rows, cols) if out.is_contiguous() else None
    k = src.shape[0]
    per_matrix = workspace_bytes(1, m, n, torch.empty((), dtype=dtype).element_size(), method)
    results = []
    for chunk in group_by_budget([per_matrix] * k, max_workspace_bytes):
        start, kc = chunk[0], len(chunk)
        ws = get_workspace(
            (kc, rows, cols), dtype, G.device, method, max_cached_bytes=max_workspace_bytes
        )
        X = ws.get("x", (kc, rows, cols))
        g = src[start : start + kc]
        X.copy_(g)  # the cast, in G's orientation
        res = orthogonalize_stack_(
            X,
            schedule,
            margin,
            eps,
            method=method,
            backend=backend,
            restart_every=restart_every,
            workspace=ws,
            reload=lambda X=X, g=g: X.copy_(g),
            preconditioner=preconditioner,
        )
        if dst is not None:
            dst[start : start + kc].copy_(res)
        else:
            results.append(res.to(out.dtype, copy=True))
    if dst is None:
        out.copy_(torch.cat(results).reshape(out.shape))
    return out
