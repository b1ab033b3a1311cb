"""Quantized optimizer state (``state_precision="int8"`` or ``"int4"``): the Muon momentum as
codes with float32 block scales in a :class:`~muonscale.momentum_formats.MomentumFormat`
(int8 linear, or 4-bit dynamic exponent packed two per byte), AdamW's moments as 8-bit dynamic
codes with float32 block absmax (:mod:`muonscale.block_quantization` holds the 8-bit formats).

A step reads a quantized tensor as float32 values, computes with them as with a floating
buffer, and writes the new values back once (:meth:`QuantizedMomentum.store_`); the math
layer (:mod:`muonscale.functional`) never sees codes. The conversions between floating and
quantized state (a checkpoint saved with one ``state_precision`` loaded with another) are
:func:`quantized_momentum_state` and :func:`float_momentum_state`, and their AdamW twins.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from .block_quantization import (
    BLOCK_SIZE,
    block_matrix_shape,
    dequantize_dynamic,
    dynamic_values,
    quantize_dynamic_,
    scale_shape,
)
from .memory import (
    DEFAULT_NS_WORKSPACE_BYTES,
    PER_DEVICE,
    MemoryBudget,
    chunk_bytes_for,
)
from .momentum_formats import INT8_MOMENTUM, MOMENTUM_FORMATS, MomentumFormat, momentum_format_of

MOMENTUM_KEY = "momentum_buffer"
ADAMW_MOMENTS = (("exp_avg", "exp_avg_absmax", True), ("exp_avg_sq", "exp_avg_sq_absmax", False))
"""AdamW's moments: (codes key, absmax key, signed)."""


def _adamw_format(key: str, absmax_key: str, signed: bool) -> MomentumFormat:
    """One of AdamW's 8-bit moments as a :class:`MomentumFormat` (its codes and absmax)."""
    return MomentumFormat(
        precision="int8",
        scale_key=absmax_key,
        what=f"AdamW's {key}: 8-bit dynamic codes per 256-entry block",
        code_dtype=torch.uint8,
        block_size=BLOCK_SIZE,
        codes_per_byte=1,
        zero_byte=dynamic_values(signed).index(0.0),
        quantize_=functools.partial(quantize_dynamic_, signed=signed),
        dequantize=lambda codes, absmax, cols: dequantize_dynamic(codes, absmax, signed=signed),
    )


ADAMW_FORMATS: dict[str, MomentumFormat] = {
    key: _adamw_format(key, absmax, signed) for key, absmax, signed in ADAMW_MOMENTS
}
"""AdamW's two 8-bit moments as stored formats, by codes key (for the layouts that quantize
pieces of blocks through a format's own functions)."""


QUANTIZED_BUDGET_DIVISOR = 4
"""The default memory bounds of a step with 8-bit state are those of floating state divided by
this: a stored entry takes 1 byte instead of 4 (float32), so the step's transients keep the
same proportion to the state (*Low-bit state* in the docs)."""


def quantized_state_budget(memory: MemoryBudget, device: torch.device) -> MemoryBudget:
    """``memory`` for a step of 8-bit state on ``device``: each bound left at its default
    (``MUONSCALE_UPDATE_CHUNK_MB`` and ``MUONSCALE_NS_WORKSPACE_MB`` not set) divided by
    :data:`QUANTIZED_BUDGET_DIVISOR`; a bound set otherwise is kept."""
    chunk = memory.update_chunk_bytes
    if chunk == PER_DEVICE:
        chunk = chunk_bytes_for(PER_DEVICE, device) // QUANTIZED_BUDGET_DIVISOR
    workspace = memory.ns_workspace_bytes
    if workspace == DEFAULT_NS_WORKSPACE_BYTES:
        workspace //= QUANTIZED_BUDGET_DIVISOR
    return MemoryBudget(update_chunk_bytes=chunk, ns_workspace_bytes=workspace)


