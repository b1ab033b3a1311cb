"""``backward_ns``: ``Muon(orthogonalize_in_backward=True)`` vs the default step, tokens/s of
a GPT-2-medium train step at 16K tokens (one micro-batch of 16 × 1024), fused AdamW beside.

Each arm trains its own copy of the model (the option's hooks live on the parameters, so a
shared model would run them for every arm), interleaved round by round. CUDA only: on CPU
(without ``--smoke``) it records why it did not run; ``--smoke`` runs tiny shapes on CPU to
exercise the code."""

from __future__ import annotations

import copy
import warnings

import torch

import muonscale

from .models import CONTEXT, GPT2, VOCAB, build_model, make_optimizer, split_hidden

ARMS = ("adamw", "muonscale", "muonscale_in_backward")


def _optimizer(kind: str, model: torch.nn.Module):
    muon_named, adamw_named = split_hidden(model.named_parameters())
    if kind != "muonscale_in_backward":
        return make_optimizer(kind, muon_named, adamw_named)
    groups = [
        {"params": [p for _, p in muon_named], "algorithm": "muon"},
        {"params": [p for _, p in adamw_named], "algorithm": "adamw"},
    ]
    ns_dtype = torch.bfloat16 if muon_named[0][1].is_cuda else torch.float32
    return muonscale.Muon(
        groups, lr=1e-3, ns_dtype=ns_dtype, nonfinite="ignore", orthogonalize_in_backward=True
    )


def section_backward_ns(bench) -> dict:
    dev = bench.device
    if dev.type != "cuda" and not bench.smoke:
        return {"skipped": "needs a CUDA device (the overlap it measures is a GPU's)"}
    if bench.smoke:
        dims, vocab, ctx, micro = (1, 32, 2), 256, 32, 2
    else:
        dims, vocab, ctx, micro = GPT2["gpt2-medium"], VOCAB, CONTEXT, 16
    base, source = build_model("gpt2-medium", dims, dev, vocab, ctx)
    models = {k: copy.deepcopy(base) for k in ARMS}
    del base
    opts = {k: _optimizer(k, m) for k, m in models.items()}
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, vocab, (micro, ctx), device=dev, generator=gen)
    tgt = torch.randint(0, vocab, (micro, ctx), device=dev, generator=gen)
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")

    def train_step(kind):
        model, opt = models[kind], opts[kind]

        def fn():
            with autocast:
                _, loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return fn

    with warnings.catch_warnings(record=True) as caught:  # a fallback would void the timing
        warnings.simplefilter("always")
        times = bench.clock.interleaved(
            {k: train_step(k) for k in ARMS},
            warmup=1 if bench.smoke else 2,
            reps=2 if bench.smoke else 8,
            budget_s=40,
        )
    fallbacks = [str(w.message)[:200] for w in caught if "in_backward" in str(w.message)]
    tokens = micro * ctx
    # same data, same number of steps: the two Muon arms differ only by rounding (batching)
    diff = max(
        (a - b).abs().max().item() / max(a.abs().max().item(), 1e-30)
        for a, b in zip(
            models["muonscale"].parameters(), models["muonscale_in_backward"].parameters()
        )
    )
    res = {
        "model_source": source,
        "tokens_per_step": tokens,
        "step_ms": {k: v * 1e3 for k, v in times.items()},
        "tokens_per_s": {k: tokens / v for k, v in times.items()},
        "in_backward_over_default": times["muonscale"] / times["muonscale_in_backward"],
        "default_over_adamw": times["adamw"] / times["muonscale"],
        "in_backward_over_adamw": times["adamw"] / times["muonscale_in_backward"],
        "buckets": len(opts["muonscale_in_backward"]._backward_ns.buckets),
        "fallback_warnings": fallbacks,
        "max_rel_param_diff_in_backward_vs_default": diff,
    }
    for k, v in res.items():
        print(f"{k:44s} {v}")
    return res
