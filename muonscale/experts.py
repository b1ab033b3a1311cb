"""Mixture-of-experts weights: one parameter holding E expert matrices, each orthogonalized on
its own, and how they are found in a model.

A stack (E, A, B) or a 2-D concatenation (E·A, B) of E row blocks holds E matrices, each stored
(out, in) or, ``transposed``, (in, out). A fused gate/up projection holds two matrices per
expert along its output features: ``"contiguous"`` ([gate; up]) or ``"interleaved"`` (gate
rows 0, 2, 4, …; up rows 1, 3, 5, …). Whether gate and up are orthogonalized apart or together
is the optimizer's ``gate_up`` option (*Mixture of experts* in the docs gives the decision
and its sources).

Detection reads what a model declares; it never imports the model's library:

* Hugging Face's ``@use_experts_implementation`` sets ``is_transposed``, ``is_concatenated``,
  ``has_gate`` and ``has_bias`` on each expert module (:func:`declared_layouts`);
* the few expert modules without it are in :data:`UNDECORATED_EXPERT_MODULES`, by class name;
* a dense ``nn.Linear`` named ``gate_up_proj`` (Phi-3's MLP) is [gate; up] of one matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

GateUpStorage = Literal["contiguous", "interleaved"]
GATE_UP_STORAGE: tuple[GateUpStorage, ...] = ("contiguous", "interleaved")

GateUpMode = Literal["apart", "together"]
GATE_UP_MODES: tuple[GateUpMode, ...] = ("apart", "together")
"""The optimizer's ``gate_up`` option: gate and up orthogonalized as two matrices (``"apart"``,
the default) or as one fused matrix (``"together"``)."""

GATE_UP_ROLES = ("gate", "up")


@dataclass(frozen=True, kw_only=True)
class ExpertLayout:
    """How one parameter holds expert matrices (see the module docstring)."""

    n_experts: int
    """E: dim 0 of a 3-D stack, or the number of equal row blocks of a 2-D concatenation
    (1 with a 2-D weight: one dense fused gate/up matrix)."""
    transposed: bool = False
    """Each expert's matrix is stored (in, out)."""
    gate_up: GateUpStorage | None = None
    """How gate and up sit along each expert's output features; None: not fused."""

    def __post_init__(self) -> None:
        n = self.n_experts
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"ExpertLayout.n_experts must be a positive int, got {n!r}")
        if not isinstance(self.transposed, bool):
            raise ValueError(f"ExpertLayout.transposed must be a bool, got {self.transposed!r}")
        if self.gate_up is not None and self.gate_up not in GATE_UP_STORAGE:
            raise ValueError(
                f"ExpertLayout.gate_up must be one of {GATE_UP_STORAGE} or None, "
                f"got {self.gate_up!r}"
            )

    def expert_shape(self, param_shape: Sequence[int]) -> tuple[int, int]:
        """(out, in) of one expert's matrix in a parameter of ``param_shape``; ValueError when
        the shape does not hold this layout."""
        shape = tuple(int(s) for s in param_shape)
        if len(shape) == 3 and shape[0] == self.n_experts:
            a, b = shape[1:]
        elif len(shape) == 2 and shape[0] % self.n_experts == 0:
            a, b = shape[0] // self.n_experts, shape[1]
        else:
            raise ValueError(
                f"{self} does not fit a parameter of shape {shape}: expected (E, A, B) or "
                f"(E·A, B) with E = {self.n_experts}"
            )
        out, inp = (b, a) if self.transposed else (a, b)
        if self.gate_up is not None and out % 2:
            raise ValueError(f"{self}: {out} output features do not split into gate and up")
        return out, inp

    def gate_up_rows(self, out_features: int) -> list[torch.Tensor] | None:
        """Rows of gate and of up in one expert's (out, in) matrix; None when not fused."""
        if self.gate_up is None:
            return None
        if self.gate_up == "contiguous":
            half = out_features // 2
            return [torch.arange(half), torch.arange(half, out_features)]
        return [torch.arange(0, out_features, 2), torch.arange(1, out_features, 2)]

    def describe(self, param_shape: Sequence[int], gate_up_mode: GateUpMode = "apart") -> str:
        """``(E=8) × gate|up (F, D)``: the expert view as :meth:`muonscale.Muon.summary` shows
        it (``gate_up_mode``: the optimizer's ``gate_up``; shapes are (out, in))."""
        out, inp = self.expert_shape(param_shape)
        apart = self.gate_up is not None and gate_up_mode == "apart"
        what = f"gate|up ({out // 2}, {inp})" if apart else f"({out}, {inp})"
        if self.gate_up is not None and not apart:
            what = f"gate+up {what}"
        where = " stored (in, out)" if self.transposed else ""
        where += "; interleaved" if self.gate_up == "interleaved" else ""
        return f"(E={self.n_experts}) × {what}{where}"


