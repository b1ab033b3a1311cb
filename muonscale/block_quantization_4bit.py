"""Blockwise 4-bit quantization of Muon's momentum, on plain tensors: the first-moment format
of Li, Chen & Zhu, "Memory Efficient Optimizers with 4-bit States" (NeurIPS 2023): blocks of
:data:`BLOCK_SIZE_4BIT` entries, each with its float32 absmax, and each entry the index of the
nearest value of the signed dynamic-exponent (DE) map (:func:`de_values`) of x / absmax.

Blocks are segments of one row of the (rows, cols) matrix
(:func:`~muonscale.block_quantization.block_matrix_shape`), and the 4-bit codes of a row are
packed two per byte (:func:`pack_nibbles`): entry 2j in the low nibble of byte j, entry 2j + 1
in its high nibble; an odd row's last byte holds one code and the code of 0. The derivation
of the map and of the error bound is in *Low-bit state* in the docs. The functions never
synchronize with the host.
"""

from __future__ import annotations

import functools

import torch

from .block_quantization import CPU_PIECE_ENTRIES, block_absmax

BLOCK_SIZE_4BIT = 128
"""Entries per block: the paper's block size for the first moment (its "B128/DE")."""

DE_EXPONENT_BITS = 3
"""Bits after the sign of the 4-bit signed DE map: decades 10⁻², 10⁻¹, 10⁰."""


def de_values() -> list[float]:
    """The 16 values of the signed 4-bit dynamic-exponent map, sorted: for each decade
    10⁻ᵉ (e = 2, 1, 0) with i = 2 − e fraction bits, ± 10⁻ᵉ times the midpoints of the 2ⁱ
    equal segments of [0.1, 1]; then 0 and 1. That is ±0.0055, ±0.0325, ±0.0775, ±0.2125,
    ±0.4375, ±0.6625, ±0.8875, 0 and 1 (the map has +1 and no −1: a block's most negative
    entry, when it sets the absmax, is read as −0.8875 · absmax)."""
    values = [0.0, 1.0]
    for i in range(DE_EXPONENT_BITS):
        decade = 10.0 ** (i - (DE_EXPONENT_BITS - 1))
        segments = 2**i
        for k in range(segments):
            mid = 0.1 + 0.9 * (k + 0.5) / segments
            values += [decade * mid, -decade * mid]
    return sorted(values)


ZERO_CODE = de_values().index(0.0)
"""The code of 0 (7: seven negative values below it)."""

ZERO_BYTE = ZERO_CODE | ZERO_CODE << 4
"""A byte of two zero codes: a zero momentum's packed codes, as :func:`quantize_de4_` writes
them (an odd row's padding nibble too)."""


@functools.cache
def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor(de_values(), dtype=torch.float64)
    return values.float(), ((values[1:] + values[:-1]) / 2).float()


def de_table(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(the map's 16 values, the 15 midpoints between neighbours), float32, on ``device``."""
    values, mids = _tables()
    if values.device != device:
        return values.to(device), mids.to(device)
    return values, mids


def packed_cols(cols: int) -> int:
    """Bytes per row of ``cols`` 4-bit codes."""
    return -(-cols // 2)


def pack_nibbles(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Write the (rows, cols) ``codes`` (integers in 0..15) into the uint8 ``out`` (rows,
    ⌈cols / 2⌉): entry 2j in the low nibble of byte j, entry 2j + 1 in the high nibble; an odd
    row's last high nibble is :data:`ZERO_CODE`."""
    cols = codes.shape[1]
    pairs = cols // 2
    low, high = codes[:, 0 : 2 * pairs : 2], codes[:, 1 : 2 * pairs : 2]
    out[:, :pairs].copy_(low.bitwise_or(high.bitwise_left_shift(4)))
    if cols % 2:
        out[:, pairs].copy_(codes[:, cols - 1].bitwise_or(ZERO_CODE << 4))


def unpack_nibbles(packed: torch.Tensor, cols: int) -> torch.Tensor:
    """The (rows, ``cols``) int32 codes of the uint8 ``packed`` (:func:`pack_nibbles`)."""
    wide = packed.int()
    pairs = torch.stack([wide.bitwise_and(15), wide.bitwise_right_shift(4)], dim=-1)
    return pairs.view(packed.shape[0], -1)[:, :cols]


def _per_entry(blockwise: torch.Tensor, cols: int, block_size: int) -> torch.Tensor:
    """The (rows, blocks) ``blockwise`` repeated over each block's entries: (rows, cols)."""
    return blockwise.repeat_interleave(block_size, dim=1)[:, :cols]


def _row_slices(x: torch.Tensor) -> list[slice]:
    """Whole rows of the (rows, cols) ``x`` worked through at a time: about
    :data:`~muonscale.block_quantization.CPU_PIECE_ENTRIES` entries on CPU (the temporaries
    stay small), all rows elsewhere."""
    rows, cols = x.shape
    step = rows if x.device.type != "cpu" else CPU_PIECE_ENTRIES // max(cols, 1)
    step = max(step, 1)
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)]


def quantize_de4_(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    block_size: int = BLOCK_SIZE_4BIT,
) -> None:
    """Write the packed 4-bit codes (uint8, (rows, ⌈cols / 2⌉)) and float32 ``absmax``
    (rows, blocks) of the (rows, cols) ``x``: each code the index of the DE value nearest to
    x / absmax (x / 1 where the absmax is 0; a midpoint goes to the lower value)."""
    _, mids = de_table(x.device)
    for rows in _row_slices(x):
        part = x[rows]
        absmax[rows] = block_absmax(part, block_size)
        safe = torch.where(absmax[rows] > 0, absmax[rows], 1.0)
        normalized = part.float() / _per_entry(safe, part.shape[1], block_size)
        pack_nibbles(torch.bucketize(normalized, mids, out_int32=True), packed[rows])


def dequantize_de4(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    cols: int,
    block_size: int = BLOCK_SIZE_4BIT,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """map[q] · absmax per entry, in float32, (rows, ``cols``) (``out``: written there): the
    inverse of :func:`quantize_de4_`."""
    if out is None:
        out = torch.empty((packed.shape[0], cols), dtype=torch.float32, device=packed.device)
    values, _ = de_table(packed.device)
    for rows in _row_slices(out):
        codes = unpack_nibbles(packed[rows], cols)
        decoded = values.index_select(0, codes.reshape(-1)).view(codes.shape)
        torch.mul(decoded, _per_entry(absmax[rows], cols, block_size), out=out[rows])
    return out
