"""Muon for Megatron-Core model chunks, exact under tensor parallelism.

    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model = GPTModel(...)                                   # Megatron-Core model chunk(s)
    opt = megatron_muon([model], MegatronMuonConfig(lr=3e-4, weight_decay=0.1))
    loss.backward(); opt.step(); opt.zero_grad()

Which parameter goes where (printed by ``opt.summary()``):

* ``is_embedding_or_output_parameter`` / ``shared_embedding`` / ``is_embedding_parameter``
  (Megatron's own flags, set by ``LanguageModule``), and every 0/1-D tensor → AdamW;
* learned position embeddings (an ``nn.Embedding`` without those flags) → AdamW;
* every other 2-D weight → Muon. ``linear_qkv.weight`` is orthogonalized as separate Q, K and
  V matrices (``muon_split_qkv``, by query group as laid out by Megatron, see
  :class:`muonscale.QKVLayout`) or one matrix per head (``qkv_split="head"``);
* expert weights (``allreduce=False``, or named ``...experts...`` as Megatron's optimizer tags
  ``expert_tp``): their TP group is the expert-tensor group, their data-parallel group the
  expert-data group.

One step on a TP group of T ranks (a *piece* is what a rank holds of one matrix)::

    G  ─(mean over the data-parallel group, unless Megatron's DDP already reduced main_grad)─▶
    B ← B.lerp(G, 1 − μ);  U = G.lerp(B, μ) or B          # per piece: elementwise
    U pieces ──all-to-all──▶ owner rank of each matrix: U = cat(pieces, partition_dim)
    owner:  O = NS(U)       (each whole matrix on exactly one TP rank, batched by shape)
    O ──all-to-all──▶ pieces;  W ← W (1 − η λ) − η s(m, n) O_piece

So the update does not depend on the TP layout (``muon_tp_mode="exact"``, the default): a model
trained at TP = 2 ends where it ends at TP = 1. Megatron's own default (``--muon-tp-mode
blockwise``) runs Newton–Schulz on each rank's shard instead, which is a different, layout
dependent update; here it is available only by its name, ``"approximate_blockwise"``.

Data parallel (``dp_mode``): ``"zero1"`` is :class:`muonscale.DistributedMuon` on Megatron's DP
group (reduce-scatter to owner ranks, each matrix updated by one DP rank and its TP group,
ZeRO-1 AdamW, all-gather); ``"replicated"``: every DP replica runs the same deterministic step
on gradients reduced by Megatron's DDP (``main_grad``) or by one all-reduce here. The TP
all-to-alls use :class:`muonscale.distributed.sharded.ShardedMatrices`; every byte is counted
by :mod:`muonscale.distributed.comm` (``opt.last_step_wire_bytes`` / ``_breakdown``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muonscale import functional
from muonscale.distributed.comm import Communicator, WireCounter
from muonscale.distributed.data_parallel import DistributedMuon
from muonscale.distributed.sharded import MatrixLayout, ShardedMatrices
from muonscale.newton_schulz import COEFFICIENT_PRESETS, Coefficients
from muonscale.optimizer import Muon
from muonscale.params import RouteDecision, route_one
from muonscale.qkv import QKV_SPLIT_MODES, QKVLayout
from muonscale.scaling import SCALE_RULES, update_scale

__all__ = [
    "DP_MODES",
    "MEGATRON_FLAGS",
    "MegatronDistributedMuon",
    "MegatronGroups",
    "MegatronMuon",
    "MegatronMuonConfig",
    "ParamPlan",
    "TP_MODES",
    "megatron_coefficients",
    "megatron_muon",
    "plan_parameters",
]

TP_MODES = ("exact", "approximate_blockwise")
"""``"exact"``: every TP-sharded matrix is orthogonalized whole (at one owner rank).
``"approximate_blockwise"``: each rank orthogonalizes its own shard (Megatron's ``blockwise``)."""

DP_MODES = ("auto", "zero1", "replicated")

# Megatron-Core --muon-scale-mode → muonscale ``scale`` rule. Same formulas, different names:
# emerging_optimizers 0.3.0 orthogonalized_optimizers/muon.py, get_muon_scale_factor (L136).
MEGATRON_SCALE_MODES = {
    "spectral": "unit_rms",  # √max(m, n)
    "unit_rms_norm": "spectral",  # √(m/n)
    "shape_scaling": "shape",  # √max(1, m/n)
}

# Megatron-Core --muon-coefficient-type → Newton–Schulz coefficients, copied from
# emerging_optimizers 0.3.0 orthogonalized_optimizers/muon_utils.py, _COEFFICIENT_SETS (L30);
# "cycle" / "repeat_last" is how that file walks the list past its end (L197-198).
MEGATRON_COEFFICIENT_SETS: dict[str, tuple[tuple[Coefficients, ...], str]] = {
    "simple": (((3.4445, -4.7750, 2.0315),), "cycle"),
    "quintic": (
        (
            (4.0848, -6.8946, 2.9270),
            (3.9505, -6.3029, 2.6377),
            (3.7418, -5.5913, 2.3037),
            (2.8769, -3.1427, 1.2046),
            (2.8366, -3.0525, 1.2012),
        ),
        "cycle",
    ),
    "polar_express": (
        (
            (8.2051, -22.9019, 16.4607),
            (4.0664, -2.8612, 0.5184),
            (3.9096, -2.8234, 0.5250),
            (3.2856, -2.4153, 0.4853),
            (2.2779, -1.6198, 0.3985),
            (1.8726, -1.2307, 0.3585),
            (1.8564, -1.2132, 0.3568),
            (1.8750, -1.2500, 0.3750),
        ),
        "repeat_last",
    ),
}

# Megatron's fp32 matmul precision → the dtype the iteration runs in (emerging_optimizers
# casts to bfloat16 when the precision is "medium": muon_utils.py L203-213).
MEGATRON_MATMUL_PRECISION = {
    "low": torch.bfloat16,
    "medium": torch.bfloat16,
    "high": torch.float32,
    "highest": torch.float32,
}

MEGATRON_FLAGS: dict[str, tuple[str, str]] = {
    # Megatron OptimizerConfig field → (muonscale MegatronMuonConfig field, how it maps)
    "muon_momentum": ("muon_momentum", "same"),
    "muon_nesterov": ("muon_nesterov", "same"),
    "muon_split_qkv": ("muon_split_qkv", "same"),
    "muon_num_ns_steps": ("muon_num_ns_steps", "same"),
    "muon_extra_scale_factor": ("muon_extra_scale_factor", "same"),
    "muon_tp_mode": (
        "muon_tp_mode",
        "duplicated/distributed → exact; blockwise → exact unless approximate_blockwise is asked by name",
    ),
    "muon_scale_mode": (
        "scale",
        "renamed: spectral → unit_rms, unit_rms_norm → spectral, shape_scaling → shape",
    ),
    "muon_coefficient_type": ("coefficients", "megatron_coefficients(name, steps)"),
    "muon_fp32_matmul_prec": ("ns_dtype", "medium/low → bfloat16, high → float32"),
    "lr": ("lr", "same"),
    "weight_decay": ("weight_decay", "same (decoupled)"),
    "adam_beta1": ("adam_beta1", "same"),
    "adam_beta2": ("adam_beta2", "same"),
    "adam_eps": ("adam_eps", "same"),
}
"""How :meth:`MegatronMuonConfig.from_megatron` reads Megatron's ``OptimizerConfig``."""


def megatron_coefficients(coefficient_type: str, steps: int) -> list[Coefficients]:
    """The ``steps`` (a, b, c) tuples Megatron's ``--muon-coefficient-type`` uses, walked the way
    emerging_optimizers walks them. Types other than simple / quintic / polar_express are read
    from an installed ``emerging_optimizers``."""
    if coefficient_type in MEGATRON_COEFFICIENT_SETS:
        table, mode = MEGATRON_COEFFICIENT_SETS[coefficient_type]
    else:
        try:
            from emerging_optimizers.orthogonalized_optimizers import muon_utils
        except ImportError:
            raise ValueError(
                f"muon_coefficient_type {coefficient_type!r}: known without emerging_optimizers: "
                f"{sorted(MEGATRON_COEFFICIENT_SETS)}"
            ) from None
        sets = getattr(muon_utils, "_COEFFICIENT_SETS", {})
        if coefficient_type not in sets:
            raise ValueError(f"muon_coefficient_type {coefficient_type!r} not in {sorted(sets)}")
        table = tuple(tuple(t) for t in sets[coefficient_type])
        mode = (
            "repeat_last"
            if coefficient_type in ("polar_express", "cans", "deepseekv4")
            else "cycle"
        )
    if mode == "cycle":
        return [tuple(table[i % len(table)]) for i in range(steps)]
    return [tuple(table[min(i, len(table) - 1)]) for i in range(steps)]


@dataclass(frozen=True, kw_only=True)
class MegatronMuonConfig:
    """Options of :func:`megatron_muon`. ``muon_*`` fields mean what Megatron's flag of the same
    name means; defaults are muonscale's (see docs/megatron.md for where they differ)."""

    lr: float = 1e-3
    """Learning rate of the Muon half (and of AdamW unless ``adam_lr`` is set)."""
    weight_decay: float = 0.0
    """Decoupled weight decay λ (Muon matrices and ≥ 2-D AdamW tensors; norms/biases get none)."""
    muon_momentum: float = 0.95
    """μ of the EMA momentum (Megatron config 0.95, Megatron CLI default 0.9)."""
    muon_nesterov: bool = True
    """Nesterov momentum (Megatron default False)."""
    muon_split_qkv: bool = True
    """Orthogonalize ``linear_qkv.weight`` as separate matrices (see ``qkv_split``)."""
    qkv_split: str = "qkv"
    """``"qkv"``: Q, K, V blocks (as Megatron's split); ``"head"``: one matrix per head."""
    scale: str = "match_rms_adamw"
    """Update scale rule (:mod:`muonscale.scaling`); Megatron's "spectral" is ``"unit_rms"``."""
    muon_extra_scale_factor: float = 1.0
    """Extra factor on every Muon update, as Megatron's."""
    muon_num_ns_steps: int = 5
    """Newton–Schulz steps."""
    coefficients: str | Coefficients | Sequence[Coefficients] = "keller"
    """muonscale preset or tuples; :func:`megatron_coefficients` translates Megatron's names."""
    ns_dtype: torch.dtype | None = None
    """dtype of the iteration; None → bfloat16 on CUDA, float32 on CPU."""
    muon_tp_mode: str = "exact"
    """``"exact"`` or ``"approximate_blockwise"`` (:data:`TP_MODES`)."""
    adam_lr: float | None = None
    """lr of the AdamW half; None → ``lr`` (allowed only with ``scale="match_rms_adamw"``)."""
    adam_beta1: float = 0.9
    """AdamW β₁."""
    adam_beta2: float = 0.95
    """AdamW β₂ (Megatron default 0.999)."""
    adam_eps: float = 1e-8
    """AdamW ε."""
    adam_weight_decay: float | None = None
    """λ of the AdamW half; None → ``weight_decay`` for ≥ 2-D tensors, 0 for norms and biases."""
    grads_reduced: bool | None = None
    """Whether gradients arrive already averaged over the data-parallel group. None → True when
    parameters carry Megatron DDP's ``main_grad``, else the optimizer averages ``.grad`` itself."""
    nonfinite: str = "raise"
    """``"raise"`` / ``"skip"`` / ``"ignore"`` a step with a NaN/inf gradient (see Muon)."""
    dp_mode: str = "auto"
    """``"zero1"``: :class:`muonscale.DistributedMuon` over Megatron's DP group (reduce-scatter
    to owners, ZeRO-1); ``"replicated"``: every DP replica runs the step; ``"auto"``: zero1
    unless Megatron's DDP reduces the gradients, or expert / pipeline parallelism is used."""

    def __post_init__(self) -> None:
        if self.muon_tp_mode not in TP_MODES:
            hint = ""
            if self.muon_tp_mode in ("duplicated", "distributed"):
                hint = " (Megatron's exact modes; muonscale's exact mode is 'exact')"
            elif self.muon_tp_mode == "blockwise":
                hint = " (per-shard Newton–Schulz is approximate: ask for 'approximate_blockwise')"
            raise ValueError(
                f"muon_tp_mode must be one of {TP_MODES}, got {self.muon_tp_mode!r}{hint}"
            )
        if self.dp_mode not in DP_MODES:
            raise ValueError(f"dp_mode must be one of {DP_MODES}, got {self.dp_mode!r}")
        if self.qkv_split not in QKV_SPLIT_MODES:
            raise ValueError(f"qkv_split must be one of {QKV_SPLIT_MODES}, got {self.qkv_split!r}")
        if self.scale not in SCALE_RULES:
            hint = ""
            if self.scale in MEGATRON_SCALE_MODES:
                hint = f"; Megatron's {self.scale!r} is muonscale's {MEGATRON_SCALE_MODES[self.scale]!r}"
            raise ValueError(f"scale must be one of {SCALE_RULES}, got {self.scale!r}{hint}")
        if isinstance(self.coefficients, str) and self.coefficients not in COEFFICIENT_PRESETS:
            raise ValueError(
                f"coefficients {self.coefficients!r} is not a muonscale preset {sorted(COEFFICIENT_PRESETS)}; "
                "for Megatron's --muon-coefficient-type use megatron_coefficients(name, steps)"
            )

    @classmethod
    def from_megatron(cls, optimizer_config: Any, **overrides: Any) -> MegatronMuonConfig:
        """Read the ``muon_*``, ``lr``, ``weight_decay`` and ``adam_*`` fields of Megatron's
        ``OptimizerConfig`` (see :data:`MEGATRON_FLAGS`). ``muon_tp_mode`` is always exact
        unless ``overrides`` says ``muon_tp_mode="approximate_blockwise"``."""
        c = optimizer_config
        if not getattr(c, "decoupled_weight_decay", True):
            raise ValueError("decoupled_weight_decay=False (L2 weight decay) is not supported")
        steps = int(getattr(c, "muon_num_ns_steps", 5))
        values: dict[str, Any] = dict(
            lr=float(c.lr) if getattr(c, "lr", None) is not None else 1e-3,
            weight_decay=float(getattr(c, "weight_decay", 0.0)),
            muon_momentum=float(c.muon_momentum),
            muon_nesterov=bool(c.muon_nesterov),
            muon_split_qkv=bool(c.muon_split_qkv),
            muon_num_ns_steps=steps,
            muon_extra_scale_factor=float(getattr(c, "muon_extra_scale_factor", 1.0)),
            scale=MEGATRON_SCALE_MODES[c.muon_scale_mode],
            coefficients=megatron_coefficients(c.muon_coefficient_type, steps),
            ns_dtype=MEGATRON_MATMUL_PRECISION[getattr(c, "muon_fp32_matmul_prec", "medium")],
            muon_tp_mode="exact",
            adam_beta1=float(c.adam_beta1),
            adam_beta2=float(c.adam_beta2),
            adam_eps=float(c.adam_eps),
        )
        if values["scale"] != "match_rms_adamw":
            values["adam_lr"] = values["lr"]  # Megatron uses one lr for both halves
        values.update(overrides)
        return cls(**values)


# --------------------------------------------------------------------------- process groups
@dataclass(frozen=True)
class MegatronGroups:
    """The process groups the optimizer needs (``None`` = a single rank / no distributed)."""

    tp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    """Dense data-parallel group, including context parallel (Megatron's ``dp_cp``)."""
    expt_tp: dist.ProcessGroup | None
    expt_dp: dist.ProcessGroup | None
    pp_size: int = 1

    @staticmethod
    def from_megatron(pg_collection: Any = None) -> MegatronGroups:
        """From a ``ProcessGroupCollection``, else from ``parallel_state``."""
        if not (dist.is_available() and dist.is_initialized()):
            return MegatronGroups(None, None, None, None)
        if pg_collection is None:
            from megatron.core import parallel_state as ps

            if not ps.model_parallel_is_initialized():
                raise RuntimeError(
                    "call parallel_state.initialize_model_parallel(...) first, or pass pg_collection"
                )
            return MegatronGroups(
                tp=ps.get_tensor_model_parallel_group(),
                dp=ps.get_data_parallel_group(with_context_parallel=True),
                expt_tp=ps.get_expert_tensor_parallel_group(check_initialized=False),
                expt_dp=ps.get_expert_data_parallel_group(check_initialized=False),
                pp_size=ps.get_pipeline_model_parallel_world_size(),
            )

        def get(name: str) -> dist.ProcessGroup | None:
            return getattr(pg_collection, name, None) if hasattr(pg_collection, name) else None

        pp = get("pp")
        return MegatronGroups(
            tp=get("tp"),
            dp=get("dp_cp") or get("dp"),
            expt_tp=get("expt_tp"),
            expt_dp=get("expt_dp"),
            pp_size=dist.get_world_size(pp) if pp is not None else 1,
        )

    @staticmethod
    def size(group: dist.ProcessGroup | None) -> int:
        return dist.get_world_size(group) if group is not None else 1


# --------------------------------------------------------------------------- parameter plan
@dataclass(frozen=True)
class ParamPlan:
    """How one Megatron parameter is optimized."""

    name: str
    param: torch.Tensor
    algorithm: str
    reason: str
    expert: bool
    """An expert weight (see :func:`_is_expert`): expert-tensor / expert-data groups."""
    tp_size: int
    """Size of the TP group the parameter is sharded over (1 when it is not sharded)."""
    partition_dim: int | None
    """Dim sharded across that group (Megatron's ``partition_dim``), None when not sharded."""
    qkv_layout: QKVLayout | None = None
    """Layout of this rank's piece of a fused QKV weight (its local query groups)."""


def _is_embedding(param: torch.Tensor) -> str | None:
    for attr in ("is_embedding_or_output_parameter", "shared_embedding", "is_embedding_parameter"):
        if getattr(param, attr, False):
            return attr
    return None


def _is_expert(name: str, param: torch.Tensor) -> bool:
    """An expert weight: ``allreduce=False`` (expert-data-parallel gradients), or named like
    one, as Megatron's optimizer tags ``expert_tp`` (optimizer/__init__.py L784: 'experts' in
    the name, not 'shared'). Megatron-Core 0.19 leaves ``allreduce=True`` on expert weights
    when EP = 1 and ETP != TP, yet shards them over the expert-tensor group."""
    if not getattr(param, "allreduce", True) or getattr(param, "expert_tp", False):
        return True
    return "experts" in name and "shared" not in name


def _check_model_config(config: Any, split_qkv: bool) -> None:
    if config is None:
        return
    if getattr(config, "multi_latent_attention", False):
        raise NotImplementedError(
            "muonscale.integrations.megatron: multi-latent attention (MLA) is not supported "
            "(its down/up projections need their own split rules)"
        )
    if split_qkv and getattr(config, "attention_output_gate", False):
        raise NotImplementedError(
            "muonscale.integrations.megatron: gated attention (attention_output_gate=True) with "
            "muon_split_qkv is not supported; pass muon_split_qkv=False"
        )


def _qkv_layout(config: Any, local_rows: int, tp_size: int, name: str) -> QKVLayout:
    heads = int(config.num_attention_heads)
    groups = int(config.num_query_groups or heads)
    head_dim = int(config.kv_channels or config.hidden_size // heads)
    if groups % tp_size:
        raise NotImplementedError(
            f"{name}: num_query_groups={groups} is not a multiple of the TP size {tp_size}, so "
            "query groups straddle ranks; muon_split_qkv needs whole groups per rank "
            "(pass muon_split_qkv=False)"
        )
    layout = QKVLayout(
        n_query_groups=groups // tp_size, q_per_group=heads // groups, head_dim=head_dim
    )
    if layout.rows != local_rows:
        raise ValueError(
            f"{name}: {local_rows} rows on this rank, the QKV layout says {layout.rows} ({layout})"
        )
    return layout


def plan_parameters(
    model_chunks: Sequence[nn.Module] | nn.Module,
    groups: MegatronGroups,
    *,
    split_qkv: bool = True,
) -> list[ParamPlan]:
    """One :class:`ParamPlan` per trainable parameter of every chunk, in order. Names of the
    second and later chunks get a ``chunk{i}.`` prefix."""
    chunks = [model_chunks] if isinstance(model_chunks, nn.Module) else list(model_chunks)
    plans: list[ParamPlan] = []
    seen: set[int] = set()
    for index, chunk in enumerate(chunks):
        config = getattr(chunk, "config", None)
        _check_model_config(config, split_qkv)
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and getattr(ddp_config, "use_distributed_optimizer", False):
            raise NotImplementedError(
                "Megatron DDP with use_distributed_optimizer=True keeps only a shard of each "
                "gradient per rank; wrap the model with use_distributed_optimizer=False"
            )
        prefix = f"chunk{index}." if index else ""
        embedding_ids = {
            id(m.weight) for m in chunk.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
        }
        for raw_name, p in chunk.named_parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            name = prefix + raw_name.removeprefix("module.")
            expert = _is_expert(raw_name, p)
            tp_group = groups.expt_tp if expert else groups.tp
            tp_size = MegatronGroups.size(tp_group)
            sharded = bool(getattr(p, "tensor_model_parallel", False)) and tp_size > 1
            partition_dim = int(getattr(p, "partition_dim", -1)) if sharded else None
            # partition_stride > 1 (GLU's fc1 holds [gate_r; up_r]): the shards concatenated in
            # rank order are a row permutation of the matrix, and NS(P U) = P NS(U), so
            # orthogonalizing the concatenation is still exact.
            if sharded and partition_dim not in (0, 1):
                raise NotImplementedError(f"{name}: TP partition_dim={partition_dim} (need 0 or 1)")
            if not sharded:
                tp_size, partition_dim = 1, None
            flag = _is_embedding(p)
            if flag is not None:
                algorithm, reason = "adamw", f"embedding/output ({flag})"
            elif (
                id(p) in embedding_ids
                or route_one(raw_name, p).algorithm == "adamw"
                and p.ndim == 2
            ):
                # e.g. learned position embeddings: an nn.Embedding without Megatron's flag
                algorithm, reason = (
                    "adamw",
                    "embedding (nn.Embedding or embedding/head module name)",
                )
            elif p.ndim < 2:
                algorithm, reason = "adamw", f"{p.ndim}-D (norm, bias or scalar)"
            elif p.ndim > 2:
                raise NotImplementedError(
                    f"{name}: {p.ndim}-D weight {tuple(p.shape)} (need 2-D matrices)"
                )
            elif expert and raw_name.rsplit(".", 1)[-1] in ("weight1", "weight2"):
                raise NotImplementedError(
                    f"{name}: legacy GroupedMLP stores all experts in one matrix; use SequentialMLP "
                    "or TEGroupedMLP (one weight per expert)"
                )
            else:
                algorithm = "muon"
                reason = "hidden matrix" + (
                    f", TP-sharded on dim {partition_dim} over {tp_size}" if sharded else ""
                )
                if expert:
                    reason += ", expert"
            layout = None
            if algorithm == "muon" and split_qkv and raw_name.endswith("linear_qkv.weight"):
                if sharded and partition_dim != 0:
                    raise NotImplementedError(f"{name}: QKV weight sharded on dim {partition_dim}")
                layout = _qkv_layout(config, p.shape[0], tp_size, name)
                reason += f", QKV split {layout.n_query_groups}x(q{layout.q_per_group},k,v)"
            plans.append(
                ParamPlan(name, p, algorithm, reason, expert, tp_size, partition_dim, layout)
            )
    if not plans:
        raise ValueError("megatron_muon: the model chunks have no trainable parameters")
    return plans


# --------------------------------------------------------------------------- optimizer
def _muon_arguments(
    plans: Sequence[ParamPlan], config: MegatronMuonConfig
) -> tuple[list[dict], dict[str, Any]]:
    """Param groups (routing pinned by the plan) and :class:`muonscale.Muon` options."""
    muon = [(pl.name, pl.param) for pl in plans if pl.algorithm == "muon"]
    adamw = [(pl.name, pl.param) for pl in plans if pl.algorithm == "adamw"]
    param_groups = []
    if muon:
        param_groups.append({"params": muon, "algorithm": "muon"})
    if adamw:
        param_groups.append({"params": adamw, "algorithm": "adamw"})
    options = dict(
        lr=config.lr, momentum=config.muon_momentum, nesterov=config.muon_nesterov,
        weight_decay=config.weight_decay, ns_steps=config.muon_num_ns_steps,
        coefficients=config.coefficients, scale=config.scale, ns_dtype=config.ns_dtype,
        adamw_lr=config.adam_lr, adamw_betas=(config.adam_beta1, config.adam_beta2),
        adamw_eps=config.adam_eps, adamw_weight_decay=config.adam_weight_decay,
        nonfinite=config.nonfinite, qkv_split=config.qkv_split,
        splits={pl.name: pl.qkv_layout for pl in plans if pl.qkv_layout is not None},
    )  # fmt: skip
    return param_groups, options


class _TensorParallelMatrices:
    """Mixin over :class:`muonscale.Muon` (or a subclass): the Muon update of
    :meth:`update_group` orthogonalizes each TP-sharded matrix whole, through one
    :class:`ShardedMatrices` exchange per TP group (dense and expert)."""

    config: MegatronMuonConfig
    groups: MegatronGroups
    plans: list[ParamPlan]

    def _init_megatron(
        self, plans: Sequence[ParamPlan], groups: MegatronGroups, config: MegatronMuonConfig
    ) -> None:
        self.config, self.groups, self.plans = config, groups, list(plans)
        self._plan_by_id = {id(pl.param): pl for pl in self.plans}
        self._exchanges: dict[tuple, ShardedMatrices] = {}

    def _finish_megatron_init(self) -> None:
        self.routing = {pl.name: RouteDecision(pl.algorithm, pl.reason) for pl in self.plans}

    def _tp_wire_counter(self) -> WireCounter:
        comm = getattr(self, "comm", None)  # DistributedMuon counts every collective in comm
        return comm.counter if comm is not None else self.wire_counter

    def _tp_group(self, expert: bool) -> dist.ProcessGroup | None:
        return self.groups.expt_tp if expert else self.groups.tp

    def update_group(
        self, group: Mapping[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor]
    ) -> None:
        if group["algorithm"] != "muon" or not params:
            return super().update_group(group, params, grads)  # type: ignore[misc]
        states = [self.init_state(p, group) for p in params]  # type: ignore[attr-defined]
        directions = functional.momentum_directions_(
            grads,
            [s["momentum_buffer"] for s in states],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
        )
        exact = self.config.muon_tp_mode == "exact"
        # Every matrix joins the exchange of its TP group (dense or expert): a TP piece with its
        # global layout, or a matrix this rank holds whole (replicated layout: computed here).
        batches: dict[bool, list[tuple[torch.Tensor, MatrixLayout]]] = {False: [], True: []}
        slots: list[list[tuple[bool, int, tuple[int, int]]]] = []
        for p, direction in zip(params, directions):
            plan = self._plan_by_id[id(p)]
            kind = plan.expert
            group_size = MegatronGroups.size(self._tp_group(kind))
            # A head of a QKV split lies whole on one rank; Q, K, V blocks are dim-0 pieces.
            sharded = plan.partition_dim is not None and not (
                plan.qkv_layout is not None and self.config.qkv_split == "head"
            )
            entries = []
            for mat in self.matrix_view(p, group).to_matrices(direction):  # type: ignore[attr-defined]
                m, n = mat.shape
                full = (m, n)
                if sharded:
                    full = (
                        (m * plan.tp_size, n) if plan.partition_dim == 0 else (m, n * plan.tp_size)
                    )
                if sharded and exact:
                    sizes = [full[plan.partition_dim] // plan.tp_size] * plan.tp_size
                    layout = MatrixLayout.sharded(full, plan.partition_dim, sizes)
                else:  # whole here, or approximate_blockwise: NS on this rank's piece
                    layout = MatrixLayout.replicated((m, n), group_size)
                entries.append((kind, len(batches[kind]), full))
                batches[kind].append((mat.contiguous(), layout))
            slots.append(entries)

        ns = dict(
            ns_steps=group["ns_steps"],
            coefficients=group["coefficients"],
            ns_dtype=group["ns_dtype"],
            eps=group["ns_eps"],
        )

        def orthogonalize(_indices: list[int], matrices: list[torch.Tensor]) -> list[torch.Tensor]:
            return functional.orthogonalize_matrices(matrices, **ns)

        results: dict[bool, list[torch.Tensor]] = {}
        for kind, items in batches.items():
            if not items:
                continue
            tp_group = self._tp_group(kind)
            if MegatronGroups.size(tp_group) == 1 or all(lay.whole_everywhere for _, lay in items):
                results[kind] = orthogonalize([], [mat for mat, _ in items])
                continue
            key = (kind, tuple((lay.shape, lay.whole_everywhere) for _, lay in items))
            exchange = self._exchanges.get(key)
            if exchange is None:
                exchange = ShardedMatrices(
                    [lay for _, lay in items],
                    group=tp_group,
                    counter=self._tp_wire_counter(),
                    tag="muon_tp",
                )
                self._exchanges[key] = exchange
            results[kind] = exchange.apply([mat for mat, _ in items], orthogonalize)

        # W ← W (1 − η λ) − η s(m, n) O, s from the matrix's *global* shape
        lr, wd = float(group["lr"]), group["weight_decay"]
        extra = self.config.muon_extra_scale_factor
        for p, entries in zip(params, slots):
            scaled = [
                results[kind][slot].to(p.dtype) * (update_scale(group["scale"], *full) * extra)
                for kind, slot, full in entries
            ]
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.add_(self.matrix_view(p, group).from_matrices(scaled).reshape(p.shape), alpha=-lr)  # type: ignore[attr-defined]


class MegatronMuon(_TensorParallelMatrices, Muon):
    """:class:`muonscale.Muon` on Megatron-Core parameters, every data-parallel replica running
    the same step (``dp_mode="replicated"``). Gradients come reduced from Megatron's DDP
    (``main_grad``) or are averaged here with one all-reduce per group. Build with
    :func:`megatron_muon`.

    Attributes:
        plans: one :class:`ParamPlan` per parameter.
        wire_counter: bytes this rank sent, by ``"<tag>/<op>"`` (``"muon_tp"``: the TP
            all-to-alls, ``"grads"``: data-parallel gradient averaging).
        last_step_wire_bytes, last_step_wire_breakdown: the latest step's total and breakdown.
    """

    dp_mode = "replicated"

    def __init__(
        self, plans: Sequence[ParamPlan], groups: MegatronGroups, config: MegatronMuonConfig
    ) -> None:
        self._init_megatron(plans, groups, config)
        self.wire_counter = WireCounter()
        self.last_step_wire_bytes, self.last_step_wire_breakdown = 0, {}
        param_groups, options = _muon_arguments(self.plans, config)
        super().__init__(param_groups, **options)
        self._finish_megatron_init()
        has_main_grad = any(hasattr(pl.param, "main_grad") for pl in self.plans)
        self.grads_reduced = has_main_grad if config.grads_reduced is None else config.grads_reduced
        if not self.grads_reduced:
            _check_self_reduction(self.plans, groups)

    def _gather_grads(self) -> None:
        """Megatron DDP accumulates into ``main_grad``; point ``.grad`` at it (as Megatron's
        FP32Optimizer does) so the rest of the step reads one attribute."""
        for pl in self.plans:
            main_grad = getattr(pl.param, "main_grad", None)
            if main_grad is not None:
                pl.param.grad = (
                    main_grad if main_grad.dtype == pl.param.dtype else main_grad.to(pl.param.dtype)
                )

    def _average_grads(self) -> None:
        """Mean of ``.grad`` over the data-parallel group (dense) and the expert-data group
        (experts), one flat all-reduce per (group, dtype)."""
        buckets: dict[tuple[bool, torch.dtype], list[torch.Tensor]] = {}
        for pl in self.plans:
            if pl.param.grad is not None:
                buckets.setdefault((pl.expert, pl.param.grad.dtype), []).append(pl.param.grad)
        for (expert, _dtype), grads in buckets.items():
            comm = Communicator(
                self.groups.expt_dp if expert else self.groups.dp, counter=self.wire_counter
            )
            if comm.world_size == 1:
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat, tag="grads")
            flat.div_(comm.world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    @torch.no_grad()
    def step(self, closure=None):
        """Average gradients over data parallel (unless already reduced), then one Muon/AdamW
        step; TP-sharded Muon matrices are orthogonalized whole (see the module docstring)."""
        self._gather_grads()
        if not self.grads_reduced:
            self._average_grads()
        try:
            return super().step(closure)
        finally:
            self.last_step_wire_bytes, self.last_step_wire_breakdown = self.wire_counter.take()


class MegatronDistributedMuon(_TensorParallelMatrices, DistributedMuon):
    """:class:`muonscale.DistributedMuon` over Megatron's data-parallel group
    (``dp_mode="zero1"``): gradients reduce-scattered to owner ranks during backward, each Muon
    matrix updated by one DP rank (its TP pieces exchanged exactly within that rank's TP group),
    AdamW sharded ZeRO-1, parameters all-gathered. Do not wrap the model in Megatron's DDP."""

    dp_mode = "zero1"

    def __init__(
        self,
        plans: Sequence[ParamPlan],
        groups: MegatronGroups,
        config: MegatronMuonConfig,
        **dp_options: Any,
    ) -> None:
        self._init_megatron(plans, groups, config)
        param_groups, options = _muon_arguments(self.plans, config)
        super().__init__(param_groups, process_group=groups.dp, **options, **dp_options)
        self._finish_megatron_init()
        self.wire_counter = self.comm.counter


def _check_self_reduction(plans: Sequence[ParamPlan], groups: MegatronGroups) -> None:
    """Refuse layouts whose gradients need more than a data-parallel average."""
    if groups.pp_size > 1:
        raise NotImplementedError(
            "pipeline parallelism without Megatron's gradient reduction: the tied embedding's "
            "gradient crosses stages; wrap the model in Megatron's DDP and call "
            "finalize_model_grads (then the optimizer reads main_grad)"
        )
    for pl in plans:
        if getattr(pl.param, "sequence_parallel", False):
            raise NotImplementedError(
                f"{pl.name}: sequence parallelism without Megatron's gradient reduction (norm "
                "gradients need a TP all-reduce, done by Megatron's finalize_model_grads)"
            )


def megatron_muon(
    model_chunks: Sequence[nn.Module] | nn.Module,
    config: MegatronMuonConfig | None = None,
    *,
    pg_collection: Any = None,
    **overrides: Any,
) -> MegatronMuon | MegatronDistributedMuon:
    """Build the muonscale optimizer for Megatron-Core ``model_chunks``.

    Args:
        model_chunks: a model chunk or the list of them (virtual pipeline); bare, or wrapped in
            Megatron's DDP (``use_distributed_optimizer=False``; then ``dp_mode`` is replicated).
        config: :class:`MegatronMuonConfig` (``MegatronMuonConfig.from_megatron(opt_config)``
            reads Megatron's ``OptimizerConfig``); ``overrides`` replace its fields.
        pg_collection: Megatron's ``ProcessGroupCollection``; None → ``parallel_state``.

    Returns :class:`MegatronDistributedMuon` for ``dp_mode="zero1"`` (``"auto"``: when nothing
    else reduces gradients, and there are no expert or pipeline-parallel layouts), else
    :class:`MegatronMuon`.
    """
    config = config if config is not None else MegatronMuonConfig()
    if overrides:
        unknown = set(overrides) - {f.name for f in fields(MegatronMuonConfig)}
        if unknown:
            raise TypeError(f"megatron_muon: unknown options {sorted(unknown)}")
        config = replace(config, **overrides)
    groups = MegatronGroups.from_megatron(pg_collection)
    plans = plan_parameters(model_chunks, groups, split_qkv=config.muon_split_qkv)
    has_main_grad = any(hasattr(pl.param, "main_grad") for pl in plans)
    zero1_blockers = []
    if has_main_grad or config.grads_reduced:
        zero1_blockers.append("gradients are reduced by Megatron's DDP (main_grad)")
    if any(pl.expert for pl in plans):
        zero1_blockers.append("expert parameters (their data-parallel group differs)")
    if groups.pp_size > 1:
        zero1_blockers.append("pipeline parallelism")
    mode = config.dp_mode
    if mode == "auto":
        mode = "replicated" if zero1_blockers or MegatronGroups.size(groups.dp) == 1 else "zero1"
    if mode == "zero1":
        if zero1_blockers:
            raise NotImplementedError(
                f"dp_mode='zero1' is not supported with: {'; '.join(zero1_blockers)}"
            )
        _check_self_reduction(plans, groups)
        return MegatronDistributedMuon(plans, groups, config)
    return MegatronMuon(plans, groups, config)
