"""The state a Muon parameter holds, declared once: each tensor's key, its shape as a function
of the parameter's matrix view, its dtype, its placement, and which settings keep it.

Creating state, checking loaded state, DCP gathering and the distributed optimizers read
these declarations instead of naming the tensors themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .matrices import MatrixView
from .settings import MuonSettings
from .state_tensor import Placement, StateTensor  # noqa: F401 (Placement: re-exported)
from .variants import VARIANT_STATE

MOMENTUM = StateTensor(
    key="momentum_buffer",
    what="the momentum buffer, shaped as the parameter",
    kept=lambda settings: True,
    shape=lambda view: view.param_shape,
    dtype=lambda settings, dtype: settings.momentum_dtype or dtype,
    placement="parameter",
)
MUON_STATE: tuple[StateTensor, ...] = (MOMENTUM, *VARIANT_STATE)
"""Every state tensor a Muon parameter may hold (the variants' declared with their math)."""

(ROW_STATE,) = [t for t in VARIANT_STATE if t.placement == "replicated"]
"""The replicated row state the matrix step reads beside the direction."""


def kept_state(settings: MuonSettings, *, variants_only: bool = False) -> list[StateTensor]:
    """The state tensors a group with ``settings`` keeps."""
    return [t for t in (VARIANT_STATE if variants_only else MUON_STATE) if t.kept(settings)]


def row_state(states: list[Mapping[str, Any]]) -> list[torch.Tensor | None]:
    """Each state's replicated row state, which the matrix step reads besides the direction
    (the row second moment; None where the settings keep none)."""
    return [s.get(ROW_STATE.key) for s in states]


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
        want = tuple(spec.shape(view))
        # torch keeps no shapes: a momentum of the parameter's size is read in its shape
        fits = tuple(value.shape) == want or (spec is MOMENTUM and value.numel() == _numel(want))
        if not fits:
            raise ValueError(
                f"load_state_dict: state {spec.key!r} of parameter '{name}' has shape "
                f"{tuple(value.shape)}, expected {want} ({spec.what}; its matrices: "
                f"{list(view.matrix_shapes)}). Was it saved from a model whose weights are "
                "stored otherwise (transposed, split, another matrix_mode)? Nothing was changed."
            )
        if not value.is_floating_point():
            raise ValueError(
                f"load_state_dict: state {spec.key!r} of parameter '{name}' has dtype "
                f"{value.dtype}, expected a floating dtype ({spec.what}). Nothing was changed."
            )


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out
