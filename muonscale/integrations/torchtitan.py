"""torchtitan: ``muonscale`` as the optimizer ``"MuonScale"`` of a torchtitan ``Trainer``.

One line (in a torchtitan config)::

    optimizer=muonscale_optimizers(lr=0.02, adamw_lr=3e-4)

which is :class:`MuonScaleOptimizersContainer` with one ``ParamGroupConfig`` matching every
parameter. torchtitan hands each optimizer factory param groups with canonical FQNs in
``param_names``; the factory here, for each model part (pipeline stage):

* routes by those names and by module type (embeddings, ``lm_head``, norms, biases → AdamW,
  hidden matrices → Muon), keeping ``param_names`` aligned with ``params`` in every routed
  group, so torchtitan's flat, FQN-keyed optimizer state dict saves and loads;
* orthogonalizes the Q, K and V blocks of each ``FusedQKVLinear.wqkv`` separately
  (:class:`muonscale.QKVLayout`; rows are ``[n_kv_heads, heads_per_kv + 2, head_dim]``);
* treats stacked MoE expert weights (E, F, D) as E matrices (the expert view of
  ``GroupedExperts``, :mod:`muonscale.experts`), and keeps the router on Muon with its reason
  (*Mixture of experts* in the docs);
* builds :class:`muonscale.DTensorMuon` for FSDP2 / tensor-parallel (DTensor) parameters, on
  the process group of their device mesh (the stage's data-parallel group under pipeline
  parallelism), and :class:`muonscale.Muon` for plain ones (single process, or replicas whose
  gradients the data-parallel wrapper already averaged).

Step metrics (what Muon did each step: :mod:`muonscale.step_metrics`) in torchtitan's metrics
output (TensorBoard, W&B): ``metrics=MuonScaleMetricsProcessor.Config(...)`` in the config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.tools.logging import logger

from ..experts import find_experts
from ..optimizer import Muon
from ..params import RouteDecision, route
from ..qkv import QKVLayout
from ..settings import PLAIN_MUON

__all__ = [
    "OPTIMIZER_NAME",
    "MuonScaleMetricsProcessor",
    "MuonScaleOptimizersContainer",
    "build_muonscale",
    "fused_qkv_layouts",
    "muonscale_optimizers",
]

OPTIMIZER_NAME = "MuonScale"
"""The ``optimizer_name`` of a ``ParamGroupConfig`` that this container builds with muonscale."""

_IMPLEMENTATION_KEYS = ("fused", "foreach")  # torchtitan's per-group AdamW switches


def fused_qkv_layouts(model: nn.Module) -> dict[str, QKVLayout]:
    """``{canonical FQN of wqkv.weight: QKVLayout}`` for every torchtitan ``FusedQKVLinear``
    (or subclass) in ``model``."""
    from torchtitan.models.common.attention import FusedQKVLinear

    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, FusedQKVLinear):
            continue
        weight = module.wqkv.weight
        rows_per_group = module.r_dim * module.head_dim
        if weight.shape[0] % rows_per_group:
            raise ValueError(
                f"{name}.wqkv.weight has {weight.shape[0]} rows, not a multiple of "
                f"(heads_per_kv + 2) * head_dim = {rows_per_group}"
            )
        out[canonical_fqn(f"{name}.wqkv.weight" if name else "wqkv.weight")] = QKVLayout(
            n_query_groups=weight.shape[0] // rows_per_group,
            q_per_group=module.heads_per_kv,
            head_dim=module.head_dim,
        )
    return out


def _shared_options(param_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``optimizer_kwargs`` of the MuonScale param groups: muonscale routes inside one
    optimizer, so every MuonScale ``ParamGroupConfig`` must give the same ones."""
    options = None
    for group in param_groups:
        mine = {
            k: v
            for k, v in group.items()
            if k not in ("params", "param_names", *_IMPLEMENTATION_KEYS)
        }
        if options is None:
            options = mine
        elif mine != options:
            raise ValueError(
                f"{OPTIMIZER_NAME}: all param groups of optimizer_name={OPTIMIZER_NAME!r} must "
                f"have the same optimizer_kwargs (muonscale routes Muon/AdamW itself; use its "
                f"'rules' option to steer parameters), got {options} and {mine}"
            )
    return options or {}


def _owning_part(model_parts: Sequence[nn.Module], params: list[torch.Tensor]) -> nn.Module:
    ids = {id(p) for p in params}
    for part in model_parts:
        if any(id(p) in ids for p in part.parameters()):
            return part
    raise ValueError(f"{OPTIMIZER_NAME}: the param groups belong to none of the model parts")


