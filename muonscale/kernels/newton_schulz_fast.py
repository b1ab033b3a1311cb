"""Fast Newton–Schulz for stacks of same-shape matrices: the same function as the reference
:func:`muonscale.newton_schulz.newton_schulz`, up to rounding, with less time and memory.

Two formulations (the reference's plain iteration, and a Gram-matrix form that iterates on
the m×m matrix X Xᵀ and is cheaper for wide matrices) on three backends (``torch.bmm`` into
preallocated workspaces, Triton kernels that compute symmetric products one triangle only, and
``torch.compile``). ``method="auto"`` takes the Gram form only where it was measured to be as
accurate and is cheaper (:data:`GRAM_POLICY`). The derivation, FLOP counts, accuracy and
timing measurements behind these choices are in ``docs/newton_schulz.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from muonscale.flops import gram_plan
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
]

# Decision for method="auto" (the measurements are in docs/newton_schulz.md).
GRAM_POLICY = {
    "min_aspect_32bit": 3.0,  # float32/float64: Gram form when n >= 3m ...
    "restart_every": 2,  # ... restarting before steps 2 and 4 (also the default for method="gram")
    "use_16bit": False,  # bfloat16/float16: never in "auto" (unstable; see the docs)
}


def _resolve_backend(backend: NSBackend, X: torch.Tensor) -> str:
    if backend == "auto":
        return "triton" if X.is_cuda and triton_available() else "torch"
    if backend not in ("torch", "triton", "compile"):
        raise ValueError(f"backend must be 'auto', 'torch', 'triton' or 'compile', got {backend!r}")
    return backend


# ----------------------------------------------------------------------------------------------
# The iterations, in place on a normalized (k, m, n) stack, m <= n


def _plain_torch_(
    X: torch.Tensor, schedule: Sequence[Coefficients], ws: NSWorkspace
) -> torch.Tensor:
    k, m, n = X.shape
    A = ws.get("A", (k, m, m))
    B = ws.get("B", (k, m, m))
    Y = ws.get("y", (k, m, n))
    cur, nxt = X, Y
    for a, b, c in schedule:
        torch.bmm(cur, cur.mT, out=A)  # A = X Xᵀ
        torch.baddbmm(A, A, A, beta=b, alpha=c, out=B)  # B = b A + c A²
        torch.baddbmm(cur, B, cur, beta=a, out=nxt)  # X ← a X + B X
        cur, nxt = nxt, cur
    if cur is not X:
        X.copy_(cur)
    return X


def _plain_triton_(
    X: torch.Tensor, schedule: Sequence[Coefficients], ws: NSWorkspace
) -> torch.Tensor:
    sym = triton_module()
    k, m, n = X.shape
    A = ws.get("A", (k, m, m))
    B = ws.get("B", (k, m, m))
    Y = ws.get("y", (k, m, n))
    cur, nxt = X, Y
    for a, b, c in schedule:
        sym.sym_matmul(cur, out=A)  # A = X Xᵀ            (upper tiles, mirrored)
        sym.sym_matmul(A, alpha=c, Z=A, beta=b, out=B)  # B = c A Aᵀ + b A = b A + c A²
        torch.baddbmm(cur, B, cur, beta=a, out=nxt)  # X ← a X + B X
        cur, nxt = nxt, cur
    if cur is not X:
        X.copy_(cur)
    return X


def _gram_(
    X: torch.Tensor,
    schedule: Sequence[Coefficients],
    ws: NSWorkspace,
    restart_every: int | None,
    use_triton: bool,
) -> torch.Tensor:
    k, m, n = X.shape
    R, Rn = ws.get("R", (k, m, m)), ws.get("Rn", (k, m, m))
    P, P2 = ws.get("P", (k, m, m)), ws.get("P2", (k, m, m))
    Q, Qn = ws.get("Q", (k, m, m)), ws.get("Qn", (k, m, m))
    Y = ws.get("y", (k, m, n))
    sym = triton_module() if use_triton else None

    def gram(out, S):  # out = S Sᵀ
        return sym.sym_matmul(S, out=out) if sym else torch.bmm(S, S.mT, out=out)

    def prod(out, S, T):  # out = S T, S and T symmetric and commuting
        return sym.sym_matmul(S, T, out=out) if sym else torch.bmm(S, T, out=out)

    x0 = X  # X_k = Q X0
    gram(R, x0)  # R0 = X0 X0ᵀ
    have_q = False
    for (a, b, c), (restart, update_r) in zip(schedule, gram_plan(len(schedule), restart_every)):
        if restart:  # re-form X = Q X0 and R = X Xᵀ, reset Q = I
            nx = Y if x0 is X else X
            torch.bmm(Q, x0, out=nx)
            x0 = nx
            gram(R, x0)
            have_q = False
        # P = a I + b R + c R²
        if sym:
            sym.sym_matmul(R, alpha=c, Z=R, beta=b, gamma=a, out=P)
        else:
            torch.baddbmm(R, R, R, beta=b, alpha=c, out=P)
            P.diagonal(dim1=-2, dim2=-1).add_(a)
        if have_q:
            prod(Qn, Q, P)  # Q ← Q P
            Q, Qn = Qn, Q
        else:
            Q.copy_(P)  # Q = P (m² copy instead of a product with I)
            have_q = True
        if update_r:
            gram(P2, P)  # P² = P Pᵀ
            prod(Rn, R, P2)  # R ← R P² (= P R P)
            R, Rn = Rn, R
    out = Y if x0 is X else X
    torch.bmm(Q, x0, out=out)  # X_s = Q X0
    if out is not X:
        X.copy_(out)
    return X


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

    ``method``: "plain" or "gram" (see ``docs/newton_schulz.md``). ``backend``: "auto" (Triton on
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
    if method == "gram":
        return _gram_(X, schedule, workspace, restart_every, backend == "triton")
    if backend == "triton":
        return _plain_triton_(X, schedule, workspace)
    return _plain_torch_(X, schedule, workspace)


def choose_method(m: int, n: int, dtype: torch.dtype) -> tuple[str, int | None]:
    """``(method, restart_every)`` that ``method="auto"`` uses for an m×n matrix in ``dtype``."""
    m, n = min(m, n), max(m, n)
    wide = n >= GRAM_POLICY["min_aspect_32bit"] * m
    if wide and (dtype in (torch.float32, torch.float64) or GRAM_POLICY["use_16bit"]):
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
) -> torch.Tensor:
    """Drop-in for :func:`muonscale.newton_schulz.newton_schulz` (same arguments, same result
    up to rounding), faster on stacks of same-shape matrices.

    Args beyond the reference's:
        out: tensor of G's shape to write the result into (any dtype; may be G itself).
            ``None`` allocates one of G's dtype.
        method: "plain" (the reference's iteration), "gram" (Gram-matrix form) or "auto"
            (:func:`choose_method`: Gram only where it saves FLOPs and was measured accurate).
        backend: "auto" (Triton symmetric kernels on CUDA, torch elsewhere), "torch",
            "triton", "compile".
        restart_every: Gram form only: restart before steps r, 2r, …; ``None`` never restarts;
            "auto" takes ``GRAM_POLICY["restart_every"]`` (2).
        max_workspace_bytes: chunk the batch so one workspace stays under this many bytes
            (one matrix per chunk at least); also the bound of the workspace cache.
    """
    if not isinstance(G, torch.Tensor) or G.ndim < 2:
        raise ValueError(
            f"newton_schulz_fast: G must be a tensor with >= 2 dims, got {getattr(G, 'shape', None)}"
        )
    if G.is_complex() or not G.is_floating_point():
        raise ValueError(f"newton_schulz_fast: G must be real floating point, got {G.dtype}")
    schedule, margin = resolve_schedule(coefficients, steps)
    dtype = ns_dtype if ns_dtype is not None else default_ns_dtype(G.device)
    if out is None:
        out = torch.empty_like(G, memory_format=torch.contiguous_format)
    elif out.shape != G.shape:
        raise ValueError(
            f"newton_schulz_fast: out shape {tuple(out.shape)} != G shape {tuple(G.shape)}"
        )

    rows, cols = G.shape[-2], G.shape[-1]
    transposed = rows > cols
    m, n = (cols, rows) if transposed else (rows, cols)
    if method == "auto":
        method, _ = choose_method(m, n, dtype)
    if restart_every == "auto":
        restart_every = GRAM_POLICY["restart_every"]
    src = G.reshape(-1, rows, cols)
    dst = out.view(-1, rows, cols) if out.is_contiguous() else None
    k = src.shape[0]
    per_matrix = workspace_bytes(1, m, n, torch.empty((), dtype=dtype).element_size(), method)

    def load(ws: NSWorkspace, g: torch.Tensor) -> torch.Tensor:
        X = ws.x  # (kc, m, n)
        X.copy_(g.mT if transposed else g)  # cast + transpose in one copy
        # X₀ = X / max(margin · ‖X‖_F, eps), norm taken in the NS dtype like the reference
        norm = ws.get("norm", (X.shape[0], 1, 1))
        torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, out=norm)
        if margin != 1.0:
            norm.mul_(margin)
        norm.clamp_(min=eps)
        return X.div_(norm)

    results = []
    for chunk in group_by_budget([per_matrix] * k, max_workspace_bytes):
        start, kc = chunk[0], len(chunk)
        ws = get_workspace(
            (kc, m, n), dtype, G.device, method, max_cached_bytes=max_workspace_bytes
        )
        g = src[start : start + kc]
        X = load(ws, g)
        kw = dict(workspace=ws, method=method, restart_every=restart_every)
        if backend == "auto" and _resolve_backend("auto", X) == "triton":
            try:
                newton_schulz_batched_(X, schedule, backend="triton", **kw)
            except Exception as exc:  # a kernel that does not compile/run on this GPU
                disable_triton(exc)
                newton_schulz_batched_(load(ws, g), schedule, backend="torch", **kw)
        else:
            newton_schulz_batched_(X, schedule, backend=backend, **kw)
        res = X.mT if transposed else X
        if dst is not None:
            dst[start : start + kc].copy_(res)
        else:
            results.append(res.to(out.dtype, copy=True))
    if dst is None:
        out.copy_(torch.cat(results).reshape(out.shape))
    return out
