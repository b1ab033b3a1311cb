"""The 4-bit dynamic-exponent momentum format against float64 references: the map's values,
the packing of two codes per byte (odd rows included), the code picked for each entry (the
nearest map value) and the error bound derived from the map's gaps (*Low-bit state* in the
docs)."""

import pytest
import torch

from muonscale.block_quantization import scale_shape
from muonscale.block_quantization_4bit import (
    BLOCK_SIZE_4BIT,
    de_values,
    dequantize_de4,
    pack_nibbles,
    packed_cols,
    quantize_de4_,
    unpack_nibbles,
)

B = BLOCK_SIZE_4BIT
SHAPES = [(3, 2 * B), (5, B + 7), (4, 2 * B + 45), (2, 19), (1, 1)]
"""Whole blocks only, a short last block (odd and even rows), one short block, one entry."""

PUBLISHED = [0.0055, 0.0325, 0.0775, 0.2125, 0.4375, 0.6625, 0.8875]
"""The nonzero magnitudes of the 4-bit signed DE map (Li, Chen & Zhu, 2023; its first
moment's map), besides +1."""


def test_de_values_are_the_published_map():
    values = torch.tensor(de_values(), dtype=torch.float64)
    assert values.numel() == 16 and (values.diff() > 0).all()
    expected = sorted([0.0, 1.0, *PUBLISHED, *(-v for v in PUBLISHED)])
    torch.testing.assert_close(values, torch.tensor(expected, dtype=torch.float64))
    assert B == 128


def test_packing_puts_even_entries_in_low_nibbles_and_pads_odd_rows_with_zero():
    codes = torch.tensor([[1, 2, 3], [15, 0, 7]], dtype=torch.int32)
    packed = torch.empty(2, packed_cols(3), dtype=torch.uint8)
    pack_nibbles(codes, packed)
    assert packed.tolist() == [[0x21, 0x73], [0x0F, 0x77]]  # odd rows: 0's code (7) pads
    assert torch.equal(unpack_nibbles(packed, 3), codes)
    g = torch.Generator().manual_seed(0)
    for cols in (1, 2, 127, 128, 301):
        codes = torch.randint(16, (3, cols), generator=g, dtype=torch.int32)
        packed = torch.empty(3, packed_cols(cols), dtype=torch.uint8)
        pack_nibbles(codes, packed)
        assert torch.equal(unpack_nibbles(packed, cols), codes)


