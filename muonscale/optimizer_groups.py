"""Param groups of :class:`muonscale.Muon`: every accepted ``params`` form (model, named
parameters, tensors, group dicts) named, routed and split into one group per algorithm; and
re-binding the groups to replaced parameter objects."""

from __future__ import annotations

import inspect
import sys
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .distributed.setup_checks import is_dtensor
from .experts import convolution_weights, find_experts
from .matrices import warn_idle_role_factors
from .optimizer_options import (
    AdamWGroup,
    resolve_splits,
    validate_adamw_group,
    validate_muon_group,
)
from .param_table import ParamTable
from .params import ALGORITHMS, RouteDecision, route, route_one, transposed_weights
from .settings import group_schedule

PARAMS_TYPE_ERROR = (
    "params argument given to the optimizer should be an iterable of Tensors or dicts"
)
FALLBACK_WARNING = (
    "muonscale.Muon: {n} unnamed parameter(s) with >= 2 dims were routed to Muon by tensor rank "
    "alone, so embeddings and output heads cannot be told apart from hidden matrices. {fix}"
)
MODULE_PARAMETERS_FIX = (
    "Pass model.named_parameters() or the model itself instead of model.parameters(): names "
    "and module types tell embeddings and output heads apart."
)
GENERIC_FIX = (
    "Pass model.named_parameters() or the model itself, give each param group 'param_names', or "
    "pin a group with 'algorithm': 'adamw'."
)


def groups_from(
    table: ParamTable, params: Any, weight_decay: float, adamw_weight_decay: float | None
) -> list[dict[str, Any]]:
    """Normalize every accepted ``params`` form into groups with an ``algorithm`` each, named
    and routed in ``table`` (``weight_decay``, ``adamw_weight_decay``: the optimizer's, for
    :func:`split_by_algorithm`)."""
    decays = dict(weight_decay=weight_decay, adamw_weight_decay=adamw_weight_decay)
    if isinstance(params, nn.Module):
        decisions = route(params, table.rules)
        named = dict(params.named_parameters())
        table.transposed |= transposed_weights(params)
        for name, layout in find_experts(params).layouts.items():
            table.experts.setdefault(name, layout)  # the experts option wins
        table.convolutions |= convolution_weights(params)
        table.routing.update(decisions)
        group = {"params": [(n, named[n]) for n in decisions]}
        return split_by_algorithm(group, decisions, named=True, **decays)
    table.from_module_parameters = (
        inspect.isgenerator(params) and params.gi_code is nn.Module.parameters.__code__
    )
    params = list(params)
    if not params:
        raise ValueError("params: the optimizer got an empty parameter list")
    if all(isinstance(p, Mapping) for p in params):
        groups = []
        for g in params:
            groups.extend(expand_user_group(table, dict(g), **decays))
        return groups
    return expand_user_group(table, {"params": params}, **decays)


def named_entries(
    table: ParamTable, group: dict[str, Any]
) -> tuple[list[tuple[str, torch.Tensor]], bool]:
    """``group``'s parameters as (name, tensor) pairs, and whether the user named them."""
    entries = group["params"]
    if isinstance(entries, (set, frozenset)):
        raise TypeError(
            "optimizer parameters need to be organized in ordered collections, but the "
            "ordering of tensors in sets will change between runs. Please use a list instead."
        )
    entries = [entries] if isinstance(entries, torch.Tensor) else list(entries)
    names = group.get("param_names")
    if names is not None:
        names = list(names)
        if len(names) != len(entries) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"param_names: expected {len(entries)} names (str), one per parameter, "
                f"got {names!r}"
            )
        if any(isinstance(e, tuple) for e in entries):
            raise ValueError(
                "param_names: give names either in 'param_names' or as "
                "(name, tensor) pairs, not both"
            )
        entries = list(zip(names, entries))
    pairs = [e for e in entries if isinstance(e, tuple)]
    if pairs and len(pairs) != len(entries):
        raise ValueError(
            "all optimizer params should be with/without names. Some param names are missing"
        )
    named: list[tuple[str, torch.Tensor]] = []
    for entry in entries:
        if isinstance(entry, tuple):
            if not (len(entry) == 2 and isinstance(entry[0], str)):
                raise TypeError(f"params: expected (name, tensor) pairs, got {entry!r}")
            name, p = entry
        else:
            p = entry
            name = table.names.get(id(p), f"param{len(table.names)}")
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                "optimizer can only optimize Tensors, but one of the params is " + torch.typename(p)
            )
        table.names.setdefault(id(p), name)
        named.append((name, p))
    return named, bool(pairs)


