"""Distributed side-by-side bench: Muon vs AdamW on N gloo processes (issues 4 and 5).

:func:`run_distributed_bench` spawns ``nproc`` CPU processes (gloo), builds the reference GPT
once per contender from the same seed, and trains every contender **interleaved step by step**
on the same data: each step's global batch (``global_batch`` windows, a pure function of
``(seed, step)``) is split across ranks by rank, so every contender sees exactly the same tokens.

``parallel="dp"`` (model replicated, gradients averaged across ranks):

* ``muon``: :class:`muonscale.DistributedMuon`, float32 gradient reduction;
* ``muon-bf16reduce``: the same with ``reduce_dtype=torch.bfloat16`` (its loss difference vs
  ``muon`` is reported: the convergence effect of the bf16 reduction);
* ``adamw-zero1``: :class:`~muonscale.DistributedMuon` with every parameter routed to AdamW,
  i.e. ZeRO-1 AdamW (reduce-scatter + all-gather) through the same machinery;
* ``adamw-ddp``: ``torch.nn.parallel.DistributedDataParallel`` + ``torch.optim.AdamW``, its
  gradient buckets all-reduced by a comm hook through :mod:`muonscale.distributed.comm`;
* ``zero-redundancy-optimizer`` (**modelled**, not trained): ``adamw-ddp``'s all-reduce plus
  ``ZeroRedundancyOptimizer``'s per-step broadcast of every parameter, ring model.

``parallel="fsdp"`` (FSDP2 ``fully_shard`` per block and at the root): ``muon`` =
:class:`muonscale.DTensorMuon` vs ``adamw`` = ``torch.optim.AdamW`` on the same sharded model.
Reported wire bytes are the **optimizer's own** (DTensorMuon's owner all-to-all and its
non-finite flag all-reduce; AdamW on shards sends nothing); FSDP's all-gathers and
reduce-scatters are the framework's and the same for both contenders, so they are not counted.

``parallel="tp"`` (all ranks one TP group) and ``"fsdp+tp"`` (2 x 2 mesh, nproc 4): Megatron-
style TP of the reference GPT via ``parallelize_module`` (fused QKV and MLP fc column-parallel,
sharded by whole key/value groups; output projections row-parallel; embeddings, norms, head
replicated), then FSDP2 over the "dp" axis for ``fsdp+tp``; contenders and wire bytes as for
``fsdp``. The data is split over the data-parallel ranks only.

Every byte count uses the ring model of :mod:`muonscale.distributed.comm`; per-rank numbers are
reported as mean and max over ranks.
"""

from __future__ import annotations

import datetime
import gc
import json
import math
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import torch

DP_CONTENDERS = ("muon", "muon-bf16reduce", "adamw-zero1", "adamw-ddp")
FSDP_CONTENDERS = ("muon", "adamw")
MODELLED_ZERO = "zero-redundancy-optimizer"
PARALLEL_MODES = ("dp", "fsdp", "tp", "fsdp+tp")

# Small enough that 30 interleaved steps of every dp contender take ~1-2 min on 2 CPU cores.
DEFAULT_MODEL = dict(n_layer=2, d_model=128, n_head=4, context_length=64)
# bench defaults (muonscale/bench/config.py DEFAULT_LR): muon 1.6e-2 (scale=match_rms_adamw,
# its AdamW half uses the same lr), AdamW 2e-3.
DEFAULT_LRS = {"muon": 1.6e-2, "adamw": 2e-3}
WEIGHT_DECAY = 0.1  # every contender (AdamW: >= 2-D parameters only)
ADAMW_BETAS = (0.9, 0.95)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _check_parallel(parallel: str, nproc: int, model_config=None) -> None:
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
    if nproc < 2:
        raise ValueError(f"the distributed bench needs nproc >= 2, got {nproc}")
    if parallel == "fsdp+tp" and nproc != 4:
        raise ValueError(f"parallel='fsdp+tp' runs on a 2 x 2 mesh: nproc must be 4, got {nproc}")
    if parallel in ("tp", "fsdp+tp") and model_config is not None:
        tp = _mesh_shape(parallel, nproc)[1]
        if model_config.mlp != "gelu":
            raise NotImplementedError(
                f"the TP plan of the distributed bench covers the gelu MLP (fc, proj), not "
                f"mlp={model_config.mlp!r} (its gate projection would need its own rule)"
            )
        if model_config.tie_embeddings and parallel == "fsdp+tp":
            raise NotImplementedError(
                "fsdp+tp with tie_embeddings: replicating wte and lm_head on the tp axis "
                "module by module would untie them"
            )
        if model_config.kv_heads % tp:
            raise ValueError(
                f"tensor parallel over {tp} ranks shards the fused QKV by whole key/value groups: "
                f"the model's {model_config.kv_heads} key/value heads must be divisible by {tp}"
            )


