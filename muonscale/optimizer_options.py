"""Options of :class:`muonscale.Muon`: their checks, torch-name aliases, the AdamW group that
aliases ``momentum`` to ``betas[0]``, and ``splits`` resolved to row blocks."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .capturable import NonFinitePolicy
from .matrices import row_blocks
from .qkv import QKVLayout
from .settings import (  # noqa: F401 (check_*, NS_METHODS: re-exported)
    NS_METHODS,
    check_dtype,
    check_flag,
    check_lr,
    check_range,
    validate_muon_options,
)

NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = ("raise", "skip", "ignore")

validate_muon_group = validate_muon_options
"""``ValueError`` naming the first invalid Muon option (see :mod:`muonscale.settings`)."""


def validate_adamw_group(group: Mapping[str, Any]) -> None:
    check_lr("adamw_lr", group["lr"])
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas (adamw_betas) must be a pair (beta1, beta2), got {betas!r}")
    check_range("betas[0] (adamw_betas)", betas[0], 0.0, 1.0, high_open=True)
    check_range("betas[1] (adamw_betas)", betas[1], 0.0, 1.0, high_open=True)
    check_range("adamw_eps", group["eps"], 0.0, math.inf)
    check_range("adamw_weight_decay", group["weight_decay"], 0.0, math.inf)


def either(name: str, value: Any, torch_name: str, torch_value: Any, default: Any) -> Any:
    """One option under two keywords (ours and torch.optim's): both given → ValueError."""
    if value is not None and torch_value is not None:
        raise ValueError(f"pass {name} or {torch_name} (its torch.optim name), not both")
    if value is not None:
        return value
    return torch_value if torch_value is not None else default


class AdamWGroup(dict):
    """An AdamW param group whose ``"momentum"`` is an alias of ``betas[0]``.

    The optimizer's ``defaults`` are Muon's (``momentum``, no ``betas``), so
    ``OneCycleLR``/``CyclicLR`` with ``cycle_momentum`` write ``group["momentum"]`` into every
    group; here that write reaches AdamW's β₁, as it does with ``torch.optim.AdamW``.
    """

    __slots__ = ()

    def __getitem__(self, key: Any) -> Any:
        if key == "momentum":
            return dict.__getitem__(self, "betas")[0]
        return dict.__getitem__(self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        if key == "momentum":
            key, value = "betas", (value, *dict.__getitem__(self, "betas")[1:])
        dict.__setitem__(self, key, value)

    def __contains__(self, key: object) -> bool:
        return key == "momentum" or dict.__contains__(self, key)

    def get(self, key: Any, default: Any = None) -> Any:
        return self[key] if key in self else default

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    @classmethod
    def wrap(cls, group: Mapping[str, Any]) -> AdamWGroup:
        out = cls({k: v for k, v in group.items() if k != "momentum"})
        out["betas"] = tuple(out["betas"])
        return out


def resolve_splits(
    splits: Mapping[str, Any],
    qkv_split: str,
    by_name: Mapping[str | None, tuple[torch.Tensor, Mapping[str, Any]]],
    is_transposed: Callable[[torch.Tensor], bool],
) -> tuple[dict[int, list[torch.Tensor]], dict[int, tuple[str, ...]]]:
    """The ``splits`` option as row blocks keyed by ``id(param)``, and the role (``"q"``,
    ``"k"``, ``"v"``) of each block of the parameters split by a :class:`QKVLayout`;
    ``by_name`` maps each parameter name to (parameter, its param group)."""
    out, roles = {}, {}
    for name, spec in splits.items():
        if name not in by_name or by_name[name][1]["algorithm"] != "muon":
            raise ValueError(f"splits: no Muon parameter named {name!r}")
        param = by_name[name][0]
        rows = param.shape[1] if is_transposed(param) else param.shape[0]
        if isinstance(spec, QKVLayout):
            if spec.rows != rows:
                raise ValueError(
                    f"splits[{name!r}]: {spec} describes {spec.rows} rows, the parameter has {rows}"
                )
            parts = spec.row_partition(qkv_split)
            roles[id(param)] = spec.block_roles(qkv_split)
        elif isinstance(spec, int) and not isinstance(spec, bool):
            if spec < 1 or rows % spec:
                raise ValueError(f"splits[{name!r}]: {spec} equal blocks do not divide {rows} rows")
            parts = row_blocks([rows // spec] * spec)
        elif isinstance(spec, Sequence):
            if sum(int(s) for s in spec) != rows:
                raise ValueError(
                    f"splits[{name!r}]: block sizes {list(spec)} do not sum to {rows} rows"
                )
            parts = row_blocks(spec)
        else:
            raise ValueError(
                f"splits[{name!r}]: expected a QKVLayout, an int or a list of sizes, got {spec!r}"
            )
        out[id(param)] = parts
    return out, roles