def _sample(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over four decades: the map's whole range, and below its smallest value
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return x * 10.0 ** torch.randint(-3, 1, shape, generator=g, dtype=torch.float64)


def _reference_absmax(x):
    rows, cols = x.shape
    out = torch.zeros(scale_shape(rows, cols, B), dtype=torch.float64)
    for j in range(out.shape[1]):
        out[:, j] = x[:, j * B : (j + 1) * B].abs().amax(dim=1)
    return out.repeat_interleave(B, dim=1)[:, :cols]


def _map():
    return torch.tensor(de_values(), dtype=torch.float64)


def _quantize(x):
    rows, cols = x.shape
    packed = torch.empty(rows, packed_cols(cols), dtype=torch.uint8)
    absmax = torch.empty(scale_shape(rows, cols, B), dtype=torch.float32)
    quantize_de4_(x, packed, absmax)
    return packed, absmax


@pytest.mark.parametrize("shape", SHAPES)
def test_de4_codes_are_nearest_and_the_error_is_bounded(shape):
    x64 = _sample(shape, 1)
    x = x64.float()
    packed, absmax = _quantize(x)
    assert packed.shape == (shape[0], -(-shape[1] // 2))
    scale = _reference_absmax(x.double())
    torch.testing.assert_close(
        absmax.double().repeat_interleave(B, dim=1)[:, : shape[1]], scale, rtol=0, atol=0
    )
    table = _map()
    normalized = x.double() / torch.where(scale > 0, scale, 1.0)
    codes = unpack_nibbles(packed, shape[1]).long()
    # float64 reference: the nearest map value (float32 rounding of the quotient aside)
    distance = (normalized[..., None] - table).abs()
    chosen = distance.gather(-1, codes[..., None]).squeeze(-1)
    assert (chosen <= distance.min(dim=-1).values + 1e-6).all()
    # error ≤ half the gap to the neighbour on x's side; below −0.8875, the distance to −1
    back = dequantize_de4(packed, absmax, shape[1])
    assert back.dtype == torch.float32 and back.shape == shape
    gaps = table.diff()
    upper = torch.cat([gaps, gaps[-1:]])
    lower = torch.cat([2 * (table[:1] + 1), gaps])
    gap = torch.maximum(upper[codes], lower[codes])
    bound = scale * (gap / 2 + 1e-6)
    assert ((back.double() - x64).abs() <= bound).all()
    # the whole bound: 0.1125 of the block's absmax
    assert ((back.double() - x64).abs() <= scale * (0.1125 + 1e-6)).all()


def test_de4_codes_are_nearest_on_a_dense_grid():
    """Every map value, every midpoint and its float32 neighbours, and a log grid over six
    decades, both signs: the code is a nearest map value (float64 distances)."""
    table = _map()
    mids = (table[1:] + table[:-1]) / 2
    grid = torch.logspace(-6, 0, 4000, dtype=torch.float64)
    points = torch.cat([table, mids, grid, -grid]).float()
    points = torch.cat([points, points.nextafter(torch.tensor(2.0)), points.nextafter(-points)])
    points = points.clamp(-1, 1)
    cols = B - 1  # each row: 1.0 first (the block's absmax), then 127 points
    rows = -(-points.numel() // cols)
    padded = torch.zeros(rows * cols)
    padded[: points.numel()] = points
    x = torch.cat([torch.ones(rows, 1), padded.view(rows, cols)], dim=1)
    packed, absmax = _quantize(x)
    assert torch.equal(absmax, torch.ones_like(absmax))
    codes = unpack_nibbles(packed, B).long()
    distance = (x.double()[..., None] - table).abs()
    chosen = distance.gather(-1, codes[..., None]).squeeze(-1)
    # a point within float32 rounding (relative 1e-6 of it) of a midpoint may take either side
    assert (chosen <= distance.min(dim=-1).values + 1e-6 * x.double().abs()).all()


def test_de4_zero_block_is_zero_and_a_positive_block_maximum_exact():
    x = torch.zeros(2, 301)
    x[1, 5] = 3.0
    x[1, 200] = -0.5
    packed, absmax = _quantize(x)
    back = dequantize_de4(packed, absmax, 301)
    assert torch.equal(back[0], x[0]) and back[1, 5] == 3.0
    # −0.5 sets its block's absmax; the map has no −1, so it reads as −0.8875 · 0.5
    assert back[1, 200] == torch.tensor(-0.8875).float() * 0.5
    assert (back[1, 6:200] == 0).all() and (back[1, 201:] == 0).all()


def test_de4_of_a_large_matrix_in_row_pieces_equals_its_rows_alone():
    """A matrix of more than ``CPU_PIECE_ENTRIES`` entries is worked through in row pieces on
    CPU: its codes, absmax and values are those of each row quantized alone."""
    from muonscale.block_quantization import CPU_PIECE_ENTRIES

    cols = B + 3
    rows = CPU_PIECE_ENTRIES // cols + 5  # two pieces, the second short
    x = _sample((rows, cols), 2).float()
    packed, absmax = _quantize(x)
    back = dequantize_de4(packed, absmax, cols)
    for r in (0, rows // 2, rows - 1):
        p, a = _quantize(x[r : r + 1])
        assert torch.equal(packed[r : r + 1], p) and torch.equal(absmax[r : r + 1], a)
        assert torch.equal(back[r : r + 1], dequantize_de4(p, a, cols))
