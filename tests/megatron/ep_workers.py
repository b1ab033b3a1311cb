"""Worker functions of test_megatron_expert_parallel.py: a tiny Megatron-Core GPT with
``SequentialMLP`` experts (all-gather token dispatcher, the one that runs on CPU) at a given
(TP, ETP, EP) layout, on every rank of a gloo WorkerPool.

Every layout starts from the same full weights (those of the layout (1, 1, 1): built first,
then sliced into this layout's shards) and gets the same full gradient per parameter and step,
keyed by the parameter's *global* name: an expert's name carries its global index
(``local_experts.<ep_rank · local count + i>``), so expert parallel ranks see the gradients of
their own experts. Returns the full parameters by global name, the global gradient norms and
wire bytes from rank 0.
"""

from __future__ import annotations

import io
import re
import zlib

import torch
import torch.distributed as dist
from megatron_workers import TINY, build_gpt, cpu_shims, gather_full, local_slice, whole_state

LOCAL_EXPERT = re.compile(r"local_experts\.(\d+)\.")


def setup_parallel(tp: int, etp: int, ep: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        expert_tensor_parallel_size=etp,
        expert_model_parallel_size=ep,
    )
    cpu_shims()


def global_names(model) -> dict[str, torch.Tensor]:
    """``{global name: parameter}``: an expert's local index replaced by its global one."""
    from megatron.core import parallel_state as ps

    local_count = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    return {global_name(name, local_count): p for name, p in model.named_parameters()}


def _merged_over_ranks(mine: dict) -> dict:
    """Every rank's ``mine`` merged into one dict on every rank (collective)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        out.update(part)
    return out


def full_params(model) -> dict[str, torch.Tensor]:
    """Every full parameter by global name on every rank (TP gathers, then experts gathered
    over all ranks)."""
    mine = {n: gather_full(p) for n, p in global_names(model).items()}
    return _merged_over_ranks(mine)


def global_name(name: str, local_count: int) -> str:
    """An expert's name with its local index replaced by its global one (``local_count``:
    experts per expert-parallel rank)."""
    from megatron.core import parallel_state as ps

    ep_rank = ps.get_expert_model_parallel_rank()
    return LOCAL_EXPERT.sub(
        lambda m: f"local_experts.{ep_rank * local_count + int(m.group(1))}.", name
    )


def full_state(opt, local_count: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's optimizer state by global name on every rank (tensors of 1 dim or
    more): a replicated optimizer's own, ZeRO-1's of the full state of its halves'
    ``state_dict()``, TP pieces gathered (``whole_state``; collective)."""
    mine = {}
    if opt.dp_mode == "zero1":
        for part in opt.parts.values():
            saved = part.state_dict()
            by_name = {}
            for group in saved["param_groups"]:
                for name, index in zip(group["param_names"], group["params"]):
                    by_name[name] = saved["state"].get(index, {})
            for plan in part.plans:
                entry = by_name.get(plan.name, {})
                mine[global_name(plan.name, local_count)] = whole_state(part, plan, entry)
    else:
        for plan in opt.plans:
            mine[global_name(plan.name, local_count)] = whole_state(opt, plan)
    return _merged_over_ranks(mine)


def inject(named: dict[str, torch.Tensor], shapes: dict[str, tuple], step: int, only=None) -> None:
    """The same full gradient of each global name in every layout, sliced to this shard
    (``only``: the names that get one; the others none)."""
    for name, p in named.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
        full = torch.randn(shapes[name], generator=g)
        p.grad = local_slice(full, p) if only is None or name in only else None


def wire_by_kind(named, shapes, opt, step: int) -> dict[str, dict[str, int]]:
    """This rank's optimizer bytes of one step with gradients on the expert matrices only and
    of one with gradients on the dense Muon matrices only."""
    muon = {pl.name for pl in opt.plans if pl.algorithm == "muon"}
    out = {}
    for kind, keep in (("experts", True), ("dense", False)):
        only = {n for n in named if n in muon or "local_experts" in n}
        only = {n for n in only if ("local_experts" in n) == keep}
        inject(named, shapes, step, only)
        opt.step()
        out[kind] = dict(opt.last_step_wire_breakdown)
        opt.zero_grad(set_to_none=True)
    return out


