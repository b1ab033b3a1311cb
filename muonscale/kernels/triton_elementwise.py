"""Triton kernels for the two elementwise passes of a Muon step, one launch per stack.

* :func:`momentum_and_ns_input_` — B ← B.lerp(G, 1 − μ), then U = G.lerp(B, μ) (Nesterov) or
  B, written in the Newton–Schulz dtype into slot j of a ``(k, rows, cols)`` input stack.
* :func:`apply_update_` — W ← W · (1 − lr · λ) + (lr · α) · O[j], O the Newton–Schulz output
  stack in its own dtype.

The members of a stack are separate tensors (gradients, parameters, momentum views): the
kernels read a table of their addresses (cached per set of addresses, so a steady state
copies nothing to the device). Each element is computed with torch's formulas, in float32
(torch's ``opmath`` for 16-bit tensors) and rounded once to the destination dtype:
``lerp(a, b, w) = a + w(b − a)`` for |w| < 0.5, else ``b − (b − a)(1 − w)``, as one fused
multiply-add, as nvcc compiles torch's CUDA kernels. Importing this module needs ``triton``;
on CPU tensors the kernels run under the Triton interpreter (tests), whose multiply-add
rounds twice (see *Newton–Schulz* in the docs).
"""

from __future__ import annotations

import functools
import struct
from collections import OrderedDict
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

__all__ = ["apply_update_", "momentum_and_ns_input_", "supports"]

