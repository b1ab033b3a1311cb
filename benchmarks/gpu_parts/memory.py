"""``memory``: peak memory and optimizer-state bytes vs AdamW, GPT-2-XL, 8×1024 tokens, bf16
autocast, fp32 params, no activation checkpointing."""

from __future__ import annotations

import torch

from .models import CONTEXT, GPT2, VOCAB, build_model, make_optimizer, split_hidden, state_bytes
from .timing import print_table


def section_memory(bench) -> dict:
    dev = bench.device
    if bench.smoke:
        dims, vocab, ctx, micro = (1, 32, 2), 256, 32, 2
    else:
        dims, vocab, ctx, micro = GPT2["gpt2-xl"], VOCAB, CONTEXT, 8
    rows = []
    for kind in ("adamw", "muonscale", "muonscale_bf16mom", "torch_muon"):
        if bench.guard.left() < 20 and not bench.smoke:
            rows.append({"optimizer": kind, "skipped": "time guard"})
            continue
        bench.cleanup()
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            torch.manual_seed(0)
            model, source = build_model("gpt2-xl", dims, dev, vocab, ctx)
            muon_named, adamw_named = split_hidden(model.named_parameters())
            opt = make_optimizer(kind, muon_named, adamw_named)
            idx = torch.randint(0, vocab, (micro, ctx), device=dev)
            autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
            for _ in range(1 if bench.smoke else 3):
                with autocast:
                    _, loss = model(idx, idx)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            bench.clock.sync()
            peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else _peak_rss()
            rows.append(
                {
                    "optimizer": kind,
                    "peak_bytes": peak,
                    "state_bytes": state_bytes(opt),
                    "model_source": source,
                }
            )
            del model, opt, loss, muon_named, adamw_named
        except Exception as exc:
            rows.append({"optimizer": kind, "error": repr(exc)})
    base = next((r for r in rows if r["optimizer"] == "adamw" and "peak_bytes" in r), None)
    for r in rows:
        if base and "peak_bytes" in r:
            r["peak_vs_adamw"] = r["peak_bytes"] / base["peak_bytes"]
            r["state_vs_adamw"] = r["state_bytes"] / max(base["state_bytes"], 1)
    print_table(rows, ["optimizer", "peak_bytes", "peak_vs_adamw", "state_bytes", "state_vs_adamw"])
    return {
        "rows": rows,
        "micro_batch": (micro, ctx),
        "peak_metric": "cuda max_memory_allocated"
        if dev.type == "cuda"
        else "process peak RSS (smoke)",
    }


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
