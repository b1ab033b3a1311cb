"""Per-rank side of the distributed bench (:mod:`muonscale.bench.distributed`): the contenders
each rank builds (model + optimizer), the spawned worker that trains them interleaved, and what
it measures per rank (losses, step times, bytes on the wire, optimizer state). The driver that
spawns the workers and the report live in :mod:`muonscale.bench.distributed`.
"""

from __future__ import annotations

import datetime
import gc
import statistics
import time
from typing import Any

import torch

WEIGHT_DECAY = 0.1  # every contender (AdamW: >= 2-D parameters only)
ADAMW_BETAS = (0.9, 0.95)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mesh_shape(parallel: str, nproc: int) -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) of ``parallel`` on ``nproc`` ranks (mesh
    ``(dp, tp)`` row-major: the TP ranks of one replica are consecutive)."""
    if parallel == "tp":
        return 1, nproc
    if parallel == "fsdp+tp":
        return 2, nproc // 2
    return nproc, 1


def _local_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the state tensors this rank holds (DTensor state counted by its local shard)."""
    from muonscale.distributed.dtensor import local_tensor

    if hasattr(opt, "optimizer_state_bytes"):
        return int(opt.optimizer_state_bytes())
    total = 0
    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                t = local_tensor(v)
                total += t.numel() * t.element_size()
    return total


def single_process_muon_state_bytes(model: torch.nn.Module) -> int:
    """``muonscale.Muon``'s state on one process, from its routing: a momentum buffer per Muon
    parameter; exp_avg, exp_avg_sq and a float32 step per AdamW parameter."""
    from muonscale import route

    params = dict(model.named_parameters())
    total = 0
    for name, decision in route(model).items():
        p = params[name]
        muon = decision.algorithm == "muon"
        total += p.numel() * p.element_size() * (1 if muon else 2) + (0 if muon else 4)
    return total


def zero_redundancy_broadcast_bytes(model: torch.nn.Module, world_size: int) -> int:
    """Per-rank bytes of ``ZeroRedundancyOptimizer``'s per-step broadcast of every parameter
    from its owner (ring model, as ``benchmarks/wire_bytes.py`` counts it)."""
    from muonscale.distributed import ring_wire_bytes

    return sum(
        ring_wire_bytes("broadcast", p.numel() * p.element_size(), world_size)
        for p in model.parameters()
    )


