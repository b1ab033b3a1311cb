"""``graph``: the optimizer step under a CUDA graph (``Muon(capturable=True)``, the recipe of
``docs/cuda_graphs.md``) vs eager, capturable and not, on GPT-2 small/medium parameter sets.
On CPU (``--smoke``) there is no graph: the eager variants only."""

from __future__ import annotations

import torch

import muonscale

from .models import CONTEXT, VOCAB, param_set
from .timing import print_table


def make_muon(muon_named, adamw_named, *, capturable: bool) -> muonscale.Muon:
    groups = [
        {"params": [p for _, p in muon_named], "algorithm": "muon"},
        {"params": [p for _, p in adamw_named], "algorithm": "adamw"},
    ]
    device = muon_named[0][1].device
    ns_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    lr = torch.tensor(1e-3, device=device) if capturable else 1e-3
    return muonscale.Muon(groups, lr=lr, ns_dtype=ns_dtype, capturable=capturable)


def capture_step(opt: muonscale.Muon, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (state, lr tensors, workspaces, Triton), then capture one
    ``opt.step()``; the gradients already in ``p.grad`` are the graph's static inputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    return graph


def section_graph(bench) -> dict:
    dev, cuda = bench.device, bench.device.type == "cuda"
    models = (
        bench.models if bench.smoke else {k: bench.models[k] for k in ("gpt2-small", "gpt2-medium")}
    )
    rows = []
    for name, (n_layer, d, _) in models.items():
        if bench.guard.left() < 30 and not bench.smoke:
            rows.append({"model": name, "skipped": "time guard"})
            continue
        vocab, ctx = (256, 32) if bench.smoke else (VOCAB, CONTEXT)
        fns, keep = {}, []
        for label, capturable in (("eager", False), ("eager_capturable", True)):
            muon_named, adamw_named = param_set(n_layer, d, dev, vocab, ctx)
            opt = make_muon(muon_named, adamw_named, capturable=capturable)
            fns[label] = opt.step
            keep.append((muon_named, adamw_named, opt))
        if cuda:
            muon_named, adamw_named = param_set(n_layer, d, dev, vocab, ctx)
            opt = make_muon(muon_named, adamw_named, capturable=True)
            graph = capture_step(opt)
            fns["graph_replay"] = graph.replay
            keep.append((muon_named, adamw_named, opt, graph))
        times = bench.clock.interleaved(
            fns, warmup=1 if bench.smoke else 3, reps=2 if bench.smoke else 10, budget_s=30
        )
        row = {"model": name, **{f"{k}_ms": t * 1e3 for k, t in times.items()}}
        if cuda:
            row["graph_vs_eager"] = times["graph_replay"] / times["eager"]
        else:
            row["graph_replay"] = "not measured: no CUDA graphs on CPU"
        rows.append(row)
        fns = keep = None
        bench.cleanup()
    print_table(
        rows, ["model", "eager_ms", "eager_capturable_ms", "graph_replay_ms", "graph_vs_eager"]
    )
    return {
        "rows": rows,
        "options": "Muon(capturable=True), defaults otherwise (nonfinite='raise')",
    }
