"""Which Megatron-Core parameter goes to Muon or AdamW, over which process groups."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from muonscale.params import ROUTER_REASON, route_one
from muonscale.qkv import QKVLayout


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
                    "call parallel_state.initialize_model_parallel(...) first, "
                    "or pass pg_collection"
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
    pipeline_copy: bool = False
    """Megatron's ``shared`` flag: the tied embedding's copy on the last pipeline stage (its
    gradient is the first stage's, so global gradient norms count it once, as Megatron does)."""
    partition_stride: int = 1
    """Megatron's ``partition_stride`` of a sharded parameter: the dimension is split into
    ``tp_size · partition_stride`` chunks, rank r holding chunks r, r + tp_size, …"""


def _strip_wrappers(name: str) -> str:
    """``module.module.decoder...`` (Megatron DDP around Float16Module) → ``decoder...``."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


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
            name = prefix + _strip_wrappers(raw_name)
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
                or route_one(_strip_wrappers(raw_name), p).algorithm == "adamw"
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
                    f"{name}: legacy GroupedMLP stores all experts in one matrix; "
                    "use SequentialMLP or TEGroupedMLP (one weight per expert)"
                )
            elif raw_name.endswith("router.weight"):  # (E, D): replicated, never TP-sharded
                algorithm, reason = "muon", ROUTER_REASON.format(n=p.shape[0])
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
                ParamPlan(
                    name,
                    p,
                    algorithm,
                    reason,
                    expert,
                    tp_size,
                    partition_dim,
                    layout,
                    pipeline_copy=bool(getattr(p, "shared", False)),
                    partition_stride=int(getattr(p, "partition_stride", 1)) if sharded else 1,
                )
            )
    if not plans:
        raise ValueError("megatron_muon: the model chunks have no trainable parameters")
    return plans