def expand_user_group(
    table: ParamTable,
    group: dict[str, Any],
    weight_decay: float,
    adamw_weight_decay: float | None,
) -> list[dict[str, Any]]:
    """One user group, named and routed in ``table``, split by :func:`split_by_algorithm`."""
    named, has_names = named_entries(table, group)
    algorithm = group.get("algorithm")
    if algorithm is not None:
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"param group 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}"
            )
        decisions = {n: RouteDecision(algorithm, "param group") for n, _ in named}
    else:
        decisions = {n: route_one(n, p, table.rules) for n, p in named}
        if not has_names:
            by_rank = [n for n, _ in named if not decisions[n].reason.startswith("user")]
            table.unnamed_to_muon += sum(decisions[n].algorithm == "muon" for n in by_rank)
            table.unnamed_low_rank += sum(p.ndim < 2 for n, p in named if n in by_rank)
    for name, decision in decisions.items():
        table.routing.setdefault(name, decision)
    return split_by_algorithm(
        dict(group, params=named),
        decisions,
        named=has_names,
        weight_decay=weight_decay,
        adamw_weight_decay=adamw_weight_decay,
    )


def split_by_algorithm(
    group: dict[str, Any],
    decisions: Mapping[str, RouteDecision],
    *,
    named: bool,
    weight_decay: float,
    adamw_weight_decay: float | None,
) -> list[dict[str, Any]]:
    """One group per algorithm; AdamW without an explicit weight decay (in ``group`` or
    ``adamw_weight_decay``) further splits by dimensionality (≥ 2-D decays by
    ``weight_decay``, 0/1-D does not). ``param_names`` stay aligned."""
    pairs = group["params"]
    rest = {k: v for k, v in group.items() if k not in ("params", "algorithm", "param_names")}

    def make(selected: list[tuple[str, torch.Tensor]], algorithm: str, **extra: Any):
        out = dict(rest, params=[p for _, p in selected], algorithm=algorithm, **extra)
        if named:
            out["param_names"] = [n for n, _ in selected]
        return out

    muon = [(n, p) for n, p in pairs if decisions[n].algorithm == "muon"]
    adamw = [(n, p) for n, p in pairs if decisions[n].algorithm == "adamw"]
    out = [make(muon, "muon")] if muon else []
    if adamw:
        if "weight_decay" in rest or adamw_weight_decay is not None:
            out.append(make(adamw, "adamw"))
        else:
            wd = weight_decay
            matrices = [(n, p) for n, p in adamw if p.ndim >= 2]
            vectors = [(n, p) for n, p in adamw if p.ndim < 2]
            if matrices:
                out.append(make(matrices, "adamw", weight_decay=wd))
            if vectors:
                out.append(make(vectors, "adamw", weight_decay=0.0))
    return out


