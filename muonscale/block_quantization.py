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
import sys
from collections.abc import Iterator

import torch

from muonscale.kernels.cpu_quantization import dequantize_dynamic_cpu, quantize_dynamic_cpu

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


CPU_PIECE_ENTRIES = 2**19
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


BUCKET_SHIFT = 16
"""A float32 magnitude's bucket is its bits above the lowest 16 (exponent and 7 mantissa bits):
every bucket below 1 holds at most one midpoint between neighbouring table values (their gaps
are wider than a bucket; :func:`_dynamic_code_buckets` checks it)."""


@functools.cache
def _dynamic_code_buckets(signed: bool) -> torch.Tensor:
    """Per bucket h of a float32 magnitude m ≤ 1 (its bits above the lowest
    :data:`BUCKET_SHIFT`), the int32 r[h] with ``(r[h] + bits(m)) >> 16`` = the code of m:
    r[h] = (c + 1) · 2¹⁶ − 1 − t − h · 2¹⁶, where c is the code of the bucket's smallest value
    (the magnitude's index; the signed format's positive half: + 128) and t the low 16 bits
    of the midpoint inside the bucket, where there is one (c · 2¹⁶ − h · 2¹⁶ otherwise). The
    midpoints are the float64 ones rounded down to float32, so a float32 m passes one exactly
    when it passes the float64 midpoint: the code is the float64 reference's nearest value (a
    tie: the smaller magnitude)."""
    values = torch.tensor(dynamic_values(signed), dtype=torch.float64)
    magnitudes = values[values >= 0].unique()  # ascending; the signed format's zeros once
    exact = (magnitudes[1:] + magnitudes[:-1]) / 2
    mids = exact.float()
    mids = torch.where(mids.double() > exact, mids.nextafter(torch.tensor(0.0)), mids)
    buckets = torch.arange(2 ** (31 - BUCKET_SHIFT), dtype=torch.int32)
    low = (buckets << BUCKET_SHIFT).view(torch.float32)
    high = ((buckets << BUCKET_SHIFT) | (2**BUCKET_SHIFT - 1)).view(torch.float32)
    finite = low.isfinite()  # the infinity and NaN buckets: the largest code
    low, high = torch.where(finite, low, 2.0), torch.where(finite, high, 2.0)
    below = torch.searchsorted(mids, low)  # midpoints < the bucket's smallest value
    inside = torch.searchsorted(mids, high) - below  # midpoints in [low, high)
    if inside[high <= 1].max() > 1:
        raise AssertionError("a bucket holds two midpoints: shorten BUCKET_SHIFT")
    midpoint_low = mids[below.clamp(max=mids.numel() - 1)].view(torch.int32)
    midpoint_low = midpoint_low & (2**BUCKET_SHIFT - 1)
    r = (below + (128 if signed else 0) - buckets) << BUCKET_SHIFT
    r = torch.where(inside == 1, r + 2**BUCKET_SHIFT - 1 - midpoint_low, r)
    return r.int()


def _nearest_dynamic_code(normalized: torch.Tensor, signed: bool) -> torch.Tensor:
    """Index into :func:`dynamic_table` of the value nearest to each entry of ``normalized``
    (float32, in [−1, 1]), from its bits b: one look-up per entry by the magnitude's bucket h
    (:func:`_dynamic_code_buckets`), then (r[h] + b) >> 16, integer arithmetic. A signed
    entry's sign reflects the code: for the magnitude code c (128..255), c for x ≥ 0 and
    255 − c (the complement in 8 bits) for x < 0; 0 is code 128, −0 code 127, both the value
    0. For x < 0, b carries the sign bit −2³¹, which moves the shifted sum by −2¹⁵ ≡ 0 modulo
    256. Returns int32 codes, right modulo 256 (the uint8 store keeps those bits)."""
    bits = normalized.contiguous().view(torch.int32)
    buckets = _dynamic_code_buckets(signed)
    if buckets.device != bits.device:
        buckets = buckets.to(bits.device)
    bucket = bits >> BUCKET_SHIFT
    bucket &= 2 ** (31 - BUCKET_SHIFT) - 1  # the magnitude's bucket: no sign bit
    code = buckets.index_select(0, bucket.view(-1)).view(bits.shape)
    del bucket
    code += bits
    code >>= BUCKET_SHIFT
    if signed:
        code ^= bits >> 31  # all ones for x < 0: the complement
    return code


def _quantize_dynamic_piece(
    x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool, block_size: int
) -> None:
    absmax.copy_(block_absmax(x, block_size))
    safe = torch.where(absmax > 0, absmax, 1.0)
    for start, stop, first, count in _segments(x.shape[1], block_size):
        normalized = _blocks(x, start, stop, count).float() / safe[:, first : first + count, None]
        _blocks(codes, start, stop, count).copy_(_nearest_dynamic_code(normalized, signed))


@functools.cache
def _dynamic_pair_table(signed: bool) -> torch.Tensor:
    """65536 int64 entries, entry c₀ + 256 c₁ holding the float32 values of codes c₀ and c₁
    in memory order (little-endian): two adjacent codes read as one uint16 look up both."""
    table = _dynamic_table(signed)
    codes = torch.arange(2**16)
    pairs = torch.stack([table[codes % 256], table[codes // 256]], dim=1)  # (65536, 2)
    return pairs.view(torch.int64).view(-1)


def _dynamic_values(codes: torch.Tensor, signed: bool) -> torch.Tensor:
    """table[q] of the (rows, cols) ``codes``, float32, contiguous. On CPU, where a look-up
    runs on one thread, two adjacent codes are looked up at once
    (:func:`_dynamic_pair_table`) when the codes can be read as uint16."""
    flat = codes.reshape(-1)
    if (
        codes.device.type == "cpu"
        and sys.byteorder == "little"
        and flat.numel() % 2 == 0
        and flat.storage_offset() % 2 == 0
    ):
        pairs = flat.view(torch.uint16).to(torch.int32)
        values = _dynamic_pair_table(signed).index_select(0, pairs).view(torch.float32)
    else:
        values = dynamic_table(signed, codes.device).index_select(0, flat.int())
    return values.view(codes.shape)


def _dequantize_dynamic_piece(
    codes: torch.Tensor, absmax: torch.Tensor, *, signed: bool, block_size: int, out: torch.Tensor
) -> None:
    values = _dynamic_values(codes, signed)
    for start, stop, first, count in _segments(codes.shape[1], block_size):
        target = _blocks(out, start, stop, count)
        part = _blocks(values, start, stop, count)
        torch.mul(part, absmax[:, first : first + count, None], out=target)


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
    (rows, blocks) of the (rows, cols) ``x``: the nearest table value of x / absmax. On CPU,
    float32: :mod:`muonscale.kernels.cpu_quantization`, the same bits in one pass."""
    buckets = _dynamic_code_buckets(signed)
    if quantize_dynamic_cpu(x, codes, absmax, buckets, signed=signed, block_size=block_size):
        return
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
    if dequantize_dynamic_cpu(codes, absmax, _dynamic_table(signed), out, block_size):
        return out
    for rows in _row_pieces(codes):
        _dequantize_dynamic_piece(
            codes[rows], absmax[rows], signed=signed, block_size=block_size, out=out[rows]
        )
    return out
