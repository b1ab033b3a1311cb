"""Triton kernels for the symmetric products of Newton–Schulz.

Two of the three products of a Newton–Schulz step (X Xᵀ, and A·A for symmetric A) have
symmetric results, so one kernel, :func:`sym_matmul` (C = α·X Yᵀ + β·Z + γ·I for X Yᵀ known
to be symmetric), computes only the tiles on and above the diagonal and mirrors them: half
the FLOPs of those products. Accumulation is in float32; C is written in X's dtype and is
exactly symmetric. Importing this module needs ``triton``; :mod:`muonscale.kernels` imports
it lazily and only for CUDA tensors. On CPU the kernels run under the Triton interpreter
(tests). How the kernel is used and its caveats are in *Newton–Schulz* in the docs.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

__all__ = ["sym_matmul", "upper_tile_indices", "pick_config"]


@triton.jit
def _sym_matmul_kernel(
    X,  # (k, M, K) pointer
    Y,  # (k, M, K) pointer; may alias X
    Z,  # (k, M, M) pointer; ignored unless HAS_Z
    C,  # (k, M, M) pointer (output)
    TILE_I,  # (T,) int32: row-tile index of each program, TILE_I <= TILE_J
    TILE_J,  # (T,) int32
    M,
    K,
    stride_xb,
    stride_xm,
    stride_xk,
    stride_yb,
    stride_ym,
    stride_yk,
    stride_zb,
    stride_zm,
    stride_zn,
    stride_cb,
    stride_cm,
    stride_cn,
    alpha,
    beta,
    gamma,
    HAS_Z: tl.constexpr,
    HAS_GAMMA: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    ti = tl.load(TILE_I + pid)
    tj = tl.load(TILE_J + pid)

    rows_i = ti * BLOCK + tl.arange(0, BLOCK)  # rows of C (and of X) in this tile
    rows_j = tj * BLOCK + tl.arange(0, BLOCK)  # cols of C (rows of Y)
    offs_k = tl.arange(0, BLOCK_K)
    mask_i = rows_i < M
    mask_j = rows_j < M

    # x_ptrs: X[i-rows, k-block] (BLOCK, BLOCK_K); y_ptrs: Y[j-rows, k-block]ᵀ (BLOCK_K, BLOCK)
    x_ptrs = X + batch * stride_xb + rows_i[:, None] * stride_xm + offs_k[None, :] * stride_xk
    y_ptrs = Y + batch * stride_yb + rows_j[None, :] * stride_ym + offs_k[:, None] * stride_yk

    # tl.full, not tl.zeros: the interpreter twin (CPU tensors, see _interpreted_kernel) cannot
    # call triton.language.standard's @jit helpers (zeros, cdiv, ...), only core builtins.
    acc = tl.full((BLOCK, BLOCK), 0.0, tl.float32)
    # Number of K blocks: computed at run time on the GPU (one compiled kernel for every K);
    # under the interpreter K_TILES > 0 passes it as a constexpr instead, because the
    # interpreter cannot loop over a run-time scalar with numpy >= 2.4 (and turns every
    # assigned name into one, hence the inline conditional).
    for kt in range(0, K_TILES if K_TILES > 0 else (K + BLOCK_K - 1) // BLOCK_K):
        k_left = K - kt * BLOCK_K
        x = tl.load(x_ptrs, mask=mask_i[:, None] & (offs_k[None, :] < k_left), other=0.0)
        y = tl.load(y_ptrs, mask=mask_j[None, :] & (offs_k[:, None] < k_left), other=0.0)
        # acc[r, c] += Σ_k X[i_r, k] · Y[j_c, k]   i.e. (X Yᵀ)[i, j]
        acc = tl.dot(x, y, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        y_ptrs += BLOCK_K * stride_yk

    acc = acc * alpha
    if HAS_Z:
        z_ptrs = Z + batch * stride_zb + rows_i[:, None] * stride_zm + rows_j[None, :] * stride_zn
        z = tl.load(z_ptrs, mask=mask_i[:, None] & mask_j[None, :], other=0.0)
        acc += beta * z.to(tl.float32)
    if HAS_GAMMA:
        acc += tl.where(rows_i[:, None] == rows_j[None, :], gamma, 0.0)

    c_base = C + batch * stride_cb
    c_mask = mask_i[:, None] & mask_j[None, :]
    if ti == tj:
        # diagonal tile: make it exactly symmetric, store once
        acc = (acc + tl.trans(acc)) * 0.5
        c_ptrs = c_base + rows_i[:, None] * stride_cm + rows_j[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=c_mask)
    else:
        out = acc.to(C.dtype.element_ty)
        c_ptrs = c_base + rows_i[:, None] * stride_cm + rows_j[None, :] * stride_cn
        tl.store(c_ptrs, out, mask=c_mask)
        # mirror: C[j, i] = C[i, j]ᵀ (transpose in registers so the store stays row-major)
        ct_ptrs = c_base + rows_j[:, None] * stride_cm + rows_i[None, :] * stride_cn
        tl.store(ct_ptrs, tl.trans(out), mask=mask_j[:, None] & mask_i[None, :])


@functools.cache
def _interpreted_kernel():
    """An interpreter twin of the kernel, for CPU tensors (tests)."""
    from triton.runtime.interpreter import InterpretedFunction

    fn = getattr(_sym_matmul_kernel, "fn", _sym_matmul_kernel)
    return InterpretedFunction(fn)


def _kernel_for(device: torch.device):
    if device.type == "cuda":
        return _sym_matmul_kernel
    if type(_sym_matmul_kernel).__name__ == "InterpretedFunction":  # TRITON_INTERPRET=1 at import
        return _sym_matmul_kernel
    return _interpreted_kernel()


_tile_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}


def upper_tile_indices(n_tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(TILE_I, TILE_J) int32 tensors listing the tiles (i, j) with i <= j, row by row.

    Cached per (n_tiles, device): the hot path allocates nothing.
    """
    key = (n_tiles, str(device))
    hit = _tile_cache.get(key)
    if hit is None:
        ii, jj = torch.triu_indices(n_tiles, n_tiles)
        hit = (ii.to(torch.int32).to(device), jj.to(torch.int32).to(device))
        _tile_cache[key] = hit
    return hit