def momentum_block_shape(view: Any) -> tuple[int, int]:
    """(rows, cols) of the blocked momentum of a parameter with this
    :class:`~muonscale.matrices.MatrixView`: an expert stack by its matrices' rows, any other
    parameter as :func:`~muonscale.block_quantization.block_matrix_shape` reads its storage."""
    mode = "batch" if view.experts is not None else view.mode
    return block_matrix_shape(view.param_shape, mode)


def momentum_scale_shape(view: Any, fmt: MomentumFormat = INT8_MOMENTUM) -> tuple[int, int]:
    """Shape of the quantized momentum's block scales (float32) in format ``fmt``."""
    return fmt.scales_shape(momentum_block_shape(view))


def momentum_codes_shape(view: Any, fmt: MomentumFormat) -> tuple[int, ...]:
    """Shape of the stored codes of the momentum in format ``fmt``: the parameter's for one
    code per byte, else (rows, bytes per row) of its block matrix."""
    if fmt.codes_per_byte == 1:
        return tuple(view.param_shape)
    return fmt.codes_matrix_shape(momentum_block_shape(view))


@dataclass
class QuantizedMomentum:
    """A Muon momentum buffer stored as ``codes`` and float32 ``scales`` (rows, blocks) over
    the (rows, cols) matrix ``block_shape``, in ``format`` (int8: the codes have the
    parameter's shape)."""

    codes: torch.Tensor
    scales: torch.Tensor
    block_shape: tuple[int, int]
    keep: torch.Tensor | None = None
    """A capturable step's device flag: where False, :meth:`store_` keeps the stored bits."""
    format: MomentumFormat = INT8_MOMENTUM
    param_shape: tuple[int, ...] | None = None
    """The parameter's shape (None: the codes')."""

    def _codes_matrix(self) -> torch.Tensor:
        return self.codes.view(self.format.codes_matrix_shape(self.block_shape))

    def values(self) -> torch.Tensor:
        """The momentum in float32, the parameter's shape (a new tensor)."""
        out = self.format.dequantize(self._codes_matrix(), self.scales, self.block_shape[1])
        return out.view(self.param_shape or self.codes.shape)

    @torch.no_grad()
    def store_(self, values: torch.Tensor) -> None:
        """Quantize ``values`` (the new momentum, the parameter's shape) into the codes and
        scales, in place."""
        flat, stored = values.reshape(self.block_shape), self._codes_matrix()
        if self.keep is None:
            self.format.quantize_(flat, stored, self.scales)
            return
        codes, scales = torch.empty_like(stored), torch.empty_like(self.scales)
        self.format.quantize_(flat, codes, scales)
        stored.copy_(torch.where(self.keep, codes, stored))
        self.scales.copy_(torch.where(self.keep, scales, self.scales))


def quantized_momentum(state: Mapping[str, Any], view: Any) -> QuantizedMomentum:
    """The quantized momentum a parameter's ``state`` holds (its format by its scale key)."""
    fmt = momentum_format_of(state) or INT8_MOMENTUM
    return QuantizedMomentum(
        state[MOMENTUM_KEY],
        state[fmt.scale_key],
        momentum_block_shape(view),
        format=fmt,
        param_shape=tuple(view.param_shape),
    )


def quantized_momentum_state(
    values: torch.Tensor, view: Any, precision: str = "int8"
) -> dict[str, torch.Tensor]:
    """Conversion float → quantized (``precision``'s format): the codes and scales of a
    floating momentum ``values``."""
    fmt = MOMENTUM_FORMATS[precision]
    block = momentum_block_shape(view)
    shape = momentum_codes_shape(view, fmt) if fmt.codes_per_byte > 1 else values.shape
    codes = torch.empty(shape, dtype=fmt.code_dtype, device=values.device)
    scales = torch.empty(fmt.scales_shape(block), dtype=torch.float32, device=values.device)
    QuantizedMomentum(codes, scales, block, format=fmt).store_(values.float())
    return {MOMENTUM_KEY: codes, fmt.scale_key: scales}


def float_momentum_state(state: Mapping[str, Any], view: Any, dtype: torch.dtype) -> torch.Tensor:
    """Conversion quantized → float: the momentum of a quantized ``state`` in ``dtype``."""
    return quantized_momentum(state, view).values().to(dtype)


