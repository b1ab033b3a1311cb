"""Worker functions for the Megatron-Core tests: run on every rank of a gloo WorkerPool.

A worker (``fn(rank, world_size, spec)``) sets up Megatron's parallel state for ``spec["tp"]``,
builds a tiny GPT (local layer spec, CPU init: the same full weights at every TP size), runs
``spec["steps"]`` optimizer steps and returns the *full* (TP-gathered, canonical-order)
parameters from global rank 0 plus timings and wire bytes.

Gradients: ``"inject"`` gives every layout the same full gradient per parameter and step
(sliced to each rank's shard), so layouts see bitwise-identical gradients; ``"same_batch"``
runs forward/backward on one batch shared by every rank; ``"split_batch"`` gives each DP rank
its slice of a global batch.
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

TINY = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=128,
    seq_len=16,
    gated_linear_unit=True,
)
"""GQA (2 query groups of 2 heads), SwiGLU-shaped fc1 (partition_stride 2 under TP)."""

COST = dict(
    num_layers=4,
    hidden_size=256,
    num_attention_heads=8,
    num_query_groups=4,
    ffn_hidden_size=1024,
    vocab_size=256,
    seq_len=16,
    gated_linear_unit=True,
)
"""Larger shapes for the optimizer-step cost comparison (gradients injected, no forward)."""


# ----------------------------------------------------------------------------- Megatron on CPU
def cpu_shims() -> None:
    """Megatron-Core's local path on CPU (attention scratch buffer, dropout RNG tracker)."""
    from muonscale.integrations.megatron.cpu import use_cpu_buffers

    use_cpu_buffers()


def setup_parallel(tp: int, etp: int | None = None) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp)
    cpu_shims()


def build_gpt(shape: dict, seed: int = 0, num_experts: int | None = None, **config_overrides):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=shape["num_layers"],
        hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"],
        num_query_groups=shape["num_query_groups"],
        ffn_hidden_size=shape["ffn_hidden_size"],
        gated_linear_unit=shape["gated_linear_unit"],
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
        num_moe_experts=num_experts,
        **config_overrides,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=num_experts),
        vocab_size=shape["vocab_size"],
        max_sequence_length=shape["seq_len"],
        position_embedding_type="learned_absolute",
    )
    _EXPERTS.clear()
    _EXPERTS.update(p for n, p in model.named_parameters() if "experts" in n and "shared" not in n)
    return model


# ----------------------------------------------------------------------------- TP layouts
_EXPERTS: set = set()
"""Expert weights of the current model (filled by :func:`build_gpt`)."""


def _tp_group(p):
    """Expert weights are sharded over the expert-tensor group."""
    from megatron.core import parallel_state as ps

    if p in _EXPERTS:
        return ps.get_expert_tensor_parallel_group()
    return ps.get_tensor_model_parallel_group()


def _tp_info(p):
    group = _tp_group(p)
    if not getattr(p, "tensor_model_parallel", False) or dist.get_world_size(group) == 1:
        return None
    return int(p.partition_dim), int(getattr(p, "partition_stride", 1)), group


def local_slice(full: torch.Tensor, p) -> torch.Tensor:
    """This rank's shard of a full (canonical order) tensor, as Megatron's CPU init splits it:
    ``full.split`` into T·stride pieces, rank r holds pieces r, r+T, …"""
    info = _tp_info(p)
    if info is None:
        return full.clone()
    dim, stride, group = info
    t, r = dist.get_world_size(group), dist.get_rank(group)
    pieces = full.chunk(t * stride, dim=dim)
    return torch.cat([pieces[c * t + r] for c in range(stride)], dim=dim).contiguous()


