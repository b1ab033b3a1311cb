"""Per-rank side of the distributed bench (:mod:`muonscale.bench.distributed`): the contenders
each rank builds (model + optimizer), the spawned worker that trains them interleaved, and what
it measures per rank (losses, step times, bytes on the wire, optimizer state).

Every contender is built from the ``TrainConfig`` that the single-process bench trains
(:func:`muonscale.bench.runner.train_config_for`), parallelized by the functions of
:mod:`muonscale.train.parallel` and stepped as :class:`muonscale.train.TrainingRun` steps:
micro-batches with gradient accumulation, global gradient clipping, the LR schedule, QK-clip.
The driver that spawns the workers and the report live in :mod:`muonscale.bench.distributed`.
"""

from __future__ import annotations

import datetime
import gc
import statistics
import time
from typing import Any

import torch

from muonscale.train.optimizers import DTYPES, adamw_for, muon_options
from muonscale.train.parallel import (
    apply_tensor_parallel,
    clip_grad_norm_,
    gradient_sync,
    mesh_shape,
    shard_fsdp,
    wrap_ddp,
)

__all__ = [
    "Contender",
    "DTYPES",
    "dp_contenders",
    "mesh_shape",
    "run_worker",
    "sharded_contenders",
    "single_process_muon_state_bytes",
    "zero_redundancy_broadcast_bytes",
]


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


class Contender:
    """One model + optimizer on this rank, stepped as ``TrainingRun.step`` steps its own, and
    what its steps measured. ``config``: the contender's ``TrainConfig`` (schedule, gradient
    clipping, QK-clip); ``counter``: the ``WireCounter`` of a DDP comm hook (None: the
    optimizer's ``last_step_wire_bytes``)."""

    def __init__(
        self, name: str, config, model, opt, forward_model=None, counter=None, probe=False
    ) -> None:
        from muonscale.qk_clip import QKClip
        from muonscale.train.schedule import build_scheduler, schedule_for

        self.name, self.config, self.model, self.opt = name, config, model, opt
        self.forward_model = forward_model if forward_model is not None else model
        self.counter = counter
        self.scheduler = build_scheduler(opt, schedule_for(config))
        self.qk_clip = (
            None if config.qk_clip is None else QKClip(model.qk_clip_targets(), tau=config.qk_clip)
        )
        self.probe = probe or self.qk_clip is not None
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.opt_s: list[float] = []
        self.wire: list[int] = []
        self.max_logits: list[float] = []
        self.breakdown: dict[str, int] = {}
        self.links: list[dict[str, int]] = []  # per step: bytes by link class
        self.expert_tokens: list[list[list[int]]] = []  # per step (n_layer, E), --mlp moe

    def train_step(self, micro_batches) -> None:
        """One optimizer step over ``micro_batches`` (this rank's rows of each)."""
        if self.counter is not None:
            self.counter.reset()
        start = time.perf_counter()
        self.model.train()
        loss_sum = torch.zeros(())
        for index, (inputs, targets) in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with gradient_sync(self.model, self.forward_model, self.opt, reduce=last):
                _, loss = self.forward_model(inputs, targets, probe_max_logits=self.probe)
                (loss / len(micro_batches)).backward()
            loss_sum += loss.detach()
        if self.config.grad_clip:
            clip_grad_norm_(self.model, self.opt, self.config.grad_clip)
        opt_start = time.perf_counter()
        self.opt.step()
        end = time.perf_counter()
        if self.qk_clip is not None:  # maxima MAX-reduced over the ranks inside QKClip
            self.max_logits.append(self.qk_clip(self.model.pop_max_attention_logits()).max().item())
        elif self.probe:  # recorded only: this rank's maxima (MAX over ranks in the report)
            self.max_logits.append(
                max(m.max().item() for m in self.model.pop_max_attention_logits())
            )
        if self.model.moe_blocks():  # the global batch's counts (summed over the ranks)
            self.expert_tokens.append(self.model.pop_expert_tokens().tolist())
        self.scheduler.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append((loss_sum / len(micro_batches)).item())
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
        losses = [self.model(x, y)[1].float() for x, y in batches]
        self.model.train()
        return torch.stack(losses).mean().item()

    def release(self) -> None:
        if hasattr(self.opt, "remove_hooks"):
            self.opt.remove_hooks()
        self.model = self.opt = self.forward_model = self.scheduler = self.qk_clip = None


