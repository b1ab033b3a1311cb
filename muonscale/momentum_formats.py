"""The stored formats of a quantized Muon momentum, one object each: the ``state_precision``
that selects it, the key of its float32 block scales, its code dtype and packing, and its
quantize/dequantize pair over the (rows, cols) block matrix (the math:
:mod:`muonscale.block_quantization`, 8-bit linear; :mod:`muonscale.block_quantization_4bit`,
4-bit dynamic exponent). A loaded state entry says its format by the scale key it holds."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .block_quantization import BLOCK_SIZE, dequantize_linear, quantize_linear_, scale_shape
from .block_quantization_4bit import BLOCK_SIZE_4BIT, ZERO_BYTE, dequantize_de4, quantize_de4_


@dataclass(frozen=True)
class MomentumFormat:
    """One stored format of the Muon momentum."""

    precision: str
    """The ``state_precision`` that selects it."""
    scale_key: str
    """The state key of its float32 scales (rows, blocks)."""
    what: str
    """What its codes are, for messages."""
    code_dtype: torch.dtype
    block_size: int
    codes_per_byte: int
    """1: the codes have the parameter's shape; 2: each row of the block matrix packed into
    ⌈cols / 2⌉ bytes, stored as (rows, ⌈cols / 2⌉)."""
    zero_byte: int
    """The stored byte of a zero momentum (its codes of 0, as quantizing zeros writes them)."""
    quantize_: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    """``quantize_(x, codes, scales)``: x (rows, cols), codes :meth:`codes_matrix_shape`."""
    dequantize: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    """``dequantize(codes, scales, cols)``: the float32 (rows, cols) values."""

    def codes_matrix_shape(self, block_shape: tuple[int, int]) -> tuple[int, int]:
        """(rows, bytes per row) of the codes of a (rows, cols) block matrix."""
        rows, cols = block_shape
        return rows, -(-cols // self.codes_per_byte)

    def scales_shape(self, block_shape: tuple[int, int]) -> tuple[int, int]:
        """Shape of the float32 scales of a (rows, cols) block matrix."""
        return scale_shape(*block_shape, self.block_size)


INT8_MOMENTUM = MomentumFormat(
    precision="int8",
    scale_key="momentum_scale",
    what="int8 codes, linear per 256-entry block",
    code_dtype=torch.int8,
    block_size=BLOCK_SIZE,
    codes_per_byte=1,
    zero_byte=0,
    quantize_=quantize_linear_,
    dequantize=lambda codes, scales, cols: dequantize_linear(codes, scales),
)
INT4_MOMENTUM = MomentumFormat(
    precision="int4",
    scale_key="momentum_absmax",
    what="4-bit dynamic-exponent codes per 128-entry block, two per uint8 byte",
    code_dtype=torch.uint8,
    block_size=BLOCK_SIZE_4BIT,
    codes_per_byte=2,
    zero_byte=ZERO_BYTE,
    quantize_=quantize_de4_,
    dequantize=dequantize_de4,
)
MOMENTUM_FORMATS: dict[str, MomentumFormat] = {
    f.precision: f for f in (INT8_MOMENTUM, INT4_MOMENTUM)
}
"""The quantized formats, by ``state_precision``."""


def momentum_format_of(entry: Mapping[str, Any]) -> MomentumFormat | None:
    """The format of the momentum a parameter's state ``entry`` holds (by its scale key), or
    None for a floating momentum."""
    for fmt in MOMENTUM_FORMATS.values():
        if fmt.scale_key in entry:
            return fmt
    return None
