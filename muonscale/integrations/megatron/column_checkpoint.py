"""Checkpoints of the quantized column pieces (:mod:`.low_bit`) of a replicated Megatron
optimizer: their scales are per block they touch, not per block of their own columns, so
torch's load, which checks each state tensor against the piece's shape, and the conversions
between precisions, which quantize each piece alone, get them set aside and back.

Before the load, a column piece's saved state is held aside and its scales in the state dict
replaced by zeros of the piece's own shape; after it, the held state goes back: as saved when
the precision is the same, else converted here (dequantized by the piece alone; quantized
under the shared maxima of its TP group, collective), which makes a conversion at load what
one process's is. A piece saved with other blocks (another TP size) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from muonscale.block_quantization import scale_shape
from muonscale.matrices import MatrixView
from muonscale.momentum_formats import MOMENTUM_FORMATS, momentum_format_of
from muonscale.optimizer_state import state_dict_in_precision
from muonscale.quantized_state import (
    ADAMW_MOMENTS,
    adamw_block_shape,
    adamw_state_is_quantized,
    momentum_block_shape,
    momentum_scale_shape,
)
from muonscale.settings import check_state_precision

from .low_bit import ColumnPiece, SharedColumnScales
from .plan import ParamPlan

ViewOf = Callable[[torch.Tensor, Mapping[str, Any]], MatrixView]
PlanOf = Callable[[torch.Tensor], ParamPlan]
_ADAMW_ABSMAX = tuple(absmax for _, absmax, _ in ADAMW_MOMENTS)
HeldAside = dict[int, tuple[str, dict[str, torch.Tensor]]]
"""Per parameter id: the precision its state was saved in and the saved tensors held aside."""


def saved_precision(entry: Mapping[str, Any], group: Mapping[str, Any]) -> str:
    """The ``state_precision`` a saved state ``entry`` of a parameter of ``group`` holds (AdamW's
    8-bit moments are those of "int8" and "int4" alike: the group's when it is quantized)."""
    if group["algorithm"] == "muon":
        fmt = momentum_format_of(entry)
        return "param" if fmt is None else fmt.precision
    if not adamw_state_is_quantized(entry):
        return "param"
    own = group.get("state_precision", "param")
    return own if own != "param" else "int8"


def _own_scale_shape(p: torch.Tensor, view: MatrixView | None, precision: str) -> tuple[int, int]:
    """The scales' shape a piece of ``p``'s shape has in ``precision`` by its own blocks."""
    if view is not None:
        return momentum_scale_shape(view, MOMENTUM_FORMATS[precision])
    return scale_shape(*adamw_block_shape(p))


class ColumnCheckpoints:
    """The checkpoint side of a replicated Megatron optimizer's column pieces (see the module
    docstring).

    Args:
        scales: the optimizer's :class:`~.low_bit.SharedColumnScales`.
        view_of: a Muon parameter's matrix view in its group.
        plan_of: a parameter's plan.
    """

    def __init__(self, scales: SharedColumnScales, view_of: ViewOf, plan_of: PlanOf) -> None:
        self.scales, self.view_of, self.plan_of = scales, view_of, plan_of

    def _entries(self, state_dict, param_groups):
        """(index, parameter, group, plan, view) of every saved entry with state."""
        for saved, group in zip(state_dict["param_groups"], param_groups):
            for index, p in zip(saved["params"], group["params"]):
                if state_dict["state"].get(index):
                    view = self.view_of(p, group) if group["algorithm"] == "muon" else None
                    yield index, p, group, self.plan_of(p), view

    def set_aside_(
        self,
        state_dict: dict[str, Any],
        param_groups: Sequence[Mapping[str, Any]],
        algorithms: tuple[str, ...] = ("muon", "adamw"),
    ) -> HeldAside:
        """Before torch's load: each column piece's saved tensors held aside (of parameters of
        ``algorithms``), its scales in ``state_dict`` (whose ``"state"`` the caller copied; the
        entries are replaced, not changed) zeros of the piece's own shape. ``ValueError``
        naming the parameter and the tensor, before anything changes, for scales of another
        shape (saved at another TP size)."""
        aside: HeldAside = {}
        for index, p, group, plan, view in self._entries(state_dict, param_groups):
            if group["algorithm"] not in algorithms:
                continue
            entry = state_dict["state"][index]
            own = group.get("state_precision", "param")
            saved = saved_precision(entry, group)
            held = self.scales.tensors(plan, group["algorithm"], saved, view)
            if saved == "param" and self.scales.tensors(plan, group["algorithm"], own, view):
                keys = ["exp_avg", "exp_avg_sq"] if view is None else ["momentum_buffer"]
                aside[id(p)] = (saved, {k: entry[k] for k in keys})  # quantized after the load
                continue
            if not held:
                continue
            entry = state_dict["state"][index] = dict(entry)
            kept: dict[str, torch.Tensor] = {}
            for tensor in held:
                value = entry[tensor.scale_key]
                want = (value.shape[0], len(tensor.blocks.blocks))
                if tuple(value.shape) != want:
                    raise ValueError(
                        f"load_state_dict: parameter '{plan.name}': {tensor.scale_key!r} has shape "
                        f"{tuple(value.shape)} in the checkpoint, {want} here (saved at another TP "
                        "size?)"
                    )
                kept[tensor.code_key], kept[tensor.scale_key] = entry[tensor.code_key], value
                entry[tensor.scale_key] = torch.zeros(_own_scale_shape(p, view, saved))
            aside[id(p)] = (saved, kept)
        return aside

    @torch.no_grad()
    def put_back_(
        self,
        state: Mapping[torch.Tensor, dict],
        param_groups: Sequence[Mapping[str, Any]],
        aside: HeldAside,
    ) -> None:
        """After torch's load (and its conversions, which took the placeholders): each column
        piece's state from what :func:`set_aside_` held, in this optimizer's precision. Collective
        over each TP group when a piece is quantized from another precision."""
        pending: list[ColumnPiece] = []
        for group in param_groups:
            own = group.get("state_precision", "param")
            for p in group["params"]:
                if id(p) not in aside:
                    continue
                saved, held = aside[id(p)]
                entry, plan = state[p], self.plan_of(p)
                view = self.view_of(p, group) if group["algorithm"] == "muon" else None
                if saved == own:  # the saved codes (torch kept them) and scales
                    for tensor in self.scales.tensors(plan, group["algorithm"], own, view):
                        entry[tensor.scale_key] = held[tensor.scale_key].to(
                            device=p.device, dtype=torch.float32, copy=True
                        )
                    continue
                held = {k: v.to(p.device) for k, v in held.items()}
                values = _values(self.scales, plan, group["algorithm"], saved, view, held)
                pending += _written(
                    self.scales, entry, p, plan, group["algorithm"], own, view, values
                )
        if pending:
            self.scales.quantize_(pending)

    def in_precision(
        self,
        packed: dict[str, Any],
        param_groups: Sequence[Mapping[str, Any]],
        precision: str,
    ) -> dict[str, Any]:
        """A ``state_dict()`` of the optimizer (``packed``) converted to ``precision`` as
        :func:`~muonscale.optimizer_state.state_dict_in_precision` converts it, the column
        pieces' state first (:meth:`converted_`; collective over each TP group)."""
        check_state_precision(precision)
        packed = {**packed, "state": dict(packed["state"])}  # column pieces' entries replaced
        self.converted_(packed, param_groups, precision)
        return state_dict_in_precision(packed, param_groups, self.view_of, precision)

    @torch.no_grad()
    def converted_(
        self,
        packed: dict[str, Any],
        param_groups: Sequence[Mapping[str, Any]],
        precision: str | None = None,
        algorithms: tuple[str, ...] = ("muon", "adamw"),
    ) -> None:
        """In a state dict of this layout (``packed``, whose ``"state"`` the caller copied;
        the entries are replaced, not changed): each column piece's state (of a parameter of
        ``algorithms``) in ``precision`` (None: its group's), from the precision it was saved
        in: dequantized by the piece alone, quantized under the shared maxima (collective over
        each TP group), so that a conversion that follows leaves it as it is."""
        pending: list[ColumnPiece] = []
        for index, p, group, plan, view in self._entries(packed, param_groups):
            algorithm = group["algorithm"]
            if algorithm not in algorithms:
                continue
            saved = saved_precision(packed["state"][index], group)
            wanted = group.get("state_precision", "param") if precision is None else precision
            if saved == wanted or (algorithm != "muon" and "param" not in (saved, wanted)):
                continue  # AdamW's moments are 8-bit in "int8" and "int4" alike
            if not (
                self.scales.tensors(plan, algorithm, saved, view)
                or self.scales.tensors(plan, algorithm, wanted, view)
            ):
                continue
            entry = packed["state"][index] = dict(packed["state"][index])
            values = _values(self.scales, plan, algorithm, saved, view, entry)
            pending += _written(self.scales, entry, p, plan, algorithm, wanted, view, values)
        if pending:
            self.scales.quantize_(pending)


def _values(
    scales: SharedColumnScales,
    plan: ParamPlan,
    algorithm: str,
    precision: str,
    view: MatrixView | None,
    entry: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """A column piece's state ``entry`` in ``precision`` as float32 values by tensor key
    (quantized: dequantized by the piece alone)."""
    tensors = scales.tensors(plan, algorithm, precision, view)
    if tensors:
        return {t.code_key: t.values(entry) for t in tensors}
    keys = ["momentum_buffer"] if algorithm == "muon" else ["exp_avg", "exp_avg_sq"]
    return {k: entry[k].float() for k in keys}


def _written(
    scales: SharedColumnScales,
    entry: dict,
    p: torch.Tensor,
    plan: ParamPlan,
    algorithm: str,
    precision: str,
    view: MatrixView | None,
    values: Mapping[str, torch.Tensor],
) -> list[ColumnPiece]:
    """``values`` written into ``entry`` in ``precision``: floating values in ``p``'s dtype, or
    its main copy's where ``entry`` holds one (ZeRO-1's; scales of any format dropped), or new
    codes and scales of (rows, blocks touched), whose quantization is returned as pieces for
    :meth:`SharedColumnScales.quantize_`."""
    for key in [*(f.scale_key for f in MOMENTUM_FORMATS.values()), *_ADAMW_ABSMAX]:
        entry.pop(key, None)
    if precision == "param":
        main = entry.get("main_param")
        dtype = main.dtype if torch.is_tensor(main) else p.dtype
        for key, value in values.items():
            entry[key] = value.reshape(p.shape).to(dtype)
        return []
    rows = (momentum_block_shape(view) if view is not None else adamw_block_shape(p))[0]
    pieces = []
    for tensor in scales.tensors(plan, algorithm, precision, view):
        fmt, value = tensor.format, values[tensor.code_key].reshape(rows, -1)
        codes = torch.empty(
            fmt.codes_matrix_shape(tuple(value.shape)), dtype=fmt.code_dtype, device=value.device
        )
        touched = torch.zeros((rows, len(tensor.blocks.blocks)), device=value.device)
        entry[tensor.code_key] = codes.view(p.shape) if fmt.codes_per_byte == 1 else codes
        entry[tensor.scale_key] = touched
        pieces.append(ColumnPiece(plan, tensor.blocks, fmt, value, codes, touched))
    return pieces