class _Contender:
    """One model + optimizer on this rank, and what its steps measured."""

    def __init__(self, name: str, model, opt, forward_model=None, counter=None) -> None:
        self.name, self.model, self.opt = name, model, opt
        self.forward_model = forward_model if forward_model is not None else model
        self.counter = counter  # WireCounter of a DDP comm hook (None: opt.last_step_wire_bytes)
        self.base_lrs = [g["lr"] for g in opt.param_groups]
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.opt_s: list[float] = []
        self.wire: list[int] = []
        self.breakdown: dict[str, int] = {}
        self.links: list[dict[str, int]] = []  # per step: bytes by link class

    def train_step(self, inputs, targets, lr_factor: float) -> None:
        for group, base in zip(self.opt.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * lr_factor
        if self.counter is not None:
            self.counter.reset()
        start = time.perf_counter()
        self.model.train()
        _, loss = self.forward_model(inputs, targets)
        loss.backward()
        opt_start = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        self.step_s.append(end - start)
        self.opt_s.append(end - opt_start)
        if self.counter is not None:
            links = self.counter.by_link()
            total, self.breakdown = self.counter.take()
        else:
            total, self.breakdown = self.opt.last_step_wire_bytes, self.opt.last_step_wire_breakdown
            links = getattr(self.opt, "last_step_wire_links", None)
            links = links or {"intra_host": 0, "inter_host": int(total)}  # hosts unknown
        self.wire.append(int(total))
        self.links.append(dict(links))

    @torch.no_grad()
    def evaluate(self, batches) -> float:
        self.model.eval()
        losses = [self.forward_model(x, y)[1].float() for x, y in batches]
        self.model.train()
        return torch.stack(losses).mean().item()

    def release(self) -> None:
        if hasattr(self.opt, "remove_hooks"):
            self.opt.remove_hooks()
        self.model = self.opt = self.forward_model = None


def _muon_options(model, lr: float) -> dict[str, Any]:
    splits = {name: model.qkv_layout for name in model.qkv_param_names()}
    return dict(
        lr=lr,
        weight_decay=WEIGHT_DECAY,
        adamw_betas=ADAMW_BETAS,
        ns_dtype=torch.float32,
        splits=splits,
    )


def _torch_adamw(model, lr: float, foreach: bool | None = None) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with muonscale's AdamW defaults, so that it is the same algorithm
    as ``adamw-zero1`` (and Muon's AdamW half): betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on
    >= 2-D parameters only (as ``muonscale.train.optimizers`` builds it)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAMW_BETAS, eps=1e-8, foreach=foreach)


def _dp_contenders(
    model_config, lrs, seed, reduce_dtypes, hosts=None, ns_dtype=torch.float32
) -> list[_Contender]:
    """DistributedMuon per reduce dtype (Newton–Schulz in ``ns_dtype``: in bfloat16 it
    gathers the owners' bf16 updates), ZeRO-1 AdamW and DDP AdamW (``hosts``: the
    :class:`~muonscale.distributed.hosts.HostMap` that DDP's all-reduce is counted with)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from muonscale.distributed import Communicator, DistributedMuon
    from muonscale.train.model import GPT

    def fresh():
        torch.manual_seed(seed)
        return GPT(model_config)

    out = []
    for dtype_name in reduce_dtypes:
        name = "muon" if dtype_name == "float32" else f"muon-{_short(dtype_name)}reduce"
        model = fresh()
        reduce_dtype = None if dtype_name == "float32" else DTYPES[dtype_name]
        opt = DistributedMuon(
            model.named_parameters(),
            reduce_dtype=reduce_dtype,
            **{**_muon_options(model, lrs["muon"]), "ns_dtype": ns_dtype},
        )
        out.append(_Contender(name, model, opt))
    model = fresh()
    opt = DistributedMuon(
        model.named_parameters(),
        rules=[(".*", "adamw")],
        lr=lrs["adamw"],
        weight_decay=WEIGHT_DECAY,
        adamw_betas=ADAMW_BETAS,
    )
    out.append(_Contender("adamw-zero1", model, opt))

    model = fresh()
    comm = Communicator(hosts=hosts)

    def all_reduce_hook(state, bucket):  # DDP's default: pre-divide + all-reduce, counted
        buf = bucket.buffer().div_(comm.world_size)
        work = comm.all_reduce(buf, tag="ddp", async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    ddp = DDP(model)
    ddp.register_comm_hook(None, all_reduce_hook)
    opt = _torch_adamw(model, lrs["adamw"])
    out.append(_Contender("adamw-ddp", model, opt, forward_model=ddp, counter=comm.counter))
    return out


def _short(dtype_name: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype_name, dtype_name)


def _fsdp_contenders(model_config, lrs, seed, world_size) -> list[_Contender]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from muonscale.distributed import distributed_muon
    from muonscale.train.model import GPT

    mesh = init_device_mesh("cpu", (world_size,))

    def sharded():
        torch.manual_seed(seed)
        model = GPT(model_config)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model

    model = sharded()
    muon = distributed_muon(model.named_parameters(), **_muon_options(model, lrs["muon"]))
    out = [_Contender("muon", model, muon)]
    model = sharded()
    adamw = _torch_adamw(model, lrs["adamw"])
    adamw.last_step_wire_bytes, adamw.last_step_wire_breakdown = 0, {}  # sends nothing itself
    out.append(_Contender("adamw", model, adamw))
    return out


def _replicate_on(model, tp_mesh) -> None:
    """Turn every parameter that is not yet a DTensor into a ``Replicate()`` DTensor on
    ``tp_mesh`` (module by module: inputs in as Replicate DTensors, outputs back as local)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(module, inputs, mesh):
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(module, output, mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(module, tp_mesh, input_fn=to_dtensor, output_fn=to_local)


def _tp_contenders(model_config, lrs, seed, world_size, parallel) -> list[_Contender]:
    """Megatron-style TP of the reference GPT: fused QKV and MLP fc column-parallel, attention
    and MLP output projections row-parallel; embeddings, norms and head replicated. The QKV rows
    are interleaved by key/value group (QKVLayout), so a contiguous row shard holds whole
    groups: each rank's attention runs its local heads with the local layout. ``fsdp+tp``: the
    same on the "tp" axis of a (dp, tp) mesh, then FSDP2 over "dp"."""
    import dataclasses

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from muonscale.distributed import distributed_muon
    from muonscale.train.model import GPT

    dp, tp = mesh_shape(parallel, world_size)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    plan = {
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(),
    }

    def sharded():
        torch.manual_seed(seed)
        model = GPT(model_config)
        splits = {name: model.qkv_layout for name in model.qkv_param_names()}  # global layout
        for block in model.blocks:
            layout = block.attn.layout
            parallelize_module(block, mesh["tp"], plan)
            block.attn.layout = dataclasses.replace(
                layout, n_query_groups=layout.n_query_groups // tp
            )
        if dp > 1:  # replicated parameters become Replicate DTensors on "tp" first, so that
            # every parameter's mesh spans all ranks (FSDP then shards them over "dp")
            _replicate_on(model, mesh["tp"])
            for block in model.blocks:
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        return model, splits

    model, splits = sharded()
    options = _muon_options(model, lrs["muon"])
    options["splits"] = splits
    muon = distributed_muon(model.named_parameters(), **options)
    out = [_Contender("muon", model, muon)]
    model, _ = sharded()
    # foreach=False: the parameter list mixes DTensors (TP) and plain tensors (replicated)
    adamw = _torch_adamw(model, lrs["adamw"], foreach=False)
    adamw.last_step_wire_bytes, adamw.last_step_wire_breakdown = 0, {}  # sends nothing itself
    out.append(_Contender("adamw", model, adamw))
    return out


def run_worker(rank: int, world_size: int, port: int, spec: dict, queue) -> None:
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(1)
    # the root FSDP module returns (logits, loss); we never modify them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    contenders: list[_Contender] = []
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=spec["pg_timeout_s"]),
        )
        result = _run_rank(rank, world_size, spec, contenders)
        queue.put(("ok", rank, result))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        import traceback

        queue.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        for c in contenders:
            c.release()
        contenders.clear()
        gc.collect()
        if dist.is_initialized():
            try:
                dist.barrier()
            except Exception:  # noqa: BLE001 - a peer may be gone
                pass
            dist.destroy_process_group()


