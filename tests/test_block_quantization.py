"""The blockwise 8-bit formats against float64 references: the codes a reference picks, and
the error bounds that follow from the code resolution (*Low-bit state* in the docs)."""

import pytest
import torch

from muonscale.block_quantization import (
    BLOCK_SIZE,
    LINEAR_LEVELS,
    block_matrix_shape,
    dequantize_dynamic,
    dequantize_linear,
    dynamic_values,
    quantize_dynamic_,
    quantize_linear_,
    scale_shape,
)

SHAPES = [(3, 2 * BLOCK_SIZE), (5, BLOCK_SIZE + 7), (2, 19), (1, 1)]
"""Whole blocks only, whole blocks and a short last block, one short block, one entry."""


def _sample(shape, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes over six decades, some zero blocks-worth of entries: the map's whole range
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x *= 10.0 ** torch.randint(-6, 1, shape, generator=g, dtype=torch.float64)
    return x


def _reference_absmax(x, block):
    rows, cols = x.shape
    out = torch.zeros(scale_shape(rows, cols, block), dtype=torch.float64)
    for j in range(out.shape[1]):
        out[:, j] = x[:, j * block : (j + 1) * block].abs().amax(dim=1)
    return out


def _per_entry(blockwise, cols, block):
    return blockwise.repeat_interleave(block, dim=1)[:, :cols]


@pytest.mark.parametrize("shape", SHAPES)
def test_linear_codes_and_error_bound(shape):
    x64 = _sample(shape, 0)
    x = x64.float()
    codes = torch.empty(shape, dtype=torch.int8)
    scales = torch.empty(scale_shape(*shape), dtype=torch.float32)
    quantize_linear_(x, codes, scales)
    step = _per_entry(
        _reference_absmax(x.double(), BLOCK_SIZE) / LINEAR_LEVELS, shape[1], BLOCK_SIZE
    )
    torch.testing.assert_close(
        scales.double(), _reference_absmax(x.double(), BLOCK_SIZE) / 127, rtol=2**-23, atol=0
    )
    exact = x.double() / torch.where(step > 0, step, 1.0)
    # the code is the nearest integer of x / s, except within float32 rounding of a half
    near_half = (exact - exact.floor() - 0.5).abs() < 1e-5
    assert torch.equal(codes.double()[~near_half], exact.round()[~near_half])
    assert codes.abs().max() <= LINEAR_LEVELS
    back = dequantize_linear(codes, scales)
    assert back.dtype == torch.float32
    # |x − q s| ≤ s / 2, plus float32 rounding of the quotient and of the product
    bound = step * (0.5 + 2**-20) + x64.abs() * 2**-23
    assert ((back.double() - x64).abs() <= bound).all()
    # the largest entry of each block is represented within float32 rounding
    assert (back.double() - x.double()).abs().amax() <= step.amax() * 0.5 + 1e-30


def test_linear_zero_block_is_zero():
    x = torch.zeros(2, 300)
    x[1, 5] = 3.0
    codes = torch.empty(2, 300, dtype=torch.int8)
    scales = torch.empty(scale_shape(2, 300))
    quantize_linear_(x, codes, scales)
    assert torch.equal(dequantize_linear(codes, scales), x)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_values(signed):
    values = torch.tensor(dynamic_values(signed), dtype=torch.float64)
    assert values.numel() == 256
    assert values.max() == 1.0 and (values.min() == -1.0 if signed else values.min() == 0.0)
    assert (values.diff() >= 0).all()
    assert values.unique().numel() == (255 if signed else 256)  # the signed format's two zeros
    smallest = values[values > 0].min()
    assert smallest == pytest.approx(10.0 ** -(6 if signed else 7))


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_codes_and_error_bound(shape, signed):
    x64 = _sample(shape, 1)
    if not signed:
        x64 = x64.square()  # a second moment: ≥ 0, over twelve decades
    x = x64.float()
    codes = torch.empty(shape, dtype=torch.uint8)
    absmax = torch.empty(scale_shape(*shape), dtype=torch.float32)
    quantize_dynamic_(x, codes, absmax, signed=signed)
    table = torch.tensor(dynamic_values(signed), dtype=torch.float64)
    scale = _per_entry(_reference_absmax(x.double(), BLOCK_SIZE), shape[1], BLOCK_SIZE)
    normalized = x.double() / torch.where(scale > 0, scale, 1.0)
    # float64 reference: the nearest table value (ties and float32 rounding aside)
    distance = (normalized[..., None] - table).abs()
    best = distance.min(dim=-1).values
    chosen = distance.gather(-1, codes.long()[..., None]).squeeze(-1)
    assert (chosen <= best + 1e-6).all()
    # error ≤ half the gap to the neighbouring value on x's side, times the block's absmax
    back = dequantize_dynamic(codes, absmax, signed=signed)
    gaps = torch.cat([table.diff(), table.diff()[-1:]])
    lower_gaps = torch.cat([table.diff()[:1], table.diff()])
    gap = torch.maximum(gaps[codes.long()], lower_gaps[codes.long()])
    bound = scale * (gap / 2 + 1e-6)
    assert ((back.double() - x64).abs() <= bound).all()
    if not signed:
        assert (back >= 0).all()


@pytest.mark.parametrize(
    ("shape", "mode", "expected"),
    [
        ((7,), "flatten", (1, 7)),
        ((4, 6), "flatten", (4, 6)),
        ((3, 4, 6), "batch", (12, 6)),
        ((8, 3, 3, 3), "flatten", (8, 27)),
    ],
)
def test_block_matrix_shape(shape, mode, expected):
    assert block_matrix_shape(shape, mode) == expected


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_codes_are_nearest_on_a_dense_grid(signed):
    """Every table value, every midpoint and its float32 neighbours, and a log grid over
    nine decades: the code is a nearest table value (float64 distances)."""
    table = torch.tensor(dynamic_values(signed), dtype=torch.float64)
    mids = (table[1:] + table[:-1]) / 2
    grid = torch.logspace(-9, 0, 20000, dtype=torch.float64)
    points = torch.cat([table, mids, grid, -grid if signed else grid]).float()
    points = torch.cat([points, points.nextafter(torch.tensor(2.0)), points.nextafter(-points)])
    points = points.clamp(-1 if signed else 0, 1)
    cols = BLOCK_SIZE - 1  # each row: 1.0 first (the block's absmax), then 255 points
    rows = -(-points.numel() // cols)
    padded = torch.zeros(rows * cols)
    padded[: points.numel()] = points
    x = torch.cat([torch.ones(rows, 1), padded.view(rows, cols)], dim=1)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    absmax = torch.empty(scale_shape(*x.shape))
    quantize_dynamic_(x, codes, absmax, signed=signed)
    assert torch.equal(absmax, torch.ones_like(absmax))
    distance = (x.double()[..., None] - table).abs()
    chosen = distance.gather(-1, codes.long()[..., None]).squeeze(-1)
    # a point within float32 rounding (relative 1e-6 of it) of a midpoint may take either side
    assert (chosen <= distance.min(dim=-1).values + 1e-6 * x.double().abs()).all()


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_codes_are_the_float64_nearest_exactly(signed):
    """For float32 entries, the code's float64 distance is the smallest one, with no
    tolerance: entries next to a midpoint (its float32 neighbours on both sides) take the
    side the float64 midpoint puts them on."""
    table = torch.tensor(dynamic_values(signed), dtype=torch.float64)
    mids = ((table[1:] + table[:-1]) / 2).float()
    g = torch.Generator().manual_seed(2)
    spread = torch.rand(4000, generator=g) * 10.0 ** torch.randint(-8, 1, (4000,), generator=g)
    points = torch.cat([mids, mids.nextafter(torch.tensor(2.0)), mids.nextafter(-mids), spread])
    points = torch.cat([points, -points] if signed else [points]).clamp(-1, 1)
    # rows of one block: 1.0 first (the block's absmax, so x / absmax = x), then the points
    blocks = torch.nn.functional.pad(points, (0, -points.numel() % (BLOCK_SIZE - 1)))
    x = torch.nn.functional.pad(blocks.view(-1, BLOCK_SIZE - 1), (1, 0), value=1.0)
    codes, absmax = torch.empty_like(x, dtype=torch.uint8), torch.empty(x.shape[0], 1)
    quantize_dynamic_(x, codes, absmax, signed=signed)
    assert torch.equal(absmax, torch.ones_like(absmax))
    distance = (x.double()[..., None] - table).abs()
    chosen = distance.gather(-1, codes.long()[..., None]).squeeze(-1)
    assert torch.equal(chosen, distance.min(dim=-1).values)
