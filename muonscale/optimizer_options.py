"""Options of :class:`muonscale.Muon`: the constructor's keyword arguments checked and expanded
into Muon's and AdamW's group defaults (torch-name aliases resolved), the AdamW group that
aliases ``momentum`` to ``betas[0]``, and ``splits`` resolved to row blocks."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .capturable import NonFinitePolicy
from .experts import GATE_UP_MODES, ExpertLayout
from .matrices import row_blocks
from .params import RouteDecision
from .qkv import QKV_SPLIT_MODES, QKVLayout
from .scaling import ADJUST_LR_FNS, SCALE_RULES
from .settings import (  # noqa: F401 (check_*, NS_METHODS: re-exported)
    NS_METHODS,
    OPTION_DEFAULTS,
    PLAIN_MUON,
    check_dtype,
    check_flag,
    check_lr,
    check_range,
    check_state_precision,
    schedule_defaults,
    validate_muon_options,
)

NONFINITE_POLICIES: tuple[NonFinitePolicy, ...] = ("raise", "skip", "ignore")

MUON_DEFAULT_KEYS = tuple(OPTION_DEFAULTS)
"""The keys of Muon's group defaults, in the order param groups hold them."""

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
    check_state_precision(group.get("state_precision", "param"))


def checked_defaults(
    options: Mapping[str, Any],
    owner: str,
    *,
    capturable_refusal: str | None,
    backward_refusal: str | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Muon's and AdamW's group defaults from ``options``, the keyword arguments of
    :class:`muonscale.Muon` by name, each checked (``ValueError`` naming the first invalid
    one). ``owner`` names the optimizer class; ``capturable_refusal`` and
    ``backward_refusal`` say why it refuses ``capturable`` or ``orthogonalize_in_backward``
    (None: it supports it)."""
    nonfinite, qkv_split = options["nonfinite"], options["qkv_split"]
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    if qkv_split not in QKV_SPLIT_MODES:
        raise ValueError(f"qkv_split must be one of {QKV_SPLIT_MODES}, got {qkv_split!r}")
    adjust_lr_fn = options["adjust_lr_fn"]
    if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
        raise ValueError(
            f"Adjust learning rate function {adjust_lr_fn} is not supported: adjust_lr_fn "
            f"must be one of {tuple(ADJUST_LR_FNS)} (or pass scale=one of {SCALE_RULES})"
        )
    scale = either(
        "scale", options["scale"], "adjust_lr_fn", ADJUST_LR_FNS.get(adjust_lr_fn), PLAIN_MUON.scale
    )
    if options["adamw_weight_decay"] is not None:
        check_range("adamw_weight_decay", options["adamw_weight_decay"], 0.0, math.inf)
    default_steps, default_coefficients = schedule_defaults(options)
    muon_defaults = {key: options[key] for key in MUON_DEFAULT_KEYS}
    if muon_defaults["matrix_mode"] is None:  # not given: expert layouts found in the model apply
        muon_defaults["matrix_mode"] = PLAIN_MUON.matrix_mode
    muon_defaults.update(  # the keyword arguments with a default that depends, or two names
        ns_steps=options["ns_steps"] if options["ns_steps"] is not None else default_steps,
        coefficients=either(
            "coefficients",
            options["coefficients"],
            "ns_coefficients",
            options["ns_coefficients"],
            default_coefficients,
        ),
        scale=scale,
        ns_eps=either("ns_eps", options["ns_eps"], "eps", options["eps"], PLAIN_MUON.ns_eps),
    )
    validate_muon_group(muon_defaults)
    betas = either("adamw_betas", options["adamw_betas"], "betas", options["betas"], (0.9, 0.95))
    adamw_defaults = dict(
        lr=options["adamw_lr"] if options["adamw_lr"] is not None else options["lr"],
        betas=tuple(betas),
        eps=options["adamw_eps"],
        weight_decay=options["adamw_weight_decay"],
        state_precision=options["state_precision"],
    )
    validate_adamw_group(dict(adamw_defaults, weight_decay=options["weight_decay"]))
    check_switches(options, owner, capturable_refusal, backward_refusal)
    return muon_defaults, adamw_defaults


def check_switches(
    options: Mapping[str, Any],
    owner: str,
    capturable_refusal: str | None,
    backward_refusal: str | None,
) -> None:
    """``capturable``, ``orthogonalize_in_backward``, ``strict`` and ``transposed`` of
    ``options`` (see :func:`checked_defaults`)."""
    capturable, in_backward = options["capturable"], options["orthogonalize_in_backward"]
    if not isinstance(capturable, bool):
        raise ValueError(f"capturable must be a bool, got {capturable!r}")
    if capturable and capturable_refusal is not None:
        raise ValueError(f"{owner} does not support capturable=True: {capturable_refusal}")
    check_flag("orthogonalize_in_backward", in_backward)
    if in_backward and backward_refusal is not None:
        raise ValueError(
            f"{owner} does not support orthogonalize_in_backward=True: {backward_refusal}"
        )
    if in_backward and capturable:
        raise ValueError(
            "orthogonalize_in_backward=True cannot be combined with capturable=True: the "
            "Newton–Schulz work would run in backward hooks, outside the captured step"
        )
    if options["strict"] is not None and not isinstance(options["strict"], bool):
        raise ValueError(
            "strict must be None (refuse certain misrouting), False (accept routing by shape "
            f"alone, with a warning) or True (refuse any routing by shape alone), got "
            f"{options['strict']!r}"
        )
    for key in ("transposed", "convolutions"):
        if isinstance(options[key], str):
            raise TypeError(f"{key} must be a collection of parameter names, got {options[key]!r}")
    if options["gate_up"] not in GATE_UP_MODES:
        raise ValueError(f"gate_up must be one of {GATE_UP_MODES}, got {options['gate_up']!r}")
    for name, layout in (options["experts"] or {}).items():
        if not isinstance(layout, ExpertLayout):
            raise TypeError(f"experts[{name!r}]: expected a muonscale.ExpertLayout, got {layout!r}")


def require_adamw_lr(
    groups: Sequence[Mapping[str, Any]],
    routing: Mapping[str, RouteDecision],
    adamw_lr: Any,
    scale: str,
) -> None:
    """``ValueError`` when AdamW groups would take Muon's lr under a ``scale`` whose updates
    are not the size of AdamW's (only ``"match_rms_adamw"`` makes one lr fit both)."""
    if adamw_lr is not None or scale == "match_rms_adamw":
        return
    if any(g["algorithm"] == "adamw" and "lr" not in g for g in groups):
        adamw_params = [n for n, d in routing.items() if d.algorithm == "adamw"]
        raise ValueError(
            f"adamw_lr is required with scale={scale!r}: only scale='match_rms_adamw' "
            "makes Muon's update RMS match AdamW's (~0.2), so that one lr fits both "
            f"halves. Parameters routed to AdamW: {adamw_params[:5]}"
        )


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
) -> tuple[dict[int, list[torch.Tensor]], dict[int, tuple[str, ...]], dict[str, ExpertLayout]]:
    """The ``splits`` option as row blocks keyed by ``id(param)``, the role (``"q"``,
    ``"k"``, ``"v"``) of each block of the parameters split by a :class:`QKVLayout`, and the
    expert layouts declared (by name); ``by_name`` maps each parameter name to (parameter,
    its param group)."""
    out, roles, layouts = {}, {}, {}
    for name, spec in splits.items():
        if name not in by_name or by_name[name][1]["algorithm"] != "muon":
            raise ValueError(f"splits: no Muon parameter named {name!r}")
        param = by_name[name][0]
        if isinstance(spec, ExpertLayout):
            try:
                spec.expert_shape(param.shape)
            except ValueError as error:
                raise ValueError(f"splits[{name!r}]: {error}") from None
            layouts[name] = spec
            continue
        rows = param.shape[1] if is_transposed(param) else param.shape[0]
        if by_name[name][1]["matrix_mode"] == "batch" and param.ndim > 2:
            rows = param.shape[-2]  # the blocks cut each matrix of the stack
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
                f"splits[{name!r}]: expected a QKVLayout, an ExpertLayout, an int or a list of "
                f"sizes, got {spec!r}"
            )
        out[id(param)] = parts
    return out, roles, layouts