def resolved_group(
    table: ParamTable,
    param_group: dict[str, Any],
    muon_defaults: Mapping[str, Any],
    adamw_defaults: Mapping[str, Any],
    param_groups: list[dict[str, Any]],
) -> dict[str, Any]:
    """``param_group`` (one algorithm) ready for torch's ``add_param_group``: named in
    ``table``, completed from the optimizer's defaults (a Muon group's Newton–Schulz schedule
    by its own preconditioner: :func:`~muonscale.settings.group_schedule`) and checked; an lr
    tensor another of ``param_groups`` (the groups added so far) holds is copied."""
    named, has_names = named_entries(table, param_group)
    params = [p for _, p in named]
    param_group["params"] = params
    if has_names:  # (name, tensor) pairs: torch checks names against the other groups'
        param_group["param_names"] = [name for name, _ in named]
    algorithm = param_group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"param group 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "muon":
        param_group.update(group_schedule(param_group, muon_defaults))
        if "matrix_mode" in param_group:  # the user's choice beats a found expert layout
            table.explicit_modes.update(table.names[id(p)] for p in params)
        for key, value in muon_defaults.items():
            param_group.setdefault(key, value)
        validate_muon_group(param_group)
        for p in params:
            if p.is_complex():
                raise ValueError(
                    f"Muon cannot orthogonalize complex parameter "
                    f"'{table.label(p, param_groups)}'; route it to AdamW"
                )
            if p.ndim < 2:
                raise ValueError(
                    f"Muon parameter '{table.label(p, param_groups)}' has shape "
                    f"{tuple(p.shape)}; Muon needs >= 2 dims (route it to AdamW)"
                )
    else:
        for key, value in adamw_defaults.items():
            param_group.setdefault(key, value)
        if param_group["weight_decay"] is None:
            param_group["weight_decay"] = muon_defaults["weight_decay"]
        param_group = AdamWGroup.wrap(param_group)
        validate_adamw_group(param_group)
    lr = param_group["lr"]
    if isinstance(lr, torch.Tensor) and any(g["lr"] is lr for g in param_groups):
        param_group["lr"] = lr.clone()  # each group's schedule acts on its own tensor
    return param_group


def added_groups(
    table: ParamTable,
    param_group: Mapping[str, Any],
    muon_defaults: Mapping[str, Any],
    adamw_defaults: Mapping[str, Any],
    strict: bool,
) -> list[dict[str, Any]]:
    """The groups ``add_param_group(param_group)`` adds, before defaults are filled in
    (:func:`resolved_group`): the group itself when it is the constructor's or is pinned with
    its options, else its parameters routed and split by algorithm (:func:`expand_user_group`,
    with the weight decays of the defaults); ``strict`` raises for unnamed ones before a group
    is added."""
    if not isinstance(param_group, Mapping):
        raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
    resolved = "algorithm" in param_group and (
        param_group["algorithm"] == "muon" or param_group.get("weight_decay") is not None
    )
    if resolved:  # the constructor's groups, or a group pinned with its options
        return [dict(param_group)]
    groups = expand_user_group(
        table, dict(param_group), muon_defaults["weight_decay"], adamw_defaults["weight_decay"]
    )
    warn_unnamed(table, strict, stacklevel=4)  # the warning points at add_param_group's caller
    return groups


def check_built_groups(
    table: ParamTable,
    param_groups: list[dict[str, Any]],
    optimizer: str,
    *,
    accepts_dtensor: bool,
    strict: bool,
    splits: Mapping[str, Any],
    qkv_split: str,
) -> None:
    """After the constructor's groups were added: refuse DTensors (unless the ``optimizer``
    class ``accepts_dtensor``) and stray ``transposed`` names, warn (``strict``: raise) for
    unnamed parameters routed by rank, resolve ``splits`` into ``table``, and warn when a
    per-role learning-rate factor reaches no block of that role
    (:func:`~muonscale.matrices.warn_idle_role_factors`)."""
    if not accepts_dtensor:
        refuse_dtensors(table, param_groups, optimizer)
    warn_unnamed(table, strict, stacklevel=4)  # warnings point at the constructor's caller
    check_transposed(table, param_groups)
    by_name = {table.name(p): (p, g) for g in param_groups for p in g["params"]}
    table.split_rows, table.split_roles, declared = resolve_splits(
        splits, qkv_split, by_name, table.is_transposed
    )
    table.experts.update(declared)
    table.declared |= declared.keys()
    warn_idle_role_factors(table.split_roles, param_groups, stacklevel=4)
    check_layouts(table, param_groups, strict, stacklevel=4)


class UnknownLayoutWarning(UserWarning):
    """A Muon parameter with 3 or more dims whose matrices nothing declared: it is flattened."""