def _mesh_shape(parallel: str, nproc: int) -> tuple[int, int]:
    """(data-parallel size, tensor-parallel size) of ``parallel`` on ``nproc`` ranks (mesh
    ``(dp, tp)`` row-major: the TP ranks of one replica are consecutive)."""
    if parallel == "tp":
        return 1, nproc
    if parallel == "fsdp+tp":
        return 2, nproc // 2
    return nproc, 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ per-rank pieces
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
            total, self.breakdown = self.counter.take()
        else:
            total, self.breakdown = self.opt.last_step_wire_bytes, self.opt.last_step_wire_breakdown
        self.wire.append(int(total))

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


def _dp_contenders(model_config, lrs, seed, reduce_dtypes) -> list[_Contender]:
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
            **_muon_options(model, lrs["muon"]),
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
    comm = Communicator()

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

    from muonscale.distributed import DTensorMuon
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
    muon = DTensorMuon(model.named_parameters(), **_muon_options(model, lrs["muon"]))
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

    from muonscale.distributed import DTensorMuon
    from muonscale.train.model import GPT

    dp, tp = _mesh_shape(parallel, world_size)
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
    muon = DTensorMuon(model.named_parameters(), **options)
    out = [_Contender("muon", model, muon)]
    model, _ = sharded()
    # foreach=False: the parameter list mixes DTensors (TP) and plain tensors (replicated)
    adamw = _torch_adamw(model, lrs["adamw"], foreach=False)
    adamw.last_step_wire_bytes, adamw.last_step_wire_breakdown = 0, {}  # sends nothing itself
    out.append(_Contender("adamw", model, adamw))
    return out


def _worker(rank: int, world_size: int, port: int, spec: dict, queue) -> None:
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
    dp_size, tp_size = _mesh_shape(spec["parallel"], world_size)
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


# ------------------------------------------------------------------ driver + report
def run_distributed_bench(
    *,
    nproc: int,
    parallel: str = "dp",
    steps: int = 30,
    model_overrides: dict | None = None,
    lrs: dict | None = None,
    seed: int = 0,
    out_dir: str | os.PathLike | None = None,
    reduce_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    preset: str = "tiny",
    global_batch: int = 8,
    warmup_steps: int = 5,
    eval_batches: int = 4,
    timeout_s: float = 900.0,
    print_table: bool = True,
) -> dict:
    """Train every contender of ``parallel`` on ``nproc`` gloo processes, side by side.

    Args:
        nproc: processes (ranks) to spawn, >= 2.
        parallel: "dp" (DistributedMuon / ZeRO-1 / DDP), or "fsdp", "tp", "fsdp+tp" (nproc 4)
            (DTensorMuon vs torch AdamW on the same DTensor model).
        steps: optimizer steps per contender (interleaved).
        model_overrides: ``ModelConfig`` overrides of ``preset`` (default: 2 layers, d_model
            128, 4 heads, context 64).
        lrs: peak learning rates ``{"muon": ..., "adamw": ...}`` (default: the bench's).
        seed: init and data seed (the same for every contender).
        out_dir: where to write ``report.json`` and ``report.md`` (None: nowhere).
        reduce_dtypes: gradient-reduction dtypes of the dp Muon contenders ("float32" gives
            ``muon``, "bfloat16" gives ``muon-bf16reduce``).
        global_batch: windows per step over all ranks (split over the data-parallel ranks).
        warmup_steps: linear lr warm-up, then constant.
        eval_batches: validation batches of 8 windows (fixed, evaluated at the end).

    Returns the report dict (also written to ``out_dir``); its ``rows`` map contender names to
    final_train_loss, val_loss, tokens_per_s (global), optimizer_step_ms (median over steps,
    max over ranks), wire_bytes_per_step and optimizer_state_bytes ({"mean", "max"} over ranks).
    """
    from muonscale.train.config import model_preset

    overrides = {**DEFAULT_MODEL, **(model_overrides or {})}
    _check_parallel(parallel, nproc, model_preset(preset, **overrides))
    dp_size = _mesh_shape(parallel, nproc)[0]
    if global_batch % dp_size:
        raise ValueError(
            f"global_batch={global_batch} must be divisible by the {dp_size} data-parallel ranks"
        )
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if parallel == "dp" and "float32" not in reduce_dtypes:
        raise ValueError("reduce_dtypes must include 'float32' (the muon reference row)")
    for name in reduce_dtypes:
        if name not in DTYPES:
            raise ValueError(f"unknown reduce dtype {name!r}; choose from {tuple(DTYPES)}")
    reduce_dtypes = ("float32", *[d for d in reduce_dtypes if d != "float32"])
    spec = {
        "parallel": parallel,
        "steps": steps,
        "preset": preset,
        "model_overrides": overrides,
        "lrs": {**DEFAULT_LRS, **(lrs or {})},
        "seed": seed,
        "reduce_dtypes": reduce_dtypes,
        "global_batch": global_batch,
        "warmup_steps": warmup_steps,
        "eval_batches": eval_batches,
        "pg_timeout_s": 120.0,
    }
    start = time.perf_counter()
    result = _launch(nproc, spec, timeout_s)
    report = _build_report(result, spec, nproc, time.perf_counter() - start)
    table = format_table(report)
    if print_table:
        print(table)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (out / "report.md").write_text(table + "\n")
    return report


