"""Which parameter goes to Muon and which to AdamW: an explicit, printable, testable rule.

Default rule, applied to each parameter in order:

1. A user rule (regex on the full name, or a callable) that answers → that answer.
2. Fewer than 2 dims (norm gains, biases, scalars), or complex → AdamW.
3. The parameter belongs to an ``nn.Embedding`` / ``nn.EmbeddingBag`` or is the same tensor as
   one (tied output head), when a module is given → AdamW.
4. Mixture-of-experts parts, when a module is given (:func:`muonscale.experts.find_experts`):
   a stacked per-expert bias (E, out) → AdamW; a router (E, D) → Muon, as Megatron's Muon and
   Moonlight train it (*Mixture of experts* in the docs); expert weights → Muon, E matrices.
5. The **last** name component of the owning module is an embedding/head name
   (:data:`EMBEDDING_OR_HEAD_NAMES`) → AdamW. Never a substring match: Hugging Face's
   ``attention.output.dense.weight`` is a hidden matrix, its owning module is ``dense``.
6. Otherwise (≥ 2-D weight of a hidden layer) → Muon.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .experts import ExpertModules, find_experts

ALGORITHMS = ("muon", "adamw")

EMBEDDING_OR_HEAD_NAMES = frozenset(
    {
        "wte",
        "wpe",
        "embed_tokens",
        "tok_embeddings",
        "embed_positions",
        "word_embeddings",
        "position_embeddings",
        "token_type_embeddings",
        "lm_head",
        "output",
        "output_layer",
        "head",
        "classifier",
    }
)

TRANSPOSED_LINEAR_CLASSES = frozenset({"Conv1D"})
"""Module classes (matched by name, so muonscale need not import their library) whose 2-D
``weight`` is stored (in_features, out_features): GPT-2's ``Conv1D`` in Hugging Face
transformers. Their matrix for Muon is the transpose (see :class:`muonscale.MatrixView`)."""

Rule = tuple[str, str] | Callable[[str, torch.Tensor], str | None]
"""``(regex, algorithm)`` matched with ``re.search`` on the full name, or
``callable(name, param) -> "muon" | "adamw" | None`` (None = no opinion)."""


@dataclass(frozen=True)
class RouteDecision:
    algorithm: str
    reason: str


def _owning_module(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def _apply_user_rules(
    name: str, param: torch.Tensor, rules: Sequence[Rule]
) -> RouteDecision | None:
    for rule in rules:
        if callable(rule):
            answer = rule(name, param)
            label = getattr(rule, "__name__", "callable rule")
        else:
            pattern, answer = rule
            label = f"rule {pattern!r}"
            if re.search(pattern, name) is None:
                continue
        if answer is None:
            continue
        if answer not in ALGORITHMS:
            raise ValueError(
                f"rules: {label} returned {answer!r} for {name}; expected one of {ALGORITHMS}"
            )
        return RouteDecision(answer, f"user {label}")
    return None


def _embedding_tensors(model: nn.Module) -> set[int]:
    return {
        id(module.weight)
        for module in model.modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
    }


def transposed_weights(model: nn.Module) -> set[str]:
    """Names of the 2-D weights of ``model`` stored as (in, out) (see
    :data:`TRANSPOSED_LINEAR_CLASSES`); a module of such a class whose weight is not (in, out)
    by its ``nf`` (out features) attribute is not listed."""
    out = set()
    for module_name, module in model.named_modules():
        if type(module).__name__ not in TRANSPOSED_LINEAR_CLASSES:
            continue
        weight = getattr(module, "weight", None)
        out_features = getattr(module, "nf", None)
        if (
            isinstance(weight, torch.Tensor)
            and weight.ndim == 2
            and weight.shape[1] == out_features
        ):
            out.add(f"{module_name}.weight" if module_name else "weight")
    return out


def route_one(
    name: str,
    param: torch.Tensor,
    rules: Sequence[Rule] = (),
    embedding_ids: set[int] | None = None,
    experts: ExpertModules | None = None,
) -> RouteDecision:
    """Decide one parameter (see the module docstring for the rule; ``experts``: what
    :func:`~muonscale.experts.find_experts` found in the model)."""
    decision = _apply_user_rules(name, param, rules)
    if decision is not None:
        return decision
    if param.ndim < 2:
        return RouteDecision("adamw", f"{param.ndim}-D (norm, bias or scalar)")
    if param.is_complex():
        return RouteDecision("adamw", "complex (Newton–Schulz needs real matrices)")
    if embedding_ids is not None and id(param) in embedding_ids:
        return RouteDecision("adamw", "embedding module (or tied to one)")
    if experts is not None:
        decision = _expert_decision(name, experts)
        if decision is not None:
            return decision
    owner = _owning_module(name)
    if owner in EMBEDDING_OR_HEAD_NAMES:
        return RouteDecision("adamw", f"embedding/output head (module '{owner}')")
    return RouteDecision("muon", f"{param.ndim}-D hidden weight")


ROUTER_REASON = "router (E={n}): Muon, as Megatron's Muon and Moonlight"
"""The reason a router weight goes to Muon (the decision and its sources: *Mixture of experts*
in the docs)."""


def _expert_decision(name: str, experts: ExpertModules) -> RouteDecision | None:
    if name in experts.biases:
        return RouteDecision("adamw", f"per-expert bias ({experts.owners[name]})")
    if name in experts.routers:
        return RouteDecision("muon", ROUTER_REASON.format(n=experts.routers[name]))
    layout = experts.layouts.get(name)
    if layout is None:
        return None
    if layout.n_experts == 1:
        return RouteDecision("muon", "fused gate/up weight")
    return RouteDecision("muon", f"expert weights ({experts.owners[name]})")


def route(
    model_or_named_parameters: nn.Module | Iterable[tuple[str, torch.Tensor]],
    rules: Sequence[Rule] | None = None,
) -> dict[str, RouteDecision]:
    """``{name: RouteDecision(algorithm, reason)}`` for every parameter, in order.

    Pass the model itself to also detect embeddings by module type (and output heads tied to
    them); with ``named_parameters()`` only names and shapes are seen.
    """
    rules = list(rules or ())
    experts = None
    if isinstance(model_or_named_parameters, nn.Module):
        embedding_ids = _embedding_tensors(model_or_named_parameters)
        named = list(model_or_named_parameters.named_parameters())
        experts = find_experts(model_or_named_parameters)
    else:
        embedding_ids = None
        named = list(model_or_named_parameters)
    out: dict[str, RouteDecision] = {}
    for name, param in named:
        if not isinstance(name, str) or not isinstance(param, torch.Tensor):
            raise TypeError(
                "route: expected (name, tensor) pairs, "
                f"got {(type(name).__name__, type(param).__name__)}"
            )
        out[name] = route_one(name, param, rules, embedding_ids, experts)
    return out


def routing_summary(decisions: dict[str, RouteDecision], params: dict[str, torch.Tensor]) -> str:
    """A short table: parameter count and element total per algorithm."""
    rows = []
    for algorithm in ALGORITHMS:
        names = [n for n, d in decisions.items() if d.algorithm == algorithm]
        total = sum(params[n].numel() for n in names)
        rows.append(f"{algorithm:<6} {len(names):>6} tensors {total:>14,d} elements")
    return "\n".join(rows)


def layout_note(
    transposed: bool,
    blocks: Sequence[torch.Tensor] | None = None,
    roles: Sequence[str] | None = None,
) -> str:
    """How Muon sees a weight beyond its shape: ``transposed (stored in, out)`` and
    ``split: 3 row blocks q k v`` / ``split: 4 row blocks [16, 16, 16, 16]``; "" when neither."""
    notes = ["transposed (stored in, out)"] if transposed else []
    if blocks:
        if roles:
            counts = {role: list(roles).count(role) for role in dict.fromkeys(roles)}
            how = " ".join(role if n == 1 else f"{n}x{role}" for role, n in counts.items())
        else:
            how = str([len(b) for b in blocks])
        notes.append(f"split: {len(blocks)} row blocks {how}")
    return "; ".join(notes)


def format_routing_table(
    decisions: dict[str, RouteDecision],
    params: dict[str, torch.Tensor],
    notes: dict[str, str] | None = None,
) -> str:
    """:func:`routing_summary`, then one line per parameter: algorithm, name, shape, reason
    and, in brackets, its layout note (see :func:`layout_note`)."""
    notes = notes or {}
    lines = [routing_summary(decisions, params)]
    for name, d in decisions.items():
        note = f"  [{notes[name]}]" if notes.get(name) else ""
        shape = str(tuple(params[name].shape))
        lines.append(f"  {d.algorithm:<6} {name:<50} {shape:<18} {d.reason}{note}")
    return "\n".join(lines)
