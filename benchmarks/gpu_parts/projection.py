"""``projection``: a MODEL of data-parallel tokens/s, muonscale's DistributedMuon vs ZeRO-1
AdamW, at N = 8, 64, 256 ranks, for GPT-2-XL and a 7B-class shape. Only the optimizer parts
are measured on this card; the rest is modelled, and every assumption is in the output.

* Muon step per rank: the DP owner planner (``assign_owners``) gives each rank its whole
  matrices; each distinct set of owned shapes is timed for real here (a ``muonscale.Muon``
  step on matrices of those shapes); the step waits for the slowest rank (max over ranks).
  Plus this rank's 1/N of the AdamW parameters (embeddings, norms), timed as fused AdamW.
* ZeRO-1 AdamW step per rank: fused AdamW over 1/N of all parameters, timed.
* Collectives, both arms: reduce-scatter of bf16 gradients + all-gather of bf16 parameters,
  ring, no overlap; 900 GB/s (NVLink) within 8 GPUs, 50 GB/s per GPU across nodes
  (hierarchical: intra-node ring, then inter-node ring on 1/8 of the bytes). Muon's owner
  streams are as long as the longest, so its bytes are scaled by the owner-bytes max/mean.
* Forward+backward = 6 · params · tokens per rank ÷ (bf16 matmul rate × MFU), with the MFU
  measured here for GPT-2-XL forward+backward (bf16 autocast, 4×1024 tokens).

Beside it, NVIDIA's published figure: Muon at 97.9% of AdamW's throughput in Megatron-Core
(Kimi K2, 256 GPUs; NVIDIA technical blog on Muon in Megatron-Core / Emerging-Optimizers).
"""

from __future__ import annotations

import collections
import time

import torch
from torch import nn

import muonscale
from muonscale.distributed.ownership import assign_owners, parameter_cost

from .models import CONTEXT, GPT2, VOCAB, build_model
from .timing import print_table

NVLINK_BYTES_PER_S = 900e9
INTER_NODE_BYTES_PER_S = 50e9
GPUS_PER_NODE = 8
NVIDIA_PUBLISHED = {
    "ratio": 0.979,
    "model": "Kimi K2",
    "gpus": 256,
    "source": "NVIDIA, Muon in Megatron-Core (Emerging-Optimizers)",
}


def llama_7b_shapes() -> tuple[list[tuple[int, int]], int]:
    """Muon matrices of a 7B-class model (32 layers, d 4096, MLP 11008: q, k, v, o, gate, up,
    down) and its AdamW elements (embedding and head of a 32000 vocabulary, norms)."""
    d, f, layers, vocab = 4096, 11008, 32, 32000
    per_layer = [(d, d)] * 4 + [(f, d), (f, d), (d, f)]
    return per_layer * layers, 2 * vocab * d + (2 * layers + 1) * d


def gpt2_xl_shapes() -> tuple[list[tuple[int, int]], int]:
    n_layer, d, _ = GPT2["gpt2-xl"]
    per_layer = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    return per_layer * n_layer, VOCAB * d * 2 + CONTEXT * d + (4 * n_layer + 2) * d


def ring_seconds(nbytes: float, ranks: int) -> float:
    """One ring reduce-scatter (or all-gather) of ``nbytes`` over ``ranks`` GPUs."""
    if ranks <= 1:
        return 0.0
    local = min(ranks, GPUS_PER_NODE)
    t = (local - 1) / local * nbytes / NVLINK_BYTES_PER_S
    nodes = ranks // GPUS_PER_NODE
    if nodes > 1:
        t += (nodes - 1) / nodes * (nbytes / GPUS_PER_NODE) / INTER_NODE_BYTES_PER_S
    return t


