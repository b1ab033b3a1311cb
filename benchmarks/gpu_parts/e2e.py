"""``e2e``: tokens/s ratio vs AdamW on a GPT-2-medium model, one micro-batch and accumulated
micro-batches, measured directly and composed from measured fwd/bwd and optimizer parts."""

from __future__ import annotations

import torch

from .models import CONTEXT, GPT2, VOCAB, build_model, make_optimizer, split_hidden


def section_e2e(bench) -> dict:
    dev = bench.device
    if bench.smoke:
        preset, dims, vocab, ctx, micro, accum = "gpt2-medium", (1, 32, 2), 256, 32, 2, 2
    else:
        preset, dims, vocab, ctx, micro, accum = (
            "gpt2-medium",
            GPT2["gpt2-medium"],
            VOCAB,
            CONTEXT,
            16,
            32,
        )
    model, source = build_model(preset, dims, dev, vocab, ctx)
    muon_named, adamw_named = split_hidden(model.named_parameters())
    opts = {
        k: make_optimizer(k, muon_named, adamw_named) for k in ("adamw", "torch_muon", "muonscale")
    }
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, vocab, (micro, ctx), device=dev, generator=gen)
    tgt = torch.randint(0, vocab, (micro, ctx), device=dev, generator=gen)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def fwd_bwd():
        with autocast:
            _, loss = model(idx, tgt)
        loss.backward()

    def train_step(opt, n_micro):
        def fn():
            for _ in range(n_micro):
                fwd_bwd()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return fn

    tokens = micro * ctx
    fwd_bwd()  # creates grads, so the optimizer steps below have work
    parts = bench.clock.interleaved(
        {"fwd_bwd": fwd_bwd, **{f"opt_{k}": o.step for k, o in opts.items()}},
        warmup=1 if bench.smoke else 2,
        reps=2 if bench.smoke else 8,
        budget_s=40,
    )
    for o in opts.values():
        o.zero_grad(set_to_none=True)
    one = bench.clock.interleaved(
        {k: train_step(o, 1) for k, o in opts.items()},
        warmup=1,
        reps=2 if bench.smoke else 6,
        budget_s=40,
    )
    n_acc = accum if bench.guard.left() > 120 or bench.smoke else 0
    acc = {}
    if n_acc:
        acc = bench.clock.interleaved(
            {k: train_step(o, n_acc) for k, o in opts.items()}, warmup=0, reps=2, budget_s=30
        )
    t_fb = parts["fwd_bwd"]
    res = {
        "model_source": source,
        "tokens_per_micro_batch": tokens,
        "accum": accum,
        "parts_ms": {k: v * 1e3 for k, v in parts.items()},
    }
    for k in ("torch_muon", "muonscale"):
        res[f"{k}_ratio_one_micro_measured"] = one["adamw"] / one[k]
        res[f"{k}_ratio_one_micro_composed"] = (t_fb + parts["opt_adamw"]) / (
            t_fb + parts[f"opt_{k}"]
        )
        res[f"{k}_ratio_accum_composed"] = (accum * t_fb + parts["opt_adamw"]) / (
            accum * t_fb + parts[f"opt_{k}"]
        )
        if acc:
            res[f"{k}_ratio_accum_measured"] = acc["adamw"] / acc[k]
    res["tokens_per_s_one_micro"] = {k: tokens / t for k, t in one.items()}
    if acc:
        res["tokens_per_s_accum"] = {k: n_acc * tokens / t for k, t in acc.items()}
    for k, v in res.items():
        print(f"{k:40s} {v}")
    return res
