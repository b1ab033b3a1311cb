"""Bytes on the wire per optimizer step per rank: DistributedMuon vs AdamW (DDP, ZeRO-1, torch's
ZeroRedundancyOptimizer), all counted by ``muonscale.distributed.comm`` with the ring model.

    # GPT-2-small shapes, 4 gloo ranks
    PYTHONPATH=. python3 benchmarks/wire_bytes.py
    PYTHONPATH=. python3 benchmarks/wire_bytes.py --world-size 8 --simulate \\
        --rows muon,muon-bf16,zero1
    # `muonscale bench`'s model
    PYTHONPATH=. python3 benchmarks/wire_bytes.py --preset bench-dp --world-size 4
    PYTHONPATH=. python3 benchmarks/wire_bytes.py --preset tiny --world-size 2 --json

Launches N gloo processes itself (or runs under ``torchrun``). Presets: ``gpt2-small`` and
``tiny`` are GPT-2's parameter shapes (tied embedding/head); ``bench-dp`` is the 2-layer
d_model-128 GPT of ``muonscale bench --parallel dp`` (``muonscale.train.model.GPT``, fused QKV
orthogonalized per Q/K/V block as the bench does). Gradients come from a cheap synthetic loss
through a real backward, so DistributedMuon's reductions start in its gradient hooks as in
training.

Rows (one optimizer step, after one warm-up step):

* DistributedMuon, fp32 reduce; and with ``reduce_dtype=torch.bfloat16`` (Muon gradients).
* ZeRO-1 AdamW: the same machinery with every parameter routed to AdamW (reduce-scatter +
  all-gather of flat shards).
* AdamW under DDP: ``DistributedDataParallel`` with a comm hook that sends each gradient bucket
  through ``comm.all_reduce`` (so DDP's real buckets are counted).
* torch ``ZeroRedundancyOptimizer``: the DDP all-reduce (as above) + its per-step broadcast of
  every parameter from its owner, counted from its partition with the same ring model
  (``broadcast`` = (N−1)/N·S).

``--simulate`` runs the ranks one at a time on torch's fake process group (collectives move no
data; the optimizer hands ``comm.py`` the same buffers, so the counts are the same: checked
against gloo at 4 ranks), for world sizes whose N processes do not fit in memory.

``--rows`` picks a subset (``muon,muon-bf16,zero1,ddp,zero``; default all). For the
DistributedMuon rows the report adds the owner layout: Newton–Schulz FLOPs per rank (max/mean),
Muon elements owned per rank (max/mean), and the owner-stream padding and AdamW fill elements.

Newton–Schulz steps do not change any byte count; ``--ns-steps`` defaults to 1 to keep the run
short on CPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import queue as queue_module
import socket

import torch
import torch.distributed as dist
from torch import nn

PRESETS = {
    # name: (vocab, context, d_model, n_layer) of GPT2Params
    "gpt2-small": (50257, 1024, 768, 12),
    "tiny": (512, 64, 64, 4),
}
BENCH_PRESET = "bench-dp"  # muonscale.bench.distributed's default model (a real GPT)
ROWS = {
    "muon": "DistributedMuon (fp32 reduce)",
    "muon-bf16": "DistributedMuon (bf16 Muon reduce)",
    "zero1": "ZeRO-1 AdamW (reduce-scatter + all-gather)",
    "ddp": "AdamW under DDP (all-reduce)",
    "zero": "torch ZeroRedundancyOptimizer (all-reduce + broadcast)",
}


class _SyntheticLoss(torch.autograd.Function):
    """``Σ_p ⟨p, R_p⟩``, R_p drawn from a generator seeded with ``seed`` (grad of p = R_p).
    Nothing is saved for backward: R_p is drawn again there (GPT-2-sized runs at 8 ranks)."""

    @staticmethod
    def forward(ctx, seed: int, *params: torch.Tensor) -> torch.Tensor:
        ctx.seed, ctx.shapes = seed, [p.shape for p in params]
        g = torch.Generator().manual_seed(seed)
        total = torch.zeros((), dtype=torch.float64)
        for p in params:
            total += (p.detach() * torch.randn(p.shape, generator=g)).sum().double()
        return total.float()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        g = torch.Generator().manual_seed(ctx.seed)
        grads = []
        for shape in ctx.shapes:
            grads.append(torch.randn(shape, generator=g) * grad_out)
        return (None, *grads)


def _synthetic_loss(module: nn.Module, seed: int) -> torch.Tensor:
    """``Σ_p ⟨p, R_p⟩`` over the parameters, R_p a fixed random tensor (grad = R_p)."""
    params = list(module.parameters())
    return _SyntheticLoss.apply(seed, *params)


class GPT2Params(nn.Module):
    """GPT-2's parameters (tied head) with the synthetic loss."""

    def __init__(self, vocab: int, context: int, d: int, n_layer: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList()
        for _ in range(n_layer):
            block = nn.Module()
            block.ln_1 = nn.LayerNorm(d)
            block.c_attn = nn.Linear(d, 3 * d)
            block.c_proj = nn.Linear(d, d)
            block.ln_2 = nn.LayerNorm(d)
            block.c_fc = nn.Linear(d, 4 * d)
            block.mlp_proj = nn.Linear(4 * d, d)
            self.h.append(block)
        self.ln_f = nn.LayerNorm(d)

    def forward(self, seed: int) -> torch.Tensor:
        return _synthetic_loss(self, seed)


BENCH_DP_MODEL = dict(n_layer=2, d_model=128, n_head=4, context_length=64)
"""The model of the distributed bench figures in BENCHMARKS.md (``--preset bench-dp``)."""


def _build(preset: str) -> tuple[nn.Module, object, dict]:
    """(module whose forward(seed) is the synthetic loss, params for DistributedMuon, options)."""
    if preset != BENCH_PRESET:
        model = GPT2Params(*PRESETS[preset])
        return model, model, {}
    from muonscale.train.config import model_preset
    from muonscale.train.model import GPT

    class SyntheticGPT(GPT):
        def forward(self, seed: int) -> torch.Tensor:  # type: ignore[override]
            return _synthetic_loss(self, seed)

    model = SyntheticGPT(model_preset("tiny", **BENCH_DP_MODEL))
    splits = {name: model.qkv_layout for name in model.qkv_param_names()}  # as the bench
    return model, None, {"splits": splits}


def _one_step(model, opt, seed: int) -> None:
    opt.zero_grad()
    model(seed).backward()
    opt.step()


def _measure_distributed_muon(model, params, **kw) -> tuple[int, dict, int, dict]:
    from muonscale.distributed import DistributedMuon

    opt = DistributedMuon(model.named_parameters() if params is None else params, **kw)
    for seed in range(2):
        _one_step(model, opt, seed)
    out = (
        opt.last_step_wire_bytes,
        opt.last_step_wire_breakdown,
        opt.optimizer_state_bytes(),
        opt.layout_stats(),
    )
    opt.remove_hooks()
    del opt
    gc.collect()
    return out


def _measure_ddp(model, zero: bool) -> tuple[int, dict, int]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from muonscale.distributed.comm import Communicator

    comm = Communicator()

    def all_reduce_hook(state, bucket):  # DDP's default: average = pre-divide + all-reduce
        buf = bucket.buffer().div_(comm.world_size)
        work = comm.all_reduce(buf, tag="ddp", async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    ddp = DDP(model)
    ddp.register_comm_hook(None, all_reduce_hook)
    if zero:
        opt = ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        )
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for seed in range(2):
        comm.counter.reset()
        opt.zero_grad()
        ddp(seed).backward()
        opt.step()
        if zero:  # it broadcasts every parameter from its owner rank after the local step
            for rank_params in opt._partition_parameters():
                for group in rank_params:
                    for p in group["params"]:
                        comm.counter.record(
                            "broadcast", p.numel() * p.element_size(), comm.world_size, "zero"
                        )
    local = opt.optim if zero else opt  # ZeroRedundancyOptimizer keeps its shard's state inside
    state = sum(
        v.numel() * v.element_size()
        for s in local.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    out = comm.counter.total, comm.counter.breakdown(), state
    del ddp, opt
    gc.collect()
    return out


def _single_process_state_bytes(model, params) -> int:
    """``muonscale.Muon``'s state on one process, from its routing: momentum per Muon matrix;
    exp_avg, exp_avg_sq and a float32 step per AdamW parameter."""
    from muonscale import route

    named = dict(model.named_parameters())
    total = 0
    for name, decision in route(model if params is model else model.named_parameters()).items():
        p = named[name]
        total += p.numel() * p.element_size() * (1 if decision.algorithm == "muon" else 2)
        total += 4 if decision.algorithm == "adamw" else 0
    return total


def _rank_rows(rank: int, world_size: int, args) -> dict:
    """This rank's measurements of every requested row (the process group is initialized)."""
    torch.manual_seed(0)
    model, params, extra = _build(args.preset)
    muon_kw = dict(
        lr=1e-3,
        ns_steps=args.ns_steps,
        ns_dtype=torch.float32,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    cases = {
        "muon": lambda: _measure_distributed_muon(model, params, **muon_kw, **extra),
        "muon-bf16": lambda: _measure_distributed_muon(
            model, params, reduce_dtype=torch.bfloat16, **muon_kw, **extra
        ),
        "zero1": lambda: _measure_distributed_muon(
            model, params, rules=[(".*", "adamw")], **muon_kw
        ),
        "ddp": lambda: _measure_ddp(model, zero=False),
        "zero": lambda: _measure_ddp(model, zero=True),
    }
    rows = {}
    for key in args.rows:
        total, breakdown, state_bytes, *layout = cases[key]()
        rows[ROWS[key]] = {"bytes": total, "breakdown": breakdown, "state_bytes": state_bytes}
        if layout:
            rows[ROWS[key]]["layout"] = layout[0]
    out = {"rank": rank, "rows": rows, "world_size": world_size, "preset": args.preset}
    out["params"] = sum(p.numel() for p in model.parameters())
    out["single_process_muon_state_bytes"] = _single_process_state_bytes(model, params)
    return out


def _worker(rank: int, world_size: int, port: int, args, queue) -> None:
    torch.set_num_threads(max(1, args.threads))
    if not dist.is_initialized():
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=10),
        )
    try:
        queue.put(_rank_rows(rank, world_size, args))
    finally:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _simulated_worker(rank: int, world_size: int, args, queue) -> None:
    """Rank ``rank`` of ``world_size`` alone, on torch's fake process group: collectives move
    no data, but DistributedMuon hands comm.py the same buffers, so the same bytes are
    counted (checked against gloo: same figures at 4 ranks)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(max(1, args.threads))
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        queue.put(_rank_rows(rank, world_size, args))
    finally:
        dist.destroy_process_group()


def _combine(per_rank: list[dict]) -> dict:
    """Mean and max over ranks of each row's bytes; rank 0's breakdown and layout."""
    per_rank = sorted(per_rank, key=lambda r: r["rank"])
    first = per_rank[0]
    rows = {}
    for name, row in first["rows"].items():
        values = [r["rows"][name]["bytes"] for r in per_rank]
        state = [r["rows"][name]["state_bytes"] for r in per_rank]
        rows[name] = {
            "mean": sum(values) / len(values),
            "max": max(values),
            "breakdown_rank0": row["breakdown"],
            "state_bytes_max": max(state),
        }
        if "layout" in row:
            rows[name]["layout"] = row["layout"]
    keys = ("params", "world_size", "preset", "single_process_muon_state_bytes")
    return {"rows": rows, **{k: first[k] for k in keys}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ratio(values) -> float:
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def _report(result: dict, as_json: bool) -> None:
    rows = result["rows"]
    zero1 = rows.get(ROWS["zero1"], {}).get("mean")
    ddp = rows.get(ROWS["ddp"], {}).get("mean")
    for row in rows.values():
        row["vs_zero1_adamw"] = row["mean"] / zero1 if zero1 else None
        row["vs_ddp_adamw"] = row["mean"] / ddp if ddp else None
        if "layout" in row:
            row["layout"]["ns_flops_max_over_mean"] = _ratio(row["layout"]["ns_flops"])
            row["layout"]["muon_elements_max_over_mean"] = _ratio(row["layout"]["muon_elements"])
    if as_json:
        print(json.dumps(result, indent=2))
        return
    n = result["world_size"]
    print(
        f"bytes on the wire per optimizer step per rank, {result['preset']} "
        f"({result['params'] / 1e6:.1f}M params), {n} {result['ranks']}, ring model"
    )
    print(
        f"{'optimizer':<56} {'mean bytes':>14} {'max bytes':>14} {'vs ZeRO-1':>10} "
        f"{'vs DDP':>8} {'state MB/rank':>14}"
    )

    def ratio(x):
        return f"{x:.4f}" if x is not None else "-"

    for name, row in rows.items():
        print(
            f"{name:<56} {row['mean']:>14,.0f} {row['max']:>14,.0f} "
            f"{ratio(row['vs_zero1_adamw']):>10} {ratio(row['vs_ddp_adamw']):>8} "
            f"{row['state_bytes_max'] / 1e6:>14.3f}"
        )
    for name, row in rows.items():
        if "layout" in row and any(row["layout"]["ns_flops"]):
            lay = row["layout"]
            print(
                f"{name}: NS FLOPs per rank max/mean {lay['ns_flops_max_over_mean']:.4f}, Muon "
                f"elements per rank max/mean {lay['muon_elements_max_over_mean']:.4f}, owner-"
                f"stream padding {lay['padding_elements']:,} elements, AdamW fill "
                f"{lay['fill_elements']:,} elements"
            )
    single = result["single_process_muon_state_bytes"]
    if ROWS["muon"] in rows:
        muon_state = rows[ROWS["muon"]]["state_bytes_max"]
        print(
            f"optimizer state: single-process muonscale.Muon {single / 1e6:.1f} MB; "
            f"DistributedMuon max per rank {muon_state / 1e6:.1f} MB "
            f"({muon_state / single:.3f}x)"
        )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset",
        choices=[*sorted(PRESETS), BENCH_PRESET],
        default="gpt2-small",
        help="parameter shapes",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=4,
        help="gloo processes to launch (ignored under torchrun)",
    )
    parser.add_argument(
        "--ns-steps", type=int, default=1, help="Newton–Schulz steps (bytes do not depend on it)"
    )
    parser.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="DistributedMuon bucket size"
    )
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"comma-separated subset of {','.join(ROWS)} (the vs-ZeRO-1 ratio needs zero1)",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="run one rank at a time on torch's fake process group (no data moves, same byte "
        "counts) when N gloo processes do not fit in memory; DistributedMuon rows only",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if args.simulate and {"ddp", "zero"} & set(args.rows):
        parser.error("--simulate measures DistributedMuon rows only: --rows muon,muon-bf16,zero1")
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        rank, world_size = dist.get_rank(), dist.get_world_size()
        per_rank = [None] * world_size
        dist.all_gather_object(per_rank, _rank_rows(rank, world_size, args))
        if rank == 0:
            _report({**_combine(per_rank), "ranks": "gloo ranks"}, args.json)
        dist.destroy_process_group()
        return
    if args.simulate:  # one rank at a time
        per_rank = []
        for r in range(args.world_size):
            proc = ctx.Process(target=_simulated_worker, args=(r, args.world_size, args, queue))
            proc.start()
            per_rank.append(_get(queue, [proc]))
            proc.join()
        _report({**_combine(per_rank), "ranks": "ranks simulated one at a time"}, args.json)
        return
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world_size, port, args, queue))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    per_rank = [_get(queue, procs) for _ in procs]
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    _report({**_combine(per_rank), "ranks": "gloo ranks"}, args.json)


def _get(queue, procs) -> dict:
    """The next result; exits if a worker died (the others could wait forever)."""
    while True:
        try:
            return queue.get(timeout=5)
        except queue_module.Empty:
            if any(p.exitcode for p in procs):
                for p in procs:
                    p.terminate()
                raise SystemExit(
                    f"a worker failed: exit codes {[p.exitcode for p in procs]}"
                ) from None


if __name__ == "__main__":
    main()