# ------------------------------------------------------------------------------ AdamW
def adamw_block_shape(p: torch.Tensor) -> tuple[int, int]:
    """(rows, cols) AdamW's moments of ``p`` are blocked in."""
    return block_matrix_shape(p.shape, "flatten")


def zero_adamw_moments(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """AdamW's 8-bit moments of ``p``, zero: every code the index of 0 in its table, and zero
    absmax."""
    rows, cols = adamw_block_shape(p)
    out = {}
    for key, absmax_key, signed in ADAMW_MOMENTS:
        zero = dynamic_values(signed).index(0.0)
        out[key] = torch.full(p.shape, zero, dtype=torch.uint8, device=p.device)
        out[absmax_key] = torch.zeros(scale_shape(rows, cols), dtype=torch.float32, device=p.device)
    return out


def adamw_moment_values(
    state: Mapping[str, Any], p: torch.Tensor, rows: slice
) -> list[torch.Tensor]:
    """AdamW's two moments of ``p`` in float32, for ``rows`` of its block matrix."""
    shape = adamw_block_shape(p)
    out = []
    for key, absmax_key, signed in ADAMW_MOMENTS:
        codes = state[key].view(shape)[rows]
        out.append(dequantize_dynamic(codes, state[absmax_key][rows], signed=signed))
    return out


def store_adamw_moments_(
    state: Mapping[str, Any],
    p: torch.Tensor,
    rows: slice,
    values: list[torch.Tensor],
    keep: torch.Tensor | None = None,
) -> None:
    """Quantize AdamW's two moments (``values``, float32, ``rows`` of the block matrix) into
    ``state``; ``keep`` (a 0-dim bool on the device): where False, the stored bits stay."""
    shape = adamw_block_shape(p)
    for (key, absmax_key, signed), value in zip(ADAMW_MOMENTS, values):
        codes, absmax = state[key].view(shape)[rows], state[absmax_key][rows]
        if keep is None:
            quantize_dynamic_(value, codes, absmax, signed=signed)
            continue
        new_codes, new_absmax = torch.empty_like(codes), torch.empty_like(absmax)
        quantize_dynamic_(value, new_codes, new_absmax, signed=signed)
        codes.copy_(torch.where(keep, new_codes, codes))
        absmax.copy_(torch.where(keep, new_absmax, absmax))


def quantize_adamw_state_(state: MutableMapping[str, Any], p: torch.Tensor) -> None:
    """Conversion float → 8-bit of AdamW's moments in ``state`` (in place)."""
    values = [state[key].float().view(adamw_block_shape(p)) for key, _, _ in ADAMW_MOMENTS]
    state.update(zero_adamw_moments(p))
    store_adamw_moments_(state, p, slice(None), values)


def dequantize_adamw_state_(state: MutableMapping[str, Any], p: torch.Tensor) -> None:
    """Conversion 8-bit → float (``p``'s dtype) of AdamW's moments in ``state`` (in place)."""
    values = adamw_moment_values(state, p, slice(None))
    for (key, absmax_key, _), value in zip(ADAMW_MOMENTS, values):
        state[key] = value.view(p.shape).to(p.dtype)
        del state[absmax_key]


def adamw_moments(state: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """AdamW's two moments of a state entry (a parameter's, or a shard of whole rows): the
    floating tensors, or float32 values of its 8-bit codes in their shape."""
    if not adamw_state_is_quantized(state):
        return state["exp_avg"], state["exp_avg_sq"]
    m, v = (
        dequantize_dynamic(
            state[key].view(adamw_block_shape(state[key])), state[absmax], signed=signed
        ).view(state[key].shape)
        for key, absmax, signed in ADAMW_MOMENTS
    )
    return m, v


def adamw_state_is_quantized(state: Mapping[str, Any]) -> bool:
    """Whether AdamW's moments in ``state`` are 8-bit codes."""
    return "exp_avg_absmax" in state