def _fresh_model(config):
    """The contender's model, its MoE blocks' token counts summed over the ranks (every
    contender's ranks split one global batch, whatever the parallelism)."""
    from muonscale.distributed import Communicator
    from muonscale.train.model import GPT

    torch.manual_seed(config.seed)
    model = GPT(config.model_config())
    if model.moe_blocks() and torch.distributed.is_initialized():
        comm = Communicator()
        model.set_expert_count_reduction(lambda counts: comm.all_reduce(counts, tag="control"))
    return model


def _variant_kwargs(options) -> dict[str, Any]:
    from muonscale.bench.variants import to_muon_kwargs

    return to_muon_kwargs(options or {})


def dp_contenders(
    muon,
    adamw,
    reduce_dtypes=("float32",),
    *,
    variants=None,
    hosts=None,
    probe=False,
    bucket_cap_mb: float = 25.0,
) -> list[Contender]:
    """DistributedMuon per reduce dtype (``muon``: float32), the ``variants``
    (``{name: (TrainConfig, Muon options)}``), ZeRO-1 AdamW and DDP AdamW, from the
    ``TrainConfig`` s ``muon`` and ``adamw``; ``hosts``: the
    :class:`~muonscale.distributed.hosts.HostMap` that DDP's all-reduce is counted with;
    ``probe``: measure every contender's maximum attention logit (``--track-max-logit``);
    ``bucket_cap_mb``: every contender's gradient bucket size (DDP's and DistributedMuon's)."""
    from muonscale.distributed import Communicator, DistributedMuon

    out = []
    muon_runs = [
        ("muon" if d == "float32" else f"muon-{_short(d)}reduce", muon, None, d)
        for d in reduce_dtypes
    ]
    muon_runs += [
        (name, cfg, options, "float32") for name, (cfg, options) in (variants or {}).items()
    ]
    for name, config, options, dtype_name in muon_runs:
        model = _fresh_model(config)
        reduce_dtype = None if dtype_name == "float32" else DTYPES[dtype_name]
        opt = DistributedMuon(
            model.named_parameters(),
            reduce_dtype=reduce_dtype,
            bucket_cap_mb=bucket_cap_mb,
            **{**muon_options(model, config), **_variant_kwargs(options)},
        )
        out.append(Contender(name, config, model, opt, probe=probe))
    model = _fresh_model(adamw)
    opt = DistributedMuon(
        model.named_parameters(),
        rules=[(".*", "adamw")],
        lr=adamw.lr,
        weight_decay=adamw.weight_decay,
        adamw_betas=tuple(adamw.adamw_betas),
        bucket_cap_mb=bucket_cap_mb,
    )
    out.append(Contender("adamw-zero1", adamw, model, opt, probe=probe))

    model = _fresh_model(adamw)
    comm = Communicator(hosts=hosts)

    def all_reduce_hook(state, bucket):  # DDP's default: pre-divide + all-reduce, counted
        buf = bucket.buffer().div_(comm.world_size)
        work = comm.all_reduce(buf, tag="ddp", async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    ddp = wrap_ddp(model, torch.device("cpu"), bucket_cap_mb)
    ddp.register_comm_hook(None, all_reduce_hook)
    opt = adamw_for(model, adamw)
    out.append(
        Contender(
            "adamw-ddp",
            adamw,
            model,
            opt,
            forward_model=ddp,
            counter=comm.counter,
            probe=probe,
        )
    )
    return out


def _short(dtype_name: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype_name, dtype_name)


def sharded_contenders(
    muon, adamw, parallel, world_size, *, variants=None, probe=False
) -> list[Contender]:
    """DTensorMuon (``muon`` and the ``variants``) vs ``torch.optim.AdamW`` on the same FSDP2
    (``parallel="fsdp"``), tensor-parallel (``"tp"``) or both (``"fsdp+tp"``) model."""
    from torch.distributed.device_mesh import init_device_mesh

    from muonscale.distributed import distributed_muon

    dp, tp = mesh_shape(parallel, world_size)
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))

    def sharded(config):
        model = _fresh_model(config)
        if parallel == "fsdp":
            splits = {name: model.qkv_layout for name in model.qkv_param_names()}
            shard_fsdp(model, mesh["dp"])
        else:
            splits = apply_tensor_parallel(model, mesh)
        return model, splits

    out = []
    runs = [("muon", muon, None), *((n, c, o) for n, (c, o) in (variants or {}).items())]
    for name, config, options in runs:
        model, splits = sharded(config)
        kwargs = {**muon_options(model, config), "splits": splits, **_variant_kwargs(options)}
        opt = distributed_muon(model.named_parameters(), **kwargs)
        out.append(Contender(name, config, model, opt, probe=probe))
    model, _ = sharded(adamw)
    opt = adamw_for(model, adamw, fused=False)
    if parallel != "fsdp":  # the parameter list mixes DTensors (TP) and plain tensors
        for group in opt.param_groups:
            group["foreach"] = False
    opt.last_step_wire_bytes, opt.last_step_wire_breakdown = 0, {}  # sends nothing itself
    out.append(Contender("adamw", adamw, model, opt, probe=probe))
    return out


