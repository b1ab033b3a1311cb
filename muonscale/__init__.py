"""muonscale: the Muon optimizer for LLM training, at AdamW's speed, on the distributed engines
people already use. ``import muonscale`` needs only torch."""

from .flops import newton_schulz_flops
from .matrices import MatrixView
from .newton_schulz import (
    COEFFICIENT_PRESETS,
    default_ns_dtype,
    newton_schulz,
    resolve_coefficients,
)
from .optimizer import Muon, NonFiniteGradientError
from .params import RouteDecision, route
from .qkv import QKVLayout
from .scaling import SCALE_RULES, update_scale

__version__ = "0.1.0"

_DISTRIBUTED = ("DistributedMuon", "DTensorMuon", "distributed_muon")


def __getattr__(name: str):
    # The distributed optimizers import torch.distributed's DTensor machinery: load on first use.
    if name in _DISTRIBUTED:
        from . import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module 'muonscale' has no attribute {name!r}")


__all__ = [
    "COEFFICIENT_PRESETS",
    "DTensorMuon",
    "DistributedMuon",
    "MatrixView",
    "Muon",
    "NonFiniteGradientError",
    "QKVLayout",
    "RouteDecision",
    "SCALE_RULES",
    "default_ns_dtype",
    "distributed_muon",
    "newton_schulz",
    "newton_schulz_flops",
    "resolve_coefficients",
    "route",
    "update_scale",
]
