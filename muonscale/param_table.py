"""The per-parameter facts of one :class:`muonscale.Muon` beyond torch's param groups, in one
owned table: each parameter's name, its routing decision, the row blocks and block roles of
``splits``, whether it is stored transposed, its expert layout, and its (cached) matrix view."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from .experts import GATE_UP_ROLES, ExpertLayout, GateUpMode
from .matrices import MatrixView
from .params import RouteDecision, Rule, format_routing_table, layout_note


class ParamTable:
    """Facts keyed by ``id(param)`` (routing: by name); :meth:`rebind` re-keys them by name
    when parameter objects are replaced, :meth:`pickled` and :meth:`unpickled` carry them by
    position (group, index), since a copy changes every id."""

    def __init__(self, rules: Sequence[Rule] = (), transposed: Iterable[str] = ()) -> None:
        self.names: dict[int, str] = {}
        self.routing: dict[str, RouteDecision] = {}
        self.rules: list[Rule] = list(rules)
        self.transposed: set[str] = set(transposed)
        """Names of the weights stored (in, out) (the optimizer's ``transposed``)."""
        self.split_rows: dict[int, list[torch.Tensor]] = {}
        self.split_roles: dict[int, tuple[str, ...]] = {}
        self.views: dict[int, MatrixView] = {}
        self.unnamed_to_muon = 0
        """Unnamed parameters with >= 2 dims routed to Muon by tensor rank (since the last
        check)."""
        self.unnamed_low_rank = 0
        """Unnamed parameters with < 2 dims beside them (a mixed list: norms, biases)."""
        self.from_module_parameters = False
        """Whether ``params`` was a ``Module.parameters()`` generator (a model's every weight,
        unnamed: certain misrouting)."""
        """Unnamed parameters routed to Muon by tensor rank alone, not yet warned about."""
        self.experts: dict[str, ExpertLayout] = {}
        """name -> the expert layout found in the model (or given) or declared in ``splits``."""
        self.declared: set[str] = set()
        """Names whose expert layout the user declared in ``splits`` (it beats ``matrix_mode``)."""
        self.mode_given = False
        """Whether the constructor's ``matrix_mode`` was given (it beats found layouts)."""
        self.explicit_modes: set[str] = set()
        """Names in param groups that set ``matrix_mode`` themselves."""
        self.convolutions: set[str] = set()
        """Names of convolution weights (flattened on purpose, no warning)."""
        self.gate_up: GateUpMode = "apart"
        """The optimizer's ``gate_up``: fused gate/up orthogonalized apart or together."""

    def name(self, p: torch.Tensor) -> str | None:
        return self.names.get(id(p))

    def label(self, p: torch.Tensor, param_groups: Sequence[Mapping[str, Any]]) -> str:
        """``p``'s name, else its place in ``param_groups``, for messages."""
        if id(p) in self.names:
            return self.names[id(p)]
        for gi, g in enumerate(param_groups):
            for pi, q in enumerate(g["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return "<unknown parameter>"

    def is_transposed(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is a 2-D weight stored (in, out) (its matrix is ``p.T``)."""
        return bool(self.transposed) and self.names.get(id(p)) in self.transposed

    def expert_layout(self, p: torch.Tensor) -> ExpertLayout | None:
        """``p``'s expert layout, when it has one and nothing the user chose beats it: a layout
        declared in ``splits`` always applies; a found one yields to a ``matrix_mode`` the user
        set and to other ``splits``."""
        name = self.names.get(id(p))
        layout = self.experts.get(name)
        if layout is None or name in self.declared:
            return layout
        if self.mode_given or name in self.explicit_modes or id(p) in self.split_rows:
            return None
        return layout

    def view(self, p: torch.Tensor, matrix_mode: str) -> MatrixView:
        """How ``p`` is split into matrices under ``matrix_mode`` (cached); an expert layout
        (:meth:`expert_layout`) gives the expert view whatever the mode."""
        view = self.views.get(id(p))
        stale = view is None or view.param_shape != tuple(p.shape)
        layout = self.expert_layout(p)
        if layout is not None:
            if stale or view.experts is None:
                view = self._expert_view(p, layout)
                self.views[id(p)] = view
            return view
        if stale or view.mode != matrix_mode or view.experts is not None:
            view = MatrixView.build(
                p.shape,
                mode=matrix_mode,
                row_partition=self.split_rows.get(id(p)),
                block_roles=self.split_roles.get(id(p)),
                transposed=self.is_transposed(p),
            )
            self.views[id(p)] = view
        return view

    def _expert_view(self, p: torch.Tensor, layout: ExpertLayout) -> MatrixView:
        out, _ = layout.expert_shape(p.shape)
        rows = layout.gate_up_rows(out) if self.gate_up == "apart" else None
        return MatrixView.build(
            p.shape,
            experts=layout.n_experts,
            transposed=layout.transposed,
            row_partition=rows,
            block_roles=GATE_UP_ROLES if rows is not None else None,
        )

    def note(self, p: torch.Tensor, group: Mapping[str, Any]) -> str:
        """How Muon sees ``p`` (of param group ``group``) beyond its shape (the bracket of its
        summary line): its expert view, its splits, or how a parameter with 3 or more dims was
        cut into matrices."""
        layout = self.expert_layout(p)
        if layout is not None:
            return layout.describe(p.shape, self.gate_up)
        note = layout_note(
            self.is_transposed(p), self.split_rows.get(id(p)), self.split_roles.get(id(p))
        )
        if note or p.ndim < 3 or group["algorithm"] != "muon":
            return note
        shapes = self.view(p, group["matrix_mode"]).matrix_shapes
        if group["matrix_mode"] == "flatten":
            return f"flattened to {shapes[0]}"
        return f"{len(shapes)} × {shapes[0]}"

    def summary(self, param_groups: Sequence[Mapping[str, Any]]) -> str:
        """The routing table of ``param_groups`` (see :meth:`muonscale.Muon.summary`)."""
        names = [self.label(p, param_groups) for g in param_groups for p in g["params"]]
        params = [p for g in param_groups for p in g["params"]]
        algorithms = [g["algorithm"] for g in param_groups for _ in g["params"]]
        decisions = {
            n: self.routing.get(n, RouteDecision(a, "param group"))
            for n, a in zip(names, algorithms)
        }
        groups = [g for g in param_groups for _ in g["params"]]
        notes = {n: self.note(p, g) for n, p, g in zip(names, params, groups)}
        return format_routing_table(decisions, dict(zip(names, params)), notes)

    def rebind(self, slots: Sequence[tuple[torch.Tensor, torch.Tensor, str]]) -> None:
        """Key every fact by the parameters now bound: ``slots`` are (bound before, bound now,
        name), one per param-group slot."""
        old_names = dict(self.names)
        rows = {old_names[i]: r for i, r in self.split_rows.items() if i in old_names}
        roles = {old_names[i]: r for i, r in self.split_roles.items() if i in old_names}
        self.names = {id(new): name for _, new, name in slots}
        self.split_rows = {id(new): rows[name] for _, new, name in slots if name in rows}
        self.split_roles = {id(new): roles[name] for _, new, name in slots if name in roles}
        self.views = {}

    def pickled(self, param_groups: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The table, by position in ``param_groups`` (a pickle's keys of the optimizer's
        extras)."""

        def per_slot(facts: Mapping[int, Any]) -> list[list[Any]]:
            return [[facts.get(id(p)) for p in g["params"]] for g in param_groups]

        return dict(
            routing=self.routing,
            names=per_slot(self.names),
            split_rows=per_slot(self.split_rows),
            split_roles=per_slot(self.split_roles),
            transposed=sorted(self.transposed),
            experts=dict(self.experts),
            declared=sorted(self.declared),
            mode_given=self.mode_given,
            explicit_modes=sorted(self.explicit_modes),
            convolutions=sorted(self.convolutions),
            gate_up=self.gate_up,
        )

    @classmethod
    def unpickled(
        cls, param_groups: Sequence[Mapping[str, Any]], extra: Mapping[str, Any]
    ) -> ParamTable:
        """The table :meth:`pickled` wrote, keyed by the copied parameters (pickles from before
        block roles have none)."""
        table = cls(transposed=extra.get("transposed", ()))
        table.routing = extra["routing"]
        table.experts = dict(extra.get("experts", {}))  # pickles from before experts: none
        table.declared = set(extra.get("declared", ()))
        table.mode_given = extra.get("mode_given", False)
        table.explicit_modes = set(extra.get("explicit_modes", ()))
        table.convolutions = set(extra.get("convolutions", ()))
        table.gate_up = extra.get("gate_up", "apart")
        no_roles = [[None] * len(g["params"]) for g in param_groups]
        for group, names, rows, roles in zip(
            param_groups, extra["names"], extra["split_rows"], extra.get("split_roles", no_roles)
        ):
            for p, name, parts, role in zip(group["params"], names, rows, roles):
                if name is not None:
                    table.names[id(p)] = name
                if parts is not None:
                    table.split_rows[id(p)] = parts
                if role is not None:
                    table.split_roles[id(p)] = role
        return table
