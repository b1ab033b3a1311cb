"""``muonscale.Muon``: Muon for hidden matrices and AdamW for the rest, in one optimizer.

Layers, as in ``torch.optim``: this class validates arguments, routes parameters into param
groups and builds state lazily; :mod:`muonscale.functional` holds the arithmetic on plain
tensors; :mod:`muonscale.newton_schulz` the orthogonalization.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from . import functional
from .kernels import clear_workspaces
from .matrices import MATRIX_MODES, MatrixView, row_blocks
from .memory import MemoryBudget
from .newton_schulz import DEFAULT_EPS, resolve_schedule
from .params import ALGORITHMS, RouteDecision, Rule, route, route_one, routing_summary
from .qkv import QKV_SPLIT_MODES, QKVLayout
from .scaling import SCALE_RULES

NONFINITE_POLICIES = ("raise", "skip", "ignore")
NS_METHODS = ("auto", "plain", "gram")


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or ±inf; nothing was changed."""


def _check_range(name: str, value: Any, low: float, high: float, *, high_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and low <= value and (value < high if high_open else value <= high)
    if not ok:
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name} must be a number in [{low}, {high}{bracket}, got {value!r}")


def _check_dtype(name: str, value: Any) -> None:
    if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
        raise ValueError(f"{name} must be None or a floating torch.dtype, got {value!r}")


def _validate_muon_group(group: Mapping[str, Any]) -> None:
    _check_range("lr", float(group["lr"]), 0.0, math.inf)
    _check_range("momentum", group["momentum"], 0.0, 1.0, high_open=True)
    _check_range("weight_decay", group["weight_decay"], 0.0, math.inf)
    if not isinstance(group["nesterov"], bool):
        raise ValueError(f"nesterov must be a bool, got {group['nesterov']!r}")
    resolve_schedule(group["coefficients"], group["ns_steps"])  # validates both
    if group["scale"] not in SCALE_RULES:
        raise ValueError(f"scale must be one of {SCALE_RULES}, got {group['scale']!r}")
    _check_dtype("ns_dtype", group["ns_dtype"])
    _check_dtype("momentum_dtype", group["momentum_dtype"])
    if group["matrix_mode"] not in MATRIX_MODES:
        raise ValueError(f"matrix_mode must be one of {MATRIX_MODES}, got {group['matrix_mode']!r}")
    _check_range("ns_eps", group["ns_eps"], 0.0, math.inf)
    if group["ns_method"] not in NS_METHODS:
        raise ValueError(f"ns_method must be one of {NS_METHODS}, got {group['ns_method']!r}")


def _validate_adamw_group(group: Mapping[str, Any]) -> None:
    _check_range("adamw_lr", float(group["lr"]), 0.0, math.inf)
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"adamw_betas must be a pair (beta1, beta2), got {betas!r}")
    _check_range("adamw_betas[0]", betas[0], 0.0, 1.0, high_open=True)
    _check_range("adamw_betas[1]", betas[1], 0.0, 1.0, high_open=True)
    _check_range("adamw_eps", group["eps"], 0.0, math.inf)
    _check_range("adamw_weight_decay", group["weight_decay"], 0.0, math.inf)


