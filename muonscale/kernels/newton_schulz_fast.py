"""Fast Newton–Schulz for stacks of same-shape matrices; the pure reference is
:func:`muonscale.newton_schulz.newton_schulz` and this module computes the same function.

Two formulations, two backends.

**Plain** (the reference's iteration; X: (m, n), m <= n)::

    # f(X) = a X + b (X Xᵀ) X + c (X Xᵀ)² X
    A = X Xᵀ;  B = b A + c A²;  X ← a X + B X

FLOPs per step: 4m²n + 2m³ with full matmuls; m²n + m³ + 2m²n = 3m²n + m³ when the two
symmetric products compute one triangle only (the Triton backend).

**Gram** (iterate on the m×m Gram matrix; for wide matrices, n ≳ 2m). Every step multiplies X
on the left by a polynomial in R = X Xᵀ, so X_k = Q_k X₀ with Q_k a polynomial in R₀, and::

    R₀ = X₀ X₀ᵀ,  Q₀ = I
    P_k = a I + b R_k + c R_k²             # X_{k+1} = P_k X_k
    Q_{k+1} = Q_k P_k                       # (Q_1 = P_0: free)
    R_{k+1} = X_{k+1} X_{k+1}ᵀ = P_k R_k P_k = R_k P_k²   # P_k commutes with R_k
    X_s = Q_s X₀                            # once, at the end

All of R, P, Q are polynomials in R₀: symmetric and mutually commuting, so every m×m product
has a symmetric result (one triangle with the Triton kernel). FLOPs for s steps, no restart:

    full matmuls:   R₀ 2m²n + X_s 2m²n + s·8m³ − 6m³ (Q_1 free; last step needs no R update)
                    = 4m²n + (8s − 6)m³
    symmetric:      m²n + 2m²n + (4s − 3)m³

versus the plain s·(4m²n + 2m³) (full) or s·(3m²n + m³) (symmetric). For s = 5: full Gram
beats full plain when n > 1.5m (n = 4m: 50m³ vs 90m³); symmetric Gram beats symmetric plain
when n > m (n = 4m: 29m³ vs 65m³).

**Stability, restarts.** R carries the squares of the singular values, so its rounding error
is relative to ‖R‖ = σ_max², and the polynomial Q_k amplifies it (a ≈ 3.4 per step for Keller,
8.2 in Polar Express's first step). A *restart* re-forms X = Q X₀ and R = X Xᵀ and resets
Q = I (+2m²n + 2m²n with full matmuls); ``restart_every=r`` restarts before steps r, 2r, …
FLOPs, in units of m³, 5 steps, full matmuls (CPU) / symmetric kernels (Triton):

    n/m   plain   Gram   Gram r=2   Gram r=3  |  plain sym   Gram sym   Gram sym r=2
    1     30      38     34         36        |  20          20         20
    2     50      42     46         44        |  35          23         29
    3     70      46     58         52        |  50          26         38
    4     90      50     70         60        |  65          29         47

Measured (CPU, one matrix each of 768×768, 768×3072, 2304×768; Gaussian and gradient-like
(σᵢ ∝ 1/i) inputs; Keller and Polar Express; relative Frobenius error against the float64 plain
iteration; bf16 emulated as fp32 products rounded to bf16 after every op, i.e. a bf16 GEMM with
fp32 accumulation — this CPU has no usable bf16 matmul):

    float32   plain ≤ 1e-4;  Gram r=0 ≤ 1.3e-3 (PE, σᵢ ∝ 1/i), ≤ 2e-4 (Keller);  Gram r=2 = plain
    bfloat16  plain 0.010–0.044
              Gram r=0: Keller Gaussian wide 0.011 (ok), Keller σᵢ ∝ 1/i 4.5 (diverged),
                        Polar Express σᵢ ∝ 1/i 1e15 (diverged)
              Gram r=3: 1.3–1.5× plain (Keller), overflow (PE, σᵢ ∝ 1/i)
              Gram r=2: 1.0–1.2× plain (Keller), 2–3× plain (Polar Express, and 7× on square)

CPU time (1 thread, batch 12, float32, CPU seconds, interleaved, median of 2): 768×3072
reference 8.9, workspace plain 8.5, Gram r=0 4.6, Gram r=2 7.1; 2304×768 (transposed)
7.0 / 6.4 / 4.2 / 5.1; 768×768 3.0 / 2.5 / 3.7 / 3.2 — time tracks the FLOP column.

Decision (:data:`GRAM_POLICY`, used by ``method="auto"``): in float32/float64 the Gram form with
``restart_every=2`` is as accurate as the plain iteration and saves 17% (n = 3m) to 22% (n = 4m)
of the FLOPs, so "auto" uses it for n ≥ 3m. In bfloat16/float16 "auto" never uses it: without
restarts it diverges on realistic spectra, and with them its error is up to 3× the plain bf16
iteration's for Polar Express; the Triton symmetric plain iteration gets a comparable FLOP saving
(65 vs 90 m³ at n = 4m) with no stability cost. ``method="gram"`` stays available explicitly
(``restart_every`` defaults to 2).

**Backends.** ``"triton"`` (CUDA only): the symmetric products use
:func:`muonscale.kernels.triton_symmetric.sym_matmul`, the final a X + B X and Q X₀ use
``torch.baddbmm`` / ``torch.bmm`` (cuBLAS). ``"torch"``: ``torch.bmm`` / ``baddbmm`` with
``out=`` into a preallocated :class:`NSWorkspace`, so the hot path allocates nothing per step.
``"compile"``: a ``torch.compile``-d plain iteration (no workspace; inductor fuses the
elementwise parts).

Workspaces are cached per (shape, dtype, device, method) and bounded: a stack whose workspace
would exceed ``max_workspace_bytes`` (default 256 MiB, env ``MUONSCALE_NS_WORKSPACE_MB``) is
processed in chunks along the batch dim, and the whole cache holds at most that many bytes
(least recently used workspaces are dropped first). The optimizers call
:func:`clear_workspaces` at the end of every step, so the scratch is reused across the chunks
and shapes of one step but not held through the next forward/backward (on CPU that lowered
the bench's peak RSS by 16–26 MiB for 0.5 ms per step; on CUDA the caching allocator hands the
freed blocks to activations). Not thread-safe, and not for concurrent use on several
CUDA streams.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from muonscale.newton_schulz import DEFAULT_EPS, default_ns_dtype, resolve_schedule

Coefficients = tuple[float, float, float]

__all__ = [
    "GRAM_POLICY",
    "NSWorkspace",
    "clear_workspaces",
    "choose_method",
    "gram_flops",
    "newton_schulz_batched_",
    "newton_schulz_fast",
    "plain_flops",
    "triton_available",
]

# Decision for method="auto" (the measurements are in the module docstring).
GRAM_POLICY = {
    "min_aspect_32bit": 3.0,  # float32/float64: Gram form when n >= 3m ...
    "restart_every": 2,  # ... restarting before steps 2 and 4 (also the default for method="gram")
    "use_16bit": False,  # bfloat16/float16: never in "auto" (unstable; see above)
}


# ----------------------------------------------------------------------------------------------
# Triton availability (lazy: importing muonscale never imports triton)


_triton_state: dict[str, object] = {}


def triton_available() -> bool:
    """True when ``triton`` imports and the symmetric kernels module loads."""
    if "ok" not in _triton_state:
        try:
            from muonscale.kernels import triton_symmetric

            _triton_state["module"] = triton_symmetric
            _triton_state["ok"] = True
        except Exception as exc:  # ImportError, or a broken triton install
            _triton_state["ok"] = False
            _triton_state["error"] = repr(exc)
    return bool(_triton_state["ok"])


def _sym():
    if not triton_available():
        raise RuntimeError(f"triton backend unavailable: {_triton_state.get('error')}")
    return _triton_state["module"]


def _disable_triton(exc: BaseException) -> None:
    """backend="auto" falls back to torch for the rest of the process, once, loudly."""
    _triton_state["ok"] = False
    _triton_state["error"] = repr(exc)
    warnings.warn(
        f"muonscale: Triton Newton–Schulz kernels failed ({exc!r}); using torch.bmm from now on",
        RuntimeWarning,
        stacklevel=3,
    )


def _resolve_backend(backend: str, X: torch.Tensor) -> str:
    if backend == "auto":
        return "triton" if X.is_cuda and triton_available() else "torch"
    if backend not in ("torch", "triton", "compile"):
        raise ValueError(f"backend must be 'auto', 'torch', 'triton' or 'compile', got {backend!r}")
    return backend


# ----------------------------------------------------------------------------------------------
# FLOP counts


def _gram_plan(steps: int, restart_every: int | None) -> list[tuple[bool, bool]]:
    """Per step: (restart before this step, R must be updated after this step)."""
    restarts = [bool(restart_every) and t > 0 and t % restart_every == 0 for t in range(steps)]
    plan = []
    for t in range(steps):
        last = t == steps - 1
        next_restarts = not last and restarts[t + 1]
        plan.append((restarts[t], not last and not next_restarts))
    return plan


def plain_flops(m: int, n: int, steps: int, *, symmetric: bool = False) -> int:
    """FLOPs of the plain iteration (m <= n after transposing); ``symmetric``: the two symmetric
    products computed one triangle only (idealized: diagonal tiles not counted twice)."""
    m, n = min(m, n), max(m, n)
    if symmetric:
        return steps * (3 * m * m * n + m**3)
    return steps * (4 * m * m * n + 2 * m**3)


def gram_flops(
    m: int, n: int, steps: int, *, restart_every: int | None = None, symmetric: bool = False
) -> int:
    """FLOPs of the Gram iteration as implemented (same plan as :func:`newton_schulz_batched_`)."""
    m, n = min(m, n), max(m, n)
    gram = (1 if symmetric else 2) * m * m * n  # R = X Xᵀ
    apply = 2 * m * m * n  # X = Q X₀ (a general product)
    sq = (1 if symmetric else 2) * m**3  # one m×m product with a symmetric result
    total = gram
    first = True  # Q = P is free right after the start or a restart
    for restart, update_r in _gram_plan(steps, restart_every):
        if restart:
            total += apply + gram
            first = True
        total += sq  # P = a I + b R + c R²
        if not first:
            total += sq  # Q ← Q P
        first = False
        if update_r:
            total += 2 * sq  # P², R ← R P²
    return total + apply


# ----------------------------------------------------------------------------------------------
# Workspace


@dataclass
class NSWorkspace:
    """Buffers for NS on one (k, m, n) stack, allocated on first use and then reused.

    ``x`` is the iterate (the caller fills it); every other buffer is scratch.
    """

    shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != torch.Size(shape):
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.buffers[name] = buf
        return buf

    @property
    def x(self) -> torch.Tensor:
        return self.get("x", self.shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


_WORKSPACES: OrderedDict[tuple, NSWorkspace] = OrderedDict()
_MAX_WORKSPACES = 64


def get_workspace(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    method: str,
    *,
    max_cached_bytes: int | None = None,
) -> NSWorkspace:
    """The cached workspace for (shape, dtype, device, method). LRU, bounded twice: at most
    64 entries, and least recently used ones are dropped while the cache would hold more than
    ``max_cached_bytes`` with this one (default: ``MUONSCALE_NS_WORKSPACE_MB``, 256 MiB), so
    the memory kept between steps does not grow with the number of matrix shapes."""
    key = (tuple(shape), dtype, str(device), method)
    ws = _WORKSPACES.get(key)
    if ws is not None:
        _WORKSPACES.move_to_end(key)
        return ws
    budget = max_cached_bytes if max_cached_bytes is not None else _default_max_workspace_bytes()
    itemsize = torch.empty((), dtype=dtype).element_size()
    needed = workspace_bytes(*shape, itemsize, method)
    while _WORKSPACES and (
        len(_WORKSPACES) >= _MAX_WORKSPACES or cached_workspace_bytes() + needed > budget
    ):
        _WORKSPACES.popitem(last=False)
    ws = NSWorkspace(tuple(shape), dtype, torch.device(device))
    _WORKSPACES[key] = ws
    return ws


def cached_workspace_bytes() -> int:
    """Bytes held by the workspace cache now."""
    return sum(ws.nbytes() for ws in _WORKSPACES.values())


def clear_workspaces() -> None:
    """Drop every cached workspace (frees their memory)."""
    _WORKSPACES.clear()


def workspace_bytes(k: int, m: int, n: int, itemsize: int, method: str) -> int:
    """Bytes of a workspace for a (k, m, n) stack (x and scratch)."""
    if method == "gram":
        return k * itemsize * (2 * m * n + 5 * m * m + 1)
    return k * itemsize * (2 * m * n + 2 * m * m + 1)


def _default_max_workspace_bytes() -> int:
    return int(float(os.environ.get("MUONSCALE_NS_WORKSPACE_MB", "256")) * 2**20)


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
    sym = _sym()
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
    sym = _sym() if use_triton else None

    def gram(out, S):  # out = S Sᵀ
        return sym.sym_matmul(S, out=out) if sym else torch.bmm(S, S.mT, out=out)

    def prod(out, S, T):  # out = S T, S and T symmetric and commuting
        return sym.sym_matmul(S, T, out=out) if sym else torch.bmm(S, T, out=out)

    x0 = X  # X_k = Q X0
    gram(R, x0)  # R0 = X0 X0ᵀ
    have_q = False
    for (a, b, c), (restart, update_r) in zip(schedule, _gram_plan(len(schedule), restart_every)):
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


_compiled: dict[str, object] = {}


def _plain_functional(X: torch.Tensor, schedule: tuple[Coefficients, ...]) -> torch.Tensor:
    for a, b, c in schedule:
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X


def _plain_compiled_(X: torch.Tensor, schedule: Sequence[Coefficients]) -> torch.Tensor:
    fn = _compiled.get("plain")
    if fn is None:
        fn = torch.compile(_plain_functional, fullgraph=True, dynamic=False)
        _compiled["plain"] = fn
    X.copy_(fn(X, tuple(schedule)))
    return X


def newton_schulz_batched_(
    X: torch.Tensor,  # (k, m, n), m <= n, normalized, NS dtype; overwritten with the result
    schedule: Sequence[Coefficients],
    *,
    workspace: NSWorkspace | None = None,
    method: str = "plain",
    backend: str = "auto",
    restart_every: int | None | str = "auto",
) -> torch.Tensor:
    """Run the Newton–Schulz steps ``schedule`` (one (a, b, c) per step) in place on a stack
    of already-normalized matrices; returns ``X``.

    ``method``: "plain" or "gram" (see the module docstring). ``backend``: "auto" (Triton on
    CUDA when available, else torch), "torch", "triton", "compile" (plain only).
    ``workspace``: reused buffers; ``None`` takes the cached one for this stack.
    ``restart_every``: Gram form only; restart before steps r, 2r, …; ``None`` never;
    "auto" → ``GRAM_POLICY["restart_every"]`` (2).
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
        workspace = get_workspace(tuple(X.shape), X.dtype, X.device, method)
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
    coefficients: str | Coefficients | Sequence[Coefficients] = "keller",
    ns_dtype: torch.dtype | None = None,
    eps: float = DEFAULT_EPS,
    *,
    out: torch.Tensor | None = None,
    method: str = "plain",
    backend: str = "auto",
    restart_every: int | None | str = "auto",
    max_workspace_bytes: int | None = None,
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
        max_workspace_bytes: chunk the batch so one workspace stays under this many bytes.
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
    budget = (
        max_workspace_bytes if max_workspace_bytes is not None else _default_max_workspace_bytes()
    )
    per_matrix = workspace_bytes(1, m, n, torch.empty((), dtype=dtype).element_size(), method)
    chunk = max(1, min(k, budget // max(per_matrix, 1)))

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
    for start in range(0, k, chunk):
        kc = min(chunk, k - start)
        ws = get_workspace((kc, m, n), dtype, G.device, method)
        g = src[start : start + kc]
        X = load(ws, g)
        kw = dict(workspace=ws, method=method, restart_every=restart_every)
        if backend == "auto" and _resolve_backend("auto", X) == "triton":
            try:
                newton_schulz_batched_(X, schedule, backend="triton", **kw)
            except Exception as exc:  # a kernel that does not compile/run on this GPU
                _disable_triton(exc)
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