def _run_rank(rank: int, world_size: int, spec: dict, contenders: list) -> dict | None:
    import torch.distributed as dist

    from muonscale.distributed import gather_wire_stats
    from muonscale.train.config import model_preset
    from muonscale.train.data import ByteTokenizer, TokenDataset, load_corpus

    model_config = model_preset(spec["preset"], **spec["model_overrides"])
    dataset = TokenDataset.from_text(
        load_corpus(), ByteTokenizer(), context_length=model_config.context_length
    )
    val = dataset.validation_batches(n_batches=spec["eval_batches"], batch_size=8)
    seed, steps, batch = spec["seed"], spec["steps"], spec["global_batch"]
    dp_size, tp_size = mesh_shape(spec["parallel"], world_size)
    per_rank, dp_rank = batch // dp_size, rank // tp_size  # TP ranks of one replica: same data
    if spec["parallel"] == "dp":
        contenders.extend(_dp_contenders(model_config, spec["lrs"], seed, spec["reduce_dtypes"]))
    elif spec["parallel"] == "fsdp":
        contenders.extend(_fsdp_contenders(model_config, spec["lrs"], seed, world_size))
    else:
        contenders.extend(
            _tp_contenders(model_config, spec["lrs"], seed, world_size, spec["parallel"])
        )
    warmup = spec["warmup_steps"]
    for step in range(steps):
        ((inputs, targets),) = dataset.train_batch(seed=seed, step=step, batch_size=batch)
        mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        factor = min(1.0, (step + 1) / warmup) if warmup else 1.0
        for c in contenders:  # interleaved: every contender does step `step` before step+1
            c.train_step(inputs[mine], targets[mine], factor)

    timed = slice(1, None) if steps > 1 else slice(None)  # step 1 warms up (lazy state etc.)
    rows = {}
    for c in contenders:
        losses = torch.tensor(c.losses, dtype=torch.float64)
        dist.all_reduce(losses)  # global train loss = mean over ranks (TP ranks: equal values)
        losses /= world_size
        step_s = torch.tensor([sum(c.step_s[timed])], dtype=torch.float64)
        dist.all_reduce(step_s, op=dist.ReduceOp.MAX)
        opt_ms = 1e3 * statistics.median(c.opt_s[timed])
        wire = gather_wire_stats(c.wire[-1])
        state = gather_wire_stats(_local_state_bytes(c.opt))
        opt_ms_stats = gather_wire_stats(int(round(opt_ms * 1e3)))
        val_loss = c.evaluate(val)  # every rank (FSDP's forward is collective); rank 0's kept
        n_timed = len(c.step_s[timed])
        rows[c.name] = {
            "final_train_loss": losses[-1].item(),
            "train_losses": losses.tolist(),
            "val_loss": val_loss,
            "tokens_per_s": n_timed * batch * model_config.context_length / step_s.item(),
            "optimizer_step_ms": opt_ms_stats["max"] / 1e3,
            "optimizer_step_ms_mean": opt_ms_stats["mean"] / 1e3,
            "wire_bytes_per_step": {"mean": wire["mean"], "max": wire["max"]},
            "wire_breakdown_rank0": c.breakdown,
            "optimizer_state_bytes": {"mean": state["mean"], "max": state["max"]},
            "wire_steps_equal": all(w == c.wire[-1] for w in c.wire[timed]),
        }
    if rank != 0:
        return None
    reference = contenders[0].model
    extra = {
        "n_params": sum(p.numel() for p in reference.parameters()),
        "model_config": {
            k: getattr(model_config, k)
            for k in ("vocab_size", "context_length", "n_layer", "d_model", "n_head")
        },
    }
    if spec["parallel"] == "dp":
        extra["single_process_muon_state_bytes"] = single_process_muon_state_bytes(reference)
        extra["zero_broadcast_bytes"] = zero_redundancy_broadcast_bytes(reference, world_size)
    else:  # full-size model to count from (the sharded one holds DTensors)
        from muonscale.train.model import GPT

        torch.manual_seed(seed)
        extra["single_process_muon_state_bytes"] = single_process_muon_state_bytes(
            GPT(model_config)
        )
    return {"rows": rows, **extra}