class Muon(torch.optim.Optimizer):
    r"""Muon for hidden 2-D (or reshaped) weights, AdamW for everything else, one ``state_dict``.

    For each Muon matrix W (m×n) with gradient G, momentum μ, learning rate η, weight decay λ:

    .. code-block:: text

        B ← B + (1 − μ)(G − B)                  # EMA momentum, B₀ = 0
        U = G + μ(B − G)  if nesterov else B
        O = NS_k(U)                             # Newton–Schulz, k = ns_steps
        W ← W (1 − η λ)                         # decoupled weight decay
        W ← W − η s(m, n) O                     # s: the ``scale`` rule

    These are ``torch.optim.Muon``'s semantics (``scale="shape"`` ≙ its ``adjust_lr_fn="original"``,
    ``"match_rms_adamw"`` ≙ ``"match_rms_adamw"``). Parameters routed to AdamW (embeddings,
    output head, norms, biases; see :func:`muonscale.route`) live in their own param groups with
    their own ``lr``, ``betas``, ``eps`` and ``weight_decay``, so LR schedulers scale both halves.

    Args:
        params: ``model.named_parameters()`` (routed by name and shape), the model itself
            (also detects embeddings by module type), plain tensors (≥ 2-D → Muon), or param
            groups (dicts; ``"algorithm": "muon" | "adamw"`` pins a group, otherwise its
            parameters are routed; a group's ``params`` may be tensors or (name, tensor) pairs).
        lr: learning rate of Muon groups (and of AdamW groups when ``adamw_lr`` is None).
        momentum: μ in [0, 1).
        nesterov: Nesterov momentum.
        weight_decay: λ of Muon groups, decoupled (multiplied by the unadjusted lr).
        ns_steps: Newton–Schulz steps (≥ 1).
        coefficients: preset name (``"keller"``, ``"polar_express"``, ``"jiacheng"``,
            ``"modded_nanogpt"``), one (a, b, c), or a list of them.
        scale: update scale rule (see :mod:`muonscale.scaling`); the default
            ``"match_rms_adamw"`` lets you keep AdamW's lr and weight decay.
        ns_dtype: dtype of the iteration; None → bfloat16 on CUDA, float32 on CPU.
        momentum_dtype: dtype of the Muon momentum buffer (e.g. ``torch.bfloat16`` to halve its
            memory); None → the parameter's dtype.
        adamw_lr: lr of AdamW groups. None → ``lr``, allowed only with ``scale="match_rms_adamw"``
            (other scales give updates of a different size than AdamW's, so one lr cannot fit both).
        adamw_betas, adamw_eps: AdamW's (β₁, β₂) and ε.
        adamw_weight_decay: λ of AdamW groups. None → ``weight_decay`` for ≥ 2-D AdamW parameters
            (embeddings, head) and 0 for 0/1-D ones (norms, biases).
        nonfinite: ``"raise"`` (a NaN/inf gradient raises :class:`NonFiniteGradientError` naming
            the parameter, leaving parameters and state untouched), ``"skip"`` (skip the whole
            step; counted in ``skipped_steps``) or ``"ignore"`` (no check, no host sync).
        splits: ``{param_name: spec}`` to orthogonalize row blocks of a fused matrix separately;
            spec is a :class:`~muonscale.QKVLayout`, an int (that many equal row blocks, e.g.
            heads) or a list of row-block sizes.
        qkv_split: with a ``QKVLayout`` spec: ``"qkv"`` (Q, K, V blocks) or ``"head"`` (each head).
        matrix_mode: parameters with > 2 dims: ``"flatten"`` trailing dims into one matrix
            (conv kernels) or ``"batch"`` (leading dims index separate matrices: stacked experts).
        rules: routing overrides for :func:`muonscale.route` (regex or callables).
        ns_eps: floor of the Frobenius norm in Newton–Schulz.
        ns_method: ``"plain"`` (the reference iteration), ``"gram"`` (iterate on the m×m Gram
            matrix, restarting every 2 steps) or ``"auto"`` (Gram for float32/float64 matrices
            with n ≥ 3m, where it is as accurate and 17–22% cheaper; plain otherwise). Same
            function either way; see :mod:`muonscale.kernels.newton_schulz_fast`.
    """

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        coefficients: Any = "keller",
        scale: str = "match_rms_adamw",
        ns_dtype: torch.dtype | None = None,
        momentum_dtype: torch.dtype | None = None,
        adamw_lr: float | None = None,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        nonfinite: str = "raise",
        *,
        splits: Mapping[str, QKVLayout | int | Sequence[int]] | None = None,
        qkv_split: str = "qkv",
        matrix_mode: str = "flatten",
        rules: Sequence[Rule] | None = None,
        ns_eps: float = DEFAULT_EPS,
        ns_method: str = "auto",
    ) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if qkv_split not in QKV_SPLIT_MODES:
            raise ValueError(f"qkv_split must be one of {QKV_SPLIT_MODES}, got {qkv_split!r}")
        if adamw_weight_decay is not None:
            _check_range("adamw_weight_decay", adamw_weight_decay, 0.0, math.inf)
        self._muon_defaults = dict(
            lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
            ns_steps=ns_steps, coefficients=coefficients, scale=scale, ns_dtype=ns_dtype,
            momentum_dtype=momentum_dtype, matrix_mode=matrix_mode, ns_eps=ns_eps,
            ns_method=ns_method,
        )  # fmt: skip
        _validate_muon_group(self._muon_defaults)
        self._adamw_defaults = dict(
            lr=adamw_lr if adamw_lr is not None else lr, betas=tuple(adamw_betas), eps=adamw_eps,
            weight_decay=adamw_weight_decay,
        )  # fmt: skip
        self.nonfinite = nonfinite
        self.skipped_steps = 0
        self.memory = MemoryBudget.from_environment()  # the environment is read here only
        self.param_names: dict[int, str] = {}
        self.routing: dict[str, RouteDecision] = {}
        self._rules = list(rules or ())
        self._views: dict[int, MatrixView] = {}

        groups = self._groups_from(params)
        if adamw_lr is None and scale != "match_rms_adamw":
            if any(g["algorithm"] == "adamw" and "lr" not in g for g in groups):
                adamw_params = [n for n, d in self.routing.items() if d.algorithm == "adamw"]
                raise ValueError(
                    f"adamw_lr is required with scale={scale!r}: only scale='match_rms_adamw' "
                    "makes Muon's update RMS match AdamW's (~0.2), so that one lr fits both "
                    f"halves. Parameters routed to AdamW: {adamw_params[:5]}"
                )
        defaults = dict(self._muon_defaults, algorithm="muon")
        super().__init__(groups, defaults)
        self._split_rows = self._resolve_splits(splits or {}, qkv_split)

    # ---------------------------------------------------------------- param groups
    def _groups_from(self, params: Any) -> list[dict[str, Any]]:
        """Normalize every accepted ``params`` form into groups with an ``algorithm`` each."""
        if isinstance(params, nn.Module):
            decisions = route(params, self._rules)
            named = dict(params.named_parameters())
            self.routing.update(decisions)
            return self._split_by_algorithm({"params": [(n, named[n]) for n in decisions]}, decisions)
        params = list(params)
        if not params:
            raise ValueError("params: the optimizer got an empty parameter list")
        if all(isinstance(p, Mapping) for p in params):
            groups = []
            for g in params:
                groups.extend(self._expand_user_group(dict(g)))
            return groups
        return self._expand_user_group({"params": params})

    def _expand_user_group(self, group: dict[str, Any]) -> list[dict[str, Any]]:
        entries = group["params"]
        entries = [entries] if isinstance(entries, torch.Tensor) else list(entries)
        named: list[tuple[str, torch.Tensor]] = []
        for i, entry in enumerate(entries):
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
                named.append(entry)
            elif isinstance(entry, torch.Tensor):
                named.append((f"param{len(self.param_names) + i}", entry))
            else:
                raise TypeError(f"params: expected tensors or (name, tensor) pairs, got {type(entry).__name__}")
        for name, p in named:
            self.param_names[id(p)] = name
        algorithm = group.get("algorithm")
        if algorithm is not None:
            if algorithm not in ALGORITHMS:
                raise ValueError(f"param group 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}")
            for name, _ in named:
                self.routing[name] = RouteDecision(algorithm, "param group")
            return self._split_by_algorithm(dict(group, params=named), {n: self.routing[n] for n, _ in named})
        decisions = {name: route_one(name, p, self._rules) for name, p in named}
        self.routing.update(decisions)
        return self._split_by_algorithm(dict(group, params=named), decisions)

    def _split_by_algorithm(self, group: dict[str, Any], decisions: Mapping[str, RouteDecision]) -> list[dict[str, Any]]:
        """One group per algorithm; AdamW without an explicit weight decay further splits by
        dimensionality (≥ 2-D decays, 0/1-D does not)."""
        for name, p in group["params"]:
            self.param_names[id(p)] = name
        muon_params = [p for n, p in group["params"] if decisions[n].algorithm == "muon"]
        adamw_named = [(n, p) for n, p in group["params"] if decisions[n].algorithm == "adamw"]
        rest = {k: v for k, v in group.items() if k not in ("params", "algorithm")}
        out = []
        if muon_params:
            out.append(dict(rest, params=muon_params, algorithm="muon"))
        if adamw_named:
            pinned = group.get("algorithm") == "adamw"
            if pinned and "weight_decay" in rest:
                out.append(dict(rest, params=[p for _, p in adamw_named], algorithm="adamw"))
            elif self._adamw_defaults["weight_decay"] is not None:
                rest.pop("weight_decay", None)
                out.append(dict(rest, params=[p for _, p in adamw_named], algorithm="adamw"))
            else:
                wd = rest.pop("weight_decay", self._muon_defaults["weight_decay"])
                matrices = [p for _, p in adamw_named if p.ndim >= 2]
                vectors = [p for _, p in adamw_named if p.ndim < 2]
                if matrices:
                    out.append(dict(rest, params=matrices, algorithm="adamw", weight_decay=wd))
                if vectors:
                    out.append(dict(rest, params=vectors, algorithm="adamw", weight_decay=0.0))
        return out

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group; ``algorithm`` defaults to ``"muon"``; missing options come from the
        constructor's Muon or AdamW settings."""
        algorithm = param_group.setdefault("algorithm", "muon")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"param group 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}")
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        if params and isinstance(params[0], tuple):
            for name, p in params:
                self.param_names[id(p)] = name
            params = [p for _, p in params]
        param_group["params"] = params
        if algorithm == "muon":
            for key, value in self._muon_defaults.items():
                param_group.setdefault(key, value)
            _validate_muon_group(param_group)
            for p in params:
                if p.is_complex():
                    raise ValueError(f"Muon cannot orthogonalize complex parameter '{self._name(p)}'; route it to AdamW")
                if p.ndim < 2:
                    raise ValueError(f"Muon parameter '{self._name(p)}' has shape {tuple(p.shape)}; Muon needs >= 2 dims (route it to AdamW)")
        else:
            for key, value in self._adamw_defaults.items():
                param_group.setdefault(key, value)
            if param_group["weight_decay"] is None:
                param_group["weight_decay"] = self._muon_defaults["weight_decay"]
            param_group["betas"] = tuple(param_group["betas"])
            _validate_adamw_group(param_group)
        super().add_param_group(param_group)

    def _resolve_splits(self, splits: Mapping[str, Any], qkv_split: str) -> dict[int, list[torch.Tensor]]:
        by_name = {self.param_names.get(id(p)): (p, g) for g in self.param_groups for p in g["params"]}
        out = {}
        for name, spec in splits.items():
            if name not in by_name or by_name[name][1]["algorithm"] != "muon":
                raise ValueError(f"splits: no Muon parameter named {name!r}")
            param = by_name[name][0]
            rows = param.shape[0]
            if isinstance(spec, QKVLayout):
                if spec.rows != rows:
                    raise ValueError(f"splits[{name!r}]: {spec} describes {spec.rows} rows, the parameter has {rows}")
                parts = spec.row_partition(qkv_split)
            elif isinstance(spec, int) and not isinstance(spec, bool):
                if spec < 1 or rows % spec:
                    raise ValueError(f"splits[{name!r}]: {spec} equal blocks do not divide {rows} rows")
                parts = row_blocks([rows // spec] * spec)
            elif isinstance(spec, Sequence):
                if sum(int(s) for s in spec) != rows:
                    raise ValueError(f"splits[{name!r}]: block sizes {list(spec)} do not sum to {rows} rows")
                parts = row_blocks(spec)
            else:
                raise ValueError(f"splits[{name!r}]: expected a QKVLayout, an int or a list of sizes, got {spec!r}")
            out[id(param)] = parts
        return out

    def _name(self, p: torch.Tensor) -> str:
        if id(p) in self.param_names:
            return self.param_names[id(p)]
        for gi, g in enumerate(self.param_groups):
            for pi, q in enumerate(g["params"]):
                if q is p:
                    return f"param_groups[{gi}]['params'][{pi}]"
        return "<unknown parameter>"

    def matrix_view(self, p: torch.Tensor, group: Mapping[str, Any]) -> MatrixView:
        """How ``p`` is split into matrices (cached)."""
        view = self._views.get(id(p))
        if view is None or view.param_shape != tuple(p.shape):
            view = MatrixView.build(p.shape, mode=group["matrix_mode"], row_partition=self._split_rows.get(id(p)))
            self._views[id(p)] = view
        return view

    # ---------------------------------------------------------------- state
    def init_state(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """Create (if missing) and return the state of ``p``."""
        state = self.state[p]
        if state:
            return state
        if group["algorithm"] == "muon":
            dtype = group["momentum_dtype"] or p.dtype
            state["momentum_buffer"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        else:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def init_all_state(self) -> None:
        """Create every parameter's state now (instead of at its first step)."""
        for group in self.param_groups:
            for p in group["params"]:
                self.init_state(p, group)

    def optimizer_state_bytes(self) -> int:
        """Exact bytes held by state tensors."""
        return sum(
            v.numel() * v.element_size()
            for s in self.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def summary(self) -> str:
        """Routing table: tensors and elements per algorithm, then one line per parameter."""
        params = {self._name(p): p for g in self.param_groups for p in g["params"]}
        decisions = {n: self.routing.get(n, RouteDecision(g["algorithm"], "param group"))
                     for g in self.param_groups for n in [self._name(p) for p in g["params"]]}  # fmt: skip
        lines = [routing_summary(decisions, params)]
        for name, d in decisions.items():
            lines.append(f"  {d.algorithm:<6} {name:<50} {tuple(params[name].shape)!s:<18} {d.reason}")
        return "\n".join(lines)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("memory", MemoryBudget.from_environment())
        # Options added after a checkpoint was written get their defaults here.
        for group in self.param_groups:
            group.setdefault("algorithm", "muon")
            if group["algorithm"] == "muon":
                group.setdefault("matrix_mode", "flatten")
                group.setdefault("ns_eps", DEFAULT_EPS)
                group.setdefault("momentum_dtype", None)
                group.setdefault("ns_dtype", None)
                group.setdefault("ns_method", "auto")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for group in state_dict.get("param_groups", []):  # checkpoints from older versions
            group.setdefault("algorithm", "muon")
            if group["algorithm"] == "muon":
                for key, value in self._muon_defaults.items():
                    group.setdefault(key, value)
        super().load_state_dict(state_dict)
        # torch casts floating state to the parameter's dtype; restore momentum_dtype.
        for group in self.param_groups:
            if group["algorithm"] == "muon" and group["momentum_dtype"] is not None:
                for p in group["params"]:
                    buf = self.state.get(p, {}).get("momentum_buffer")
                    if buf is not None and buf.dtype != group["momentum_dtype"]:
                        self.state[p]["momentum_buffer"] = buf.to(group["momentum_dtype"])

    # ---------------------------------------------------------------- step
    def _check_gradients(self) -> str | None:
        """Validate gradient kinds; return the name of the first non-finite gradient, if any."""
        grads, owners = [], []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"parameter '{self._name(p)}' has a sparse gradient; muonscale.Muon needs dense gradients")
                grads.append(p.grad)
                owners.append(p)
        if self.nonfinite == "ignore" or not grads:
            return None
        return self._first_nonfinite(grads, owners)

    def _first_nonfinite(self, grads: list[torch.Tensor], owners: list[torch.Tensor]) -> str | None:
        max_abs = torch._foreach_norm(grads, float("inf"))  # NaN propagates through the max
        finite = torch.stack([m.to(max_abs[0].device) for m in max_abs]).isfinite()
        if bool(finite.all()):
            return None
        return self._name(owners[int((~finite).nonzero()[0])])

    def _handle_nonfinite(self, bad: str) -> None:
        if self.nonfinite == "raise":
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN or inf) in parameter '{bad}'; parameters and optimizer "
                "state were left unchanged. Pass nonfinite='skip' to skip such steps instead."
            )
        self.skipped_steps += 1

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step over every group (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        bad = self._check_gradients()
        if bad is not None:
            self._handle_nonfinite(bad)
            return loss
        try:
            self._apply_updates()
        finally:
            clear_workspaces()  # NS scratch is not held through the next forward/backward
        return loss

    def _apply_updates(self) -> None:
        """The update phase of :meth:`step`, after the gradients were checked (subclasses that
        lay parameters out differently override this, not ``step``)."""
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            self.update_group(group, params, [p.grad for p in params])

    def update_group(self, group: Mapping[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Apply one step of ``group``'s algorithm to ``params`` with ``grads`` (plain local
        tensors; the distributed optimizers call this on the matrices a rank owns)."""
        if not params:
            return
        states = [self.init_state(p, group) for p in params]
        if group["algorithm"] == "muon":
            functional.muon(
                params, grads, [s["momentum_buffer"] for s in states],
                views=[self.matrix_view(p, group) for p in params],
                lr=float(group["lr"]), weight_decay=group["weight_decay"], momentum=group["momentum"],
                nesterov=group["nesterov"], ns_steps=group["ns_steps"],
                coefficients=group["coefficients"], ns_dtype=group["ns_dtype"],
                scale=group["scale"], eps=group["ns_eps"], ns_method=group["ns_method"],
                max_chunk_bytes=self.memory.update_chunk_bytes,
                max_workspace_bytes=self.memory.ns_workspace_bytes,
            )  # fmt: skip
        else:
            beta1, beta2 = group["betas"]
            functional.adamw(
                params, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"],
                max_chunk_bytes=self.memory.update_chunk_bytes,
            )  # fmt: skip


def hidden_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The (name, param) pairs the default rule sends to Muon."""
    return [(n, p) for n, p in named if route_one(n, p).algorithm == "muon"]
