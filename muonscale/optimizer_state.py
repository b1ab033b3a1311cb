"""State of :class:`muonscale.Muon` beyond ``torch.optim``'s: each parameter's state created,
what pickling carries, the checks before ``load_state_dict``, the fix-ups after it, and the
stacks its momentum buffers live in."""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .declared_state import (
    MOMENTUM,
    MUON_STATE,
    check_loaded_state,
    kept_state,
    saved_precision,
    zero_momentum,
)
from .distributed.dtensor_layout import local_tensor
from .distributed.dtensor_state import convert_dtensor_state_
from .distributed.setup_checks import is_dtensor
from .kernels import elementwise_backend_from_environment
from .matrices import MatrixView
from .memory import MemoryBudget
from .momentum_formats import momentum_format_of
from .nonfinite import NonFiniteSteps
from .optimizer_options import AdamWGroup
from .param_table import ParamTable
from .quantized_state import (
    ADAMW_MOMENTS,
    adamw_state_is_quantized,
    dequantize_adamw_state_,
    float_momentum_state,
    quantize_adamw_state_,
    quantized_momentum_state,
    zero_adamw_moments,
)
from .settings import (
    OPTION_DEFAULTS,
    MuonSettings,
    changed_variant_options,
    check_state_precision,
)

STATE_KEYS = {
    "muon": {t.key for t in MUON_STATE},
    "adamw": {"step", "exp_avg", "exp_avg_sq", *(absmax for _, absmax, _ in ADAMW_MOMENTS)},
}
"""The state keys :class:`muonscale.Muon` writes, per algorithm."""


PICKLED_EXTRAS_KEY = "_muonscale"
"""The key under which a pickled :class:`muonscale.Muon` carries :func:`pickled_extras`."""


def created_state(
    state: dict[str, Any],
    p: torch.Tensor,
    group: Mapping[str, Any],
    settings: MuonSettings | None,
    matrix_view: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
    *,
    capturable: bool,
) -> dict[str, Any]:
    """``state``, the optimizer's entry for ``p`` of ``group``, with what is missing created:
    Muon's declared state (``settings``: the group's) or, when ``settings`` is None and
    ``state`` is empty, AdamW's. ``matrix_view(p, group)``: ``p``'s matrices, read only for
    state shaped by them."""
    if settings is not None:
        if MOMENTUM.key not in state:  # laid out as the parameter (a DTensor's shards)
            view = functools.partial(matrix_view, p, group)  # read for packed codes only
            state[MOMENTUM.key] = zero_momentum(p, settings, p.dtype, view)
        for spec in kept_state(settings, variants_only=True):
            if spec.key not in state:
                state[spec.key] = spec.zeros(settings, matrix_view(p, group), p.dtype, p.device)
    elif not state:
        # capturable: on the parameter's device (torch's convention), made by a fill kernel
        device = p.device if capturable else torch.device("cpu")
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        if group.get("state_precision", "param") != "param":  # 8-bit moments (int8, int4)
            state.update(zero_adamw_moments(p))
        else:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def pickled_extras(opt: Any) -> dict[str, Any]:
    """What a pickle of the :class:`muonscale.Muon` ``opt`` carries beyond torch's state. The
    rest is keyed by ``id(param)``, which a copy changes: the table travels by position."""
    return dict(
        opt.param_table.pickled(opt.param_groups),
        nonfinite=opt.nonfinite,
        skipped_steps=opt.skipped_steps,
        capturable=opt.capturable,
        muon_defaults=opt.muon_defaults,
        adamw_defaults=opt.adamw_defaults,
        orthogonalize_in_backward=opt.orthogonalize_in_backward,
        strict=opt.__dict__.get("strict", False),
    )