def unknown_layouts(table: ParamTable, param_groups: list[dict[str, Any]]) -> list[str]:
    """Muon parameters with 3 or more dims flattened without a source: not an expert stack of
    a known module, not a convolution, no ``splits`` and no ``matrix_mode`` of the user."""
    out = []
    for group in param_groups:
        if group["algorithm"] != "muon":
            continue
        for p in group["params"]:
            name = table.names.get(id(p))
            if p.ndim < 3 or table.expert_layout(p) is not None or id(p) in table.split_rows:
                continue
            if name in table.convolutions or table.mode_given or name in table.explicit_modes:
                continue
            out.append(f"{table.label(p, param_groups)} {tuple(p.shape)}")
    return out


def check_layouts(
    table: ParamTable, param_groups: list[dict[str, Any]], strict: bool, stacklevel: int = 3
) -> None:
    """Warn once (:class:`UnknownLayoutWarning`; ``strict``: raise ``ValueError``) naming the
    Muon parameters of :func:`unknown_layouts`, and what to pass."""
    unknown = unknown_layouts(table, param_groups)
    if not unknown:
        return
    message = (
        f"muonscale.Muon: {', '.join(unknown)}: 3 or more dims and no known layout, so each "
        "is flattened to one (dim 0, rest) matrix. If it stacks E expert matrices, pass "
        "splits={name: muonscale.ExpertLayout(n_experts=E, ...)}; for a convolution, pass the "
        "model itself; to keep the flattened view, pass matrix_mode='flatten' "
        "(see *Mixture of experts* in the docs)."
    )
    if strict:
        raise ValueError(f"strict=True: {message}")
    warnings.warn(message, UnknownLayoutWarning, stacklevel=stacklevel)


def check_transposed(table: ParamTable, param_groups: list[dict[str, Any]]) -> None:
    """Refuse a ``transposed`` name of a Muon parameter that is not 2-D."""
    muon = {table.name(p): p for g in param_groups if g["algorithm"] == "muon" for p in g["params"]}
    for name in sorted(table.transposed & muon.keys()):
        if muon[name].ndim != 2:
            raise ValueError(
                f"transposed: {name!r} has shape {tuple(muon[name].shape)}; only 2-D (in, out) "
                "weights can be stored transposed"
            )


def refuse_dtensors(table: ParamTable, param_groups: list[dict[str, Any]], optimizer: str) -> None:
    """DTensor (FSDP2 / tensor-parallel) parameters need the DTensor optimizer (``optimizer``:
    the class name of the one that got them)."""
    for group in param_groups:
        for p in group["params"]:
            if is_dtensor(p):
                name = table.names.get(id(p), f"a {tuple(p.shape)} parameter")
                raise ValueError(
                    f"{optimizer} got DTensor parameter {name!r} (FSDP2 or tensor "
                    "parallel); build the optimizer with muonscale.distributed_muon(...), "
                    "which returns the DTensor optimizer for such parameters"
                )


_LIGHTNING_FIX = (
    "In a LightningModule, return muonscale.integrations.lightning.configure_optimizers(self, "
    "lr=...) from configure_optimizers: it routes by name."
)
FRAMEWORK_FIXES = {  # calling module prefix -> the fix its users can apply
    "transformers.": (
        "Under the Hugging Face Trainer, pass optimizer_cls_and_kwargs=("
        "muonscale.integrations.hf.MuonFactory, muonscale.integrations.hf.muon_kwargs(args)) "
        "instead of muonscale.Muon: the factory sees the model and routes by name."
    ),
    "lightning.": _LIGHTNING_FIX,
    "pytorch_lightning.": _LIGHTNING_FIX,
}


def framework_fix(max_depth: int = 64) -> str | None:
    """The fix for a training framework that is building this optimizer (found among the
    calling frames), or ``None``."""
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        module = frame.f_globals.get("__name__", "")
        for prefix, fix in FRAMEWORK_FIXES.items():
            if module.startswith(prefix):
                return fix
        frame = frame.f_back
    return None