@dataclass(frozen=True)
class _Entry:
    """A parameter of an undecorated expert module: its layout without E (from the shape, or
    from the module attribute ``experts_attr`` for a 2-D concatenation)."""

    transposed: bool = False
    gate_up: GateUpStorage | None = None
    experts_attr: str | None = None


UNDECORATED_EXPERT_MODULES: dict[str, dict[str, _Entry]] = {
    # Llama4TextExperts: gate_up_proj (E, D, 2F) and down_proj (E, F, D) multiply as x @ W[e]
    # (stored (in, out)); the forward chunks gate|up in two along the output features.
    "Llama4TextExperts": {
        "gate_up_proj": _Entry(True, "contiguous"),
        "down_proj": _Entry(True),
    },
    # LongcatFlashExperts and Step3p7Experts: F.linear(x, W[e]) ((out, in)), chunked in two.
    "LongcatFlashExperts": {"gate_up_proj": _Entry(False, "contiguous"), "down_proj": _Entry()},
    "Step3p7Experts": {"gate_up_proj": _Entry(False, "contiguous"), "down_proj": _Entry()},
    # DbrxExpertGLU: w1 (gate) and v1 (up) are (E·F, D), expert e's block used as x @ W.T
    # ((out, in)); w2 (E·F, D) is used as h @ W (stored (in, out)).
    "DbrxExpertGLU": {
        "w1": _Entry(False, None, "moe_num_experts"),
        "v1": _Entry(False, None, "moe_num_experts"),
        "w2": _Entry(True, None, "moe_num_experts"),
    },
    # JetMoe: JetMoeParallelExperts.weight (E, out, in), F.linear per expert. The MoE block's
    # input_linear is [gate; up] (chunked in two); the attention experts' are not fused.
    "JetMoeMoE": {
        "input_linear.weight": _Entry(False, "contiguous"),
        "output_linear.weight": _Entry(),
    },
    "JetMoeMoA": {"input_linear.weight": _Entry(), "output_linear.weight": _Entry()},
    # torchtitan's GroupedExperts: w1 (gate), w3 (up) (E, F, D) and w2 (E, D, F), multiplied
    # as x @ W[e].T ((out, in)).
    "GroupedExperts": {"w1_EFD": _Entry(), "w2_EDF": _Entry(), "w3_EFD": _Entry()},
}
"""Expert modules that do not carry Hugging Face's decorator, by class name: parameter path
under the module -> its layout."""

DECORATOR_ATTRIBUTES = ("is_transposed", "is_concatenated", "has_gate")
"""The attributes Hugging Face's ``@use_experts_implementation`` sets on an expert module."""


@dataclass
class ExpertModules:
    """What :func:`find_experts` found in a model, by full parameter name."""

    layouts: dict[str, ExpertLayout] = field(default_factory=dict)
    """Expert weights (and dense fused gate/up weights) and their layouts."""
    owners: dict[str, str] = field(default_factory=dict)
    """Each expert weight's (and bias's) module class."""
    biases: set[str] = field(default_factory=set)
    """Stacked per-expert biases (E, out): AdamW."""
    routers: dict[str, int] = field(default_factory=dict)
    """Router weights (E, D) -> E."""


