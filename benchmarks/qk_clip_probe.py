"""Cost of QK-clip on a training step of the reference GPT: the exact max-logit probe (QKᵀ in
chunks beside ``scaled_dot_product_attention``) plus the rescale, against the same step without.

Both run side by side in one process, alternating step by step on the same model and batch, so
machine noise hits both alike; the script prints the median step time of each and their ratio.

    python benchmarks/qk_clip_probe.py                      # tiny preset, 16 x 128 tokens, CPU
    python benchmarks/qk_clip_probe.py --preset gpt2-small --batch 8 --device cuda
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import muonscale
from muonscale.qk_clip import QKClip
from muonscale.train.config import model_preset
from muonscale.train.model import GPT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step")
    parser.add_argument("--steps", type=int, default=12, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    config = model_preset(args.preset)
    model = GPT(config).to(device)
    optimizer = muonscale.Muon(
        model.named_parameters(),
        lr=0.02,
        splits={name: model.qkv_layout for name in model.qkv_param_names()},
    )
    clip = QKClip(model.qk_clip_targets(), tau=100.0)
    idx = torch.randint(0, config.vocab_size, (args.batch, config.context_length), device=device)

    def step(probe: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = model(idx, idx, probe_max_logits=probe)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if probe:
            clip(model.pop_max_attention_logits())
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.warmup + args.steps):
        for probe in (False, True) if i % 2 == 0 else (True, False):
            elapsed = step(probe)
            if i >= args.warmup:
                times[probe].append(elapsed)
    plain, probed = (statistics.median(times[p]) * 1e3 for p in (False, True))
    print(
        f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"device {device}, threads {torch.get_num_threads()}"
    )
    print(
        f"model {args.preset}: {config.n_layer} layers, {config.n_head} heads of "
        f"{config.head_dim}, {args.batch} x {config.context_length} tokens"
    )
    print(f"step without probe: {plain:8.1f} ms (median of {args.steps})")
    print(f"step with probe + clip: {probed:8.1f} ms")
    print(f"ratio: {probed / plain:.3f}")


if __name__ == "__main__":
    main()
