"""Tiny GPT-2, Llama and Qwen3-MoE models from configs (random init, nothing downloaded) and a
learnable token data set, shared by the Hugging Face and Lightning tests (and a free port for
torchrun)."""

from __future__ import annotations

import socket

import torch

VOCAB, SEQ = 64, 16


def tiny_model(kind: str, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(config)
    if kind == "llama":
        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        return LlamaForCausalLM(config)
    if kind == "qwen3_moe":  # stacked experts (E, 2F, D) and (E, D, F), a router per layer
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        config = Qwen3MoeConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
        return Qwen3MoeForCausalLM(config)
    raise ValueError(kind)


class TokenData(torch.utils.data.Dataset):
    """Sequences t_{i+1} = (t_i + step) mod VOCAB: next tokens are predictable from context."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 4, (n, 1), generator=g)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


EMBEDDING_AND_HEAD = {
    "gpt2": ("transformer.wte.weight", "transformer.wpe.weight"),  # lm_head is tied to wte
    "llama": ("model.embed_tokens.weight", "lm_head.weight"),
    "qwen3_moe": ("model.embed_tokens.weight", "lm_head.weight"),
}


def algorithm_of(optimizer) -> dict[str, str]:
    """{name: "muon" | "adamw"} of a muonscale.Muon (or of one inside accelerate's wrapper)."""
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return {
        optimizer.param_names[id(p)]: g["algorithm"]
        for g in optimizer.param_groups
        for p in g["params"]
    }


def free_port() -> int:
    """A free TCP port for torchrun's rendezvous (``--master_port=0`` can hang)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_process_group() -> None:
    """End a torchrun worker: the ranks leave together, destroy the groups and exit without
    the interpreter's teardown. The worker's model and optimizers (FSDP2 states, pipeline
    stages, the frameworks' own objects) still hold process groups, which would otherwise end at
    that teardown, where a gloo group aborted a rank now and then ("terminate called without an
    active exception") after its results were written (docs/train.md)."""
    import os
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
