"""Optimizer-state bytes of muonscale's state precisions against AdamW's float32 state, on
GPT-2-small and GPT-2-XL shapes, counted from the stored buffers (codes + scales): the
parameters live on the ``meta`` device, so nothing the size of the model is allocated.

AdamW's float32 state is exp_avg and exp_avg_sq (8 bytes per parameter) and a float32 step
per tensor, as ``torch.optim.AdamW`` keeps it. ``muonscale[int4]`` is the 4-bit Muon momentum
with AdamW's 8-bit moments (``state_precision="int4"``).

    PYTHONPATH=. python3 benchmarks/state_bytes.py
"""

from __future__ import annotations

import argparse
import json

import torch

import muonscale

SHAPES = {"gpt2-small": (12, 768), "gpt2-xl": (48, 1600)}
"""Model → (layers, width); vocabulary 50304, context 1024."""

CONTENDERS = {
    "muonscale[param]": {},
    "muonscale[bf16 momentum]": {"momentum_dtype": torch.bfloat16},
    "muonscale[int8]": {"state_precision": "int8"},
    "muonscale[int4]": {"state_precision": "int4"},
}
"""Name → the muonscale.Muon options of its state."""


def gpt2_meta_parameters(layers: int, d: int, vocab: int = 50304, context: int = 1024):
    """(name, parameter) pairs with GPT-2 shapes on the meta device (Linear weights (out, in))."""

    def p(*shape):
        return torch.nn.Parameter(torch.empty(*shape, device="meta"))

    named = [("wte.weight", p(vocab, d)), ("wpe.weight", p(context, d))]
    for i in range(layers):
        named += [
            (f"h.{i}.ln_1.weight", p(d)),
            (f"h.{i}.ln_1.bias", p(d)),
            (f"h.{i}.attn.c_attn.weight", p(3 * d, d)),
            (f"h.{i}.attn.c_attn.bias", p(3 * d)),
            (f"h.{i}.attn.c_proj.weight", p(d, d)),
            (f"h.{i}.attn.c_proj.bias", p(d)),
            (f"h.{i}.ln_2.weight", p(d)),
            (f"h.{i}.ln_2.bias", p(d)),
            (f"h.{i}.mlp.c_fc.weight", p(4 * d, d)),
            (f"h.{i}.mlp.c_fc.bias", p(4 * d)),
            (f"h.{i}.mlp.c_proj.weight", p(d, 4 * d)),
            (f"h.{i}.mlp.c_proj.bias", p(d)),
        ]
    return named + [("ln_f.weight", p(d)), ("ln_f.bias", p(d))]


def state_bytes(model: str) -> dict[str, int]:
    """State bytes of AdamW float32 and of each contender on ``model``'s shapes."""
    named = gpt2_meta_parameters(*SHAPES[model])
    out = {"adamw[fp32]": sum(8 * p.numel() + 4 for _, p in named)}
    for name, options in CONTENDERS.items():
        opt = muonscale.Muon(named, lr=1e-3, **options)
        opt.init_all_state()
        out[name] = opt.optimizer_state_bytes()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    results = {model: state_bytes(model) for model in SHAPES}
    print(f"{'model':<12}{'contender':<26}{'state MiB':>12}{'vs adamw[fp32]':>16}")
    for model, row in results.items():
        for name, nbytes in row.items():
            ratio = nbytes / row["adamw[fp32]"]
            print(f"{model:<12}{name:<26}{nbytes / 2**20:>12.1f}{ratio:>16.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
