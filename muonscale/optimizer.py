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

from . import functional
from .backward_ns import BackwardOrthogonalizer
from .capturable import DeviceNonFiniteGuard, device_lr, step_lr
from .compile_boundary import eager_under_compile
from .declared_state import MOMENTUM, ROW_MOMENT, kept_state, variant_state
from .kernels import ElementwiseBackend, clear_workspaces, elementwise_backend_from_environment
from .matrices import MatrixView
from .memory import MemoryBudget
from .newton_schulz import Coefficients
from .optimizer_groups import (
    PARAMS_TYPE_ERROR,
    check_transposed,
    expand_user_group,
    groups_from,
    rebind_slots,
    refuse_dtensors,
    resolved_group,
    warn_idle_qk_lr_scale,
    warn_unnamed,
)
from .optimizer_options import (  # noqa: F401 (NONFINITE_POLICIES, NS_METHODS: re-exported)
    NONFINITE_POLICIES,
    NS_METHODS,
    AdamWGroup,
    check_flag,
    check_range,
    either,
    resolve_splits,
    validate_adamw_group,
    validate_muon_group,
)
from .optimizer_state import (
    MomentumStacks,
    check_loadable,
    check_loaded_groups,
    keep_momentum_dtypes,
    parameter_states,
    restore_loaded,
    upgraded_groups,
    with_group_defaults,
)
from .param_table import ParamTable
from .params import RouteDecision, Rule
from .qkv import QKV_SPLIT_MODES, QKVLayout
from .scaling import ADJUST_LR_FNS, SCALE_RULES
from .settings import OPTION_DEFAULTS, PLAIN_MUON, MuonSettings, schedule_defaults
from .variants import Normalize, Preconditioner


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or ±inf; nothing was changed."""


class Muon(torch.optim.Optimizer):
    r"""Muon for hidden 2-D (or reshaped) weights, AdamW for everything else, one ``state_dict``.

    For each Muon matrix W (m×n) with gradient G, momentum μ, learning rate η, weight decay λ:

    .. code-block:: text

        B ← B + (1 − μ)(G − B)                  # EMA momentum, B₀ = 0
        U = G + μ(B − G)  if nesterov else B
        O = NS_k(U)                             # Newton–Schulz, k = ns_steps
        W ← W (1 − η λ)                         # decoupled weight decay
        W ← W − η s(m, n) O                     # s: the ``scale`` rule

    These are ``torch.optim.Muon``'s semantics, with its positional order and defaults for the
    shared arguments and its keyword names (``ns_coefficients``, ``eps``, ``ns_steps``,
    ``adjust_lr_fn``). One default differs: the scale is ``"match_rms_adamw"``, not torch's
    ``"original"`` (pass ``adjust_lr_fn="original"`` or ``scale="shape"`` for that). Parameters
    routed to AdamW (embeddings, output head, norms, biases, complex tensors; see
    :func:`muonscale.route`) live in their own param groups with their own ``lr``, ``betas``,
    ``eps`` and ``weight_decay``, so LR and momentum schedulers reach both halves.

    Example (a user calls ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict`` as with
    any torch optimizer, and ``summary`` to see the routing):

    .. code-block:: python

        model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 32))
        opt = muonscale.Muon(model, lr=0.02, weight_decay=0.01)
        print(opt.summary())  # the embedding and the bias go to AdamW, the matrix to Muon
        model(torch.randint(100, (8,))).square().mean().backward()
        opt.step()
        opt.zero_grad()

    Args:
        params: ``model.named_parameters()`` (routed by name and shape), the model itself
            (also detects embeddings by module type), plain tensors (≥ 2-D → Muon, with a
            warning: names are needed to tell embeddings and heads apart), or param groups
            (dicts; ``"algorithm": "muon" | "adamw"`` pins a group, otherwise its parameters are
            routed; a group's ``params`` may be tensors or (name, tensor) pairs, or tensors with
            a ``"param_names"`` list).
        lr: learning rate of Muon groups (and of AdamW groups when ``adamw_lr`` is None).
        weight_decay: λ, decoupled (multiplied by the unadjusted lr); AdamW groups inherit it
            for ≥ 2-D parameters (see ``adamw_weight_decay``).
        momentum: μ in [0, 1).
        nesterov: Nesterov momentum.
        ns_coefficients (or ``coefficients``): preset name (``"keller"``, ``"polar_express"``,
            ``"jiacheng"``, ``"modded_nanogpt"``), one (a, b, c), or a list of them. Default
            ``"keller"`` = torch's (3.4445, −4.775, 2.0315). Tuples whose iteration diverges are
            rejected.
        eps (or ``ns_eps``): floor of the Frobenius norm in Newton–Schulz, as in torch.
        ns_steps: Newton–Schulz steps (≥ 1).
        adjust_lr_fn: torch's name for the scale: ``"original"`` (= ``scale="shape"``) or
            ``"match_rms_adamw"``.
        scale: update scale rule (see :mod:`muonscale.scaling`); default ``"match_rms_adamw"``
            lets you keep AdamW's lr and weight decay.
        betas (or ``adamw_betas``): AdamW's (β₁, β₂), default (0.9, 0.95).
        adamw_lr: lr of AdamW groups. None → ``lr``, allowed only with ``scale="match_rms_adamw"``
            (other scales give updates of a different size than AdamW's, so one lr cannot fit both).
        adamw_eps: AdamW's ε.
        adamw_weight_decay: λ of AdamW groups. None → ``weight_decay`` for ≥ 2-D AdamW parameters
            (embeddings, head) and 0 for 0/1-D ones (norms, biases).
        ns_dtype: dtype of the iteration; None → bfloat16 on CUDA, float32 on CPU.
        momentum_dtype: dtype of the Muon momentum buffer (e.g. ``torch.bfloat16`` to halve its
            memory; ``torch.float16`` is refused, its range would overflow on large finite
            gradients); None → the parameter's dtype. The buffers of one param group with the same
            shape, dtype and device are views into one stacked tensor (``state_dict`` still
            holds one tensor per parameter).
        nonfinite: ``"raise"`` (a NaN/inf gradient raises :class:`NonFiniteGradientError` naming
            the parameter, leaving parameters and state untouched), ``"skip"`` (skip the whole
            step; counted in ``skipped_steps``) or ``"ignore"`` (no check, no host sync).
            With ``capturable=True`` the check runs on the device: see ``capturable``.
        capturable: torch's meaning: the step never synchronizes with the host, so it can be
            captured in a CUDA graph (recipe: *CUDA graphs* in the docs). Learning rates become
            0-dim float64 tensors on the parameters' device (a scheduler updates them in place)
            and AdamW's step counters live there too. A non-finite gradient makes the step a
            no-op on the device; ``"raise"`` then raises :class:`NonFiniteGradientError` at the
            next ``step()`` that finds the device's record on the host without waiting, at
            :meth:`check_finite` or at ``state_dict()``; every step in between is a no-op too.
            ``"skip"`` counts on the device (``skipped_steps`` reads the count, with a sync).
        splits: ``{param_name: spec}`` to orthogonalize row blocks of a fused matrix separately;
            spec is a :class:`~muonscale.QKVLayout`, an int (that many equal row blocks, e.g.
            heads) or a list of row-block sizes.
        qkv_split: with a ``QKVLayout`` spec: ``"qkv"`` (Q, K, V blocks) or ``"head"`` (each head).
        qk_lr_scale: learning-rate multiplier of the query and key blocks of weights split by a
            ``QKVLayout`` (1: none); value blocks and other matrices keep the group's lr. Larger
            values shorten the early loss plateau that attention must leave, and can cost
            in longer runs; *Variants* in the docs has what it gains and costs.
        matrix_mode: parameters with > 2 dims: ``"flatten"`` trailing dims into one matrix
            (conv kernels) or ``"batch"`` (leading dims index separate matrices: stacked experts).
        rules: routing overrides for :func:`muonscale.route` (regex or callables).
        transposed: names of 2-D weights stored (in, out), as GPT-2's ``Conv1D``: their Muon
            matrix is the transpose, so scales see (out, in) and ``splits`` cut output features
            (columns of the stored tensor). None: detected by module class when ``params`` is
            the model (:func:`muonscale.params.transposed_weights`), else none.
        ns_method: ``"plain"`` (the reference iteration), ``"gram"`` (iterate on the m×m Gram
            matrix, restarting every 2 steps) or ``"auto"`` (Gram for float32/float64 matrices
            with n ≥ 3m, and for bfloat16 ones with Keller's coefficients and n ≥ 4m; plain
            otherwise). Same function either way, not the same rounding; the costs and errors
            measured are in *Newton–Schulz* in the docs (:data:`muonscale.kernels.GRAM_POLICY`).
        normalize: ``"none"`` or ``"row"`` (NorMuon: each row of the orthogonalized update is
            divided by the root of its EMA second moment, then the matrix is rescaled to its
            norm before; its state, one float32 per row, is declared in
            :mod:`muonscale.declared_state`).
        row_beta2: β₂ of that second moment (NorMuon's 0.95).
        cautious_weight_decay: decay only the entries where the update and the weight agree
            in sign (W ← W − ηλ 𝟙[u ⊙ W ≥ 0] ⊙ W).
        preconditioner: ``"frobenius"`` (X / ‖X‖_F) or ``"aol"`` (Turbo-Muon: AOL scaling from
            the first Gram product; defaults to its four-step ``"turbo_muon"`` coefficients,
            ``ns_steps=4``). The equations and sources are in *Variants* in the docs.
        orthogonalize_in_backward: compute each stackable Muon matrix's momentum and
            Newton–Schulz during backward, as soon as the gradients of its bucket are final
            (post-accumulate-grad hooks; a side stream on CUDA), so that ``step()`` only
            applies the updates; the same arithmetic, bitwise on CPU. For one backward per
            step in one process: when a gradient changed after its hook (clipping, a second
            backward), ``step()`` discards that work and computes every update as usual,
            warning once. Not with ``capturable``. Costs a second momentum buffer and the
            Newton–Schulz workspaces, held between steps. See *Design notes* in the docs.
        strict: raise ``ValueError`` instead of warning when parameters without names would
            be routed by tensor rank alone (embeddings and heads then look like hidden weights).
    """

    _CAPTURABLE_REFUSAL: str | None = None
    """Why a subclass refuses ``capturable=True`` (None: it supports it)."""

    _ACCEPTS_DTENSOR = False
    """Whether the class updates DTensor parameters (the DTensor optimizer does)."""

    _BACKWARD_NS_REFUSAL: str | None = None
    """Why a subclass refuses ``orthogonalize_in_backward=True`` (None: it supports it)."""

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = PLAIN_MUON.lr,
        weight_decay: float = PLAIN_MUON.weight_decay,
        momentum: float = PLAIN_MUON.momentum,
        nesterov: bool = PLAIN_MUON.nesterov,
        *,
        ns_coefficients: str | Coefficients | Sequence[Coefficients] | None = None,
        eps: float | None = None,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = None,
        betas: tuple[float, float] | None = None,
        coefficients: str | Coefficients | Sequence[Coefficients] | None = None,
        scale: str | None = None,
        ns_eps: float | None = None,
        ns_dtype: torch.dtype | None = None,
        momentum_dtype: torch.dtype | None = None,
        adamw_lr: float | torch.Tensor | None = None,
        adamw_betas: tuple[float, float] | None = None,
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        nonfinite: str = "raise",
        splits: Mapping[str, QKVLayout | int | Sequence[int]] | None = None,
        qkv_split: str = "qkv",
        matrix_mode: str = PLAIN_MUON.matrix_mode,
        rules: Sequence[Rule] | None = None,
        ns_method: str = PLAIN_MUON.ns_method,
        normalize: Normalize = PLAIN_MUON.normalize,
        row_beta2: float = PLAIN_MUON.row_beta2,
        cautious_weight_decay: bool = PLAIN_MUON.cautious_weight_decay,
        preconditioner: Preconditioner = PLAIN_MUON.preconditioner,
        qk_lr_scale: float = PLAIN_MUON.qk_lr_scale,
        capturable: bool = False,
        transposed: Iterable[str] | None = None,
        orthogonalize_in_backward: bool = False,
        strict: bool = False,
    ) -> None:
        if isinstance(params, torch.Tensor):
            raise TypeError(f"{PARAMS_TYPE_ERROR}, but got {torch.typename(params)}")
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if qkv_split not in QKV_SPLIT_MODES:
            raise ValueError(f"qkv_split must be one of {QKV_SPLIT_MODES}, got {qkv_split!r}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(
                f"Adjust learning rate function {adjust_lr_fn} is not supported: adjust_lr_fn "
                f"must be one of {tuple(ADJUST_LR_FNS)} (or pass scale=one of {SCALE_RULES})"
            )
        scale = either(
            "scale", scale, "adjust_lr_fn", ADJUST_LR_FNS.get(adjust_lr_fn), PLAIN_MUON.scale
        )
        if adamw_weight_decay is not None:
            check_range("adamw_weight_decay", adamw_weight_decay, 0.0, math.inf)
        default_steps, default_coefficients = schedule_defaults(preconditioner)
        self.muon_defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_steps=ns_steps if ns_steps is not None else default_steps,
            coefficients=either(
                "coefficients",
                coefficients,
                "ns_coefficients",
                ns_coefficients,
                default_coefficients,
            ),
            scale=scale,
            ns_dtype=ns_dtype,
            momentum_dtype=momentum_dtype,
            matrix_mode=matrix_mode,
            ns_eps=either("ns_eps", ns_eps, "eps", eps, PLAIN_MUON.ns_eps),
            ns_method=ns_method,
            normalize=normalize,
            row_beta2=row_beta2,
            cautious_weight_decay=cautious_weight_decay,
            preconditioner=preconditioner,
            qk_lr_scale=qk_lr_scale,
        )
        validate_muon_group(self.muon_defaults)
        self.adamw_defaults = dict(
            lr=adamw_lr if adamw_lr is not None else lr,
            betas=tuple(either("adamw_betas", adamw_betas, "betas", betas, (0.9, 0.95))),
            eps=adamw_eps,
            weight_decay=adamw_weight_decay,
        )
        validate_adamw_group(dict(self.adamw_defaults, weight_decay=weight_decay))
        if not isinstance(capturable, bool):
            raise ValueError(f"capturable must be a bool, got {capturable!r}")
        if capturable and self._CAPTURABLE_REFUSAL is not None:
            raise ValueError(
                f"{type(self).__name__} does not support capturable=True: "
                f"{self._CAPTURABLE_REFUSAL}"
            )
        check_flag("orthogonalize_in_backward", orthogonalize_in_backward)
        if orthogonalize_in_backward and self._BACKWARD_NS_REFUSAL is not None:
            raise ValueError(
                f"{type(self).__name__} does not support orthogonalize_in_backward=True: "
                f"{self._BACKWARD_NS_REFUSAL}"
            )
        if orthogonalize_in_backward and capturable:
            raise ValueError(
                "orthogonalize_in_backward=True cannot be combined with capturable=True: the "
                "Newton–Schulz work would run in backward hooks, outside the captured step"
            )
        self._backward_ns: BackwardOrthogonalizer | None = None
        self.nonfinite = nonfinite
        self.capturable = capturable
        self._guard: DeviceNonFiniteGuard | None = None
        self.skipped_steps = 0
        # The environment is read here only; every step passes these on.
        self.memory = MemoryBudget.from_environment()
        self.elementwise_backend: ElementwiseBackend = elementwise_backend_from_environment()
        self.momentum_stacks = MomentumStacks()
        check_flag("strict", strict)
        self.strict = strict
        """Whether routing unnamed parameters by tensor rank alone is an error."""
        if isinstance(transposed, str):
            raise TypeError(
                f"transposed must be a collection of parameter names, got {transposed!r}"
            )
        self.param_table = ParamTable(rules or (), transposed or ())
        """Names, routing, ``splits`` and matrix views of the parameters."""

        groups = groups_from(
            self.param_table, params, weight_decay, self.adamw_defaults["weight_decay"]
        )
        if adamw_lr is None and scale != "match_rms_adamw":
            if any(g["algorithm"] == "adamw" and "lr" not in g for g in groups):
                adamw_params = [n for n, d in self.routing.items() if d.algorithm == "adamw"]
                raise ValueError(
                    f"adamw_lr is required with scale={scale!r}: only scale='match_rms_adamw' "
                    "makes Muon's update RMS match AdamW's (~0.2), so that one lr fits both "
                    f"halves. Parameters routed to AdamW: {adamw_params[:5]}"
                )
        defaults = dict(self.muon_defaults, algorithm="muon")
        super().__init__(groups, defaults)
        if not self._ACCEPTS_DTENSOR:
            refuse_dtensors(self.param_table, self.param_groups, type(self).__name__)
        warn_unnamed(self.param_table, strict)
        check_transposed(self.param_table, self.param_groups)
        table = self.param_table
        by_name = {table.name(p): (p, g) for g in self.param_groups for p in g["params"]}
        table.split_rows, table.split_roles = resolve_splits(
            splits or {}, qkv_split, by_name, table.is_transposed
        )
        warn_idle_qk_lr_scale(table, self.param_groups)
        if orthogonalize_in_backward:
            self._backward_ns = BackwardOrthogonalizer(self, table)

    # The tables' facts under the names they have always had on the optimizer.
    @property
    def param_names(self) -> dict[int, str]:
        """``id(param)`` -> name."""
        return self.param_table.names

    @property
    def routing(self) -> dict[str, RouteDecision]:
        """name -> where :func:`muonscale.route` (or a param group) sent the parameter."""
        return self.param_table.routing

    @routing.setter
    def routing(self, decisions: dict[str, RouteDecision]) -> None:
        self.param_table.routing = decisions

    @property
    def split_rows(self) -> dict[int, list[torch.Tensor]]:
        """``id(param)`` -> the row blocks ``splits`` gave it."""
        return self.param_table.split_rows

    @property
    def split_roles(self) -> dict[int, tuple[str, ...]]:
        """``id(param)`` -> the roles (``"q"``, ``"k"``, ``"v"``) of its row blocks."""
        return self.param_table.split_roles

    @property
    def transposed_names(self) -> set[str]:
        """Names of the weights stored (in, out) (see ``transposed``)."""
        return self.param_table.transposed

    @property
    def orthogonalize_in_backward(self) -> bool:
        """Whether Newton–Schulz runs during backward (see the class docstring)."""
        return self.__dict__.get("_backward_ns") is not None

    # ---------------------------------------------------------------- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters with the constructor's defaults: routed like the constructor's
        ``params`` (by name when named, by rank otherwise; ``"algorithm"`` pins), AdamW ones
        split so that 0/1-D parameters get no weight decay unless the group asks for it."""
        if not isinstance(param_group, Mapping):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        resolved = "algorithm" in param_group and (
            param_group["algorithm"] == "muon" or param_group.get("weight_decay") is not None
        )
        if resolved:  # the constructor's groups, or a group pinned with its options
            self._add_resolved_group(dict(param_group))
            return
        groups = expand_user_group(
            self.param_table,
            dict(param_group),
            self.muon_defaults["weight_decay"],
            self.adamw_defaults["weight_decay"],
        )
        warn_unnamed(self.param_table, self.strict)  # strict: raises before a group is added
        for group in groups:
            self._add_resolved_group(group)

    def _add_resolved_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(
            resolved_group(
                self.param_table,
                param_group,
                self.muon_defaults,
                self.adamw_defaults,
                self.param_groups,
            )
        )
        if self.capturable:
            device_lr(self.param_groups[-1])
        if self.__dict__.get("_backward_ns") is not None:
            self._backward_ns.rebuild()

    def rebind_parameters(self, named_parameters: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Point the optimizer at the parameters now named in ``named_parameters``, by the names
        it was built with: param groups, names, ``splits``, matrix views and state follow.
        Parameters already bound (the same objects) stay. Returns how many were re-bound.
        ``named_parameters`` may also be the model; a changed shape or dtype is refused.

        For frameworks that replace parameter objects after the optimizer was built
        (accelerate's FSDP2 preparation; a model re-created from a checkpoint). A group slot
        that already holds one of the model's parameters (the framework swapped the group) is
        named by the model."""
        table = self.param_table
        slots = rebind_slots(table, self.param_groups, named_parameters)
        self._check_rebind([(old, new) for old, new, _ in slots])
        new_of_name = {name: new for _, new, name in slots}
        for key in list(self.state):  # state keys are alive, so their ids name them exactly
            name = table.names.get(id(key))
            if name in new_of_name and new_of_name[name] is not key:
                self.state[new_of_name[name]] = self.state.pop(key)
        flat = iter(slots)
        for group in self.param_groups:
            group["params"] = [next(flat)[1] for _ in group["params"]]
        table.rebind(slots)
        self._after_rebind([(old, new) for old, new, _ in slots])
        if self._backward_ns is not None:
            self._backward_ns.rebuild()
        return sum(old is not new for old, new, _ in slots)

    def _check_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Raise before anything changes if a subclass cannot follow ``slots`` (see below)."""

    def _after_rebind(self, slots: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Re-key what a subclass holds by parameter: ``slots`` are (bound before, bound now)
        in param-group order (the same object when nothing moved)."""

    def _name(self, p: torch.Tensor) -> str:
        return self.param_table.label(p, self.param_groups)

    def _matrix_view(self, p: torch.Tensor, group: Mapping[str, Any]) -> MatrixView:
        """How ``p`` is split into matrices (cached)."""
        return self.param_table.view(p, group["matrix_mode"])

    # ---------------------------------------------------------------- capturable
    @property
    def skipped_steps(self) -> int:
        """Steps skipped by ``nonfinite="skip"`` (capturable: counted on the device, and
        reading this waits for it)."""
        guard = self.__dict__.get("_guard")
        on_device = guard.read()[2] if guard is not None and guard.policy == "skip" else 0
        return self.__dict__.get("_skipped_steps", 0) + on_device

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.__dict__["_skipped_steps"] = int(value)
        guard = self.__dict__.get("_guard")
        if guard is not None:
            guard.clear(skipped=True)

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteGradientError` if a capturable step since the last check saw
        a non-finite gradient (``nonfinite="raise"``; waits for the device). Without
        ``capturable``, ``step()`` raises at once and this does nothing."""
        guard = self._guard
        if guard is not None:
            self._raise_recorded_nonfinite(guard.read())

    def _raise_recorded_nonfinite(self, record: tuple[int, int, int] | None) -> None:
        if record is None or not record[0] or self.nonfinite != "raise":
            return
        name = self._guard.bad_name(record[1])
        self._guard.clear()
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or inf) in parameter '{name}' in a capturable step; "
            "that step and every step after it until now were no-ops on the device, so "
            "parameters and optimizer state are as they were before it. Pass "
            "nonfinite='skip' to skip such steps instead."
        )

    def state_dict(self) -> dict[str, Any]:
        self.check_finite()  # capturable "raise": a pending non-finite step raises here
        return super().state_dict()

    # ---------------------------------------------------------------- state
    def _init_state(
        self, p: torch.Tensor, group: Mapping[str, Any], settings: MuonSettings | None = None
    ) -> dict[str, torch.Tensor]:
        """Create (if missing) and return the state of ``p`` (``settings``: the group's, when
        the caller has them)."""
        state = self.state[p]
        if group["algorithm"] == "muon":
            if settings is None:
                settings = MuonSettings.from_group(group)
            if MOMENTUM.key not in state:  # laid out as the parameter (a DTensor's shards)
                state[MOMENTUM.key] = torch.zeros_like(
                    p, dtype=MOMENTUM.dtype(settings, p.dtype), memory_format=torch.preserve_format
                )
            for spec in kept_state(settings, variants_only=True):
                if spec.key not in state:
                    view = self._matrix_view(p, group)
                    state[spec.key] = spec.zeros(settings, view, p.dtype, p.device)
            return state
        elif state:
            return state
        else:
            # capturable: on the parameter's device (torch's convention), made by a fill kernel
            device = p.device if self.capturable else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    def _stacked_momentum(
        self, group: Mapping[str, Any], params: list[torch.Tensor], states: list[dict]
    ) -> list[torch.Tensor]:
        """The momentum buffers of ``states``, as views into their stacks (see
        :class:`~muonscale.optimizer_state.MomentumStacks`)."""
        return self.momentum_stacks.buffers(group, params, states, self.state)

    def init_all_state(self) -> None:
        """Create every parameter's state now (instead of at its first step)."""
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p, group)

    def optimizer_state_bytes(self) -> int:
        """Exact bytes held by state tensors."""
        return sum(
            v.numel() * v.element_size()
            for s in parameter_states(self.state)
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )

    def summary(self) -> str:
        """Routing table: tensors and elements per algorithm, then one line per parameter,
        with the weights Muon treats as transposed or splits into row blocks (and how)."""
        return self.param_table.summary(self.param_groups)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        # The rest is keyed by id(param), which a copy changes: the table travels by position.
        state["_muonscale"] = dict(
            self.param_table.pickled(self.param_groups),
            nonfinite=self.nonfinite,
            skipped_steps=self.skipped_steps,
            capturable=self.capturable,
            muon_defaults=self.muon_defaults,
            adamw_defaults=self.adamw_defaults,
            orthogonalize_in_backward=self.orthogonalize_in_backward,
            strict=self.__dict__.get("strict", False),
        )
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's, then defaults for options added after a checkpoint was written, and (from
        a pickle) the extras of :meth:`__getstate__`, keyed by the copied parameters."""
        extra = state.pop("_muonscale", None)
        super().__setstate__(state)
        self.__dict__.setdefault("memory", MemoryBudget.from_environment())
        if "elementwise_backend" not in self.__dict__:  # not pickled, as memory: read here once
            self.elementwise_backend = elementwise_backend_from_environment()
        for key, value in dict(
            capturable=False, strict=False, _guard=None, _backward_ns=None
        ).items():
            self.__dict__.setdefault(key, value)
        self.momentum_stacks = MomentumStacks()  # new state tensors: restacked at the next step
        upgraded_groups(self.param_groups)
        if extra is None:  # load_state_dict: same parameters, same attributes
            return
        self.nonfinite, self.skipped_steps = extra["nonfinite"], extra["skipped_steps"]
        self.capturable = extra.get("capturable", False)
        self.strict = extra.get("strict", False)  # pickled before strict existed: False
        # options added since the pickle was written: the table's defaults
        self.muon_defaults = {**OPTION_DEFAULTS, **extra["muon_defaults"]}
        self.adamw_defaults = extra["adamw_defaults"]
        self.param_table = ParamTable.unpickled(self.param_groups, extra)
        if extra.get("orthogonalize_in_backward"):  # hooks on the copied parameters
            self._backward_ns = BackwardOrthogonalizer(self, self.param_table)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_loadable(state_dict, self.param_groups)
        check_loaded_groups(self.param_groups, self.param_table, state_dict)
        state_dict = with_group_defaults(state_dict, self.muon_defaults)
        lrs = [g["lr"] for g in self.param_groups] if self.capturable else []
        momentum_dtypes = [g.get("momentum_dtype") for g in self.param_groups]
        super().load_state_dict(state_dict)
        restore_loaded(self.param_groups, self.state, lrs)
        keep_momentum_dtypes(self.param_groups, self.state, momentum_dtypes)
        if self._backward_ns is not None:
            self._backward_ns.reset()  # work done from the replaced state is void

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        if self.__dict__.get("_backward_ns") is not None:
            self._backward_ns.reset()  # the next backward starts the step afresh

    # ---------------------------------------------------------------- step
    def _step_gradients(self) -> dict[int, torch.Tensor]:
        """This step's gradient of every parameter that has one, by ``id`` (the one place the
        step reads ``p.grad``; sparse gradients raise)."""
        grads = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(
                        f"parameter '{self._name(p)}' has a sparse gradient; "
                        "muonscale.Muon needs dense gradients"
                    )
                grads[id(p)] = p.grad
        return grads

    def _checked_owners(self, grads: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """The parameters whose gradients the non-finite check reads: those in ``grads`` with
        elements (an empty tensor has no max norm, and nothing to check)."""
        return [
            p
            for group in self.param_groups
            for p in group["params"]
            if id(p) in grads and grads[id(p)].numel()
        ]

    def _check_gradients(self, grads: Mapping[int, torch.Tensor]) -> str | None:
        """The name of the first non-finite gradient of ``grads``, if any."""
        owners = self._checked_owners(grads)
        if self.nonfinite == "ignore" or not owners:
            return None
        return self._first_nonfinite([grads[id(p)] for p in owners], owners)

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

    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step over every group (see the class docstring). Under
        ``torch.compile`` it runs eagerly (see :func:`eager_under_compile`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.capturable:
            self._capturable_step()
            return loss
        engine = self._backward_ns
        from_backward = [] if engine is None else engine.collect()
        try:
            grads = self._step_gradients()
            bad = self._check_gradients(grads)
            if bad is not None:
                self._handle_nonfinite(bad)
                return loss
            self._apply_updates(grads, from_backward)
        finally:
            if engine is not None:
                engine.reset()
            clear_workspaces()  # NS scratch is not held through the next forward/backward
        return loss

    def _capturable_step(self) -> None:
        """:meth:`step` without a host sync: the non-finite check is a device flag that gates
        the update's scalars (see :mod:`muonscale.capturable`)."""
        guard = self._guard
        if guard is not None:
            self._raise_recorded_nonfinite(guard.poll())  # only a record already on the host
        grads = self._step_gradients()
        owners = self._checked_owners(grads)
        step_ok = None  # a device flag: False when a gradient is not finite
        if self.nonfinite != "ignore" and owners:
            checked = [grads[id(p)] for p in owners]
            if guard is None:
                guard = self._guard = DeviceNonFiniteGuard(self.nonfinite, checked[0].device)
            step_ok = guard.gate(checked, [self._name(p) for p in owners])
        try:
            self._apply_updates(grads, step_ok=step_ok)
        finally:
            clear_workspaces()
        if guard is not None:
            guard.publish()

    def _apply_updates(
        self,
        grads: Mapping[int, torch.Tensor],
        from_backward: Sequence[Any] = (),
        step_ok: torch.Tensor | None = None,
    ) -> None:
        """The update phase of :meth:`step`, after ``grads`` (of :meth:`_step_gradients`) were
        checked (subclasses that lay parameters out differently override this, not ``step``):
        ``from_backward``, the buckets orthogonalized during backward; ``step_ok``, a
        capturable step's device flag."""
        for group in self.param_groups:
            params = [p for p in group["params"] if id(p) in grads]
            if from_backward:  # orthogonalize_in_backward: buckets done in backward
                params = self._backward_ns.apply(group, from_backward, params, self._init_state)
            self._update_group(group, params, [grads[id(p)] for p in params], step_ok=step_ok)

    def _update_group(
        self,
        group: Mapping[str, Any],
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        *,
        step_ok: torch.Tensor | None = None,
        apply_updates: functional.ApplyUpdates | None = None,
    ) -> None:
        """Apply one step of ``group``'s algorithm to ``params`` with ``grads`` (plain local
        tensors; the distributed optimizers call this on the matrices a rank owns). ``step_ok``
        (capturable): a device flag, False to make the step a no-op. ``apply_updates``: Muon's
        last pass, instead of :func:`~muonscale.functional.apply_updates_`
        (:func:`muonscale.functional.muon`)."""
        if not params:
            return
        settings = MuonSettings.from_group(group) if group["algorithm"] == "muon" else None
        states = [self._init_state(p, group, settings) for p in params]
        if group["algorithm"] == "muon":
            # Zero-element matrices have state (as in torch) but nothing to orthogonalize.
            keep = [i for i, p in enumerate(params) if p.numel() > 0]
            if len(keep) < len(params):
                params, grads = [params[i] for i in keep], [grads[i] for i in keep]
                states = [states[i] for i in keep]
                if not params:
                    return
            buffers = self._stacked_momentum(group, params, states)
            if step_ok is not None:
                # A gradient equal to the momentum leaves it unchanged (B.lerp(B, w) = B), and a
                # zero lr leaves the parameter unchanged: the step is a no-op on the device.
                grads = [torch.where(step_ok, g, b) for g, b in zip(grads, buffers)]
            functional.muon(
                params,
                grads,
                buffers,
                options=settings,
                row_moments=variant_state(states)[ROW_MOMENT.key],
                qk_lr_scale=settings.qk_lr_scale,
                views=[self._matrix_view(p, group) for p in params],
                lr=step_lr(group, step_ok) if self.capturable else float(group["lr"]),
                weight_decay=group["weight_decay"],
                momentum=settings.momentum,
                nesterov=settings.nesterov,
                ns=settings.ns,
                scale=settings.scale,
                max_chunk_bytes=self.memory.update_chunk_bytes,
                max_workspace_bytes=self.memory.ns_workspace_bytes,
                elementwise_backend=self.elementwise_backend,
                apply_updates=apply_updates,
            )
        else:
            beta1, beta2 = group["betas"]
            if self.capturable:
                for p, s in zip(params, states):  # loaded checkpoints hold steps on the host
                    if s["step"].device != p.device:
                        s["step"] = s["step"].to(p.device)
            exp_avgs = [s["exp_avg"] for s in states]
            exp_avg_sqs = [s["exp_avg_sq"] for s in states]
            if any(p.is_complex() for p in params):
                # As torch.optim.AdamW: real and imaginary parts are independent coordinates.
                params, grads, exp_avgs, exp_avg_sqs = (
                    [torch.view_as_real(t) if t.is_complex() else t for t in ts]
                    for ts in (params, grads, exp_avgs, exp_avg_sqs)
                )
            functional.adamw(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                [s["step"] for s in states],
                lr=device_lr(group) if self.capturable else float(group["lr"]),
                beta1=beta1,
                beta2=beta2,
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                max_chunk_bytes=self.memory.update_chunk_bytes,
                finite=step_ok,
            )
