"""Options of the Megatron-Core adapter and how Megatron's ``--muon-*`` flags map onto them."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

import torch

from muonscale.newton_schulz import COEFFICIENT_PRESETS, Coefficients
from muonscale.qkv import QKV_SPLIT_MODES
from muonscale.scaling import SCALE_RULES
from muonscale.settings import VARIANT_KEYWORDS, checked_variant_options

if TYPE_CHECKING:
    from .plan import ParamPlan

TP_MODES = ("exact", "approximate_blockwise")
"""``"exact"``: every TP-sharded matrix is orthogonalized whole (at one owner rank).
``"approximate_blockwise"``: each rank orthogonalizes its own shard (Megatron's ``blockwise``)."""

DP_MODES = ("auto", "zero1", "replicated")
STATE_PRECISIONS = ("param", "int8", "int4")

# Megatron-Core --muon-scale-mode → muonscale ``scale`` rule. Same formulas, different names:
# emerging_optimizers 0.3.0 orthogonalized_optimizers/muon.py, get_muon_scale_factor (L136).
MEGATRON_SCALE_MODES = {
    "spectral": "unit_rms",  # √max(m, n)
    "unit_rms_norm": "spectral",  # √(m/n)
    "shape_scaling": "shape",  # √max(1, m/n)
}

# Megatron-Core --muon-coefficient-type → Newton–Schulz coefficients, copied from
# emerging_optimizers 0.3.0 orthogonalized_optimizers/muon_utils.py, _COEFFICIENT_SETS (L30);
# "cycle" / "repeat_last" is how that file walks the list past its end (L197-198).
MEGATRON_COEFFICIENT_SETS: dict[str, tuple[tuple[Coefficients, ...], str]] = {
    "simple": (((3.4445, -4.7750, 2.0315),), "cycle"),
    "quintic": (
        (
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        ),
        "cycle",
    ),
    "polar_express": (
        (
            (8.2051, -22.9019, 16.4607),
            (4.0664, -2.8612, 0.5184),
            (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853),
            (2.2779, -1.6198, 0.3985),
            (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568),
            (1.8750, -1.2500, 0.3750),
        ),
        "repeat_last",
    ),
}

# Megatron's fp32 matmul precision → the dtype the iteration runs in (emerging_optimizers
# casts to bfloat16 when the precision is "medium": muon_utils.py L203-213).
MEGATRON_MATMUL_PRECISION = {
    "low": torch.bfloat16,
    "medium": torch.bfloat16,
    "high": torch.float32,
    "highest": torch.float32,
}

MEGATRON_FLAGS: dict[str, tuple[str, str]] = {
    # Megatron OptimizerConfig field → (muonscale MegatronMuonConfig field, how it maps)
    "muon_momentum": ("muon_momentum", "same"),
    "muon_nesterov": ("muon_nesterov", "same"),
    "muon_split_qkv": ("muon_split_qkv", "same"),
    "muon_num_ns_steps": ("muon_num_ns_steps", "same"),
    "muon_extra_scale_factor": ("muon_extra_scale_factor", "same"),
    "muon_tp_mode": (
        "muon_tp_mode",
        "duplicated/distributed → exact; "
        "blockwise → exact unless approximate_blockwise is asked by name",
    ),
    "muon_scale_mode": (
        "scale",
        "renamed: spectral → unit_rms, unit_rms_norm → spectral, shape_scaling → shape",
    ),
    "muon_coefficient_type": ("coefficients", "megatron_coefficients(name, steps)"),
    "muon_fp32_matmul_prec": ("ns_dtype", "medium/low → bfloat16, high → float32"),
    "lr": ("lr", "same"),
    "weight_decay": ("weight_decay", "same (decoupled)"),
    "adam_beta1": ("adam_beta1", "same"),
    "adam_beta2": ("adam_beta2", "same"),
    "adam_eps": ("adam_eps", "same"),
    "clip_grad": ("clip_grad", "same (Megatron default 1.0, muonscale default 0 = off)"),
    "bf16": ("main_params_dtype", "fp32 main copies of bf16 parameters (default float32)"),
}
"""How :meth:`MegatronMuonConfig.from_megatron` reads Megatron's ``OptimizerConfig``."""


def megatron_coefficients(coefficient_type: str, steps: int) -> list[Coefficients]:
    """The ``steps`` (a, b, c) tuples Megatron's ``--muon-coefficient-type`` uses, walked the way
    emerging_optimizers walks them. Types other than simple / quintic / polar_express are read
    from an installed ``emerging_optimizers``."""
    if coefficient_type in MEGATRON_COEFFICIENT_SETS:
        table, mode = MEGATRON_COEFFICIENT_SETS[coefficient_type]
    else:
        try:
            from emerging_optimizers.orthogonalized_optimizers import muon_utils
        except ImportError:
            raise ValueError(
                f"muon_coefficient_type {coefficient_type!r}: known without emerging_optimizers: "
                f"{sorted(MEGATRON_COEFFICIENT_SETS)}"
            ) from None
        sets = getattr(muon_utils, "_COEFFICIENT_SETS", {})
        if coefficient_type not in sets:
            raise ValueError(f"muon_coefficient_type {coefficient_type!r} not in {sorted(sets)}")
        table = tuple(tuple(t) for t in sets[coefficient_type])
        mode = (
            "repeat_last"
            if coefficient_type in ("polar_express", "cans", "deepseekv4")
            else "cycle"
        )
    if mode == "cycle":
        return [tuple(table[i % len(table)]) for i in range(steps)]
    return [tuple(table[min(i, len(table) - 1)]) for i in range(steps)]


@dataclass(frozen=True, kw_only=True)
class MegatronMuonConfig:
    """Options of :func:`megatron_muon`. ``muon_*`` fields mean what Megatron's flag of the same
    name means; defaults are muonscale's (see *Megatron-Core* in the docs for where they differ)."""

    lr: float = 1e-3
    """Learning rate of the Muon half (and of AdamW unless ``adam_lr`` is set)."""
    weight_decay: float = 0.0
    """Decoupled weight decay λ (Muon matrices and ≥ 2-D AdamW tensors; norms/biases get none)."""
    muon_momentum: float = 0.95
    """μ of the EMA momentum (Megatron config 0.95, Megatron CLI default 0.9)."""
    muon_nesterov: bool = True
    """Nesterov momentum (Megatron default False)."""
    muon_split_qkv: bool = True
    """Orthogonalize ``linear_qkv.weight`` as separate matrices (see ``qkv_split``)."""
    qkv_split: str = "qkv"
    """``"qkv"``: Q, K, V blocks (as Megatron's split); ``"head"``: one matrix per head."""
    scale: str = "match_rms_adamw"
    """Update scale rule (:mod:`muonscale.scaling`); Megatron's "spectral" is ``"unit_rms"``."""
    muon_extra_scale_factor: float = 1.0
    """Extra factor on every Muon update, as Megatron's."""
    muon_num_ns_steps: int | None = None
    """Newton–Schulz steps; None → muonscale.Muon's default for the preconditioner (resolved
    by ``muonscale.Muon`` when the optimizer is built)."""
    coefficients: str | Coefficients | Sequence[Coefficients] | None = None
    """muonscale preset or tuples; :func:`megatron_coefficients` translates Megatron's names.
    None → muonscale.Muon's default for the preconditioner (resolved when it is built)."""
    ns_dtype: torch.dtype | None = None
    """dtype of the iteration; None → bfloat16 on CUDA, float32 on CPU."""
    muon_tp_mode: str = "exact"
    """``"exact"`` or ``"approximate_blockwise"`` (:data:`TP_MODES`)."""
    adam_lr: float | None = None
    """lr of the AdamW half; None → ``lr`` (allowed only with ``scale="match_rms_adamw"``)."""
    adam_beta1: float = 0.9
    """AdamW β₁."""
    adam_beta2: float = 0.95
    """AdamW β₂ (Megatron default 0.999)."""
    adam_eps: float = 1e-8
    """AdamW ε."""
    adam_weight_decay: float | None = None
    """λ of the AdamW half; None → ``weight_decay`` for ≥ 2-D tensors, 0 for norms and biases."""
    grads_reduced: bool | None = None
    """Whether gradients arrive already averaged over the data-parallel group. None → True when
    parameters carry Megatron DDP's ``main_grad``, else the optimizer averages ``.grad`` itself."""
    clip_grad: float = 0.0
    """Clip the global gradient norm (over TP, pipeline, data and expert parallel ranks, each
    gradient counted once, see :mod:`.grad_norm`) to this value; 0 disables clipping (the norm
    is still computed: ``opt.last_grad_norm``). Megatron's default is 1.0."""
    main_params_dtype: torch.dtype | None = torch.float32
    """Keep main copies in this dtype of parameters with fewer bits (bf16 models: fp32 main
    parameters, as Megatron's --bf16 optimizer), updated by the optimizer and written back
    after each step. None: update the parameters in place, in their own dtype."""
    nonfinite: str = "raise"
    """``"raise"`` / ``"skip"`` / ``"ignore"`` a step with a NaN/inf gradient (see Muon)."""
    variant_options: Mapping[str, Any] = field(default_factory=dict)
    """:class:`muonscale.Muon`'s variant options (:data:`muonscale.settings.VARIANT_KEYWORDS`,
    each in *Variants* in the docs), the others at their defaults. Under exact TP each whole
    matrix's variant runs at its owner rank, and replicated row state stays replicated over
    the TP group. :meth:`replaced` (and ``from_megatron`` / ``megatron_muon`` overrides) also
    take them by name."""
    state_precision: str = "param"
    """How the optimizer state is stored (:class:`muonscale.Muon`'s option): ``"param"``
    (floating), ``"int8"`` (the Muon momentum as int8 codes, AdamW's moments 8-bit) or
    ``"int4"`` (a 4-bit Muon momentum). A TP piece that holds columns of its rows (row-parallel
    weights, TP-sharded biases) shares its cut blocks' scales over the TP group, replicated
    and under ZeRO-1; ZeRO-1 refuses by name only AdamW state of such a piece of several rows,
    unless ``float_state_params`` names it (*Low-bit state* in the docs)."""
    float_state_params: tuple[str, ...] = ()
    """Names (``fnmatch`` patterns, e.g. ``"*.linear_proj.weight"``) of parameters whose state
    stays floating (``state_precision="param"``, a param group of their own) while
    ``state_precision`` quantizes the others: e.g. under ZeRO-1 a 2-D AdamW parameter whose
    TP shard cuts the blocks of its rows, which a quantized state refuses there by name
    (*Low-bit state* in the docs)."""
    dp_mode: str = "auto"
    """``"zero1"``: :class:`muonscale.DistributedMuon` over Megatron's DP group (reduce-scatter
    to owners, ZeRO-1); ``"replicated"``: every DP replica runs the step; ``"auto"``: zero1
    unless Megatron's DDP reduces the gradients, or expert / pipeline parallelism is used."""

    def __post_init__(self) -> None:
        variant = checked_variant_options(self.variant_options, type(self).__name__)
        object.__setattr__(self, "variant_options", variant)
        if self.muon_tp_mode not in TP_MODES:
            hint = ""
            if self.muon_tp_mode in ("duplicated", "distributed"):
                hint = " (Megatron's exact modes; muonscale's exact mode is 'exact')"
            elif self.muon_tp_mode == "blockwise":
                hint = " (per-shard Newton–Schulz is approximate: ask for 'approximate_blockwise')"
            raise ValueError(
                f"muon_tp_mode must be one of {TP_MODES}, got {self.muon_tp_mode!r}{hint}"
            )
        factor = self.muon_extra_scale_factor
        finite = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        if not (finite and math.isfinite(factor) and factor > 0):
            raise ValueError(
                "muon_extra_scale_factor must be a positive finite number (a factor on every "
                f"Muon update), got {factor!r}"
            )
        if not (isinstance(self.clip_grad, (int, float)) and self.clip_grad >= 0):
            raise ValueError(
                f"clip_grad must be a number >= 0 (0 disables), got {self.clip_grad!r}"
            )
        if self.state_precision not in STATE_PRECISIONS:
            raise ValueError(
                f"state_precision must be one of {STATE_PRECISIONS}, got {self.state_precision!r}"
            )
        names = self.float_state_params
        if isinstance(names, str) or not all(isinstance(n, str) for n in names):
            raise TypeError(
                "float_state_params must be a tuple of parameter names or fnmatch patterns, "
                f"got {names!r}"
            )
        object.__setattr__(self, "float_state_params", tuple(names))
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode must be one of {DP_MODES}, got {self.dp_mode!r}")
        if self.qkv_split not in QKV_SPLIT_MODES:
            raise ValueError(f"qkv_split must be one of {QKV_SPLIT_MODES}, got {self.qkv_split!r}")
        if self.scale not in SCALE_RULES:
            hint = ""
            if self.scale in MEGATRON_SCALE_MODES:
                hint = (
                    f"; Megatron's {self.scale!r} is muonscale's "
                    f"{MEGATRON_SCALE_MODES[self.scale]!r}"
                )
            raise ValueError(f"scale must be one of {SCALE_RULES}, got {self.scale!r}{hint}")
        if isinstance(self.coefficients, str) and self.coefficients not in COEFFICIENT_PRESETS:
            raise ValueError(
                f"coefficients {self.coefficients!r} is not a muonscale preset "
                f"{sorted(COEFFICIENT_PRESETS)}; "
                "for Megatron's --muon-coefficient-type use megatron_coefficients(name, steps)"
            )

    def replaced(self, **changes: Any) -> MegatronMuonConfig:
        """A copy with ``changes``: fields by name, and the variant options by name too
        (merged into ``variant_options``); ``TypeError`` names an option neither takes."""
        names = {f.name for f in fields(self)}
        variant = {k: changes.pop(k) for k in list(changes) if k in VARIANT_KEYWORDS}
        unknown = sorted(set(changes) - names)
        if unknown:
            raise TypeError(
                f"{type(self).__name__}: unknown options {unknown} (its fields: "
                f"{', '.join(sorted(names))}; variant options: {', '.join(VARIANT_KEYWORDS)})"
            )
        if variant:
            changes["variant_options"] = {
                **self.variant_options,
                **changes.get("variant_options", {}),
                **variant,
            }
        return replace(self, **changes)

    @classmethod
    def from_megatron(cls, optimizer_config: Any, **overrides: Any) -> MegatronMuonConfig:
        """Read the ``muon_*``, ``lr``, ``weight_decay`` and ``adam_*`` fields of Megatron's
        ``OptimizerConfig`` (see :data:`MEGATRON_FLAGS`). ``muon_tp_mode`` is always exact
        unless ``overrides`` says ``muon_tp_mode="approximate_blockwise"``."""
        c = optimizer_config
        if not getattr(c, "decoupled_weight_decay", True):
            raise ValueError("decoupled_weight_decay=False (L2 weight decay) is not supported")
        if getattr(c, "fp16", False):
            raise NotImplementedError(
                "OptimizerConfig.fp16=True: float16 training needs a loss scaler, which this "
                "adapter does not implement; use bf16=True"
            )
        steps = int(getattr(c, "muon_num_ns_steps", 5))
        values: dict[str, Any] = dict(
            lr=float(c.lr) if getattr(c, "lr", None) is not None else 1e-3,
            weight_decay=float(getattr(c, "weight_decay", 0.0)),
            muon_momentum=float(c.muon_momentum),
            muon_nesterov=bool(c.muon_nesterov),
            muon_split_qkv=bool(c.muon_split_qkv),
            muon_num_ns_steps=steps,
            muon_extra_scale_factor=float(getattr(c, "muon_extra_scale_factor", 1.0)),
            scale=_megatron_value("muon_scale_mode", c.muon_scale_mode, MEGATRON_SCALE_MODES),
            coefficients=megatron_coefficients(c.muon_coefficient_type, steps),
            ns_dtype=_megatron_value(
                "muon_fp32_matmul_prec",
                getattr(c, "muon_fp32_matmul_prec", "medium"),
                MEGATRON_MATMUL_PRECISION,
            ),
            muon_tp_mode="exact",
            adam_beta1=float(c.adam_beta1),
            adam_beta2=float(c.adam_beta2),
            adam_eps=float(c.adam_eps),
            clip_grad=float(getattr(c, "clip_grad", 0.0) or 0.0),
        )
        if values["scale"] != "match_rms_adamw":
            values["adam_lr"] = values["lr"]  # Megatron uses one lr for both halves
        return cls(**values).replaced(**overrides)


def _megatron_value(field_name: str, value: Any, table: Mapping[str, Any]) -> Any:
    """What Megatron's ``field_name`` = ``value`` maps to in ``table``; ``ValueError`` naming
    the field and the values it accepts otherwise."""
    if not isinstance(value, str) or value not in table:
        raise ValueError(
            f"OptimizerConfig.{field_name} {value!r} is not one of the values this adapter "
            f"reads: {sorted(table)}"
        )
    return table[value]


def muon_arguments(
    plans: Sequence[ParamPlan], config: MegatronMuonConfig
) -> tuple[list[dict], dict[str, Any]]:
    """Param groups (routing pinned by the plan) and :class:`muonscale.Muon` options."""
    floating = {pl.name for pl in plans if keeps_float_state(pl.name, config)}
    param_groups = []
    for algorithm in ("muon", "adamw"):
        mine = [pl for pl in plans if pl.algorithm == algorithm]
        quantized = [(pl.name, pl.param) for pl in mine if pl.name not in floating]
        kept = [(pl.name, pl.param) for pl in mine if pl.name in floating]
        if quantized:
            param_groups.append({"params": quantized, "algorithm": algorithm})
        if kept:  # the parameters named by float_state_params
            param_groups.append(
                {"params": kept, "algorithm": algorithm, "state_precision": "param"}
            )
    options = dict(
        lr=config.lr,
        momentum=config.muon_momentum,
        nesterov=config.muon_nesterov,
        weight_decay=config.weight_decay,
        ns_steps=config.muon_num_ns_steps,  # None: Muon's default for the preconditioner
        coefficients=config.coefficients,
        scale=config.scale,
        ns_dtype=config.ns_dtype,
        adamw_lr=config.adam_lr,
        adamw_betas=(config.adam_beta1, config.adam_beta2),
        adamw_eps=config.adam_eps,
        adamw_weight_decay=config.adam_weight_decay,
        nonfinite=config.nonfinite,
        qkv_split=config.qkv_split,
        state_precision=config.state_precision,
        splits={pl.name: pl.qkv_layout for pl in plans if pl.qkv_layout is not None},
        **config.variant_options,
    )
    return param_groups, options


def keeps_float_state(name: str, config: MegatronMuonConfig) -> bool:
    """Whether parameter ``name`` is named by ``config.float_state_params`` (its state stays
    floating)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in config.float_state_params)