def _launch(nproc: int, spec: dict, timeout_s: float) -> dict:
    import queue as queue_module

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = _free_port()
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, nproc, port, spec, results), daemon=True)
        for r in range(nproc)
    ]
    for p in procs:
        p.start()
    out, errors = None, []
    deadline = time.monotonic() + timeout_s
    try:
        for _ in range(nproc):
            try:
                status, rank, payload = results.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_module.Empty:
                errors.append(f"no result from some rank within {timeout_s:.0f} s")
                break
            if status == "error":
                errors.append(f"rank {rank}: {payload}")
            elif rank == 0:
                out = payload
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    if errors or out is None:
        raise RuntimeError(
            "distributed bench failed:\n" + "\n".join(errors or ["no rank-0 result"])
        )
    return out


def _build_report(result: dict, spec: dict, nproc: int, seconds: float) -> dict:
    rows = result["rows"]
    notes = []
    report: dict[str, Any] = {
        "parallel": spec["parallel"],
        "nproc": nproc,
        "steps": spec["steps"],
        "seed": spec["seed"],
        "global_batch": spec["global_batch"],
        "tokens_per_step": spec["global_batch"] * result["model_config"]["context_length"],
        "lrs": spec["lrs"],
        "model": {"preset": spec["preset"], **result["model_config"]},
        "n_params": result["n_params"],
        "single_process_muon_state_bytes": result["single_process_muon_state_bytes"],
        "wall_seconds": seconds,
        "rows": rows,
        "wire_model": "ring: all-reduce 2(N-1)/N*S; reduce-scatter, all-gather, all-to-all, "
        "broadcast (N-1)/N*S; bytes sent per rank per optimizer step",
    }
    for row in rows.values():
        row["modelled"] = False
    if spec["parallel"] == "dp":
        ddp = rows["adamw-ddp"]
        zero_bytes = ddp["wire_bytes_per_step"]["mean"] + result["zero_broadcast_bytes"]
        zero_max = ddp["wire_bytes_per_step"]["max"] + result["zero_broadcast_bytes"]
        rows[MODELLED_ZERO] = {
            "modelled": True,
            "wire_bytes_per_step": {"mean": zero_bytes, "max": zero_max},
            "note": "modelled, not trained: adamw-ddp's counted all-reduce + ZeroRedundancy"
            "Optimizer's broadcast of every parameter from its owner (ring model)",
        }
        zero1 = rows["adamw-zero1"]["wire_bytes_per_step"]["mean"]
        ddp_bytes = ddp["wire_bytes_per_step"]["mean"]
        for row in rows.values():
            mean = row["wire_bytes_per_step"]["mean"]
            row["wire_vs_adamw_zero1"] = mean / zero1 if zero1 else math.nan
            row["wire_vs_adamw_ddp"] = mean / ddp_bytes if ddp_bytes else math.nan
        muon = rows["muon"]
        report["ratios"] = {
            "muon_wire_vs_adamw_zero1": muon["wire_vs_adamw_zero1"],
            "muon_wire_vs_adamw_ddp": muon["wire_vs_adamw_ddp"],
            "muon_state_max_vs_single_process": muon["optimizer_state_bytes"]["max"]
            / result["single_process_muon_state_bytes"],
        }
        for name, row in rows.items():
            if name.startswith("muon-") and name.endswith("reduce"):
                row["final_train_loss_minus_muon"] = (
                    row["final_train_loss"] - muon["final_train_loss"]
                )
                row["val_loss_minus_muon"] = row["val_loss"] - muon["val_loss"]
                row["wire_vs_muon"] = row["wire_bytes_per_step"]["mean"] / max(
                    1.0, muon["wire_bytes_per_step"]["mean"]
                )
    else:
        dp_size, tp_size = _mesh_shape(spec["parallel"], nproc)
        report["mesh"] = {"dp": dp_size, "tp": tp_size}
        notes.append(
            "wire bytes are the optimizer's own (DTensorMuon's owner all-to-all + a non-finite "
            "flag all-reduce; torch AdamW on shards sends nothing); the framework's collectives "
            "(FSDP all-gathers / reduce-scatters, TP activation all-reduces) are not counted and "
            "are identical for both contenders"
        )
        if tp_size > 1:
            notes.append(
                "TP plan: attn.qkv and mlp.fc column-parallel (QKV rows by whole key/value "
                "group), attn.proj and mlp.proj row-parallel; embeddings, norms and head "
                "replicated; the TP ranks of one replica see the same batch"
            )
        muon = rows["muon"]
        report["ratios"] = {
            "muon_state_max_vs_single_process": muon["optimizer_state_bytes"]["max"]
            / result["single_process_muon_state_bytes"],
        }
    notes.append(
        "wall-clock figures come from processes sharing the same cores (interleaved contenders, "
        "so noise is shared); byte counts are exact under the ring model"
    )
    report["notes"] = notes
    return report