def pick_config(m: int, p: int, dtype: torch.dtype, device: torch.device) -> dict:
    """Tile sizes and launch options.

    Heuristic, not autotuned: 128×128 tiles with BLOCK_K 64 (bf16/fp16), 8 warps, 3 stages are
    the usual sweet spot on Hopper (Triton 3.6 emits wgmma for them on sm_90: checked by
    compiling for sm_90 without a GPU; 64 KiB shared memory); smaller tiles when m is small
    so there are enough programs to fill the SMs; tiny tiles under the interpreter.
    """
    if device.type != "cuda":
        return {"BLOCK": 16, "BLOCK_K": 16, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    if m <= 256:
        return {"BLOCK": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4}
    return {"BLOCK": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def _as3d(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def sym_matmul(
    X: torch.Tensor,  # (k, m, p) or (m, p)
    Y: torch.Tensor | None = None,  # (k, m, p); None -> X
    *,
    alpha: float = 1.0,
    Z: torch.Tensor | None = None,  # (k, m, m)
    beta: float = 0.0,
    gamma: float = 0.0,
    out: torch.Tensor | None = None,  # (k, m, m)
    config: dict | None = None,
) -> torch.Tensor:
    """``C = alpha · X Yᵀ + beta · Z + gamma · I``, computing only the upper tiles of X Yᵀ.

    The caller promises that X Yᵀ is symmetric (Y is None, or X and Y commuting symmetric
    matrices); only tiles (i, j) with i <= j are computed and mirrored. ``out`` may alias
    nothing that is read (not X, Y or Z). Returns ``out`` (allocated if None).
    """
    squeeze = X.dim() == 2
    X3 = _as3d(X)
    Y3 = X3 if Y is None else _as3d(Y)
    k, m, p = X3.shape
    if Y3.shape != X3.shape:
        raise ValueError(f"sym_matmul: Y shape {tuple(Y3.shape)} != X shape {tuple(X3.shape)}")
    if out is None:
        out = torch.empty((k, m, m) if not squeeze else (m, m), dtype=X.dtype, device=X.device)
    C3 = _as3d(out)
    if C3.shape != (k, m, m):
        raise ValueError(f"sym_matmul: out shape {tuple(out.shape)}, expected {(k, m, m)}")
    Z3 = None if Z is None else _as3d(Z)
    if Z3 is not None and Z3.shape != (k, m, m):
        raise ValueError(f"sym_matmul: Z shape {tuple(Z3.shape)}, expected {(k, m, m)}")
    for name, t in (("X", X3), ("Y", Y3), ("Z", Z3)):
        if t is not None and t.data_ptr() == C3.data_ptr():
            raise ValueError(f"sym_matmul: out must not alias {name}")

    cfg = dict(config or pick_config(m, p, X.dtype, X.device))
    block = cfg.pop("BLOCK")
    n_tiles = triton.cdiv(m, block)
    tile_i, tile_j = upper_tile_indices(n_tiles, X.device)
    Zp = Z3 if Z3 is not None else C3  # dummy pointer when HAS_Z is False
    if X.dtype == torch.float32:
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 and X.is_cuda else "ieee"
    else:
        precision = "tf32"  # ignored for 16-bit inputs
    grid = (tile_i.numel(), k)
    _kernel_for(X.device)[grid](
        X3,
        Y3,
        Zp,
        C3,
        tile_i,
        tile_j,
        m,
        p,
        X3.stride(0),
        X3.stride(1),
        X3.stride(2),
        Y3.stride(0),
        Y3.stride(1),
        Y3.stride(2),
        Zp.stride(0),
        Zp.stride(1),
        Zp.stride(2),
        C3.stride(0),
        C3.stride(1),
        C3.stride(2),
        float(alpha),
        float(beta),
        float(gamma),
        HAS_Z=Z3 is not None,
        HAS_GAMMA=gamma != 0.0,
        BLOCK=block,
        K_TILES=0 if X.is_cuda else triton.cdiv(p, cfg["BLOCK_K"]),
        INPUT_PRECISION=precision,
        **cfg,
    )
    return out
