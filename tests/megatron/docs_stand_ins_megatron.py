"""Stand-ins for the Megatron-Core blocks of ``docs/megatron.md`` (``tests/docs_blocks.py``):
the tiny GPT of ``megatron_workers`` and its batches."""

from __future__ import annotations

import torch
from megatron_workers import TINY


def _transformer_config(ns):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=TINY["num_layers"],
        hidden_size=TINY["hidden_size"],
        num_attention_heads=TINY["num_attention_heads"],
        num_query_groups=TINY["num_query_groups"],
        ffn_hidden_size=TINY["ffn_hidden_size"],
        gated_linear_unit=TINY["gated_linear_unit"],
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.float32,
    )


def _data(ns, steps: int = 2, batch: int = 4):
    """(tokens, position_ids, attention_mask, labels) per step, the same on every rank."""
    s = TINY["seq_len"]
    out = []
    for step in range(steps):
        g = torch.Generator().manual_seed(99 + step)
        ids = torch.randint(0, TINY["vocab_size"], (batch, s + 1), generator=g)
        positions = torch.arange(s).unsqueeze(0).expand(batch, s)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
        out.append((ids[:, :-1], positions, mask, ids[:, 1:]))
    return out


def _optimizer_config(ns):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(optimizer="muon", lr=3e-4, weight_decay=0.1)


def _one_rank_model(ns):
    """A tiny GPTModel on a world of one rank (the caller made the process group)."""
    from megatron_workers import build_gpt, setup_parallel

    setup_parallel(1)
    return build_gpt(TINY)


STAND_INS = {
    "docs/megatron.md": {
        "transformer_config": _transformer_config,
        "vocab_size": lambda ns: TINY["vocab_size"],
        "seq_len": lambda ns: TINY["seq_len"],
        "data": _data,
        "optimizer_config": _optimizer_config,
        "model": _one_rank_model,
    },
}
