"""Workers for runs across Megatron layouts (TP × PP × DP), bf16 parameters with fp32 main
copies, gradient clipping and checkpoints. Run on every rank of a gloo WorkerPool.

Every layout must see the same model and the same gradients, so both come from the
parameter's *canonical* name (``decoder.layers.<global index>...``: the layer numbering of
PP = 1) rather than from the order of construction, which differs per pipeline stage:

* weights: N(0, 0.02²) from a seed hashed from the canonical name (norm weights 1 + that),
  sliced to the rank's TP shard; the tied embedding's pipeline copy gets the embedding's values;
* gradients: N(0, 1) from (canonical name, step), written where Megatron's DDP leaves reduced
  gradients (``main_grad``, fp32) — the optimizer reads them as already reduced — or into
  ``.grad`` (then the optimizer averages over data parallel itself); ``bf16_grads``: rounded
  to bf16 values first (what a bf16 model's ``.grad`` holds), for fp32 references of those.

``run_layout`` returns (from global rank 0) the full parameters by canonical name, gathered
over TP and pipeline stages, the optimizer's main copies the same way, and the per-step
global gradient norms.
"""

from __future__ import annotations

import os
import zlib

import megatron_workers as W
import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- model
def setup(tp: int, pp: int) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    W.cpu_shims()