def run_worker(rank: int, world_size: int, port: int, spec: dict, queue) -> None:
    import warnings

    import torch.distributed as dist

    torch.set_num_threads(spec["threads"] or 1)
    # the root FSDP module returns (logits, loss); we never modify them in place
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    contenders: list[Contender] = []
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


def build_contenders(bench, lrs: dict, world_size: int, reduce_dtypes) -> list[Contender]:
    """The contenders of ``bench.parallel``, each from its single-process ``TrainConfig``."""
    from muonscale.bench.runner import train_config_for

    muon = train_config_for(bench, "muon", lrs["muon"])
    adamw = train_config_for(bench, "adamw", lrs["adamw"])
    variants = {
        name: (train_config_for(bench, name, lrs[name]), bench.variant_options(name))
        for name in bench.parsed_variants
    }
    probe = bench.track_max_logit
    if bench.parallel == "dp":
        return dp_contenders(muon, adamw, reduce_dtypes, variants=variants, probe=probe)
    return sharded_contenders(
        muon, adamw, bench.parallel, world_size, variants=variants, probe=probe
    )


def _run_rank(rank: int, world_size: int, spec: dict, contenders: list) -> dict | None:
    import torch.distributed as dist

    from muonscale.bench.config import BenchConfig
    from muonscale.bench.runner import bundled_corpus_text, train_config_for
    from muonscale.bench.side_by_side import eval_steps_for
    from muonscale.distributed import gather_wire_stats
    from muonscale.train.data import TokenDataset, load_corpus, make_tokenizer

    bench = BenchConfig(**spec["bench"])
    config = train_config_for(bench, "muon", spec["lrs"]["muon"])  # data, batch, seed: shared
    model_config = config.model_config()
    text = bundled_corpus_text(bench.corpus) if bench.corpus else load_corpus(bench.data)
    dataset = TokenDataset.from_text(
        text,
        make_tokenizer(config, text),
        context_length=model_config.context_length,
        val_fraction=config.val_fraction,
    )
    val = dataset.validation_batches(
        n_batches=config.eval_batches, batch_size=config.micro_batch_size
    )
    seed, steps = config.seed, config.steps
    batch = config.micro_batch_size
    dp_size, tp_size = mesh_shape(bench.parallel, world_size)
    per_rank, dp_rank = batch // dp_size, rank // tp_size  # TP ranks of one replica: same data
    mine = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    contenders.extend(build_contenders(bench, spec["lrs"], world_size, spec["reduce_dtypes"]))
    eval_steps = eval_steps_for(steps, bench.eval_interval)
    val_losses: dict[str, list[float]] = {c.name: [] for c in contenders}
    from muonscale.train.run_log import progress_bar

    bar = progress_bar(spec["progress"] and rank == 0, total=steps, initial=0)
    for step in range(steps + 1):
        if step in eval_steps:  # every rank (FSDP's forward is collective); rank 0's kept
            for c in contenders:
                val_losses[c.name].append(c.evaluate(val))
        if step == steps:
            break
        micro_batches = [
            (x[mine], y[mine])
            for x, y in dataset.train_batch(
                seed=seed,
                step=step,
                batch_size=batch,
                micro_steps=config.gradient_accumulation_steps,
            )
        ]
        for c in contenders:  # interleaved: every contender does step `step` before step+1
            c.train_step(micro_batches)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    skip = min(bench.timing_warmup_steps, steps - 1)
    timed = slice(skip, None)  # the first steps warm up (lazy state etc.)
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
        n_timed = len(c.step_s[timed])
        rows[c.name] = {
            "lr": c.config.lr,
            "final_train_loss": losses[-1].item(),
            "train_losses": losses.tolist(),
            "val_loss": val_losses[c.name][-1],
            "val_losses": val_losses[c.name],
            "eval_steps": eval_steps,
            "tokens_per_s": n_timed * config.tokens_per_step / step_s.item(),
            "optimizer_step_ms": opt_ms_stats["max"] / 1e3,
            "optimizer_step_ms_mean": opt_ms_stats["mean"] / 1e3,
            "wire_bytes_per_step": {"mean": wire["mean"], "max": wire["max"]},
            "wire_breakdown_rank0": c.breakdown,
            "optimizer_state_bytes": {"mean": state["mean"], "max": state["max"]},
            "wire_steps_equal": all(w == c.wire[-1] for w in c.wire[timed]),
            "step_seconds": list(c.step_s),  # this rank's (rank 0's is reported)
            "timed_steps": n_timed,
        }
        muon_groups = [g for g in c.opt.param_groups if g.get("algorithm") == "muon"]
        if muon_groups:  # what the Muon half runs in (--ns-dtype, --momentum-dtype)
            rows[c.name]["muon_dtypes"] = {
                key: str(muon_groups[0].get(key)) for key in ("ns_dtype", "momentum_dtype")
            }
        if c.expert_tokens:  # --mlp moe: equal on every rank (global counts)
            from muonscale.bench.moe import expert_load, optimizer_facts

            rows[c.name]["expert_tokens"] = c.expert_tokens
            rows[c.name]["expert_load"] = expert_load(c.expert_tokens)
            rows[c.name]["moe"] = optimizer_facts(c.model, c.opt)
        if c.probe:
            logits = torch.tensor(c.max_logits, dtype=torch.float64)
            dist.all_reduce(logits, op=dist.ReduceOp.MAX)
            rows[c.name]["max_attention_logits"] = logits.tolist()
    if rank != 0:
        return None
    reference = contenders[0].model
    extra = {
        "torch_threads": torch.get_num_threads(),  # per rank: --threads
        "n_params": sum(p.numel() for p in reference.parameters()),
        "model_config": {
            k: getattr(model_config, k)
            for k in ("vocab_size", "context_length", "n_layer", "d_model", "n_head")
        },
    }
    if bench.parallel == "dp":
        extra["single_process_muon_state_bytes"] = single_process_muon_state_bytes(reference)
        extra["zero_broadcast_bytes"] = zero_redundancy_broadcast_bytes(reference, world_size)
    else:  # full-size model to count from (the sharded one holds DTensors)
        extra["single_process_muon_state_bytes"] = single_process_muon_state_bytes(
            _fresh_model(config)
        )
    return {"rows": rows, **extra}