def warn_unnamed(table: ParamTable, strict: bool | None, stacklevel: int = 3) -> None:
    """Judge unnamed parameters routed to Muon by rank alone (``stacklevel``: ``warnings.warn``'s,
    counted from here). ``strict=None``: raise where the misrouting is certain (a training
    framework builds the optimizer, or ``params`` was ``model.parameters()``), accept a list of
    matrices alone silently (what ``torch.optim.Muon`` takes), warn for a mixed list.
    ``False``: warn. ``True``: raise."""
    if not table.unnamed_to_muon:
        return
    framework = framework_fix()  # a framework's users cannot pass names
    if framework is not None:
        fix = framework
    elif table.from_module_parameters:
        fix = MODULE_PARAMETERS_FIX
    else:
        fix = GENERIC_FIX
    message = FALLBACK_WARNING.format(n=table.unnamed_to_muon, fix=fix)
    certain = framework is not None or table.from_module_parameters
    matrices_only = table.unnamed_low_rank == 0
    table.unnamed_to_muon = table.unnamed_low_rank = 0
    table.from_module_parameters = False
    if strict is True:
        raise ValueError(f"strict=True: {message}")
    if strict is None and certain:
        raise ValueError(f"{message} (strict=False accepts routing by shape alone.)")
    if strict is None and matrices_only:
        return
    warnings.warn(message, UserWarning, stacklevel=stacklevel)


def rebind_groups_and_state(
    table: ParamTable,
    param_groups: list[dict[str, Any]],
    state: dict[Any, Any],
    slots: list[tuple[torch.Tensor, torch.Tensor, str]],
) -> None:
    """Follow ``slots`` (of :func:`rebind_slots`): ``state`` re-keyed by the new parameters,
    ``param_groups`` and ``table`` pointed at them."""
    new_of_name = {name: new for _, new, name in slots}
    for key in list(state):  # state keys are alive, so their ids name them exactly
        name = table.names.get(id(key))
        if name in new_of_name and new_of_name[name] is not key:
            state[new_of_name[name]] = state.pop(key)
    flat = iter(slots)
    for group in param_groups:
        group["params"] = [next(flat)[1] for _ in group["params"]]
    table.rebind(slots)


def _named_tensors(named_parameters: Any) -> dict[str, torch.Tensor]:
    """``named_parameters`` (pairs, or a module) as a dict, or a TypeError saying what it got."""
    if isinstance(named_parameters, nn.Module):
        return dict(named_parameters.named_parameters())
    current = {}
    for entry in named_parameters:
        if not (
            isinstance(entry, tuple)
            and len(entry) == 2
            and isinstance(entry[0], str)
            and isinstance(entry[1], torch.Tensor)
        ):
            raise TypeError(
                "rebind_parameters: expected (name, tensor) pairs such as "
                f"model.named_parameters(), or the model, got an entry {torch.typename(entry)}"
            )
        current[entry[0]] = entry[1]
    return current


def rebind_slots(
    table: ParamTable,
    param_groups: list[dict[str, Any]],
    named_parameters: Iterable[tuple[str, torch.Tensor]] | nn.Module,
) -> list[tuple[torch.Tensor, torch.Tensor, str]]:
    """(bound now, bound next, name) for every param-group slot, matched by the names in
    ``table`` (see :meth:`muonscale.Muon.rebind_parameters`); nothing changes here."""
    current = _named_tensors(named_parameters)
    model_name = {id(p): n for n, p in current.items()}
    slots: list[tuple[torch.Tensor, torch.Tensor, str]] = []
    for group in param_groups:
        for p in group["params"]:
            name = model_name.get(id(p))
            if name is None or current[name] is not p:
                name = table.names.get(id(p))
            if name is None or name not in current:
                raise KeyError(
                    f"rebind_parameters: optimizer parameter {name or '<unnamed>'!r} is not "
                    f"among the model's parameters (first names there: {list(current)[:3]})"
                )
            new = current[name]
            if tuple(new.shape) != tuple(p.shape) and not is_dtensor(new):
                raise ValueError(
                    f"rebind_parameters: {name!r} changed shape {tuple(p.shape)} -> "
                    f"{tuple(new.shape)}"
                )
            if new.dtype != p.dtype:
                raise ValueError(
                    f"rebind_parameters: {name!r} changed dtype {p.dtype} -> {new.dtype}; its "
                    "optimizer state is in the old one. Cast the model before building the "
                    "optimizer (or build a new optimizer and load its state_dict)."
                )
            slots.append((p, new, name))
    return slots
