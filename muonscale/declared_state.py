"""The state a Muon parameter holds, declared once: each tensor's key, its shape as a function
of the parameter's matrix view, its dtype, its placement, and which settings keep it.

Creating state, checking loaded state, DCP gathering and the distributed optimizers read
these declarations instead of naming the tensors themselves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from . import variants
from .matrices import MatrixView
from .momentum_formats import (
    INT4_MOMENTUM,
    INT8_MOMENTUM,
    MOMENTUM_FORMATS,
    MomentumFormat,
    momentum_format_of,
)
from .quantized_state import momentum_codes_shape, momentum_scale_shape
from .settings import MuonSettings
from .state_tensor import Placement, StateTensor  # noqa: F401 (Placement: re-exported)
from .variants import VARIANT_STATE

MOMENTUM = StateTensor(
    key="momentum_buffer",
    what="the momentum buffer, shaped as the parameter",
    kept=lambda settings: True,
    shape=lambda view: view.param_shape,
    dtype=lambda settings, dtype: settings.momentum_storage_dtype(dtype),
    placement="parameter",
)


def _momentum_scales(fmt: MomentumFormat) -> StateTensor:
    """The declaration of the float32 block scales of the momentum in format ``fmt``."""
    return StateTensor(
        key=fmt.scale_key,
        what=f"the float32 scales of the {fmt.precision} momentum ({fmt.what}), one per block "
        "of a row",
        kept=lambda settings: settings.state_precision == fmt.precision,
        shape=lambda view: momentum_scale_shape(view, fmt),
        dtype=lambda settings, dtype: torch.float32,
        placement="parameter",
    )


MOMENTUM_SCALE = _momentum_scales(INT8_MOMENTUM)
MOMENTUM_ABSMAX = _momentum_scales(INT4_MOMENTUM)
MUON_STATE: tuple[StateTensor, ...] = (MOMENTUM, MOMENTUM_SCALE, MOMENTUM_ABSMAX, *VARIANT_STATE)
"""Every state tensor a Muon parameter may hold (the variants' declared with their math)."""


def momentum_shape(precision: str, view: MatrixView) -> tuple[int, ...]:
    """Shape of the momentum stored in ``precision`` (a ``state_precision``) of a parameter with
    this ``view``: the parameter's, or, for a format that packs codes (``"int4"``), the packed
    rows of its block matrix."""
    fmt = MOMENTUM_FORMATS.get(precision)
    return tuple(view.param_shape) if fmt is None else momentum_codes_shape(view, fmt)


def saved_precision(entry: Mapping[str, Any]) -> str:
    """The ``state_precision`` a Muon parameter's state ``entry`` was stored with (its scales'
    key tells)."""
    fmt = momentum_format_of(entry)
    return "param" if fmt is None else fmt.precision


def zero_momentum(
    like: torch.Tensor, settings: MuonSettings, dtype: torch.dtype, view: Callable[[], MatrixView]
) -> torch.Tensor:
    """A zero momentum buffer for ``like`` (a parameter, a DTensor's shards, an owner's range of
    experts; ``dtype``: its parameter's or main copy's): laid out as ``like``, or the packed
    rows of ``view()``'s block matrix for a format that packs codes (each byte its codes of
    0)."""
    fmt = MOMENTUM_FORMATS.get(settings.state_precision)
    if fmt is not None and fmt.codes_per_byte > 1:
        shape = momentum_codes_shape(view(), fmt)
        return torch.full(shape, fmt.zero_byte, dtype=fmt.code_dtype, device=like.device)
    return torch.zeros_like(
        like, dtype=MOMENTUM.dtype(settings, dtype), memory_format=torch.preserve_format
    )


def kept_state(settings: MuonSettings, *, variants_only: bool = False) -> list[StateTensor]:
    """The state tensors a group with ``settings`` keeps (the variants' declarations read when
    called, so that a variant declared after import counts); ``variants_only``: those besides
    the momentum buffer (created with the parameter: :func:`zero_momentum`)."""
    besides = (MOMENTUM_SCALE, MOMENTUM_ABSMAX, *variants.VARIANT_STATE)
    declared = besides if variants_only else (MOMENTUM, *besides)
    return [t for t in declared if t.kept(settings)]


def replicated_declarations(settings: MuonSettings | None = None) -> list[StateTensor]:
    """Every replicated state declared (one value per row of a parameter's whole matrices), or
    those a group with ``settings`` keeps."""
    return [
        t
        for t in variants.VARIANT_STATE
        if t.placement == "replicated" and (settings is None or t.kept(settings))
    ]


def replicated_state(
    state: Mapping[str, Any], settings: MuonSettings
) -> dict[StateTensor, torch.Tensor]:
    """The replicated row states that a parameter's ``state`` holds and ``settings`` keep, by
    declaration (in declaration order): what the matrix step reads and steps besides the
    direction (NorMuon's row second moment)."""
    return {t: state[t.key] for t in replicated_declarations(settings) if t.key in state}


def check_loaded_state(
    entry: Mapping[str, Any],
    settings: MuonSettings,
    view: MatrixView,
    *,
    name: str,
    explicit: Mapping[str, Any],
) -> None:
    """``ValueError`` naming the parameter and the tensor unless the loaded state ``entry`` of a
    Muon parameter fits the declaration: each declared tensor it holds has the shape of the
    parameter's matrix view and a floating dtype; a tensor the settings keep is missing only
    from a state that was never created, or when ``explicit`` (the saved group's own options)
    does not state the option that keeps it (a checkpoint from before that option)."""
    for spec in MUON_STATE:
        value = entry.get(spec.key)
        if value is None:
            if spec.kept(settings) and entry and spec is not MOMENTUM:
                if spec.kept(MuonSettings.from_group(explicit)):  # not a filled-in default
                    raise ValueError(
                        f"load_state_dict: the state of parameter '{name}' has no "
                        f"{spec.key!r} ({spec.what}), which its saved param group needs "
                        f"({settings.variant_summary()}). A checkpoint read into this "
                        "optimizer's own state dict (torch.distributed.checkpoint) only has "
                        "room for the state this optimizer keeps: build it with the saved "
                        "options. Nothing was changed."
                    )
            continue
        if not torch.is_tensor(value):
            raise ValueError(
                f"load_state_dict: state {spec.key!r} of parameter '{name}' is a "
                f"{type(value).__name__}, expected a tensor ({spec.what}). Nothing was changed."
            )
        fmt = momentum_format_of(entry) if spec is MOMENTUM else None
        want = tuple(spec.shape(view) if fmt is None else momentum_codes_shape(view, fmt))
        # torch keeps no shapes: a momentum of the parameter's size is read in its shape
        fits = tuple(value.shape) == want or (spec is MOMENTUM and value.numel() == _numel(want))
        if not fits:
            raise ValueError(
                f"load_state_dict: state {spec.key!r} of parameter '{name}' has shape "
                f"{tuple(value.shape)}, expected {want} ({spec.what}; its matrices: "
                f"{list(view.matrix_shapes)}). Was it saved from a model whose weights are "
                "stored otherwise (transposed, split, another matrix_mode)? Nothing was changed."
            )
        codes = fmt is not None and value.dtype == fmt.code_dtype
        if not (value.is_floating_point() or codes):
            raise ValueError(
                f"load_state_dict: state {spec.key!r} of parameter '{name}' has dtype "
                f"{value.dtype}, expected a floating dtype ({spec.what}; int8 codes with "
                f"{MOMENTUM_SCALE.key!r} for state_precision='int8', uint8 bytes of 4-bit codes "
                f"with {MOMENTUM_ABSMAX.key!r} for 'int4'). Nothing was changed."
            )


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out