def declared_layouts(module: nn.Module) -> tuple[dict[str, ExpertLayout], set[str]] | None:
    """The layouts Hugging Face's decorator declares on ``module`` (parameter name under it ->
    layout) and the names of its per-expert biases; None when it is not a decorated module."""
    if not all(isinstance(getattr(module, a, None), bool) for a in DECORATOR_ATTRIBUTES):
        return None
    storage: GateUpStorage = "contiguous" if module.is_concatenated else "interleaved"
    layouts, biases = {}, set()
    for name, param in module.named_parameters(recurse=False):
        if param.ndim == 3:
            fused = module.has_gate and name == "gate_up_proj"
            layouts[name] = ExpertLayout(
                n_experts=param.shape[0],
                transposed=module.is_transposed,
                gate_up=storage if fused else None,
            )
        elif param.ndim == 2:
            biases.add(name)
    return layouts, biases


def _table_layouts(module: nn.Module) -> dict[str, ExpertLayout] | None:
    entries = UNDECORATED_EXPERT_MODULES.get(type(module).__name__)
    if entries is None:
        return None
    out = {}
    params = dict(module.named_parameters())
    for path, entry in entries.items():
        param = params.get(path)
        if param is None:
            continue
        n = getattr(module, entry.experts_attr) if entry.experts_attr else param.shape[0]
        out[path] = ExpertLayout(
            n_experts=int(n), transposed=entry.transposed, gate_up=entry.gate_up
        )
    return out


def find_experts(model: nn.Module) -> ExpertModules:
    """Expert weights, per-expert biases and routers of ``model`` (see the module docstring).

    A router is a 2-D weight with one row per expert (E, D) in the nearest enclosing module
    (up to :data:`ROUTER_SEARCH_DEPTH` levels up) that holds one outside the expert module."""
    found = ExpertModules()
    blocks: list[tuple[str, int]] = []  # (expert module name, E)
    modules = dict(model.named_modules())
    for name, module in modules.items():
        declared = declared_layouts(module)
        layouts, biases = declared if declared is not None else (_table_layouts(module), set())
        if not layouts:
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] == "gate_up_proj":
                layouts = {"weight": ExpertLayout(n_experts=1, gate_up="contiguous")}
            else:
                continue
        prefix = f"{name}." if name else ""
        for path, layout in layouts.items():
            found.layouts[prefix + path] = layout
            found.owners[prefix + path] = type(module).__name__
        for path in biases:
            found.biases.add(prefix + path)
            found.owners[prefix + path] = type(module).__name__
        stacks = [lay.n_experts for lay in layouts.values() if lay.n_experts > 1]
        if stacks and name:
            blocks.append((name, max(stacks)))
    for experts_name, n in blocks:
        _find_router(model, modules, experts_name, n, found)
    return found


ROUTER_SEARCH_DEPTH = 3
"""How many enclosing modules of an expert module are searched for its router (torchtitan's
``moe.routed_experts.inner_experts`` sits two levels below ``moe.router.gate``)."""


def _find_router(
    model: nn.Module, modules: dict[str, nn.Module], experts_name: str, n: int, found: ExpertModules
) -> None:
    parts = experts_name.split(".")
    for up in range(1, min(ROUTER_SEARCH_DEPTH, len(parts)) + 1):
        parent = ".".join(parts[:-up])
        block = modules[parent] if parent else model
        inner = ".".join(parts[: len(parts) - up + 1])  # the child that holds the experts
        hits = []
        for path, param in block.named_parameters():
            full = f"{parent}.{path}" if parent else path
            inside = full.startswith(f"{inner}.")
            known = full in found.layouts or full in found.biases
            if not inside and not known and param.ndim == 2 and param.shape[0] == n:
                hits.append(full)
        if hits:
            found.routers.update(dict.fromkeys(hits, n))
            return


def convolution_weights(model: nn.Module) -> set[str]:
    """Names of the weights of ``model``'s convolutions (flattened to (out, in·k…) for Muon,
    Keller Jordan's convention)."""
    out = set()
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.conv._ConvNd):
            out.add(f"{name}.weight" if name else "weight")
    return out