BLOCK = 1024
"""Elements per program (4 warps, 8 per thread: 32-byte loads of float32)."""

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _momentum_ns_input_kernel(
    G_PTRS,  # (k,) int64: address of each member's gradient (contiguous, numel N)
    B_PTRS,  # (k,) int64: address of each member's momentum buffer (contiguous)
    X,  # (k, rows, cols) Newton–Schulz input stack
    N,  # elements per member (rows · cols)
    COLS,
    stride_xb,
    stride_xr,
    stride_xc,
    beta_weight,  # 1 − μ (float32)
    nesterov_weight,  # μ (float32)
    G_DTYPE: tl.constexpr,
    B_DTYPE: tl.constexpr,
    NESTEROV: tl.constexpr,
    BETA_SMALL: tl.constexpr,
    NESTEROV_SMALL: tl.constexpr,
    X_CONTIGUOUS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    member = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g_ptr = tl.load(G_PTRS + member).to(tl.pointer_type(G_DTYPE))
    b_ptr = tl.load(B_PTRS + member).to(tl.pointer_type(B_DTYPE))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    # update_momentum_ casts G to the buffer's dtype first, then lerps in float32
    # torch's lerp(a, e, w) in float32: a + w(e − a) for |w| < 0.5, else e − (e − a)(1 − w),
    # each one multiply-add. Written inline: the interpreter twin cannot call @jit helpers.
    g_b = g.to(B_DTYPE).to(tl.float32)
    if BETA_SMALL:
        b = tl.fma(beta_weight, g_b - b, b)
    else:
        b = tl.fma(beta_weight - 1.0, g_b - b, g_b)
    b = b.to(B_DTYPE)
    tl.store(b_ptr + offs, b, mask=mask)
    if NESTEROV:
        # write_directions_: the buffer in the gradient's dtype, lerp in float32, then the cast
        g32 = g.to(tl.float32)
        b32 = b.to(G_DTYPE).to(tl.float32)
        if NESTEROV_SMALL:
            u = tl.fma(nesterov_weight, b32 - g32, g32)
        else:
            u = tl.fma(nesterov_weight - 1.0, b32 - g32, b32)
        u = u.to(G_DTYPE)
    else:
        u = b.to(G_DTYPE)
    if X_CONTIGUOUS:
        x_offs = member.to(tl.int64) * stride_xb + offs
    else:
        x_offs = member.to(tl.int64) * stride_xb + (offs // COLS) * stride_xr
        x_offs += (offs % COLS) * stride_xc
    tl.store(X + x_offs, u.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _apply_update_kernel(
    P_PTRS,  # (k,) int64: address of each member's parameter (contiguous, numel N)
    O,  # (k, rows, cols) Newton–Schulz output stack
    N,
    COLS,
    stride_ob,
    stride_or,
    stride_oc,
    decay,  # 1 − lr · λ (float32)
    step,  # lr · α (float32)
    P_DTYPE: tl.constexpr,
    HAS_DECAY: tl.constexpr,
    O_CONTIGUOUS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    member = tl.program_id(1)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p_ptr = tl.load(P_PTRS + member).to(tl.pointer_type(P_DTYPE))
    if O_CONTIGUOUS:
        o_offs = member.to(tl.int64) * stride_ob + offs
    else:
        o_offs = member.to(tl.int64) * stride_ob + (offs // COLS) * stride_or
        o_offs += (offs % COLS) * stride_oc
    o = tl.load(O + o_offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DECAY:
        # _foreach_mul_ rounds W · (1 − lr λ) to W's dtype before the add
        p = (p * decay).to(P_DTYPE).to(tl.float32)
    # _foreach_add_(W, O, alpha=lr α): one multiply-add in float32
    tl.store(p_ptr + offs, tl.fma(o, step, p).to(P_DTYPE), mask=mask)


def _float32(x: float) -> float:
    """``x`` rounded to float32 (as torch rounds a Python scalar for a float32 opmath): the
    GPU kernel gets float32 scalars anyway; the interpreter would keep a float64."""
    return struct.unpack("f", struct.pack("f", x))[0]


@functools.cache
def _interpreted(kernel):
    """An interpreter twin of ``kernel``, for CPU tensors (tests)."""
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(getattr(kernel, "fn", kernel))


def _launcher(kernel, device: torch.device):
    if device.type == "cuda" or type(kernel).__name__ == "InterpretedFunction":
        return kernel
    return _interpreted(kernel)


_MAX_TABLES = 256
_tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _address_table(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(k,) int64 tensor of the tensors' addresses, on ``device``; cached per tuple of
    addresses (the same gradients, buffers and parameters step after step)."""
    key = (str(device), *(t.data_ptr() for t in tensors))
    table = _tables.get(key)
    if table is not None:
        _tables.move_to_end(key)
        return table
    host = torch.tensor(key[1:], dtype=torch.int64)
    if device.type == "cuda":
        table = host.pin_memory().to(device, non_blocking=True)
    else:
        table = host
    _tables[key] = table
    while len(_tables) > _MAX_TABLES:
        _tables.popitem(last=False)
    return table


def supports(
    tensors: Sequence[torch.Tensor], *, dtypes: Sequence[torch.dtype] = tuple(_TL_DTYPES)
) -> bool:
    """Whether the kernels take these per-member tensors: contiguous, of one of ``dtypes``."""
    return all(t.is_contiguous() and t.dtype in dtypes for t in tensors)


def _check_stack(name: str, stack: torch.Tensor, k: int, n: int, device: torch.device) -> None:
    if stack.dim() != 3 or stack.shape[0] != k or stack.shape[1] * stack.shape[2] != n:
        raise ValueError(
            f"{name}: expected a ({k}, rows, cols) stack with rows·cols = {n}, "
            f"got {tuple(stack.shape)}"
        )
    if stack.dtype not in _TL_DTYPES or stack.device != device:
        raise ValueError(f"{name}: float32/bfloat16/float16 on {device}, got {stack.dtype}")


def _check_members(name: str, tensors: Sequence[torch.Tensor], n: int) -> None:
    for t in tensors:
        if t.numel() != n or not t.is_contiguous() or t.dtype not in _TL_DTYPES:
            raise ValueError(
                f"{name}: every member must be contiguous float32/bfloat16/float16 with "
                f"{n} elements, got {tuple(t.shape)} {t.dtype}"
            )


def momentum_and_ns_input_(
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor],
    out: torch.Tensor,
    *,
    momentum: float,
    nesterov: bool,
) -> torch.Tensor:
    """B ← B.lerp(G, 1 − μ) in place, and ``out[j]`` ← U of member j (G.lerp(B, μ) with
    Nesterov, else B) in ``out``'s dtype: :func:`muonscale.functional.update_momentum_`
    followed by ``write_directions_``, in one launch. ``out`` is a ``(k, rows, cols)`` stack
    (any strides) whose slot j has the members' element order. Returns ``out``."""
    k = len(grads)
    if k == 0:
        return out
    n = grads[0].numel()
    _check_members("momentum_and_ns_input_: grads", grads, n)
    _check_members("momentum_and_ns_input_: momentum_buffers", momentum_buffers, n)
    if len(momentum_buffers) != k:
        raise ValueError("momentum_and_ns_input_: one momentum buffer per gradient")
    device = out.device
    _check_stack("momentum_and_ns_input_: out", out, k, n, device)
    g_dtype, b_dtype = grads[0].dtype, momentum_buffers[0].dtype
    if any(g.dtype != g_dtype for g in grads) or any(b.dtype != b_dtype for b in momentum_buffers):
        raise ValueError("momentum_and_ns_input_: members of a stack share their dtypes")
    beta_weight, nesterov_weight = 1 - momentum, momentum
    grid = (triton.cdiv(n, BLOCK), k)
    _launcher(_momentum_ns_input_kernel, device)[grid](
        _address_table(grads, device),
        _address_table(momentum_buffers, device),
        out,
        n,
        out.shape[2],
        out.stride(0),
        out.stride(1),
        out.stride(2),
        _float32(beta_weight),
        _float32(nesterov_weight),
        G_DTYPE=_TL_DTYPES[g_dtype],
        B_DTYPE=_TL_DTYPES[b_dtype],
        NESTEROV=bool(nesterov),
        BETA_SMALL=abs(beta_weight) < 0.5,
        NESTEROV_SMALL=abs(nesterov_weight) < 0.5,
        X_CONTIGUOUS=out[0].is_contiguous(),
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out


def apply_update_(
    params: Sequence[torch.Tensor],
    updates: torch.Tensor,
    *,
    lr: float,
    weight_decay: float,
    alpha: float,
) -> None:
    """W ← W · (1 − lr · λ) + (lr · α) · ``updates[j]`` for member j, in place: the
    arithmetic of :func:`muonscale.matrix_step.apply_updates_` with one α, in one launch.
    ``updates`` is a ``(k, rows, cols)`` stack (any strides, its own dtype)."""
    k = len(params)
    if k == 0:
        return
    if isinstance(lr, torch.Tensor):
        raise TypeError("apply_update_: lr must be a Python float (tensor lr: foreach path)")
    n = params[0].numel()
    _check_members("apply_update_: params", params, n)
    p_dtype = params[0].dtype
    if any(p.dtype != p_dtype for p in params):
        raise ValueError("apply_update_: members of a stack share their dtype")
    device = updates.device
    _check_stack("apply_update_: updates", updates, k, n, device)
    grid = (triton.cdiv(n, BLOCK), k)
    _launcher(_apply_update_kernel, device)[grid](
        _address_table(params, device),
        updates,
        n,
        updates.shape[2],
        updates.stride(0),
        updates.stride(1),
        updates.stride(2),
        _float32(1 - lr * weight_decay),
        _float32(lr * alpha),
        P_DTYPE=_TL_DTYPES[p_dtype],
        HAS_DECAY=weight_decay != 0,
        O_CONTIGUOUS=updates[0].is_contiguous(),
        BLOCK=BLOCK,
        num_warps=4,
    )