def _layout_model(spec: dict, initial: dict):
    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    model = build_gpt(TINY, expert_model_parallel_size=spec["layout"][2], **_model_kwargs(spec))
    named = global_names(model)
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(local_slice(initial[name], p))
    opt = megatron_muon([model], MegatronMuonConfig().replaced(**spec.get("options", {})))
    return model, named, opt


def _local_count(spec: dict) -> int:
    return _model_kwargs(spec)["num_experts"] // spec["layout"][2]


def _model_kwargs(spec: dict) -> dict:
    return dict(
        num_experts=spec.get("experts", 4),
        moe_token_dispatcher_type="allgather",
        add_bias_linear=False,
    )


def _steps(named, shapes, opt, first: int, count: int, norms: list, wire: list) -> None:
    for step in range(first, first + count):
        inject(named, shapes, step)
        opt.step()
        norms.append(opt.last_grad_norm)
        wire.append(dict(opt.last_step_wire_breakdown))
        opt.zero_grad(set_to_none=True)


def run(rank: int, world_size: int, spec: dict) -> dict | None:
    """``spec``: ``layout`` (TP, ETP, EP), ``steps``, ``options`` (MegatronMuonConfig fields),
    optional ``resume_at`` (also: a run saved after that many steps, its state loaded into a
    fresh model and optimizer at the same layout, which finishes the steps) and ``state``
    (also: the optimizer state by global name, :func:`full_state`)."""
    from megatron.core import parallel_state as ps

    setup_parallel(1, 1, 1)  # the reference layout's full weights
    initial = {
        n: p.detach().clone() for n, p in build_gpt(TINY, **_model_kwargs(spec)).named_parameters()
    }
    shapes = {n: tuple(t.shape) for n, t in initial.items()}
    setup_parallel(*spec["layout"])
    model, named, opt = _layout_model(spec, initial)
    norms, wire = [], []
    _steps(named, shapes, opt, 0, spec["steps"], norms, wire)
    out = dict(
        initial=initial,
        params=full_params(model),
        norms=norms,
        wire=wire,
        dp_mode=opt.dp_mode,
        summary=opt.summary(),
    )
    if spec.get("state"):
        out["state"] = full_state(opt, _local_count(spec))
    parts = getattr(opt, "parts", None)
    if spec.get("wire"):  # ZeRO-1: each half's bytes of the last step (its buckets move whole)
        split = (
            wire_by_kind(named, shapes, opt, spec["steps"])
            if parts is None
            else {name: dict(part.last_step_wire_breakdown) for name, part in parts.items()}
        )
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, split)
        out["wire_by_kind"] = everyone
    if parts is not None:  # ZeRO-1 with experts: which group each half shards over
        out["parts"] = {
            name: (dist.get_process_group_ranks(part.comm.group), [pl.name for pl in part.plans])
            for name, part in parts.items()
        }
        out["expert_dp_ranks"] = dist.get_process_group_ranks(ps.get_expert_data_parallel_group())
        out["dp_ranks"] = dist.get_process_group_ranks(ps.get_data_parallel_group())
    if spec.get("resume_at"):
        k = spec["resume_at"]
        model, named, opt = _layout_model(spec, initial)
        _steps(named, shapes, opt, 0, k, [], [])
        saved_params = {n: p.detach().clone() for n, p in named.items()}
        buffer = io.BytesIO()  # through torch.save / torch.load, as a checkpoint file
        torch.save(opt.state_dict(), buffer)
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=False)
        model, named, opt = _layout_model(spec, initial)  # fresh: everything from the save
        with torch.no_grad():
            for name, p in named.items():
                p.copy_(saved_params[name])
        opt.load_state_dict(saved)
        _steps(named, shapes, opt, k, spec["steps"] - k, [], [])
        out["resumed"] = full_params(model)
        if spec.get("state"):
            out["resumed_state"] = full_state(opt, _local_count(spec))
    ps.destroy_model_parallel()
    return out if rank == 0 else None