def build_stage(shape: dict, *, tied: bool):
    """This rank's pipeline stage of the tiny GPT (fp32; CPU init)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
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
        pipeline_dtype=torch.float32,
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
    )
    # CPU shim: with PP > 1, LanguageModule syncs the tied embedding's two copies with
    # ``weight.data.cuda()`` + all-reduce (language_module.py L307); keep it on the CPU.
    cuda = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=shape["vocab_size"],
            max_sequence_length=shape["seq_len"],
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=tied,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
        )
    finally:
        torch.Tensor.cuda = cuda
    W._EXPERTS.clear()
    return model


def canonical_names(model, shape: dict) -> dict[str, str]:
    """Local parameter name → name at PP = 1 (global layer index; the pipeline copy of the
    tied embedding → the embedding's name)."""
    from megatron.core import parallel_state as ps

    per_stage = shape["num_layers"] // ps.get_pipeline_model_parallel_world_size()
    offset = ps.get_pipeline_model_parallel_rank() * per_stage
    out = {}
    for name, p in model.named_parameters():
        canon = name
        if name.startswith("decoder.layers."):
            _, _, index, rest = name.split(".", 3)
            canon = f"decoder.layers.{int(index) + offset}.{rest}"
        if getattr(p, "shared", False) and name == "output_layer.weight":
            canon = "embedding.word_embeddings.weight"
        out[name] = canon
    return out


def _seeded(canon: str, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(canon.encode()) * 7919 + salt)


@torch.no_grad()
def canonical_init(model, names: dict[str, str]) -> None:
    for name, p in model.named_parameters():
        full = torch.randn(W.full_shape(p), generator=_seeded(names[name], 0)) * 0.02
        if p.ndim == 1 and name.endswith("weight"):
            full += 1.0  # norm weights
        p.copy_(W.local_slice(full, p))


def inject(
    model, names: dict[str, str], step: int, where: str, scale: float, bf16: bool = False
) -> None:
    for name, p in model.named_parameters():
        full = torch.randn(W.full_shape(p), generator=_seeded(names[name], 1 + step)) * scale
        if bf16:
            full = full.bfloat16().float()
        g = W.local_slice(full, p)
        if where == "main_grad":
            p.main_grad = g.float()
        else:
            p.grad = g.to(p.dtype)


def gather_model(model, names: dict[str, str], tensors: dict[str, torch.Tensor] | None = None):
    """{canonical name: full tensor} over TP shards and pipeline stages, on every rank.
    ``tensors``: local name → tensor to gather instead of the parameter (e.g. main copies)."""
    local = {}
    for name, p in model.named_parameters():
        data = tensors[name] if tensors is not None and name in tensors else p
        local[names[name]] = W.gather_full(p, data).float()
    everything = [None] * dist.get_world_size()
    dist.all_gather_object(everything, local)
    merged: dict[str, torch.Tensor] = {}
    for part in everything:
        for name, value in part.items():
            merged.setdefault(name, value)
    return dict(sorted(merged.items()))


# ----------------------------------------------------------------------------- runs
def _build(spec: dict):
    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    setup(spec.get("tp", 1), spec.get("pp", 1))
    shape = spec.get("shape", W.TINY)
    model = build_stage(shape, tied=spec.get("tied", False))
    names = canonical_names(model, shape)
    canonical_init(model, names)
    if spec.get("dtype") == "bf16":
        model.bfloat16()  # same Parameter objects (attributes kept), data rounded
    elif spec.get("round_to_bf16"):  # fp32 model starting from the bf16 model's values
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    if spec.get("ddp_like"):  # as Megatron's DDP: fp32 main_grad buffers exist before the optimizer
        for p in model.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    opt = megatron_muon([model], MegatronMuonConfig().replaced(**spec.get("options", {})))
    return model, names, opt


def _poison(model, where: str) -> None:
    """A NaN in this rank's piece of the first TP-sharded matrix (other ranks stay finite)."""
    for _, p in model.named_parameters():
        if getattr(p, "tensor_model_parallel", False) and p.ndim == 2:
            (p.main_grad if where == "main_grad" else p.grad).view(-1)[0] = float("nan")
            return
    raise AssertionError("no TP-sharded matrix to poison")


def _train(model, names, opt, spec: dict, steps: range) -> list[float]:
    norms = []
    for step in steps:
        where, scale = spec.get("grads_in", "grad"), spec.get("grad_scale", 1.0)
        inject(model, names, step, where, scale, spec.get("bf16_grads", False))
        if spec.get("nan_at") == (step, dist.get_rank()):
            _poison(model, spec.get("grads_in", "grad"))
        opt.step()
        norms.append(opt.last_grad_norm)
        opt.zero_grad(set_to_none=True)
    return norms


def _result(model, names, opt, norms) -> dict:
    mains = None
    local_names = {id(p): n for n, p in model.named_parameters()}
    copies = getattr(opt, "main_params", None)
    if copies is not None and copies.copied:
        mains = gather_model(
            model,
            names,
            {local_names[id(copies.model_params[i])]: copies.plans[i].param for i in copies.copied},
        )
    elif opt.dp_mode == "zero1" and getattr(opt, "main_params_dtype", None) is not None:
        full = opt.state_dict()["state"]  # collective over data parallel: main copies gathered
        held = {local_names[id(p)]: full[i].get("main_param") for i, p in enumerate(opt.params)}
        if any(v is not None for v in held.values()):
            mains = gather_model(model, names, {n: v for n, v in held.items() if v is not None})
    full = gather_model(model, names)
    return dict(
        params=full,
        mains=mains,
        norms=norms,
        dp_mode=opt.dp_mode,
        summary=opt.summary(),
        skipped=opt.skipped_steps,
        wire=opt.last_step_wire_breakdown,
        grads_reduced=getattr(opt, "grads_reduced", None),
    )


def run_layout(rank: int, world_size: int, spec: dict) -> dict | None:
    """``spec["steps"]`` steps on layout (tp, pp) with injected gradients; see the module
    docstring. Results from global rank 0."""
    from megatron.core import parallel_state as ps

    model, names, opt = _build(spec)
    norms = _train(model, names, opt, spec, range(spec["steps"]))
    out = _result(model, names, opt, norms)
    ps.destroy_model_parallel()
    return out if rank == 0 or spec.get("all_ranks") else None


def _checkpoint_path(folder: str) -> str:
    from megatron.core import parallel_state as ps

    return os.path.join(
        folder,
        f"tp{ps.get_tensor_model_parallel_rank()}_pp{ps.get_pipeline_model_parallel_rank()}.pt",
    )


def run_and_save(rank: int, world_size: int, spec: dict) -> dict | None:
    """``spec["save_at"]`` steps, save (model shard + optimizer state, one file per TP × PP
    rank, written by data-parallel rank 0; the optimizer's state_dict is collective), then
    continue to ``spec["steps"]``: the uninterrupted reference."""
    from megatron.core import parallel_state as ps

    model, names, opt = _build(spec)
    norms = _train(model, names, opt, spec, range(spec["save_at"]))
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if ps.get_data_parallel_rank() == 0:
        torch.save(state, _checkpoint_path(spec["folder"]))
    dist.barrier()
    norms += _train(model, names, opt, spec, range(spec["save_at"], spec["steps"]))
    out = _result(model, names, opt, norms)
    ps.destroy_model_parallel()
    return out if rank == 0 else None


def load_and_resume(rank: int, world_size: int, spec: dict) -> dict | None:
    """A fresh model and optimizer (possibly another data-parallel size), loaded from the
    files of :func:`run_and_save`, trained from ``save_at`` to ``steps``."""
    from megatron.core import parallel_state as ps

    model, names, opt = _build(spec)
    state = torch.load(_checkpoint_path(spec["folder"]), weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    norms = _train(model, names, opt, spec, range(spec["save_at"], spec["steps"]))
    out = _result(model, names, opt, norms)
    ps.destroy_model_parallel()
    return out if rank == 0 else None


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[n] - b[n]).abs().max()) for n in a)