def _mesh_process_group(params: list[torch.Tensor]) -> dist.ProcessGroup | None:
    """The process group spanning the device mesh of the DTensor parameters: the mesh's own
    group for a 1-D mesh, the world when the meshes cover every rank."""
    from torch.distributed.tensor import DTensor

    meshes = {p.device_mesh for p in params if isinstance(p, DTensor)}
    if len(meshes) == 1:
        (mesh,) = meshes
        if mesh.ndim == 1:
            return mesh.get_group()
    ranks = {tuple(sorted(m.mesh.flatten().tolist())) for m in meshes}
    if len(ranks) == 1 and next(iter(ranks)) == tuple(range(dist.get_world_size())):
        return None
    raise ValueError(
        f"{OPTIMIZER_NAME}: the DTensor parameters live on meshes over ranks {sorted(ranks)}; "
        "pass the process group spanning them as optimizer_factory_kwargs_by_name="
        f"{{{OPTIMIZER_NAME!r}: {{'process_group': ...}}}}"
    )


def _refuse_local_shards(named: list[tuple[str, torch.Tensor]]) -> None:
    """torchtitan's ``spmd_backend="spmd_types"`` keeps tensor-parallel parameters as plain
    tensors holding the local shard (the sharding is a ``PartitionSpec`` attribute): Newton–Schulz
    on such a shard is not Muon's update, so refuse them rather than orthogonalize shards."""
    for name, p in named:
        spec = getattr(p, "_partition_spec", None)  # spmd_types.runtime.get_partition_spec
        if spec is not None and any(entry is not None for entry in spec):
            raise ValueError(
                f"{OPTIMIZER_NAME}: parameter {name!r} is a plain tensor holding a local shard "
                f"(spmd_types PartitionSpec {spec!r}); muonscale needs the sharding as DTensors: "
                "set parallelism.spmd_backend='partial_dtensor', which makes them DTensors"
            )


def build_muonscale(
    param_groups: Sequence[dict[str, Any]],
    *,
    model_parts: Sequence[nn.Module],
    process_group: dist.ProcessGroup | None = None,
    split_fused_qkv: bool = True,
) -> Muon:
    """The ``"MuonScale"`` optimizer factory: one muonscale optimizer over torchtitan's param
    groups of one model part (see the module docstring).

    ``param_groups`` are torchtitan's (``params``, ``param_names`` and the ``optimizer_kwargs``,
    which are :class:`muonscale.Muon`'s keyword arguments). ``process_group`` overrides the
    group read from the DTensor meshes; ``split_fused_qkv=False`` orthogonalizes ``wqkv`` whole.
    """
    from torch.distributed.tensor import DTensor

    param_groups = list(param_groups)
    options = _shared_options(param_groups)
    named: list[tuple[str, torch.Tensor]] = []
    for group in param_groups:
        names = group.get("param_names")
        if names is None or len(names) != len(group["params"]):
            raise ValueError(
                f"{OPTIMIZER_NAME}: each param group needs 'param_names', one per param"
            )
        named.extend(zip(names, group["params"]))
    _refuse_local_shards(named)
    params = [p for _, p in named]
    part = _owning_part(model_parts, params)

    # Route by module type and name on the model part, keyed by canonical FQN.
    raw = route(part, options.get("rules"))
    by_id = {id(p): raw[raw_name] for raw_name, p in part.named_parameters()}
    decisions: dict[str, RouteDecision] = {n: by_id[id(p)] for n, p in named}
    groups = [
        {"params": [(n, p) for n, p in named if decisions[n].algorithm == a], "algorithm": a}
        for a in ("muon", "adamw")
    ]
    groups = [g for g in groups if g["params"]]

    layouts = find_experts(part).layouts  # stacked experts (E, F, D): E matrices
    by_id_layout = {id(p): layouts[n] for n, p in part.named_parameters() if n in layouts}
    options.setdefault(
        "experts", {n: by_id_layout[id(p)] for n, p in named if id(p) in by_id_layout}
    )
    if split_fused_qkv and "splits" not in options:
        options["splits"] = {
            n: layout
            for n, layout in fused_qkv_layouts(part).items()
            if n in decisions and decisions[n].algorithm == "muon"
        }
    if any(isinstance(p, DTensor) for p in params):
        from ..distributed import distributed_muon

        if process_group is None:
            process_group = _mesh_process_group(params)
        optimizer = distributed_muon(groups, process_group=process_group, **options)
    else:
        if process_group is not None:
            raise ValueError(
                f"{OPTIMIZER_NAME}: process_group applies to DTensor (FSDP2 / TP) parameters; "
                "these are plain tensors (their data-parallel wrapper reduces gradients)"
            )
        optimizer = Muon(groups, **options)
    for name, decision in decisions.items():  # keep the reasons in opt.summary()
        optimizer.routing[name] = decision
    return optimizer


class MuonScaleOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also knows ``optimizer_name="MuonScale"``:
    one muonscale optimizer per model part (pipeline stage), built by :func:`build_muonscale`.
    Other names (``"AdamW"``, ...) are torchtitan's. State dicts are torchtitan's flat,
    FQN-keyed ones, so DCP saves them sharded and loads them onto another mesh."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., torch.optim.Optimizer]:
        if name == OPTIMIZER_NAME:

            def factory(param_groups: Sequence[dict[str, Any]], **kwargs: Any) -> Muon:
                return build_muonscale(param_groups, model_parts=self.model_parts, **kwargs)

            return factory
        return OptimizersContainer._resolve_optimizer_factory(name)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torchtitan's, reading a missing ``param_groups.<fqn>.state_precision`` as the
        default: :meth:`Muon.state_dict` writes the key only where it is not the default, and
        torchtitan looks up every key of each live group."""
        state_dict = dict(state_dict)
        for optimizer in self.optimizers:
            if not isinstance(optimizer, Muon):
                continue
            for group in optimizer.param_groups:
                for fqn in group.get("param_names", ())[:1]:  # torchtitan reads the first
                    key = f"param_groups.{fqn}.state_precision"
                    state_dict.setdefault(key, PLAIN_MUON.state_precision)
        super().load_state_dict(state_dict)

    def _log_optimizer(
        self, optimizer: torch.optim.Optimizer, part_idx: int, patterns: list[str]
    ) -> None:
        if not isinstance(optimizer, Muon):
            return super()._log_optimizer(optimizer, part_idx, patterns)
        logger.info(
            f"Optimizer {type(optimizer).__name__} (model_part={part_idx}) [{', '.join(patterns)}]"
            f"\n{optimizer.summary()}"
        )


def muonscale_optimizers(
    *, pattern: str = ".*", factory_kwargs: dict[str, Any] | None = None, **muon_kwargs: Any
) -> MuonScaleOptimizersContainer.Config:
    """Config of a :class:`MuonScaleOptimizersContainer` giving every parameter matching
    ``pattern`` to muonscale (``muon_kwargs``: :class:`muonscale.Muon`'s keyword arguments);
    ``factory_kwargs``: :func:`build_muonscale`'s (``process_group``, ``split_fused_qkv``)."""
    return MuonScaleOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=pattern, optimizer_name=OPTIMIZER_NAME, optimizer_kwargs=muon_kwargs
            )
        ],
        implementation="for-loop",
        optimizer_factory_kwargs_by_name={OPTIMIZER_NAME: dict(factory_kwargs or {})},
    )


class MuonScaleMetricsProcessor(MetricsProcessor):
    """torchtitan's ``MetricsProcessor`` that adds the step metrics of the muonscale optimizers
    (:mod:`muonscale.step_metrics`) to each log, as ``extra_metrics``: every logger torchtitan
    writes gets them. Metrics are enabled when the trainer hands the processor its
    optimizers, and read (one host sync, one collective over each optimizer's ranks: every rank
    logs) only at torchtitan's logging steps. With several model parts on a rank, each part's
    names carry ``part<k>/`` after the prefix."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        step_metrics_timing: bool = False
        """Also time the Muon update (:class:`muonscale.step_metrics.StepMetrics`)."""

    @property
    def optimizers(self) -> OptimizersContainer | None:
        return self.__dict__.get("_optimizers")

    @optimizers.setter
    def optimizers(self, container: OptimizersContainer | None) -> None:
        self.__dict__["_optimizers"] = container
        for optimizer in self._muonscale_optimizers():
            optimizer.enable_step_metrics(timing=self.config.step_metrics_timing)

    def _muonscale_optimizers(self) -> list[Muon]:
        container = self.optimizers
        inner = [] if container is None else getattr(container, "optimizers", [])
        return [o for o in inner if isinstance(o, Muon)]

    def step_metrics(self) -> dict[str, float]:
        """The step metrics of every muonscale optimizer on this rank (collective)."""
        optimizers = self._muonscale_optimizers()
        figures: dict[str, float] = {}
        for k, optimizer in enumerate(optimizers):
            metrics = optimizer.step_metrics
            if metrics is None or not metrics.steps:
                continue
            for name, value in optimizer.read_step_metrics(across_ranks=True).items():
                if len(optimizers) > 1:
                    name = f"{metrics.prefix}part{k}/{name[len(metrics.prefix) :]}"
                figures[name] = value
        return figures

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        extra = {**(extra_metrics or {}), **self.step_metrics()}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