def _muon_step_seconds(bench, shapes: tuple, dev, cache: dict) -> float:
    """Time of a ``muonscale.Muon`` step over matrices of ``shapes`` (fp32, random grads)."""
    if not shapes:
        return 0.0
    if shapes in cache:
        return cache[shapes]
    params = []
    for m, n in shapes:
        p = nn.Parameter(torch.empty(m, n, device=dev).normal_(0, 0.02))
        p.grad = torch.randn(m, n, device=dev) * 1e-3
        params.append(p)
    ns_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    opt = muonscale.Muon([{"params": params, "algorithm": "muon"}], lr=1e-3, ns_dtype=ns_dtype)
    t = bench.clock.interleaved({"s": opt.step}, warmup=1, reps=1 if bench.smoke else 3)["s"]
    cache[shapes] = t
    del opt, params
    bench.cleanup()
    return t


def _adamw_seconds_per_element(bench, dev) -> float:
    n = 2**16 if bench.smoke else 2**27
    p = nn.Parameter(torch.zeros(n, device=dev))
    p.grad = torch.randn(n, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=dev.type == "cuda")
    t = bench.clock.interleaved({"s": opt.step}, warmup=2, reps=3 if bench.smoke else 8)["s"]
    del opt, p
    bench.cleanup()
    return t / n


def _xl_mfu(bench, rate: float) -> dict:
    """Forward+backward of GPT-2-XL (tiny model with --smoke), bf16 autocast: MFU."""
    dev = bench.device
    dims, vocab, ctx, micro = (
        ((2, 64, 2), 256, 32, 2) if bench.smoke else (GPT2["gpt2-xl"], VOCAB, CONTEXT, 4)
    )
    model, source = build_model("gpt2-xl", dims, dev, vocab, ctx)
    params = sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, vocab, (micro, ctx), device=dev)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def fwd_bwd():
        with autocast:
            _, loss = model(idx, idx)
        loss.backward()

    t = bench.clock.interleaved({"fb": fwd_bwd}, warmup=2, reps=2 if bench.smoke else 5)["fb"]
    tokens = micro * ctx
    mfu = 6 * params * tokens / t / rate
    fwd_bwd = model = None  # free the activations and weights before the next timing
    bench.cleanup()
    return {"model": source, "params": params, "tokens": tokens, "fwd_bwd_ms": t * 1e3, "mfu": mfu}


