"""Bytes on the wire per optimizer step per rank: DistributedMuon vs AdamW (DDP, ZeRO-1, torch's
ZeroRedundancyOptimizer), all counted by ``muonscale.distributed.comm`` with the ring model.

    python benchmarks/wire_bytes.py                      # GPT-2-small shapes, 4 gloo ranks
    python benchmarks/wire_bytes.py --preset tiny --world-size 2 --json

Launches N gloo processes itself (or runs under ``torchrun``). The parameter set has GPT-2
small's shapes (tied embedding/head); gradients come from a cheap synthetic loss through a real
backward, so DistributedMuon's reductions start in its gradient hooks as in training.

Rows (one optimizer step, after one warm-up step):

* DistributedMuon, fp32 reduce; and with ``reduce_dtype=torch.bfloat16`` (Muon gradients).
* ZeRO-1 AdamW: the same machinery with every parameter routed to AdamW (reduce-scatter +
  all-gather of flat shards).
* AdamW under DDP: ``DistributedDataParallel`` with a comm hook that sends each gradient bucket
  through ``comm.all_reduce`` (so DDP's real buckets are counted).
* torch ``ZeroRedundancyOptimizer``: the DDP all-reduce (as above) + its per-step broadcast of
  every parameter from its owner, counted from its partition with the same ring model
  (``broadcast`` = (N−1)/N·S).

Newton–Schulz steps do not change any byte count; ``--ns-steps`` defaults to 1 to keep the run
short on CPU.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import socket
import sys

import torch
import torch.distributed as dist
from torch import nn

PRESETS = {
    # name: (vocab, context, d_model, n_layer)
    "gpt2-small": (50257, 1024, 768, 12),
    "tiny": (512, 64, 64, 4),
}


class GPT2Params(nn.Module):
    """GPT-2's parameters (tied head) with a synthetic loss: ``Σ_p ⟨p, R_p⟩`` (grad = R_p)."""

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
        g = torch.Generator().manual_seed(seed)
        total = torch.zeros(())
        for p in self.parameters():
            total = total + (p * torch.randn(p.shape, generator=g)).sum()
        return total


def _one_step(model, opt, seed: int) -> None:
    opt.zero_grad()
    model(seed).backward()
    opt.step()


def _measure_distributed_muon(model, **kw) -> tuple[int, dict, int]:
    from muonscale.distributed import DistributedMuon

    opt = DistributedMuon(model, **kw)
    for seed in range(2):
        _one_step(model, opt, seed)
    out = opt.last_step_wire_bytes, opt.last_step_wire_breakdown, opt.optimizer_state_bytes()
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


def _single_process_state_bytes(model) -> int:
    """``muonscale.Muon``'s state on one process, from its routing: momentum per Muon matrix;
    exp_avg, exp_avg_sq and a float32 step per AdamW parameter."""
    from muonscale import route

    params = dict(model.named_parameters())
    total = 0
    for name, decision in route(model).items():
        p = params[name]
        total += p.numel() * p.element_size() * (1 if decision.algorithm == "muon" else 2)
        total += 4 if decision.algorithm == "adamw" else 0
    return total


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
    from muonscale.distributed import gather_wire_stats

    rows = {}
    try:
        torch.manual_seed(0)
        model = GPT2Params(*PRESETS[args.preset])
        muon_kw = dict(
            lr=1e-3,
            ns_steps=args.ns_steps,
            ns_dtype=torch.float32,
            bucket_cap_mb=args.bucket_cap_mb,
        )
        cases = [
            ("DistributedMuon (fp32 reduce)", lambda: _measure_distributed_muon(model, **muon_kw)),
            (
                "DistributedMuon (bf16 Muon reduce)",
                lambda: _measure_distributed_muon(model, reduce_dtype=torch.bfloat16, **muon_kw),
            ),
            (
                "ZeRO-1 AdamW (reduce-scatter + all-gather)",
                lambda: _measure_distributed_muon(model, rules=[(".*", "adamw")], **muon_kw),
            ),
            ("AdamW under DDP (all-reduce)", lambda: _measure_ddp(model, zero=False)),
            (
                "torch ZeroRedundancyOptimizer (all-reduce + broadcast)",
                lambda: _measure_ddp(model, zero=True),
            ),
        ]
        for name, measure in cases:
            total, breakdown, state_bytes = measure()
            stats = gather_wire_stats(total)
            state = gather_wire_stats(state_bytes)
            rows[name] = {
                "mean": stats["mean"],
                "max": stats["max"],
                "breakdown_rank0": breakdown,
                "state_bytes_max": state["max"],
            }
        n_params = sum(p.numel() for p in model.parameters())
        if rank == 0:
            result = {"rows": rows, "params": n_params, "world_size": world_size}
            result["preset"] = args.preset
            result["single_process_muon_state_bytes"] = _single_process_state_bytes(model)
            queue.put(result)
    finally:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _report(result: dict, as_json: bool) -> None:
    rows = result["rows"]
    zero1 = rows["ZeRO-1 AdamW (reduce-scatter + all-gather)"]["mean"]
    ddp = rows["AdamW under DDP (all-reduce)"]["mean"]
    for row in rows.values():
        row["vs_zero1_adamw"] = row["mean"] / zero1
        row["vs_ddp_adamw"] = row["mean"] / ddp
    if as_json:
        print(json.dumps(result, indent=2))
        return
    n = result["world_size"]
    print(
        f"bytes on the wire per optimizer step per rank, {result['preset']} ({result['params'] / 1e6:.1f}M params), {n} gloo ranks, ring model"
    )
    print(
        f"{'optimizer':<56} {'mean MB':>10} {'max MB':>10} {'vs ZeRO-1':>10} {'vs DDP':>8} {'state MB/rank':>14}"
    )
    for name, row in rows.items():
        print(
            f"{name:<56} {row['mean'] / 1e6:>10.2f} {row['max'] / 1e6:>10.2f} "
            f"{row['vs_zero1_adamw']:>10.4f} {row['vs_ddp_adamw']:>8.4f} {row['state_bytes_max'] / 1e6:>14.1f}"
        )
    single = result["single_process_muon_state_bytes"]
    muon_state = rows["DistributedMuon (fp32 reduce)"]["state_bytes_max"]
    print(
        f"optimizer state: single-process muonscale.Muon {single / 1e6:.1f} MB; DistributedMuon max per rank {muon_state / 1e6:.1f} MB ({muon_state / single:.3f}x)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), default="gpt2-small", help="parameter shapes"
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
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ctx = torch.multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        _worker(dist.get_rank(), dist.get_world_size(), 0, args, queue)
        if int(os.environ["RANK"]) == 0:
            _report(queue.get(), args.json)
        return
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, args.world_size, port, args, queue))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    result = queue.get()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a worker failed: exit codes {[p.exitcode for p in procs]}")
    _report(result, args.json)


if __name__ == "__main__":
    main()
