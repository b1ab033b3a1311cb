"""The plain-tensor math of a TP piece that holds columns of its rows
(:mod:`muonscale.column_blocks`): every rank's codes and scales, given
the maxima of the blocks it shares (the maximum of the ranks' own maxima, as the TP group's
all-reduce takes it), against one process quantizing the whole rows, for every stored format
(int8 linear, 4-bit dynamic exponent, AdamW's signed and unsigned 8-bit dynamic), Megatron's
strided splits and splits whose ranks touch more blocks than their own columns make."""

from __future__ import annotations

import pytest
import torch

from muonscale.column_blocks import (
    column_blocks,
    dequantize_columns,
    local_block_maxima,
    quantize_columns_,
    strided_spans,
)
from muonscale.momentum_formats import INT4_MOMENTUM, INT8_MOMENTUM
from muonscale.quantized_state import ADAMW_FORMATS

FORMATS = {
    "int8": INT8_MOMENTUM,
    "int4": INT4_MOMENTUM,
    "exp_avg": ADAMW_FORMATS["exp_avg"],
    "exp_avg_sq": ADAMW_FORMATS["exp_avg_sq"],
}
SPLITS = [  # (rows, cols, TP size, partition_stride)
    (3, 64, 2, 1),  # one short block cut in two
    (2, 256, 2, 2),  # a gated MLP's bias: two chunks per rank in one block
    (4, 400, 2, 1),  # rank 1 touches 2 blocks with 200 columns
    (2, 300, 3, 1),
    (2, 1024, 4, 1),  # on block boundaries at 256: no block shared
    (1, 768, 2, 2),
    (2, 1536, 3, 2),
]


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows, cols, tp, stride", SPLITS)
def test_pieces_quantize_as_the_whole_rows(name, rows, cols, tp, stride):
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(cols * 31 + tp)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-4, 1, cols)  # six decades
    if name == "exp_avg_sq":
        x = x.abs()
    codes = torch.empty(fmt.codes_matrix_shape((rows, cols)), dtype=fmt.code_dtype)
    scales = torch.empty(fmt.scales_shape((rows, cols)))
    fmt.quantize_(x, codes, scales)
    values = fmt.dequantize(codes, scales, cols)

    spans = [strided_spans(cols, tp, r, stride) for r in range(tp)]
    pieces = [column_blocks(cols, fmt.block_size, spans, r) for r in range(tp)]
    assert all(p.shared == pieces[0].shared for p in pieces)
    local = [torch.cat([x[:, s : s + n] for s, n in p.spans], dim=1) for p in pieces]
    shared = torch.zeros_like(scales)  # the all-reduce (max) of every rank's maxima
    for piece, part in zip(pieces, local):
        touched = list(piece.blocks)
        shared[:, touched] = shared[:, touched].maximum(local_block_maxima(part, piece))
    for piece, part in zip(pieces, local):
        touched = list(piece.blocks)
        got_codes = torch.empty(fmt.codes_matrix_shape((rows, piece.width)), dtype=fmt.code_dtype)
        got_scales = torch.empty(rows, len(touched))
        quantize_columns_(part, piece, shared[:, touched], fmt, got_codes, got_scales)
        assert torch.equal(got_scales, scales[:, touched])
        got = dequantize_columns(got_codes, got_scales, piece, fmt)
        want = torch.cat([values[:, s : s + n] for s, n in piece.spans], dim=1)
        assert torch.equal(got, want)
        if fmt.codes_per_byte == 1:
            whole_codes = torch.cat([codes[:, s : s + n] for s, n in piece.spans], dim=1)
            assert torch.equal(got_codes, whole_codes)
