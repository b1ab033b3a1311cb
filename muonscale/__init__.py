"""muonscale: the Muon optimizer for LLM training, at AdamW's speed, on the distributed engines
people already use. ``import muonscale`` needs only torch, and loads it on first use of a name
(so ``muonscale --help`` and ``--version`` stay fast)."""

from __future__ import annotations

import sys
import types
from importlib.metadata import PackageNotFoundError, version

from .lazy_names import lazy_names

try:
    __version__ = version("muonscale")  # pyproject.toml is the one source
except PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

# Public name -> submodule defining it; each is imported on first access (PEP 562).
_LAZY = {
    "COEFFICIENT_PRESETS": "newton_schulz",
    "default_ns_dtype": "newton_schulz",
    "newton_schulz": "newton_schulz",
    "resolve_coefficients": "newton_schulz",
    "newton_schulz_flops": "flops",
    "ExpertLayout": "experts",
    "MatrixView": "matrices",
    "Muon": "optimizer",
    "NonFiniteGradientError": "nonfinite",
    "RouteDecision": "params",
    "route": "params",
    "QKVLayout": "qkv",
    "SCALE_RULES": "scaling",
    "update_scale": "scaling",
    # The distributed optimizers import torch.distributed's DTensor machinery.
    "DistributedMuon": "distributed",
    "DTensorMuon": "distributed",
    "distributed_muon": "distributed",
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule newton_schulz binds its name here; the name is the function's.
        if name == "newton_schulz" and isinstance(value, types.ModuleType):
            value = value.newton_schulz
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = sorted(_LAZY, key=str.casefold)
