"""``muonscale.Muon``: Muon for hidden matrices and AdamW for the rest, in one optimizer.

Layers, as in ``torch.optim``: this class validates arguments, routes parameters into param
groups and builds state lazily; :mod:`muonscale.functional` holds the arithmetic on plain
tensors; :mod:`muonscale.newton_schulz` the orthogonalization. The phases it owns live in
collaborators: options (:mod:`~muonscale.optimizer_options`), param groups
(:mod:`~muonscale.optimizer_groups`), state (:mod:`~muonscale.optimizer_state`), one group's
step (:mod:`~muonscale.group_step`) and non-finite gradients (:mod:`~muonscale.nonfinite`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Unpack

import torch

from . import functional
from .backward_ns import BackwardOrthogonalizer
from .capturable import device_lr
from .compile_boundary import eager_under_compile
from .experts import ExpertLayout, GateUpMode
from .group_step import adamw_group_step, muon_group_step, nonempty
from .kernels import ElementwiseBackend, clear_workspaces, elementwise_backend_from_environment
from .kernels.cpu_quantization import prepare_cpu_kernels
from .matrices import MatrixView
from .matrix_step import apply_updates_by_rule_
from .memory import MemoryBudget
from .newton_schulz import Coefficients
from .nonfinite import (  # noqa: F401 (NonFiniteGradientError: re-exported, users import it here)
    NonFiniteGradientError,
    NonFiniteSteps,
    checked_params,
    first_nonfinite,
)
from .optimizer_groups import (
    PARAMS_TYPE_ERROR,
    added_groups,
    check_built_groups,
    groups_from,
    rebind_groups_and_state,
    rebind_slots,
    resolved_group,
)
from .optimizer_options import (  # noqa: F401 (NONFINITE_POLICIES, NS_METHODS: re-exported)
    NONFINITE_POLICIES,
    NS_METHODS,
    checked_defaults,
    require_adamw_lr,
)
from .optimizer_state import (
    PICKLED_EXTRAS_KEY,
    MomentumStacks,
    attributes_added_since,
    check_state_dict,
    created_state,
    extras_not_pickled,
    pickled_extras,
    put_back_narrowed,
    restore_loaded,
    state_bytes,
    state_dict_in_precision,
    state_torch_would_narrow,
    unpickled_attributes,
    upgraded_groups,
    with_group_defaults,
    without_default_precision,
)
from .param_table import ParamTable
from .params import RouteDecision, Rule
from .qkv import QKVLayout
from .settings import (
    PLAIN_MUON,
    MuonSettings,
    StatePrecision,
    VariantOptions,
    checked_variant_options,
)
from .step_metrics import Reduction, StepMetrics, group_label


class Muon(torch.optim.Optimizer):
    r"""Muon for hidden 2-D (or reshaped) weights, AdamW for everything else, one ``state_dict``.

    For each Muon matrix W (m×n) with gradient G, momentum μ, learning rate η, weight decay λ:

    .. code-block:: text

        B ← B + (1 − μ)(G − B)                  # EMA momentum, B₀ = 0
        U = G + μ(B − G)  if nesterov else B
        O = NS_k(U)                             # Newton–Schulz, k = ns_steps
        W ← W (1 − η λ)                         # decoupled weight decay
        W ← W − η s(m, n) O                     # s: the ``scale`` rule

    These are ``torch.optim.Muon``'s semantics, argument order, defaults and names, except the
    default scale (``"match_rms_adamw"``). Parameters routed to AdamW (see
    :func:`muonscale.route`) get param groups of their own. Every argument is described in
    *Options* in the docs.

    Example (a user calls ``step``, ``zero_grad``, ``state_dict`` / ``load_state_dict`` as with
    any torch optimizer, and ``summary`` to see the routing):

    .. code-block:: python

        model = torch.nn.Sequential(torch.nn.Embedding(100, 32), torch.nn.Linear(32, 32))
        opt = muonscale.Muon(model, lr=0.02, weight_decay=0.01)
        print(opt.summary())  # the embedding and the bias go to AdamW, the matrix to Muon
        model(torch.randint(100, (8,))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    """

    _CAPTURABLE_REFUSAL: str | None = None
    """Why a subclass refuses ``capturable=True`` (None: it supports it)."""

    _ACCEPTS_DTENSOR = False
    """Whether the class updates DTensor parameters (the DTensor optimizer does)."""

    _BACKWARD_NS_REFUSAL: str | None = None
    """Why a subclass refuses ``orthogonalize_in_backward=True`` (None: it supports it)."""
    _HOLDS_OWN_STATE = False
    """Whether the class keeps its state in buffers of its own, loaded by
    :meth:`_load_held_state` (torch's copy would cast it to the parameters' dtypes)."""

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
        state_precision: StatePrecision = PLAIN_MUON.state_precision,
        adamw_lr: float | torch.Tensor | None = None,
        adamw_betas: tuple[float, float] | None = None,
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float | None = None,
        nonfinite: str = "raise",
        splits: Mapping[str, QKVLayout | ExpertLayout | int | Sequence[int]] | None = None,
        qkv_split: str = "qkv",
        matrix_mode: str | None = None,
        rules: Sequence[Rule] | None = None,
        ns_method: str = PLAIN_MUON.ns_method,
        capturable: bool = False,
        transposed: Iterable[str] | None = None,
        orthogonalize_in_backward: bool = False,
        strict: bool | None = None,
        gate_up: GateUpMode = "apart",
        experts: Mapping[str, ExpertLayout] | None = None,
        convolutions: Iterable[str] | None = None,
        **variant_options: Unpack[VariantOptions],
    ) -> None:
        # Every keyword argument by name, for checked_defaults (before any other local exists).
        options = {
            k: v
            for k, v in locals().items()
            if k not in ("self", "params", "__class__", "variant_options")
        }
        options.update(checked_variant_options(variant_options, type(self).__name__))
        if isinstance(params, torch.Tensor):
            raise TypeError(f"{PARAMS_TYPE_ERROR}, but got {torch.typename(params)}")
        self.muon_defaults, self.adamw_defaults = checked_defaults(
            options,
            type(self).__name__,
            capturable_refusal=self._CAPTURABLE_REFUSAL,
            backward_refusal=self._BACKWARD_NS_REFUSAL,
        )
        self._refuse_untested_precision(state_precision)
        self._backward_ns: BackwardOrthogonalizer | None = None
        self.nonfinite = nonfinite
        self.capturable = capturable
        self.nonfinite_steps = NonFiniteSteps()
        """Skipped steps and the device record of capturable ones (see ``nonfinite``)."""
        self.step_metrics: StepMetrics | None = None
        """What the last step did (:meth:`enable_step_metrics`); None: not recorded."""
        # The environment is read here only; every step passes these on.
        self.memory = MemoryBudget.from_environment()
        self.elementwise_backend: ElementwiseBackend = elementwise_backend_from_environment()
        self.momentum_stacks = MomentumStacks()
        self.strict = strict
        """None: routing by tensor rank alone is an error where it is certainly wrong; True:
        always; False: never (a warning)."""
        self.param_table = ParamTable(rules or (), transposed or ())
        """Names, routing, ``splits``, expert layouts and matrix views of the parameters."""
        self.param_table.gate_up = gate_up
        self.param_table.experts.update(experts or {})
        self.param_table.convolutions.update(convolutions or ())
        self.param_table.mode_given = matrix_mode is not None

        groups = groups_from(
            self.param_table, params, weight_decay, self.adamw_defaults["weight_decay"]
        )
        require_adamw_lr(groups, self.routing, adamw_lr, self.muon_defaults["scale"])
        super().__init__(groups, dict(self.muon_defaults, algorithm="muon"))
        for group in self.param_groups:  # a param group's own state_precision too
            self._refuse_untested_precision(group.get("state_precision", "param"))
        check_built_groups(
            self.param_table,
            self.param_groups,
            type(self).__name__,
            accepts_dtensor=self._ACCEPTS_DTENSOR,
            strict=strict,
            splits=splits or {},
            qkv_split=qkv_split,
        )
        if any(
            g.get("state_precision", "param") != "param"
            and any(p.device.type == "cpu" for p in g["params"])
            for g in self.param_groups
        ):
            prepare_cpu_kernels()  # built here, so that no step compiles
        if orthogonalize_in_backward:
            self._backward_ns = BackwardOrthogonalizer(self, self.param_table)

    def _refuse_untested_precision(self, state_precision: str) -> None:
        if state_precision != "param" and not self._accepts_quantized_state():
            raise ValueError(
                f"{type(self).__name__} does not support state_precision={state_precision!r} "
                "yet (quantized state is tested with muonscale.Muon, DistributedMuon, "
                "DTensorMuon and the Megatron-Core optimizer only); use "
                "state_precision='param' (momentum_dtype=torch.bfloat16 halves the momentum)"
            )

    @classmethod
    def _accepts_quantized_state(cls) -> bool:
        """Whether the class steps quantized state (``state_precision`` other than
        ``"param"``); a layout accepts it once it is tested with it."""
        return cls is Muon

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
        """Whether Newton–Schulz runs during backward (see *Options* in the docs)."""
        return self.__dict__.get("_backward_ns") is not None

    # ---------------------------------------------------------------- param groups
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add parameters with the constructor's defaults: routed like the constructor's
        ``params`` (by name when named, by rank otherwise; ``"algorithm"`` pins), AdamW ones
        split so that 0/1-D parameters get no weight decay unless the group asks for it."""
        groups = added_groups(
            self.param_table, param_group, self.muon_defaults, self.adamw_defaults, self.strict
        )
        for group in groups:
            self._add_resolved_group(group)

    def _add_resolved_group(self, param_group: dict[str, Any]) -> None:
        defaults = self.muon_defaults, self.adamw_defaults
        group = resolved_group(self.param_table, param_group, *defaults, self.param_groups)
        super().add_param_group(group)
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
        rebind_groups_and_state(table, self.param_groups, self.state, slots)
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

    # ---------------------------------------------------------------- non-finite gradients
    @property
    def skipped_steps(self) -> int:
        """Steps skipped by ``nonfinite="skip"`` (capturable: counted on the device, and
        reading this waits for it)."""
        return self.nonfinite_steps.skipped

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.nonfinite_steps.reset_skipped(value)

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteGradientError` if a capturable step since the last check saw
        a non-finite gradient (``nonfinite="raise"``; waits for the device). Without
        ``capturable``, ``step()`` raises at once and this does nothing."""
        self.nonfinite_steps.raise_recorded(self.nonfinite, wait=True)

    def state_dict(self) -> dict[str, Any]:
        """torch's; a group's ``state_precision`` is written only where it is not the default
        (``"param"``), so that full-precision checkpoints keep the keys of earlier versions
        (``torch.distributed.checkpoint`` loads only keys the checkpoint holds)."""
        self.check_finite()  # capturable "raise": a pending non-finite step raises here
        return without_default_precision(super().state_dict())

    def state_dict_in_precision(self, state_precision: StatePrecision) -> dict[str, Any]:
        """:meth:`state_dict` with the state converted to ``state_precision`` (``"param"``:
        floating, the parameters' dtypes; ``"int8"``, ``"int4"``: quantized), this optimizer's
        state unchanged: a full-precision checkpoint of an int8 run, or the reverse. Loading it into
        an optimizer of either precision converts it again (``load_state_dict``)."""
        return state_dict_in_precision(
            self.state_dict(), self.param_groups, self._matrix_view, state_precision
        )

    # ---------------------------------------------------------------- step metrics
    def enable_step_metrics(
        self, *, timing: bool = False, orthogonality: bool = True, prefix: str = "muon/"
    ) -> StepMetrics:
        """Record what each step does from now on (:class:`~muonscale.step_metrics.StepMetrics`:
        tensors and elements through Newton–Schulz, AdamW or skipped, update RMS per group, an
        orthogonality check, and with ``timing`` the Muon update's seconds); read them with
        :meth:`read_step_metrics`. Returns the record (already enabled: the same one)."""
        if self.__dict__.get("step_metrics") is None:
            self.step_metrics = StepMetrics(
                timing=timing, orthogonality=orthogonality, prefix=prefix
            )
        return self.step_metrics

    def read_step_metrics(self, across_ranks: bool = False) -> dict[str, float]:
        """The last step's metrics as ``{name: float}`` (waits for the device), with
        ``skipped_steps``; ``across_ranks``: combined over the ranks of a distributed optimizer
        (one collective: every rank calls it)."""
        metrics = self.__dict__.get("step_metrics")
        if metrics is None:
            raise RuntimeError(
                f"{type(self).__name__}: step metrics are off; call "
                "optimizer.enable_step_metrics() before the steps to record"
            )
        read = metrics.read(self._metrics_reduction() if across_ranks else None)
        read[metrics.prefix + "skipped_steps"] = float(self.skipped_steps)
        return read

    def _metrics_reduction(self) -> Reduction | None:
        """How a layout combines the metrics over its ranks (None: one process)."""
        return None

    def _count_step(self, metrics: StepMetrics, grads: Any, ran: bool) -> None:
        """Count where each parameter went this step (``grads``: of :meth:`_step_gradients`;
        ``ran``: False when a non-finite gradient stopped it)."""
        metrics.count_step(self.param_groups, lambda p: ran and id(p) in grads, self._logical_numel)

    def _counts_update(self, p: torch.Tensor) -> bool:
        """Whether this rank adds ``p``'s update to the update RMS (a layout whose ranks hold
        copies of ``p`` counts it on one of them)."""
        return True

    def _logical_numel(self, p: torch.Tensor) -> int:
        """Elements of the parameter ``p`` stands for (a layout's piece: the whole's)."""
        return p.numel()

    def _group_label(self, group: Mapping[str, Any]) -> str:
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        return group_label(index, group)

    # ---------------------------------------------------------------- state
    def _init_state(
        self, p: torch.Tensor, group: Mapping[str, Any], settings: MuonSettings | None = None
    ) -> dict[str, torch.Tensor]:
        """Create (if missing) and return the state of ``p`` (``settings``: the group's, when
        the caller has them)."""
        if group["algorithm"] != "muon":
            settings = None  # AdamW's state
        elif settings is None:
            settings = MuonSettings.from_group(group)
        state, view = self.state[p], self._matrix_view
        return created_state(state, p, group, settings, view, capturable=self.capturable)

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
        return state_bytes(self.state)

    def summary(self) -> str:
        """Routing table: tensors and elements per algorithm, then one line per parameter,
        with the weights Muon treats as transposed or splits into row blocks (and how)."""
        return self.param_table.summary(self.param_groups)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state[PICKLED_EXTRAS_KEY] = pickled_extras(self)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's, then defaults for options added after a checkpoint was written, and (from
        a pickle) the extras of :meth:`__getstate__`, keyed by the copied parameters."""
        extras = state.pop(PICKLED_EXTRAS_KEY, None)
        super().__setstate__(state)
        self.__dict__.update(attributes_added_since(self.__dict__))
        self.__dict__.setdefault("_backward_ns", None)
        self.__dict__.setdefault("step_metrics", None)
        self.momentum_stacks = MomentumStacks()  # new state tensors: restacked at the next step
        upgraded_groups(self.param_groups)
        if extras is None and "param_table" not in self.__dict__:  # pickled by muonscale 0.1
            extras = extras_not_pickled(self.param_groups, self.defaults)
        if extras is None:  # load_state_dict: same parameters, same attributes
            held = self.__dict__.pop("_held_state_loaded", None)
            if held is not None:  # loaded by the layout itself: torch copied no tensor
                self.state = held
                self._after_held_state_load()
            return
        self.__dict__.update(unpickled_attributes(self.param_groups, extras))
        if extras.get("orthogonalize_in_backward"):  # hooks on the copied parameters
            self._backward_ns = BackwardOrthogonalizer(self, self.param_table)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's: its pre-hooks, the load, then its post-hooks. A layout that holds its state
        in buffers of its own (:meth:`_load_held_state`) loads it after the last pre-hook, and
        torch then copies no tensor."""
        if self._HOLDS_OWN_STATE:
            self._load_through_torch_hooks(state_dict)
            return
        check_state_dict(state_dict, self.param_groups, self.param_table)
        lrs = [g["lr"] for g in self.param_groups] if self.capturable else []
        storage = [
            (g.get("momentum_dtype"), g.get("state_precision", "param")) for g in self.param_groups
        ]
        narrowed = state_torch_would_narrow(state_dict, self.param_groups)
        super().load_state_dict(with_group_defaults(state_dict, self.muon_defaults))
        put_back_narrowed(self.state, narrowed)
        restore_loaded(self.param_groups, self.state, lrs, storage, self._matrix_view)
        if self._backward_ns is not None:
            self._backward_ns.reset()  # work done from the replaced state is void

    def _load_held_state(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict`` (as torch's pre-hooks left it) into a layout's own buffers and
        param groups (overridden by layouts that hold state torch's copy would cast)."""
        raise NotImplementedError

    def _after_held_state_load(self) -> None:
        """Follow the param group dicts torch's load put in place (a layout's hook)."""

    def _load_through_torch_hooks(self, state_dict: dict[str, Any]) -> None:
        held = self.state

        def load_held(optimizer: Muon, loaded: dict[str, Any]) -> dict[str, Any]:
            self._load_held_state(loaded)  # registered last: after every user pre-hook
            self.__dict__["_held_state_loaded"] = held
            groups = [  # the loaded groups, as torch's copy wants them (no tensors to copy)
                {**{k: v for k, v in g.items() if k != "params"}, "params": s["params"]}
                for g, s in zip(self.param_groups, loaded["param_groups"])
            ]
            return {"state": {}, "param_groups": groups}

        handle = self.register_load_state_dict_pre_hook(load_held)
        try:
            super().load_state_dict(state_dict)
        finally:
            handle.remove()
            self.__dict__.pop("_held_state_loaded", None)

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

    def _check_gradients(self, grads: Mapping[int, torch.Tensor]) -> str | None:
        """The name of the first non-finite gradient of ``grads``, if any."""
        owners = checked_params(self.param_groups, grads)
        if self.nonfinite == "ignore" or not owners:
            return None
        return self._first_nonfinite([grads[id(p)] for p in owners], owners)

    def _first_nonfinite(self, grads: list[torch.Tensor], owners: list[torch.Tensor]) -> str | None:
        bad = first_nonfinite(grads)
        return None if bad is None else self._name(owners[bad])

    def _handle_nonfinite(self, bad: str) -> None:
        self.nonfinite_steps.stop(bad, self.nonfinite)

    @eager_under_compile
    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step over every group (see the class docstring), as named phases
        that a layout overrides (never ``step`` itself): :meth:`_begin_step`,
        :meth:`_step_gradients`, :meth:`_check_gradients`, then :meth:`_apply_updates` or
        :meth:`_handle_nonfinite`, and :meth:`_end_step` whatever happened. Under
        ``torch.compile`` it runs eagerly (see :func:`eager_under_compile`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        metrics = self.__dict__.get("step_metrics")
        if metrics is not None:
            metrics.begin(self.param_groups)
        if self.capturable:
            self._capturable_step()
            return loss
        try:
            work = self._begin_step()
            grads = self._step_gradients()
            bad = self._check_gradients(grads)
            if metrics is not None:
                self._count_step(metrics, grads, ran=bad is None)
            if bad is None:
                self._apply_updates(grads, work)
            else:
                self._handle_nonfinite(bad)
        finally:
            self._end_step()
        return loss

    def _begin_step(self) -> Sequence[Any]:
        """What the step starts with, before it reads gradients; returns the work done ahead of
        it that :meth:`_apply_updates` takes (here: the buckets orthogonalized in backward)."""
        engine = self._backward_ns
        return [] if engine is None else engine.collect()

    def _end_step(self) -> None:
        """What every step ends with, whether it updated, skipped or raised."""
        if self._backward_ns is not None:
            self._backward_ns.reset()
        clear_workspaces()  # NS scratch is not held through the next forward/backward

    def _capturable_step(self) -> None:
        """:meth:`step` without a host sync: the non-finite check is a device flag that gates
        the update's scalars (see :mod:`muonscale.capturable`)."""
        record = self.nonfinite_steps
        record.raise_recorded(self.nonfinite, wait=False)  # only a record already on the host
        grads = self._step_gradients()
        step_ok = record.gate(self.param_groups, grads, self._name, self.nonfinite)
        if self.step_metrics is not None:
            self._count_step(self.step_metrics, grads, ran=True)
            self.step_metrics.gate(step_ok)
        try:
            self._apply_updates(grads, step_ok=step_ok)
        finally:
            clear_workspaces()
        record.publish()

    def _apply_updates(
        self,
        grads: Mapping[int, torch.Tensor],
        from_backward: Sequence[Any] = (),
        step_ok: torch.Tensor | None = None,
    ) -> None:
        """The update phase of :meth:`step`, after ``grads`` (of :meth:`_step_gradients`) were
        checked: ``from_backward``, the buckets orthogonalized during backward (of
        :meth:`_begin_step`); ``step_ok``, a capturable step's device flag."""
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
        last pass, instead of :func:`~muonscale.matrix_step.apply_updates_by_rule_`
        (:func:`muonscale.functional.muon`)."""
        if not params:
            return
        metrics = self.__dict__.get("step_metrics")
        if group["algorithm"] != "muon":
            states = [self._init_state(p, group) for p in params]
            adamw_group_step(
                group,
                params,
                grads,
                states,
                capturable=self.capturable,
                step_ok=step_ok,
                max_chunk_bytes=self.memory.update_chunk_bytes,
            )
            if metrics is not None:
                kept = [s for p, s in zip(params, states) if self._counts_update(p)]
                metrics.record_adamw(self._group_label(group), group, kept)
            return
        settings = MuonSettings.from_group(group)
        states = [self._init_state(p, group, settings) for p in params]
        params, grads, states = nonempty(params, grads, states)
        if not params:
            return
        timed = contextlib.nullcontext()
        if metrics is not None:  # the updates' squares and a sample pass through the apply
            apply_updates = metrics.metered_apply(
                self._group_label(group),
                apply_updates or apply_updates_by_rule_,
                (lambda p: self._matrix_view(p, group)) if settings.normalize == "none" else None,
            )
            timed = metrics.timed(params[0].device)
        with timed:
            muon_group_step(
                group,
                settings,
                params,
                grads,
                states,
                self._stacked_momentum(group, params, states),
                [self._matrix_view(p, group) for p in params],
                capturable=self.capturable,
                step_ok=step_ok,
                memory=self.memory,
                elementwise_backend=self.elementwise_backend,
                apply_updates=apply_updates,
            )