def gather_full(p: torch.Tensor, data: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`local_slice`: the full tensor in canonical order (of ``data``, laid
    out as ``p``'s shard, e.g. its main copy; default ``p`` itself)."""
    info = _tp_info(p)
    data = (p if data is None else data).detach()
    if info is None:
        return data.clone()
    dim, stride, group = info
    t = dist.get_world_size(group)
    shards = [torch.empty_like(data) for _ in range(t)]
    dist.all_gather(shards, data.contiguous(), group=group)
    per_rank = [s.chunk(stride, dim=dim) for s in shards]
    return torch.cat([per_rank[r][c] for c in range(stride) for r in range(t)], dim=dim)


SCALE_BLOCKS = {
    "momentum_scale": 256,
    "momentum_absmax": 128,
    "exp_avg_absmax": 256,
    "exp_avg_sq_absmax": 256,
}
"""Each quantized state's scales and the entries of its blocks."""


def whole_scales(opt, plan, key: str, value: torch.Tensor) -> torch.Tensor | None:
    """A column piece's scales (rows, blocks it touches) placed among the whole rows' blocks,
    every TP rank's (a block that several share holds one value on all of them); None for a
    piece of whole rows. Collective over the piece's TP group."""
    from muonscale.quantized_state import adamw_block_shape

    size = SCALE_BLOCKS[key]
    blocks = opt.column_scales.blocks(plan, adamw_block_shape(plan.param), size)
    if blocks is None:
        return None
    group = _tp_group(plan.param)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (blocks.blocks, value), group=group)
    whole = torch.full((value.shape[0], -(-blocks.cols // size)), float("nan"))
    for touched, scales in everyone:
        for k, b in enumerate(touched):
            if not whole[:, b].isnan().all():
                assert torch.equal(whole[:, b], scales[:, k]), (plan.name, key, b)
            whole[:, b] = scales[:, k]
    assert not whole.isnan().any(), (plan.name, key)
    return whole


def whole_state(opt, plan, entry=None) -> dict[str, torch.Tensor]:
    """The state tensors (1 dim or more) of ``plan``'s parameter in a replicated Megatron
    optimizer (``entry``: this TP rank's state of it, default the optimizer's; a ZeRO-1
    ``state_dict()``'s), TP pieces gathered into the whole parameter's (canonical order; a
    column piece's scales placed among its blocks). Collective over its TP group."""
    out = {}
    entry = opt.state.get(plan.param, {}) if entry is None else entry
    for key, value in entry.items():
        if not (torch.is_tensor(value) and value.dim() > 0):
            continue
        whole = whole_scales(opt, plan, key, value) if key in SCALE_BLOCKS else None
        if whole is None:
            same_rows = value.shape[:1] == plan.param.shape[:1]
            whole = gather_full(plan.param, value) if same_rows else value.clone()
        out[key] = whole
    return out


def full_shape(p) -> tuple[int, ...]:
    info = _tp_info(p)
    shape = list(p.shape)
    if info is not None:
        shape[info[0]] *= dist.get_world_size(info[2])
    return tuple(shape)


def inject_gradients(model, step: int, seed: int = 1234) -> None:
    """The same full gradient for every layout: N(0, 1) from a per-(parameter, step) seed."""
    for index, (_, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(seed + 1000 * step + index)
        full = torch.randn(full_shape(p), generator=g)
        p.grad = local_slice(full, p)


def batch(step: int, shape: dict, batch_size: int = 4, seed: int = 99):
    g = torch.Generator().manual_seed(seed + step)
    ids = torch.randint(0, shape["vocab_size"], (batch_size, shape["seq_len"] + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def forward_backward(model, step: int, shape: dict, split: bool) -> float:
    from megatron.core import parallel_state as ps

    tokens, labels = batch(step, shape)
    if split:
        dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        tokens, labels = tokens.chunk(dp)[rank], labels.chunk(dp)[rank]
    s = shape["seq_len"]
    positions = torch.arange(s).unsqueeze(0).expand(tokens.shape[0], s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    loss = model(tokens, positions, mask, labels=labels).mean()
    loss.backward()
    return float(loss)


# ----------------------------------------------------------------------------- optimizers
def megatron_own_muon(
    model,
    *,
    tp_mode: str,
    lr: float,
    weight_decay: float,
    momentum: float,
    nesterov: bool,
    steps: int,
    coefficient_type: str = "simple",
):
    """Megatron-Core's own Muon (``TensorParallelMuon`` from megatron/core/optimizer/
    emerging_optimizers.py, on emerging_optimizers) for the Muon half, built directly: Megatron's
    ``get_megatron_optimizer`` needs CUDA, the optimizer class itself does not. fp32 matmuls.
    Returns (muon optimizer or None, names of its parameters)."""
    from megatron.core import parallel_state as ps
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    cfg = model.config
    names, params = [], []
    for name, p in model.named_parameters():
        if getattr(p, "is_embedding_or_output_parameter", False) or p.ndim != 2:
            continue
        if "position_embeddings" in name:  # an embedding: AdamW in muonscale (Muon in Megatron)
            continue
        if name.endswith("linear_qkv.weight"):
            p.is_qkv = True
        names.append(name)
        params.append(p)
    q = cfg.num_attention_heads // cfg.num_query_groups * cfg.kv_channels
    pg = SimpleNamespace(
        tp=ps.get_tensor_model_parallel_group(),
        expt_tp=ps.get_expert_tensor_parallel_group(),
        gtp_remat=None,
        expt_gtp_remat=None,
    )
    opt = TensorParallelMuon(
        params,
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=weight_decay,
        split_qkv=True,
        is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
        qkv_split_shapes=[q, cfg.kv_channels, cfg.kv_channels],
        fp32_matmul_prec="highest",
        coefficient_type=coefficient_type,
        num_ns_steps=steps,
        scale_mode="spectral",
        pg_collection=pg,
        tp_mode=tp_mode,
    )
    return opt, names


def run(rank: int, world_size: int, spec: dict) -> dict:
    """One training run under ``spec`` (see the module docstring); results from rank 0."""
    from megatron.core import parallel_state as ps

    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    setup_parallel(spec["tp"], spec.get("etp"))
    shape = spec.get("shape", TINY)
    model = build_gpt(shape, seed=spec.get("seed", 0), **spec.get("model", {}))
    options = dict(spec.get("options", {}))
    impl = spec.get("impl", "muonscale")
    if impl == "muonscale":
        opt = megatron_muon([model], MegatronMuonConfig().replaced(**options))
        muon_names = [pl.name for pl in opt.plans if pl.algorithm == "muon"]
    else:  # Megatron's own Muon; the AdamW half stays untouched (compare Muon matrices only)
        opt, muon_names = megatron_own_muon(
            model, tp_mode=impl.removeprefix("megatron_"), **options
        )
    init = (
        {n: gather_full(p) for n, p in model.named_parameters()}
        if spec.get("return_init")
        else None
    )
    step_times, wire, losses = [], [], []
    for step in range(spec["steps"]):
        if spec["grads"] == "inject":
            inject_gradients(model, step)
        else:
            losses.append(
                forward_backward(model, step, shape, split=spec["grads"] == "split_batch")
            )
        if impl != "muonscale" and ps.get_data_parallel_world_size() > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                    p.grad.div_(ps.get_data_parallel_world_size())
        dist.barrier()
        start = time.perf_counter()
        opt.step()
        step_times.append(time.perf_counter() - start)
        if impl == "muonscale":
            wire.append(opt.last_step_wire_bytes)
        opt.zero_grad(set_to_none=True)
    full = {n: gather_full(p) for n, p in model.named_parameters()}
    out = None
    if rank == 0:
        warm = step_times[1:] or step_times
        out = dict(
            params=full,
            init=init,
            muon_names=muon_names,
            losses=losses,
            step_seconds=statistics.median(warm),
            wire_bytes=wire,
            summary=opt.summary() if impl == "muonscale" else "",
        )
        if impl == "muonscale":
            out["breakdown"] = opt.last_step_wire_breakdown
            out["dp_mode"] = opt.dp_mode
    ps.destroy_model_parallel()
    return out


def max_abs_diff(a: dict, b: dict, names=None) -> float:
    names = names if names is not None else list(a)
    return max(float((a[n] - b[n]).abs().max()) for n in names)


# ----------------------------------------------------------------------------- benchmark arms
def muon_arms(rank: int, world_size: int, spec: dict) -> dict | None:
    """The two Muon arms of ``benchmarks/megatron_gpu.py`` built from ONE Megatron
    ``OptimizerConfig(**spec["config"])`` on two equal tiny GPTs (TP 1): Megatron's through
    ``get_megatron_optimizer`` (its CUDA-only wrappers unwrapped, as the CPU smoke does),
    muonscale's through ``MegatronMuonConfig.from_megatron``. Returns, from rank 0, the settings
    read back from both optimizers, which matrices each gives Muon, and the parameters before and
    after ``spec["steps"]`` Muon steps on injected (identical) gradients."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from benchmarks.megatron_gpu_parts.arms import (
        megatron_muon_optimizers,
        muon_settings,
        unwrapped_megatron_optimizers,
    )
    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    setup_parallel(1)
    config = OptimizerConfig(**spec["config"])
    theirs_model, ours_model = build_gpt(TINY, seed=0), build_gpt(TINY, seed=0)
    with unwrapped_megatron_optimizers():
        theirs = get_megatron_optimizer(config, [theirs_model])
    (tpm,) = megatron_muon_optimizers(theirs)
    ours = megatron_muon(
        [ours_model],
        MegatronMuonConfig.from_megatron(config, main_params_dtype=None, dp_mode="replicated"),
    )
    in_tpm = {id(p) for g in tpm.param_groups for p in g["params"]}
    init = {n: p.detach().clone() for n, p in ours_model.named_parameters()}
    for step in range(spec["steps"]):
        inject_gradients(theirs_model, step)
        inject_gradients(ours_model, step)
        tpm.step()  # the Muon half only; the Adam half is not compared
        ours.step()
        for model in (theirs_model, ours_model):
            model.zero_grad(set_to_none=True)
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    if rank != 0:
        return None
    return dict(
        settings={"megatron": muon_settings(theirs), "muonscale": muon_settings(ours)},
        megatron_muon_names=[n for n, p in theirs_model.named_parameters() if id(p) in in_tpm],
        muonscale_muon_names=[pl.name for pl in ours.plans if pl.algorithm == "muon"],
        init=init,
        megatron={n: p.detach().clone() for n, p in theirs_model.named_parameters()},
        muonscale={n: p.detach().clone() for n, p in ours_model.named_parameters()},
    )


def assert_same_state(got: dict, want: dict, what: str) -> None:
    """``got`` equals ``want`` bitwise, nested dicts of tensors alike (``what``: the message)."""
    assert got.keys() == want.keys(), what
    for name, value in want.items():
        if isinstance(value, dict):
            assert_same_state(got[name], value, f"{what}/{name}")
        else:
            assert torch.equal(got[name], value), f"{what}/{name}"