def extras_not_pickled(
    param_groups: list[dict[str, Any]], defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The extras (as :func:`pickled_extras` writes them) of a pickle written before they were
    pickled (muonscale 0.1: torch's ``defaults``, ``state`` and ``param_groups`` only), each
    at its default, as torch fills options a checkpoint lacks; a warning names what was not
    recorded. ``param_groups``: the copy's, already upgraded (:func:`upgraded_groups`)."""
    adamw = next((g for g in param_groups if g["algorithm"] == "adamw"), None)
    adamw_defaults = dict(
        lr=adamw["lr"] if adamw is not None else defaults.get("lr", OPTION_DEFAULTS["lr"]),
        betas=tuple(adamw["betas"]) if adamw is not None else (0.9, 0.95),
        eps=adamw["eps"] if adamw is not None else 1e-8,
        weight_decay=None,
    )
    warnings.warn(
        "muonscale.Muon unpickled from muonscale 0.1, which pickled torch's state only: the "
        "copy steps with the pickled param groups and state, and the options kept outside "
        "them take their defaults: nonfinite='raise' (set opt.nonfinite = 'skip' to skip "
        "non-finite steps instead) and no splits (an optimizer built with splits= must be "
        "built again with them, then load this copy's state_dict()). Parameter names and "
        "routing were not recorded (messages name param-group slots); add_param_group takes "
        "AdamW's options from the first AdamW group",
        UserWarning,
        stacklevel=5,  # the caller of torch.load or copy.deepcopy
    )
    return dict(
        routing={},
        names=[[None] * len(g["params"]) for g in param_groups],
        split_rows=[[None] * len(g["params"]) for g in param_groups],
        nonfinite="raise",
        skipped_steps=0,
        muon_defaults={k: v for k, v in defaults.items() if k in OPTION_DEFAULTS},
        adamw_defaults=adamw_defaults,
    )


def attributes_added_since(present: Mapping[str, Any]) -> dict[str, Any]:
    """The attributes of :class:`muonscale.Muon` missing from ``present`` (its ``__dict__``
    after torch's ``__setstate__``), with their values: options added after an object was
    pickled, and the environment's memory budget and elementwise pass (never pickled: read
    when missing)."""
    added = dict(
        memory=MemoryBudget.from_environment(),
        capturable=False,
        strict=False,
        nonfinite_steps=NonFiniteSteps(),
    )
    if "elementwise_backend" not in present:
        added["elementwise_backend"] = elementwise_backend_from_environment()
    return {key: value for key, value in added.items() if key not in present}


def unpickled_attributes(
    param_groups: list[dict[str, Any]], extras: Mapping[str, Any]
) -> dict[str, Any]:
    """The attributes :func:`pickled_extras` gives the copy, keyed by its parameters
    (``param_groups``); options added since the pickle was written take their defaults."""
    return dict(
        nonfinite=extras["nonfinite"],
        nonfinite_steps=NonFiniteSteps(extras["skipped_steps"]),
        capturable=extras.get("capturable", False),
        strict=extras.get("strict", False),  # pickled before strict existed: False
        muon_defaults={**OPTION_DEFAULTS, **extras["muon_defaults"]},
        adamw_defaults=extras["adamw_defaults"],
        param_table=ParamTable.unpickled(param_groups, extras),
    )


class MomentumStacks:
    """Muon momentum buffers as views into one ``(k, *shape)`` stack per (param group, shape,
    dtype, device); owned by the optimizer, rebuilt whenever a buffer was replaced. A DTensor
    buffer (:class:`~muonscale.distributed.DTensorMuon`) is stacked by its local shard's shape:
    it stays a DTensor with its placements, its local tensor over its slot of the stack."""

    def __init__(self) -> None:
        self.views: dict[int, torch.Tensor] = {}  # id(state) -> its view in a stack

    def buffers(
        self,
        group: Mapping[str, Any],
        params: list[torch.Tensor],
        states: list[dict],
        all_state: Mapping[torch.Tensor, dict],
    ) -> list[torch.Tensor]:
        """The momentum buffers of ``states``, each a view into its stack. A buffer that is not
        the view handed out (new state, ``load_state_dict``, a checkpoint loaded by replacing
        tensors) has its stack rebuilt: every member's values are copied into a new stack
        (parameters without a gradient keep their values), so the ``state_dict`` format is
        unchanged. ``all_state`` is the optimizer's ``state``."""
        stale = {
            _stack_key(s["momentum_buffer"])
            for s in states
            if self.views.get(id(s)) is not s["momentum_buffer"]
        }
        for key in stale:
            self._restack(group, key, states, all_state)
        if stale:  # forget the views of state that was replaced (their stacks can be freed)
            live = {id(s) for s in all_state.values()}
            self.views = {k: v for k, v in self.views.items() if k in live}
        return [s["momentum_buffer"] for s in states]

    @torch.no_grad()
    def _restack(
        self,
        group: Mapping[str, Any],
        key: tuple,
        states: list[dict],
        all_state: Mapping[torch.Tensor, dict],
    ) -> None:
        shape, dtype, device = key
        members, seen = [], set()
        candidates = [all_state.get(q) for q in group["params"]] + states
        for s in candidates:
            buf = s.get("momentum_buffer") if s else None
            if isinstance(buf, torch.Tensor) and id(s) not in seen and _stack_key(buf) == key:
                members.append(s)
                seen.add(id(s))
        stack = torch.empty((len(members), *shape), dtype=dtype, device=device)
        sources = [local_tensor(s["momentum_buffer"]) for s in members]
        torch._foreach_copy_(list(stack.unbind(0)), sources)
        for s, view in zip(members, stack.unbind(0)):
            s["momentum_buffer"] = _like(s["momentum_buffer"], view)
            self.views[id(s)] = s["momentum_buffer"]


def _stack_key(buf: torch.Tensor) -> tuple:
    """(shape, dtype, device) of the stack ``buf`` belongs in: its local shard's, for a
    DTensor."""
    local = local_tensor(buf)
    return tuple(local.shape), local.dtype, local.device


def _like(old: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` (a slot of a stack) standing in for ``old``: for a DTensor, a DTensor with
    ``old``'s mesh, placements, global shape and stride over the slot's memory (no copy),
    else ``view``."""
    if not is_dtensor(old):
        return view
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        _at_offset_zero(view),
        old.device_mesh,
        old.placements,
        run_check=False,
        shape=old.shape,
        stride=old.stride(),
    )


def _at_offset_zero(view: torch.Tensor) -> torch.Tensor:
    """A tensor over the memory of ``view`` (contiguous) that starts at storage offset 0: its
    storage is a slice of the stack's, which it keeps alive. A DTensor takes its local
    tensor's storage offset, and one with an offset cannot be deep-copied or ``torch.save``-d
    (both then read the storage a DTensor does not have), so DTensor state must not be a
    plain view into a stack."""
    if view.numel() == 0:
        return torch.empty(view.shape, dtype=view.dtype, device=view.device)
    start = view.storage_offset() * view.element_size()
    memory = view.untyped_storage()[start : start + view.numel() * view.element_size()]
    out = torch.empty(0, dtype=view.dtype, device=view.device)
    return out.set_(memory, 0, view.shape, view.stride())


def upgraded_groups(param_groups: list[dict[str, Any]]) -> None:
    """Give groups unpickled from older versions every option added since (in place)."""
    for i, group in enumerate(param_groups):
        group.setdefault("algorithm", "muon")
        if group["algorithm"] == "muon":
            for key, value in OPTION_DEFAULTS.items():
                group.setdefault(key, value)
        elif not isinstance(group, AdamWGroup):
            param_groups[i] = AdamWGroup.wrap(group)


def check_state_dict(
    state_dict: Mapping[str, Any], param_groups: list[dict[str, Any]], table: ParamTable
) -> None:
    """:func:`check_loadable`, then :func:`check_loaded_groups`: before ``load_state_dict``
    changes anything."""
    check_loadable(state_dict, param_groups)
    check_loaded_groups(param_groups, table, state_dict, stacklevel=4)


def check_loadable(state_dict: Mapping[str, Any], param_groups: list[Mapping[str, Any]]) -> None:
    """Raise ``ValueError`` unless ``state_dict`` was written by this kind of optimizer with
    the same groups (checked before anything changes)."""
    saved = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(saved, list) or "state" not in state_dict:
        raise ValueError("load_state_dict: expected a dict with 'state' and 'param_groups'")
    if len(saved) != len(param_groups):
        raise ValueError(
            f"load_state_dict: the state dict has {len(saved)} param groups, this optimizer "
            f"{len(param_groups)} ({[g['algorithm'] for g in param_groups]})"
        )
    for i, (old, new) in enumerate(zip(saved, param_groups)):
        algorithm = old.get("algorithm")
        if algorithm is None and {"ns_steps", "coefficients"} <= old.keys():
            algorithm = "muon"  # written before groups carried 'algorithm'
        if algorithm != new["algorithm"]:
            raise ValueError(
                f"load_state_dict: param group {i} of the state dict is not a muonscale.Muon "
                f"{new['algorithm']} group (algorithm={old.get('algorithm')!r}, keys "
                f"{sorted(old)}); a state dict written by another optimizer (such as "
                "torch.optim.AdamW or torch.optim.Muon) cannot be loaded. Nothing was changed."
            )
        allowed = STATE_KEYS[algorithm]
        for index in old.get("params", []):
            extra_keys = set(state_dict["state"].get(index, {})) - allowed
            if extra_keys:
                raise ValueError(
                    f"load_state_dict: state of parameter {index} (group {i}, "
                    f"{algorithm}) has keys {sorted(extra_keys)} that muonscale.Muon does "
                    f"not write (expected {sorted(allowed)}). Nothing was changed."
                )


def with_group_defaults(
    state_dict: Mapping[str, Any], muon_defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """A shallow copy of ``state_dict`` whose groups (from older versions) have every option."""
    state_dict = dict(state_dict, param_groups=[dict(g) for g in state_dict["param_groups"]])
    for group in state_dict["param_groups"]:  # checkpoints from older versions
        group.setdefault("algorithm", "muon")
        if group["algorithm"] == "muon":
            for key, value in muon_defaults.items():
                group.setdefault(key, value)
    return state_dict


def without_default_precision(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` (a fresh one, changed in place) without ``state_precision`` in the groups
    that keep the default (``"param"``): the format of versions before the option."""
    for group in state_dict["param_groups"]:
        if group.get("state_precision") == "param":
            del group["state_precision"]
    return state_dict


def parameter_states(state: Mapping[Any, dict]) -> list[dict[str, Any]]:
    """The per-parameter entries of an optimizer's ``state``. torch lets other keys in (a
    ``load_state_dict`` post-hook may write ``opt.state["flag"] = True``): they are kept, and
    skipped here."""
    return [s for k, s in state.items() if isinstance(k, torch.Tensor)]


def state_bytes(state: Mapping[Any, dict]) -> int:
    """Bytes held by the tensors of an optimizer's per-parameter ``state``."""
    return sum(
        v.numel() * v.element_size()
        for s in parameter_states(state)
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


def state_torch_would_narrow(
    state_dict: Mapping[str, Any], param_groups: list[dict[str, Any]]
) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
    """The floating state tensors of ``state_dict`` (not ``step``) that torch's
    ``load_state_dict`` casts to their parameter's dtype although theirs differs (float32
    block scales and float32 momentum of bfloat16 parameters), keyed by the parameter they
    load into (paired by position, as torch pairs them): :func:`put_back_narrowed` restores
    them after the load, so that no bit is lost to the round trip."""
    saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = itertools.chain.from_iterable(g["params"] for g in param_groups)
    narrowed: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for saved_id, p in zip(saved_ids, params):
        entry = state_dict["state"].get(saved_id)
        if not entry or not p.is_floating_point():
            continue
        kept = {
            key: value
            for key, value in entry.items()
            if key != "step"
            and torch.is_tensor(value)
            and value.is_floating_point()
            and value.dtype != p.dtype
        }
        if kept:
            narrowed[p] = kept
    return narrowed


def put_back_narrowed(
    state: Mapping[Any, dict], narrowed: Mapping[torch.Tensor, Mapping[str, torch.Tensor]]
) -> None:
    """After torch's ``load_state_dict``: the tensors :func:`state_torch_would_narrow` found,
    copied in their saved dtype onto their parameter's device (torch's load copies too)."""
    for p, entry in narrowed.items():
        loaded = state.get(p)
        for key, value in entry.items():
            if loaded is not None and key in loaded:
                loaded[key] = value.to(device=p.device, copy=True)


def restore_loaded(
    param_groups: list[dict[str, Any]],
    state: Mapping[Any, dict],
    lrs: list[torch.Tensor],
    storage: list[tuple[torch.dtype | None, str]],
    view: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
) -> None:
    """Undo what torch's ``load_state_dict`` changes: capturable lr tensors (``lrs``, the ones a
    graph captured) are written in place, step counters become tensors, buffers get back
    their dtypes (torch casts floating state to the parameter's dtype), and each group keeps
    its storage options (``storage``: (``momentum_dtype``, ``state_precision``) per group,
    see :func:`keep_state_precisions` and :func:`keep_momentum_dtypes`; ``view(p, group)``:
    a Muon parameter's matrices)."""
    for group, lr in zip(param_groups, lrs):  # keep the tensors a graph captured
        loaded = group["lr"]
        if isinstance(loaded, torch.Tensor):
            lr.copy_(loaded)
        else:
            lr.fill_(loaded)
        group["lr"] = lr
    for s in parameter_states(state):  # AdamW's step saved as a Python number (older torch)
        if "step" in s and not torch.is_tensor(s["step"]):
            s["step"] = torch.tensor(float(s["step"]), dtype=torch.float32)
        for key, absmax, _ in ADAMW_MOMENTS:  # 8-bit AdamW's codes and scales, cast by torch
            if absmax in s:
                s[key], s[absmax] = s[key].to(torch.uint8), s[absmax].float()
    # torch casts all state (codes too) to the parameter's dtype; restore the declared dtypes.
    for group in param_groups:
        if group["algorithm"] != "muon":
            continue
        settings = MuonSettings.from_group(group)
        for p in group["params"]:
            entry = state.get(p, {})
            for spec in kept_state(settings):
                value = entry.get(spec.key)
                dtype = spec.dtype(settings, p.dtype)
                if spec is MOMENTUM:  # codes where the scales are, else floating values
                    fmt = momentum_format_of(entry)
                    dtype = fmt.code_dtype if fmt else settings.momentum_dtype or p.dtype
                if value is not None and value.dtype != dtype:
                    entry[spec.key] = value.to(dtype)
    keep_state_precisions(param_groups, state, [p for _, p in storage], view, stacklevel=4)
    keep_momentum_dtypes(param_groups, state, [d for d, _ in storage], stacklevel=4)


def keep_state_precisions(
    param_groups: list[dict[str, Any]],
    state: Mapping[Any, dict],
    wanted: list[str],
    view: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
    stacklevel: int = 3,
) -> None:
    """After ``load_state_dict``: each group keeps this optimizer's ``state_precision``
    (``wanted``, per group: a storage choice of the run, like ``momentum_dtype``), and state
    saved with another is converted (float → int8: quantized; int8 → float: dequantized, the
    parameter's dtype), with a warning naming each conversion."""
    changed = []
    for i, (group, precision) in enumerate(zip(param_groups, wanted)):
        saved = group.get("state_precision", "param")
        group["state_precision"] = precision
        if saved != precision:
            changed.append(f"group {i}: {saved!r} -> {precision!r}")
        for p in group["params"]:
            entry = state.get(p)
            if entry:
                convert_state_precision_(entry, p, group, view, precision)
    if changed:
        warnings.warn(
            "load_state_dict: state_precision differs from the state dict's "
            f"({'; '.join(changed)}); the loaded state was converted to this optimizer's",
            UserWarning,
            stacklevel=stacklevel,
        )


def convert_state_precision_(
    entry: dict,
    p: torch.Tensor,
    group: Mapping[str, Any],
    view: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
    precision: str,
) -> None:
    """The state ``entry`` of ``p`` (of ``group``) in ``precision``, in place: float →
    quantized, quantized → float dequantized into ``p``'s dtype, one quantized format to the
    other through float32 (AdamW's moments are 8-bit in both); as it is when it already is. A
    DTensor's state converts shard by shard (:mod:`muonscale.distributed.dtensor_state`)."""
    if any(is_dtensor(v) for v in entry.values()):
        muon = group["algorithm"] == "muon"
        convert_dtensor_state_(entry, p, group, view(p, group) if muon else None, precision)
    elif group["algorithm"] == "muon":
        _convert_momentum(entry, p, view(p, group), precision)
    elif precision != "param" and not adamw_state_is_quantized(entry):
        quantize_adamw_state_(entry, p)
    elif precision == "param" and adamw_state_is_quantized(entry):
        dequantize_adamw_state_(entry, p)


def state_dict_in_precision(
    state_dict: dict[str, Any],
    param_groups: list[dict[str, Any]],
    view: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
    precision: str,
) -> dict[str, Any]:
    """``state_dict`` (a fresh one of the optimizer with these ``param_groups``) with every
    parameter's state in ``precision`` and the groups saying so (new tensors where converted;
    the default precision unwritten, as :func:`without_default_precision`)."""
    check_state_precision(precision)
    for saved, group in zip(state_dict["param_groups"], param_groups):
        saved["state_precision"] = precision
        for index, p in zip(saved["params"], group["params"]):
            entry = state_dict["state"].get(index)
            if entry:
                entry = state_dict["state"][index] = dict(entry)
                convert_state_precision_(entry, p, group, view, precision)
    return without_default_precision(state_dict)


def _convert_momentum(entry: dict, p: torch.Tensor, view: MatrixView, precision: str) -> None:
    """The momentum of a Muon parameter's loaded ``entry`` in ``precision`` (in place)."""
    buf = entry.get(MOMENTUM.key)
    if buf is None:
        return
    saved = momentum_format_of(entry)
    if saved_precision(entry) == precision:
        return
    if saved is not None:  # dequantized first (float32 on the way to the other format)
        dtype = p.dtype if precision == "param" else torch.float32
        entry[MOMENTUM.key] = buf = float_momentum_state(entry, view, dtype)
        del entry[saved.scale_key]
    if precision != "param":
        entry.update(quantized_momentum_state(buf, view, precision))


def check_loaded_groups(
    param_groups: list[dict[str, Any]],
    table: ParamTable,
    state_dict: Mapping[str, Any],
    stacklevel: int = 3,
) -> None:
    """Before anything changes: refuse (naming the tensor) saved Muon state that does not fit
    its parameter's matrix view under the options it is loaded with (the saved group's,
    torch's rule), and warn naming each variant option the saved groups change
    (``stacklevel``: ``warnings.warn``'s, counted from here)."""
    saved_state = state_dict["state"]
    for i, (saved, group) in enumerate(zip(state_dict["param_groups"], param_groups)):
        if group["algorithm"] != "muon":
            continue
        merged = {**group, **saved}
        settings = MuonSettings.from_group(merged)
        for index, p in zip(saved.get("params", []), group["params"]):
            entry = saved_state.get(index, {})
            view = table.view(p, merged["matrix_mode"])
            name = table.label(p, param_groups)
            check_loaded_state(entry, settings, view, name=name, explicit=saved)
        changes = changed_variant_options(saved, group)
        if changes:
            warnings.warn(
                f"load_state_dict: the saved param group {i} changes {', '.join(changes)}; the "
                "saved options replace the ones this optimizer was built with (torch's rule), "
                "so the loaded run continues with the saved algorithm",
                UserWarning,
                stacklevel=stacklevel,
            )


def keep_momentum_dtypes(
    param_groups: list[dict[str, Any]],
    state: Mapping[Any, dict],
    wanted: list[torch.dtype | None],
    stacklevel: int = 3,
) -> None:
    """After ``load_state_dict``: each Muon group keeps this optimizer's ``momentum_dtype``
    (``wanted``, per group: a storage choice of the run, not a hyperparameter of the
    checkpoint), its buffers are cast to it, and a warning names every group whose state
    dict said otherwise."""
    changed = []
    for i, (group, dtype) in enumerate(zip(param_groups, wanted)):
        if group["algorithm"] != "muon":
            continue
        if group["momentum_dtype"] != dtype:
            changed.append(f"group {i}: {group['momentum_dtype']} -> {dtype}")
        group["momentum_dtype"] = dtype
        if group.get("state_precision", "param") != "param":
            continue  # quantized: no floating buffer to cast
        for p in group["params"]:
            buf = state.get(p, {}).get(MOMENTUM.key)
            if buf is not None and buf.dtype != (dtype or p.dtype):
                state[p][MOMENTUM.key] = buf.to(dtype or p.dtype)
    if changed:
        warnings.warn(
            "load_state_dict: momentum_dtype differs from the state dict's "
            f"({'; '.join(changed)}; None: the parameter's dtype); the momentum buffers were "
            "cast to this optimizer's",
            UserWarning,
            stacklevel=stacklevel,
        )