def section_projection(bench) -> dict:
    from .matmul import matmul_rate

    dev, rate = bench.device, matmul_rate(bench)
    xl = _xl_mfu(bench, rate)
    adamw_per_element = _adamw_seconds_per_element(bench, dev)
    ranks = (2, 4) if bench.smoke else (8, 64, 256)
    tokens_per_step = (2**12, 2**13) if bench.smoke else (2**19, 2**20, 2**21, 2**22)
    if bench.smoke:  # tiny shapes: the same code on a CPU budget
        models = {"tiny": ([(64, 32), (32, 32), (128, 32), (32, 128)] * 2, 4096)}
    else:
        models = {"gpt2-xl": gpt2_xl_shapes(), "7b-class": llama_7b_shapes()}
    cache: dict = {}
    rows, loads = [], []
    t_start = time.perf_counter()
    for model_name, (shapes, adamw_elements) in models.items():
        muon_elements = sum(m * n for m, n in shapes)
        params = muon_elements + adamw_elements
        for n_ranks in ranks:
            owners = assign_owners(shapes, n_ranks, sizes=[m * n for m, n in shapes])
            owned = collections.defaultdict(list)
            for shape, rank in zip(shapes, owners):
                owned[rank].append(shape)
            flops = [sum(parameter_cost(s) for s in owned[r]) for r in range(n_ranks)]
            elems = [sum(m * n for m, n in owned[r]) for r in range(n_ranks)]
            distinct = {tuple(sorted(owned[r])) for r in range(n_ranks)}
            step_times = {s: _muon_step_seconds(bench, s, dev, cache) for s in distinct}
            muon_step = max(step_times.values())
            adamw_share = adamw_per_element * adamw_elements / n_ranks
            zero1_step = adamw_per_element * params / n_ranks
            mean_elems = sum(elems) / n_ranks
            byte_imbalance = max(elems) / mean_elems if mean_elems else 1.0
            comm_adamw = 2 * ring_seconds(2 * params, n_ranks)  # bf16 RS + bf16 AG
            comm_muon = 2 * ring_seconds(
                2 * (adamw_elements + muon_elements * byte_imbalance), n_ranks
            )
            loads.append(
                {
                    "model": model_name,
                    "ranks": n_ranks,
                    "flops_max_over_mean": max(flops) / (sum(flops) / n_ranks),
                    "bytes_max_over_mean": byte_imbalance,
                    "idle_ranks": sum(not o for o in elems),
                    "distinct_rank_sets_timed": len(distinct),
                    "muon_step_ms": muon_step * 1e3,
                }
            )
            for tokens in tokens_per_step:
                fb = 6 * params * (tokens / n_ranks) / (rate * xl["mfu"])
                t_adamw = fb + zero1_step + comm_adamw
                t_muon = fb + muon_step + adamw_share + comm_muon
                rows.append(
                    {
                        "model": model_name,
                        "ranks": n_ranks,
                        "tokens_per_step": tokens,
                        "fwd_bwd_ms": fb * 1e3,
                        "adamw_step_ms": (zero1_step + comm_adamw) * 1e3,
                        "muon_step_ms": (muon_step + adamw_share + comm_muon) * 1e3,
                        "projected_ratio": t_adamw / t_muon,
                    }
                )
    print("owner load (max/mean over ranks):")
    print_table(
        loads,
        [
            "model",
            "ranks",
            "flops_max_over_mean",
            "bytes_max_over_mean",
            "idle_ranks",
            "distinct_rank_sets_timed",
            "muon_step_ms",
        ],
    )
    print("projected tokens/s, muonscale ÷ ZeRO-1 AdamW (a MODEL, see below):")
    print_table(
        rows,
        [
            "model",
            "ranks",
            "tokens_per_step",
            "fwd_bwd_ms",
            "adamw_step_ms",
            "muon_step_ms",
            "projected_ratio",
        ],
    )
    fb_rule = (
        f"forward+backward = 6 * params * tokens_per_rank / ({rate / 1e12:.4g} TFLOP/s "
        f"bf16 * MFU {xl['mfu']:.3f} measured for GPT-2-XL fwd+bwd here)"
    )
    print(
        f"MODEL, not a measurement: {fb_rule}; collectives: bf16 reduce-scatter + all-gather, "
        f"ring, {NVLINK_BYTES_PER_S / 1e9:.0f} GB/s within {GPUS_PER_NODE} GPUs, "
        f"{INTER_NODE_BYTES_PER_S / 1e9:.0f} GB/s per GPU across nodes, no overlap; "
        f"optimizer steps timed on this card. Published beside it: "
        f"{NVIDIA_PUBLISHED['ratio']:.1%} ({NVIDIA_PUBLISHED['model']}, "
        f"{NVIDIA_PUBLISHED['gpus']} GPUs, {NVIDIA_PUBLISHED['source']})."
    )
    return {
        "kind": "model (projection), not a measurement",
        "forward_backward_rule": fb_rule,
        "gpt2_xl_mfu": xl,
        "matmul_tflops": rate / 1e12,
        "adamw_ns_per_element": adamw_per_element * 1e9,
        "links": {
            "nvlink_GBps": NVLINK_BYTES_PER_S / 1e9,
            "inter_node_GBps_per_gpu": INTER_NODE_BYTES_PER_S / 1e9,
            "gpus_per_node": GPUS_PER_NODE,
        },
        "owner_load": loads,
        "rows": rows,
        "published": NVIDIA_PUBLISHED,
        "timing_seconds": time.perf_counter() - t_start,
    }
