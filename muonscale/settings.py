"""Muon's options in one place: the table of defaults, the checks, and :class:`MuonSettings`,
the frozen value of one Muon param group's options (its Newton–Schulz part one
:class:`NewtonSchulzSettings`).

Param groups stay dicts (torch's ``state_dict`` and schedulers read and write them by key);
every reader turns a group into a :class:`MuonSettings` with :meth:`MuonSettings.from_group`,
which also fills in the options that groups written by older versions lack.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, TypedDict

import torch

from .kernels.first_step import PRECONDITIONERS, Preconditioner
from .matrices import MATRIX_MODES
from .momentum_formats import MOMENTUM_FORMATS
from .newton_schulz import DEFAULT_EPS, CoefficientSpec, validate_coefficients
from .scaling import SCALE_RULES
from .variants import NORMALIZE_MODES, NORMUON_BETA2, Normalize

NS_METHODS = ("auto", "plain", "gram")

StatePrecision = Literal["param", "int8", "int4"]
"""How optimizer state is stored: ``"param"``, in floating point (the Muon momentum in
``momentum_dtype``, else the parameter's dtype; AdamW's moments in the parameter's dtype);
``"int8"``, one byte per entry and a float32 scale per block of 256 entries of a row (the Muon
momentum linear int8, AdamW's moments 8-bit dynamic: :mod:`muonscale.block_quantization`);
``"int4"`` (experimental), the Muon momentum in 4 bits per entry, two per byte, and a float32
absmax per block of 128 entries of a row (:mod:`muonscale.block_quantization_4bit`), AdamW's
moments 8-bit as with ``"int8"``."""

STATE_PRECISIONS: tuple[StatePrecision, ...] = ("param", "int8", "int4")

PRECONDITIONER_SCHEDULES: dict[str, tuple[int, str]] = {
    "frobenius": (5, "keller"),
    "aol": (4, "turbo_muon"),
}
"""Default (``ns_steps``, ``coefficients``) of each preconditioner: Keller Jordan's five steps
for X/‖X‖_F, Turbo-Muon's four for AOL (see *Variants* in the docs)."""

STEP_SCALARS = ("lr", "weight_decay")
"""Options read by every step itself (schedulers change them between steps)."""

VARIANT_OPTIONS = ("normalize", "row_beta2", "cautious_weight_decay", "preconditioner")
"""Options that choose the algorithm's variant (``load_state_dict`` warns when they change)."""

VARIANT_KEYWORDS = (*VARIANT_OPTIONS, "qk_lr_scale")
"""The variant options and the per-role learning-rate factor: the ``**variant_options`` of
:class:`muonscale.Muon` (and of every optimizer built on it and of the Megatron adapter)."""


class VariantOptions(TypedDict, total=False):
    """The keyword arguments of :data:`VARIANT_KEYWORDS`, for type checkers (defaults: the
    fields of :class:`MuonSettings`; each option: *Options* and *Variants* in the docs)."""

    normalize: Normalize
    row_beta2: float
    cautious_weight_decay: bool
    preconditioner: Preconditioner
    qk_lr_scale: float


# ------------------------------------------------------------------------------ checks
def check_range(name: str, value: Any, low: float, high: float, *, high_open: bool = False) -> None:
    """``ValueError`` naming ``name`` unless ``value`` is a finite number in the range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        if math.isinf(high):
            accepts = f"a finite number >= {low}"
        else:
            accepts = f"a number in [{low}, {high}{')' if high_open else ']'}"
        raise ValueError(f"{name} must be {accepts}, got {value!r}")


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


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


# ------------------------------------------------------------------------------ values
def _hashable(value: Any) -> Any:
    """Lists (of coefficient tuples) as tuples, so that settings hash."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


@dataclass(frozen=True)
class NewtonSchulzSettings:
    """How a Muon group orthogonalizes: the Newton–Schulz iteration and its input scaling."""

    steps: int = PRECONDITIONER_SCHEDULES["frobenius"][0]
    """Iterations (``ns_steps``)."""
    coefficients: CoefficientSpec = PRECONDITIONER_SCHEDULES["frobenius"][1]
    """A preset name, one (a, b, c) or one per step."""
    dtype: torch.dtype | None = None
    """dtype of the iteration (``ns_dtype``); None: bfloat16 on CUDA, float32 elsewhere."""
    eps: float = DEFAULT_EPS
    """Floor of the input's norm (``ns_eps``)."""
    method: str = "auto"
    """``"plain"``, ``"gram"`` or ``"auto"`` (``ns_method``)."""
    preconditioner: Preconditioner = "frobenius"
    """Input scaling: ``"frobenius"`` (X/‖X‖_F) or ``"aol"`` (Turbo-Muon)."""


@dataclass(frozen=True)
class MuonSettings:
    """The options of one Muon param group, under their param-group keys; the class defaults
    are the defaults of :class:`muonscale.Muon` (each option: *Options* in the docs)."""

    lr: float | torch.Tensor = 1e-3
    momentum: float = 0.95
    nesterov: bool = True
    weight_decay: float = 0.1
    ns_steps: int = PRECONDITIONER_SCHEDULES["frobenius"][0]
    coefficients: CoefficientSpec = PRECONDITIONER_SCHEDULES["frobenius"][1]
    scale: str = "match_rms_adamw"
    ns_dtype: torch.dtype | None = None
    momentum_dtype: torch.dtype | None = None
    """dtype of the momentum buffer; None: the parameter's (or its main copy's)."""
    matrix_mode: str = "flatten"
    ns_eps: float = DEFAULT_EPS
    ns_method: str = "auto"
    normalize: Normalize = "none"
    row_beta2: float = NORMUON_BETA2
    cautious_weight_decay: bool = False
    preconditioner: Preconditioner = "frobenius"
    qk_lr_scale: float = 1.0
    state_precision: StatePrecision = "param"
    """How the momentum is stored (:data:`StatePrecision`)."""

    @classmethod
    def from_group(cls, group: Mapping[str, Any]) -> MuonSettings:
        """The settings of a Muon param group; options it lacks (written by an older version)
        take their defaults."""
        values = {k: group.get(k, v) for k, v in OPTION_DEFAULTS.items()}
        values["coefficients"] = _hashable(values["coefficients"])
        return cls(**values)

    @property
    def ns(self) -> NewtonSchulzSettings:
        """The Newton–Schulz settings, as one value."""
        return NewtonSchulzSettings(
            steps=self.ns_steps,
            coefficients=self.coefficients,
            dtype=self.ns_dtype,
            eps=self.ns_eps,
            method=self.ns_method,
            preconditioner=self.preconditioner,
        )

    @property
    def variant(self) -> tuple:
        """The variant options (:data:`VARIANT_OPTIONS`) as a tuple: equal to
        ``PLAIN_MUON.variant`` for plain Muon."""
        return tuple(getattr(self, k) for k in VARIANT_OPTIONS)

    def variant_summary(self) -> str:
        """The variant options that differ from plain Muon's, as ``name=value`` pairs."""
        changed = [
            f"{k}={v!r}"
            for k, v, plain in zip(VARIANT_OPTIONS, self.variant, PLAIN_MUON.variant)
            if v != plain
        ]
        return ", ".join(changed) or "plain Muon's options"

    def momentum_dtype_for(self, dtype: torch.dtype) -> torch.dtype:
        """dtype of the momentum's values (what the step computes in) for a parameter (or main
        copy) of ``dtype``: float32 for quantized state."""
        if self.state_precision != "param":
            return torch.float32
        return self.momentum_dtype or dtype

    def momentum_storage_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """dtype of the stored momentum buffer: its format's codes' for quantized state (int8
        codes, or 4-bit codes packed in uint8 bytes)."""
        if self.state_precision in MOMENTUM_FORMATS:
            return MOMENTUM_FORMATS[self.state_precision].code_dtype
        return self.momentum_dtype or dtype


PLAIN_MUON = MuonSettings()
OPTION_DEFAULTS: dict[str, Any] = {
    f.name: getattr(PLAIN_MUON, f.name) for f in fields(MuonSettings)
}
"""The one table of Muon's option defaults, by param-group key."""

BACKWARD_SNAPSHOT = tuple(k for k in OPTION_DEFAULTS if k not in STEP_SCALARS)
"""Options that work done during backward (``orthogonalize_in_backward``) depends on."""


def schedule_defaults(options: Mapping[str, Any]) -> tuple[int, str]:
    """(``ns_steps``, ``coefficients``) defaults for the preconditioner of ``options``."""
    preconditioner = options.get("preconditioner", PLAIN_MUON.preconditioner)
    return PRECONDITIONER_SCHEDULES.get(preconditioner, PRECONDITIONER_SCHEDULES["frobenius"])


def group_schedule(group: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The ``ns_steps`` and ``coefficients`` a Muon param group lacks, resolved as the
    constructor resolves them: the optimizer's (``defaults``) where it was given them, else
    the default of the group's own preconditioner. An optimizer given exactly its
    preconditioner's default schedule is taken as given none."""
    inherited = schedule_defaults(defaults)
    own = schedule_defaults(group if "preconditioner" in group else defaults)
    return {
        key: defaults[key] if defaults[key] != inherited_default else own_default
        for key, inherited_default, own_default in zip(("ns_steps", "coefficients"), inherited, own)
        if key not in group
    }


def checked_variant_options(given: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """Every option of :data:`VARIANT_KEYWORDS`, from the ``given`` keyword arguments or the
    defaults, checked: ``TypeError`` for a keyword ``owner`` (a class name) does not take,
    ``ValueError`` naming the first invalid value."""
    unknown = sorted(set(given) - set(VARIANT_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r} (its variant "
            f"options are {', '.join(VARIANT_KEYWORDS)})"
        )
    values = {k: given.get(k, OPTION_DEFAULTS[k]) for k in VARIANT_KEYWORDS}
    validate_muon_options(values)
    return values


def validate_muon_options(group: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first invalid Muon option of ``group`` (a param group or the
    constructor's defaults; options it lacks are not checked)."""
    for name, check in _CHECKS.items():
        if name in group:
            check(group[name])
    check_state_precision(group.get("state_precision", "param"), group.get("momentum_dtype"))
    if "coefficients" in group or "ns_steps" in group:
        validate_coefficients(  # also checks ns_steps
            group.get("coefficients", PLAIN_MUON.coefficients),
            group.get("ns_steps", PLAIN_MUON.ns_steps),
        )


def _check_momentum_dtype(value: Any) -> None:
    check_dtype("momentum_dtype", value)
    if value == torch.float16:
        raise ValueError(
            "momentum_dtype=torch.float16 is refused: a gradient entry beyond its range "
            "(65504) becomes inf in the buffer and turns every weight NaN although the "
            "gradient is finite; torch.bfloat16 takes the same memory with float32's range"
        )


def check_state_precision(value: Any, momentum_dtype: Any = None) -> None:
    """``ValueError`` unless ``value`` is a :data:`StatePrecision` that agrees with
    ``momentum_dtype`` (quantized state has no floating momentum dtype to choose)."""
    check_choice("state_precision", value, STATE_PRECISIONS)
    if value != "param" and momentum_dtype is not None:
        raise ValueError(
            f"momentum_dtype={momentum_dtype} contradicts state_precision={value!r}: the "
            f"momentum is stored as {value} codes with float32 block scales and computed in "
            "float32. Pass momentum_dtype=None with a quantized state_precision, or "
            "state_precision='param' to store the momentum in momentum_dtype"
        )


def _check_nesterov(value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"nesterov must be a bool, got {value!r}")


_CHECKS = {
    "lr": lambda v: check_lr("lr", v),
    "momentum": lambda v: check_range("momentum", v, 0.0, 1.0, high_open=True),
    "weight_decay": lambda v: check_range("weight_decay", v, 0.0, math.inf),
    "nesterov": _check_nesterov,
    "scale": lambda v: check_choice("scale", v, SCALE_RULES),
    "ns_dtype": lambda v: check_dtype("ns_dtype", v),
    "momentum_dtype": _check_momentum_dtype,
    "matrix_mode": lambda v: check_choice("matrix_mode", v, MATRIX_MODES),
    "ns_eps": lambda v: check_range("eps (ns_eps)", v, 0.0, math.inf),
    "qk_lr_scale": lambda v: check_range("qk_lr_scale", v, 0.0, math.inf),
    "ns_method": lambda v: check_choice("ns_method", v, NS_METHODS),
    "normalize": lambda v: check_choice("normalize", v, NORMALIZE_MODES),
    "row_beta2": lambda v: check_range("row_beta2", v, 0.0, 1.0, high_open=True),
    "cautious_weight_decay": lambda v: check_flag("cautious_weight_decay", v),
    "preconditioner": lambda v: check_choice("preconditioner", v, PRECONDITIONERS),
}
"""One check per option (``coefficients`` with ``ns_steps``: they are checked together)."""


def changed_variant_options(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``"name: current → saved"`` for each variant option a saved param group states with
    another value than ``current`` (the group it is loaded into)."""
    out = []
    for key in VARIANT_OPTIONS:
        if key in saved and key in current and saved[key] != current[key]:
            out.append(f"{key}: {current[key]!r} → {saved[key]!r}")
    return out
