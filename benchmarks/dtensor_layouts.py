"""Wire bytes and exactness of DTensorMuon per DTensor layout (CPU, gloo, real processes).

For each layout (FSDP 2/4, TP Shard(0) and Shard(1) at 2/4, FSDP × TP on a 2×2 mesh) this
injects identical full gradients into GPT-block-shaped parameters (fused QKV split into Q/K/V,
attention output, MLP up/down, plus AdamW embedding and norms), runs K steps and prints, per rank
and optimizer step:

* bytes DTensorMuon put on the wire (counted by comm.py; Muon's two all-to-alls plus the tiny
  non-finite-flag all-reduce), max and mean over ranks;
* bytes of "duplicated" mode by the same ring cost model: all-gather every full Muon matrix on
  every rank, (N−1)/N · S;
* max |ΔW| of the full parameters against single-process ``muonscale.Muon`` (float32 NS).

Gradient reduction is the framework's (FSDP2's reduce-scatter) and is not counted here.

    PYTHONPATH=. python3 benchmarks/dtensor_layouts.py [--dim 256] [--layers 2] [--steps 3]
"""

from __future__ import annotations

import argparse
import datetime
import gc
import multiprocessing as mp
import os
import socket

import torch

OPTIONS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=0.01)
LAYOUTS = [  # (name, world size, mesh shape)
    ("FSDP2 Shard(0)", 2, (2,)),
    ("FSDP2 Shard(0)", 4, (4,)),
    ("TP Shard(0)", 2, (2,)),
    ("TP Shard(0)", 4, (4,)),
    ("TP Shard(1)", 2, (2,)),
    ("TP Shard(1)", 4, (4,)),
    ("FSDP x TP (Shard(0), Shard(1))", 4, (2, 2)),
    ("FSDP2 approximate_per_shard", 4, (4,)),
]


def shapes_for(dim: int, layers: int):
    import muonscale

    qkv = muonscale.QKVLayout(n_query_groups=dim // 64, q_per_group=1, head_dim=64)
    shapes = {"wte.weight": (512, dim)}
    splits = {}
    for i in range(layers):
        shapes |= {
            f"h.{i}.attn.qkv.weight": (qkv.rows, dim),
            f"h.{i}.attn.proj.weight": (dim, dim),
            f"h.{i}.mlp.fc.weight": (4 * dim, dim),
            f"h.{i}.mlp.proj.weight": (dim, 4 * dim),
            f"h.{i}.ln.weight": (dim,),
        }
        splits[f"h.{i}.attn.qkv.weight"] = qkv
    return shapes, splits


def _tensors(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) * 0.05 for n, s in shapes.items()}


def _placements(name: str, ndim: int, mesh_shape):
    from torch.distributed.tensor import Replicate, Shard

    if "TP Shard(1)" in name:
        return [Shard(1)] if ndim >= 2 else [Replicate()]
    if len(mesh_shape) == 2:
        return [Shard(0), Shard(1)] if ndim >= 2 else [Shard(0), Replicate()]
    return [Shard(0)]


def layout_worker(rank, world_size, name, mesh_shape, dim, layers, steps):
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    import muonscale
    from muonscale.distributed.sharded import duplicated_wire_bytes

    shapes, splits = shapes_for(dim, layers)
    init = _tensors(shapes, 0)
    ref = {n: nn.Parameter(t.clone()) for n, t in init.items()}
    ref_opt = muonscale.Muon(list(ref.items()), splits=splits, **OPTIONS)
    mesh = init_device_mesh("cpu", mesh_shape)
    if name.startswith("FSDP2"):
        bag = nn.Module()
        for n, t in init.items():
            bag.register_parameter(n.replace(".", "_"), nn.Parameter(t.clone()))
        fully_shard(bag, mesh=mesh)
        named = [(n, getattr(bag, n.replace(".", "_"))) for n in init]
    else:
        named = [
            (
                n,
                nn.Parameter(
                    distribute_tensor(t.clone(), mesh, _placements(name, t.ndim, mesh_shape))
                ),
            )
            for n, t in init.items()
        ]
    opt = muonscale.distributed_muon(
        named, splits=splits, approximate_per_shard="approximate" in name, **OPTIONS
    )
    per_step = []
    for k in range(steps):
        grads = _tensors(shapes, 100 + k)
        for n, p in ref.items():
            p.grad = grads[n].clone()
        ref_opt.step()
        for n, p in named:
            full = distribute_tensor(grads[n], p.device_mesh, [Replicate()] * p.device_mesh.ndim)
            p.grad = full.redistribute(p.device_mesh, p.placements)
        opt.step()
        per_step.append((opt.last_step_wire_bytes, opt.last_step_wire_breakdown))
    diff = max(
        (p.full_tensor() - ref[n]).abs().max().item() for n, p in named if isinstance(p, DTensor)
    )
    layouts = [opt.matrix_layout(p) for n, p in named if opt.routing[n].algorithm == "muon"]
    duplicated = duplicated_wire_bytes(layouts, 4, world_size)
    muon_bytes = (
        sum(b for _, breakdown in per_step for k, b in breakdown.items() if k.startswith("muon/"))
        // steps
    )
    total = sum(t for t, _ in per_step) // steps
    del named, opt
    gc.collect()
    return {"muon": muon_bytes, "total": total, "duplicated": duplicated, "diff": diff}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, queue, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )
    try:
        queue.put((rank, layout_worker(rank, world_size, *args)))
    finally:
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def run_layout(world_size, args):
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, queue, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [results[r] for r in range(world_size)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=256, help="model width (multiple of 64)")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps K")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shapes, _ = shapes_for(args.dim, args.layers)
    muon_elems = sum(
        s[0] * s[1] for n, s in shapes.items() if len(s) == 2 and not n.startswith("wte")
    )
    print(
        f"dim {args.dim}, {args.layers} layers, {args.steps} steps; "
        f"Muon matrices S = {4 * muon_elems:,d} B (fp32)"
    )
    print(
        f"{'layout':<32} {'N':>2} {'muon B/step/rank max':>21} {'mean':>10} "
        f"{'duplicated':>11} {'ratio':>6} {'max|dW|':>9}"
    )
    for name, world_size, mesh_shape in LAYOUTS:
        res = run_layout(world_size, (name, mesh_shape, args.dim, args.layers, args.steps))
        muon = [r["muon"] for r in res]
        dup = res[0]["duplicated"]
        ratio = max(muon) / dup if dup else float("nan")
        print(
            f"{name:<32} {world_size:>2} {max(muon):>21,d} "
            f"{sum(muon) / len(muon):>10,.0f} {dup:>11,d} "
            f"{ratio:>6.2f} {max(r['diff'] for r in res):>9.2g}"
        )


if __name__ == "__main__":
    main()
