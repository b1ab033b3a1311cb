"""Blockwise 8-bit quantization of optimizer state, on plain tensors.

A state tensor is read as a (rows, cols) matrix (:func:`block_matrix_shape`) and cut into
blocks of :data:`BLOCK_SIZE` consecutive entries of one row (the last block of a row may be
shorter). Each block keeps one float32 scale; each entry one byte:

* **linear** (Muon's momentum): int8 codes, x ≈ q · s with s = absmax / 127 per block, q
  rounded to nearest; error ≤ s / 2 per entry.
* **dynamic** (AdamW's moments, "8-bit Optimizers via Block-wise Quantization", Dettmers et
  al., 2022): uint8 indices into a sorted table of 256 values in [−1, 1] (signed, the first
  moment) or [0, 1] (unsigned, the second), dense near 0; x ≈ table[q] · absmax per block,
  q the nearest table value of x / absmax.

The derivation of the error bounds and the choice of block size are in *Low-bit state* in
the docs. The functions never synchronize with the host.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator

import torch

BLOCK_SIZE = 256
"""Entries per block (one float32 scale each: 4 / 256 = 1.6 % over the codes)."""

LINEAR_LEVELS = 127
"""Largest int8 code of the linear format (symmetric: −127..127)."""


def block_matrix_shape(shape: tuple[int, ...] | torch.Size, matrix_mode: str = "flatten"):
    """(rows, cols) a state tensor of ``shape`` is blocked in: blocks are segments of one row.
    1-D: one row; 2-D, and stacks of matrices (``matrix_mode="batch"``): the last dim; other
    tensors of 3 or more dims (``"flatten"``): (dim 0, the rest), Muon's flattened matrix.
    Dim 0 always splits between rows, so a ``Shard(0)`` boundary between rows cuts no block."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    if len(shape) == 2 or matrix_mode == "batch":
        return (numel // shape[-1] if shape[-1] else 0), shape[-1]
    return shape[0], (numel // shape[0] if shape[0] else 0)


def scale_shape(rows: int, cols: int, block_size: int = BLOCK_SIZE) -> tuple[int, int]:
    """Shape of the scales of a (rows, cols) matrix: one per block of each row."""
    return rows, -(-cols // block_size)


CPU_PIECE_ENTRIES = 2**18
"""On CPU the formats work through a matrix this many entries (whole rows) at a time: their
temporaries stay in cache and in the allocator's pool instead of being mapped afresh (page
faults) for every operation. Rows are independent, so the result is the same."""


def _row_pieces(x: torch.Tensor) -> Iterator[slice]:
    """Slices of whole rows of the (rows, cols) ``x``: :data:`CPU_PIECE_ENTRIES` entries each
    on CPU, all rows elsewhere (one launch per operation)."""
    rows, cols = x.shape
    step = rows if x.device.type != "cpu" else max(1, CPU_PIECE_ENTRIES // max(cols, 1))
    for start in range(0, rows, max(step, 1)):
        yield slice(start, min(rows, start + step))


def _segments(cols: int, block_size: int) -> Iterator[tuple[int, int, int, int]]:
    """(start col, stop col, first block, blocks) of the full blocks, then of the short
    last block of each row (if any)."""
    full = cols // block_size
    if full:
        yield 0, full * block_size, 0, full
    if cols % block_size:
        yield full * block_size, cols, full, 1


def _blocks(x: torch.Tensor, start: int, stop: int, count: int) -> torch.Tensor:
    """Columns [start, stop) of the (rows, cols) ``x`` as (rows, count, block) (a view)."""
    part = x[:, start:stop]
    return part.reshape(x.shape[0], count, (stop - start) // count)


def block_absmax(x: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """max |x| per block of the (rows, cols) ``x``, in float32: (rows, blocks)."""
    rows, cols = x.shape
    out = torch.empty(scale_shape(rows, cols, block_size), dtype=torch.float32, device=x.device)
    for start, stop, first, count in _segments(cols, block_size):
        part = _blocks(x, start, stop, count)
        out[:, first : first + count] = part.abs().amax(dim=-1).float()
    return out


def _quantize_linear_piece(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int
) -> None:
    scales.copy_(block_absmax(x, block_size).div_(LINEAR_LEVELS))
    safe = torch.where(scales > 0, scales, 1.0)
    for start, stop, first, count in _segments(x.shape[1], block_size):
        q = _blocks(x, start, stop, count).float() / safe[:, first : first + count, None]
        q = q.round_().clamp_(-LINEAR_LEVELS, LINEAR_LEVELS)
        _blocks(codes, start, stop, count).copy_(q)


def _dequantize_linear_piece(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: torch.Tensor
) -> None:
    for start, stop, first, count in _segments(codes.shape[1], block_size):
        target = _blocks(out, start, stop, count)
        torch.mul(
            _blocks(codes, start, stop, count), scales[:, first : first + count, None], out=target
        )


@functools.cache
def _dynamic_table(signed: bool) -> torch.Tensor:
    values = dynamic_values(signed)
    return torch.tensor(values, dtype=torch.float32)


def dynamic_values(signed: bool) -> list[float]:
    """The 256 values of the dynamic 8-bit format, sorted (Dettmers et al., 2022, §2: "dynamic
    tree quantization"). A code's bits after the sign (signed only) are a run of e zeros
    (magnitude 10⁻ᵉ), an indicator 1 and f = remaining bits of linear fraction; the value is
    ±10⁻ᵉ · (0.1 + 0.9 (k + 1) / 2ᶠ) for fraction k, so the largest is exactly 1. All-zero
    bits are 0 (the signed format's negative zero too). Every value is distinct except the
    signed format's two zeros."""
    bits = 7 if signed else 8
    magnitudes = [0.0]
    for e in range(bits):
        f = bits - 1 - e
        for k in range(2**f):
            magnitudes.append(10.0**-e * (0.1 + 0.9 * (k + 1) / 2**f))
    if not signed:
        return sorted(magnitudes)
    return sorted([-m for m in magnitudes] + magnitudes)


def dynamic_table(signed: bool, device: torch.device) -> torch.Tensor:
    """:func:`dynamic_values` as a float32 tensor on ``device`` (256 values)."""
    table = _dynamic_table(signed)
    return table if table.device == device else table.to(device)


def _nearest_dynamic_code(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """Index into :func:`dynamic_table` of the value nearest to each entry of ``normalized``
    (in [−1, 1]), computed from the format's structure instead of a search: the decade
    e = ⌊−log₁₀|x|⌋ and the fraction k = round((|x| 10ᵉ − 0.1) / 0.9 · 2ᶠ − 1). Decade e's
    grid extended to k = −1 lands on the largest value of decade e + 1, so rounding within
    the decade is rounding to the nearest value of the table; below half the smallest value
    is 0. Returns int32."""
    bits = 7 if signed else 8
    last = bits - 1  # the decade with no fraction bits: one value, 10⁻ˡᵃˢᵗ
    magnitude = normalized.abs()
    decade = torch.log10(magnitude).neg_().floor_().clamp_(0, last)
    levels = torch.exp2(last - decade)
    k = magnitude * torch.pow(10.0, decade)
    k = k.sub_(0.1).div_(0.9).mul_(levels).sub_(1).round_().clamp_(min=-1)
    index = torch.minimum(k, levels - 1).add_(levels)  # magnitudes ascending, 0 at index 0
    smallest = magnitude >= 0.5 * 10.0**-last
    index = torch.where(decade >= last, smallest.float(), index).int()
    if not signed:
        return index
    half = len(dynamic_values(True)) // 2  # 127 negatives, two zeros, 127 positives
    return torch.where(normalized < 0, (half - 1) - index, half + index)


def _quantize_dynamic_piece(
    x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool, block_size: int
) -> None:
    absmax.copy_(block_absmax(x, block_size))
    safe = torch.where(absmax > 0, absmax, 1.0)
    for start, stop, first, count in _segments(x.shape[1], block_size):
        normalized = _blocks(x, start, stop, count).float() / safe[:, first : first + count, None]
        _blocks(codes, start, stop, count).copy_(_nearest_dynamic_code(normalized, signed))


def _dequantize_dynamic_piece(
    codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool, block_size: int, out: torch.Tensor
) -> None:
    table = dynamic_table(signed, codes.device)
    for start, stop, first, count in _segments(codes.shape[1], block_size):
        target = _blocks(out, start, stop, count)
        index = _blocks(codes, start, stop, count).reshape(-1).int()
        values = table.index_select(0, index).view(target.shape)
        torch.mul(values, absmax[:, first : first + count, None], out=target)


def quantize_linear_(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, block_size: int = BLOCK_SIZE
) -> None:
    """Write int8 ``codes`` (rows, cols) and float32 ``scales`` (rows, blocks) of the
    (rows, cols) ``x``: s = absmax / 127 per block, q = round(x / s) (0 where s = 0)."""
    for rows in _row_pieces(x):
        _quantize_linear_piece(x[rows], codes[rows], scales[rows], block_size)


def dequantize_linear(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = BLOCK_SIZE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q · s per entry, in float32 (``out``: written there): the inverse of
    :func:`quantize_linear_`."""
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    for rows in _row_pieces(codes):
        _dequantize_linear_piece(codes[rows], scales[rows], block_size, out[rows])
    return out


def quantize_dynamic_(
    x: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    *,
    signed: bool,
    block_size: int = BLOCK_SIZE,
) -> None:
    """Write uint8 ``codes`` (indices into :func:`dynamic_table`) and float32 ``absmax``
    (rows, blocks) of the (rows, cols) ``x``: the nearest table value of x / absmax."""
    for rows in _row_pieces(x):
        _quantize_dynamic_piece(
            x[rows], codes[rows], absmax[rows], signed=signed, block_size=block_size
        )


def dequantize_dynamic(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    *,
    signed: bool,
    block_size: int = BLOCK_SIZE,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """table[q] · absmax per entry, in float32 (``out``: written there): the inverse of
    :func:`quantize_dynamic_`."""
    if out is None:
        out = torch.empty(codes.shape, dtype=torch.float32, device=codes.device)
    for rows in _row_pieces(codes):
        _dequantize_dynamic_piece(
            codes[rows], absmax[rows], signed=signed, block_size=block_size, out=out[rows]
        )
    return out
