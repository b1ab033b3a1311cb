"""Options of :class:`muonscale.Muon`: their checks, torch-name aliases, the AdamW group that
aliases ``momentum`` to ``betas[0]``, and ``splits`` resolved to row blocks."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .capturable import NonFinitePolicy
from .matrices import MATRIX_MODES, row_blocks
from .newton_schulz import validate_coefficients
from .qkv import QKVLayout
from .scaling import SCALE_RULES
from .variants import validate_variant_options  # [variants]

NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = ("raise", "skip", "ignore")
NS_METHODS = ("auto", "plain", "gram")


def check_range(name: str, value: Any, low: float, high: float, *, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        bracket = ")" if high_open else "]"
        expected = f"in [{low}, {high}{bracket}" if math.isfinite(high) else f">= {low}"
        raise ValueError(f"{name} must be a finite number {expected}, got {value!r}")


def check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_dtype(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{name} must be None or a floating torch.dtype, got {value!r}")


def check_lr(name: str, lr: Any) -> None:
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        lr = float(lr)
    check_range(name, lr, 0.0, math.inf)


def validate_muon_group(group: Mapping[str, Any]) -> None:
    check_lr("lr", group["lr"])
    check_range("momentum", group["momentum"], 0.0, 1.0, high_open=True)
    check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov must be a bool, got {group['nesterov']!r}")
    validate_coefficients(group["coefficients"], group["ns_steps"])  # also checks ns_steps
    if group["scale"] not in SCALE_RULES:
        raise ValueError(f"scale must be one of {SCALE_RULES}, got {group['scale']!r}")
    check_dtype("ns_dtype", group["ns_dtype"])
    check_dtype("momentum_dtype", group["momentum_dtype"])
    if group["momentum_dtype"] == torch.float16:
        raise ValueError(
            "momentum_dtype=torch.float16 is refused: a gradient entry beyond its range "
            "(65504) becomes inf in the buffer and turns every weight NaN although the "
            "gradient is finite; torch.bfloat16 takes the same memory with float32's range"
        )
    if group["matrix_mode"] not in MATRIX_MODES:
        raise ValueError(f"matrix_mode must be one of {MATRIX_MODES}, got {group['matrix_mode']!r}")
    check_range("eps (ns_eps)", group["ns_eps"], 0.0, math.inf)
    check_range("qk_lr_scale", group.get("qk_lr_scale", 1.0), 0.0, math.inf)
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")
    validate_variant_options(group)  # [variants]


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