def _fmt_bytes(n: float) -> str:
    return f"{n:,.0f}"


def format_table(report: dict) -> str:
    """Markdown table of a :func:`run_distributed_bench` report."""
    rows = report["rows"]
    dp = report["parallel"] == "dp"
    head = (
        f"distributed bench: parallel={report['parallel']}, {report['nproc']} gloo ranks, "
        f"{report['steps']} steps x {report['tokens_per_step']} tokens, "
        f"{report['n_params'] / 1e6:.2f}M params (n_layer {report['model']['n_layer']}, "
        f"d_model {report['model']['d_model']}), seed {report['seed']}, lrs {report['lrs']}"
    )
    cols = [
        "contender",
        "train loss",
        "val loss",
        "tokens/s",
        "opt step ms",
        "wire B/step/rank mean",
        "max",
    ]
    if dp:
        cols += ["vs adamw-zero1", "vs adamw-ddp"]
    cols += ["state B/rank mean", "max"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, row in rows.items():
        wire = row["wire_bytes_per_step"]
        if row.get("modelled"):
            cells = [f"{name} (modelled)", "—", "—", "—", "—"]
        else:
            cells = [
                name,
                f"{row['final_train_loss']:.4f}",
                f"{row['val_loss']:.4f}",
                f"{row['tokens_per_s']:,.0f}",
                f"{row['optimizer_step_ms']:.1f}",
            ]
        cells += [_fmt_bytes(wire["mean"]), _fmt_bytes(wire["max"])]
        if dp:
            cells += [f"{row['wire_vs_adamw_zero1']:.3f}", f"{row['wire_vs_adamw_ddp']:.3f}"]
        if row.get("modelled"):
            cells += ["—", "—"]
        else:
            state = row["optimizer_state_bytes"]
            cells += [_fmt_bytes(state["mean"]), _fmt_bytes(state["max"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    single = report["single_process_muon_state_bytes"]
    muon_state = rows["muon"]["optimizer_state_bytes"]["max"]
    lines.append(
        f"optimizer state: single-process muonscale.Muon {single:,} B; distributed muon max per "
        f"rank {muon_state:,.0f} B ({muon_state / single:.3f}x)"
    )
    for name, row in rows.items():
        if "final_train_loss_minus_muon" in row:
            lines.append(
                f"{name}: train loss {row['final_train_loss_minus_muon']:+.4f}, val loss "
                f"{row['val_loss_minus_muon']:+.4f} vs muon (fp32 reduce); wire "
                f"{row['wire_vs_muon']:.3f}x muon's"
            )
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
