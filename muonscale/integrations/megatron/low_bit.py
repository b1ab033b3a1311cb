"""Which Megatron parameters may keep quantized state (``state_precision`` "int8" / "int4"):
those whose shard on this rank holds whole rows of the state's block matrix (blocks are
segments of a row), so that each rank quantizes exactly as one process does. The others are
refused by name, pointing at ``float_state_params`` (*Low-bit state* in the docs)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .plan import ParamPlan


def cut_rows_reason(plan: ParamPlan) -> str | None:
    """Why ``plan``'s state shard on this rank cuts rows of its block matrix (None: it holds
    whole rows). Muon's momentum is blocked by the rows of its matrix, AdamW's moments by the
    rows of :func:`~muonscale.block_quantization.block_matrix_shape` (a 1-D tensor: one row)."""
    dim = plan.partition_dim
    if plan.algorithm == "muon":
        if dim == 1:  # a ZeRO-1 owner holds the TP piece whole: it cuts what TP cuts
            return "its tensor-parallel shard (partition_dim=1, row-parallel) cuts every row"
        return None
    # ZeRO-1's flat AdamW shards cut blocks too, but DistributedMuon shares each cut block's
    # scale over the ranks holding its pieces: exact, so ZeRO-1 adds no reason.
    if dim is not None and (dim != 0 or plan.param.dim() == 1):
        return f"its tensor-parallel shard (partition_dim={dim}) cuts its rows"
    return None


def refuse_cut_rows(
    plans: Sequence[ParamPlan],
    param_groups: Sequence[Mapping[str, Any]],
    default_precision: str,
) -> None:
    """ValueError naming the first parameter whose quantized state would be cut across ranks
    (``param_groups``: :func:`~.config.muon_arguments`' groups, ``default_precision`` its
    ``state_precision`` option)."""
    precision = {
        id(p): group.get("state_precision", default_precision)
        for group in param_groups
        for _, p in group["params"]
    }
    for plan in plans:
        wanted = precision.get(id(plan.param), "param")
        if wanted == "param":
            continue
        reason = cut_rows_reason(plan)
        if reason is not None:
            suggestion = f"({'*.' + '.'.join(plan.name.split('.')[-2:])!r},)"
            raise ValueError(
                f"parameter '{plan.name}': state_precision={wanted!r} quantizes state in "
                f"blocks of a row, but {reason}, so its blocks would not be one process's; "
                f"keep its state floating with float_state_params={suggestion} (names or "
                "fnmatch patterns: state_precision='param' for those parameters)"
            )
