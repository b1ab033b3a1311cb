"""Tiny torchtitan llama3 and qwen3 (dense and MoE) models from their model args, random init
(nothing downloaded), and a learnable token stream, shared by the torchtitan tests and their
gloo workers.

torchtitan's language models default to FlexAttention, which has no backward on CPU; the tiny
models use its ``ScaledDotProductAttention`` (causal), which the model classes also accept.
"""

from __future__ import annotations

import torch

VOCAB, SEQ, DIM, HEADS, KV_HEADS = 64, 16, 32, 4, 2


def _sdpa(layers):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def tiny_config(kind: str, *, n_layers: int = 2, num_experts: int = 4):
    """Model config of a tiny ``"llama3"``, ``"qwen3"`` or ``"qwen3_moe"`` (``num_experts``
    experts, top 2)."""
    from torchtitan.models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear

    if kind == "llama3":
        import torchtitan.models.llama3 as llama3

        return llama3.Llama3Model.Config(
            dim=DIM,
            vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(
                num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
            ),
            norm=llama3.RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(
                in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
            ),
            layers=_sdpa(
                llama3._build_llama3_layers(
                    n_layers=n_layers,
                    dim=DIM,
                    n_heads=HEADS,
                    n_kv_heads=KV_HEADS,
                    hidden_dim=64,
                    rope=ComplexRoPE.Config(
                        dim=DIM // HEADS, max_seq_len=4 * SEQ, theta=500000, scaling="llama"
                    ),
                    attn_backend="flex",
                )
            ),
        )
    import torchtitan.models.qwen3 as qwen3

    head_dim = 8
    rope = CosSinRoPE.Config(dim=head_dim, max_seq_len=4 * SEQ, theta=1000000.0)
    common = dict(
        n_layers=n_layers,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=KV_HEADS,
        head_dim=head_dim,
        attn_backend="flex",
        rope=rope,
    )
    if kind == "qwen3":
        layers = qwen3._build_qwen3_layers(hidden_dim=64, **common)
    elif kind == "qwen3_moe":
        layers = qwen3._build_qwen3_moe_layers(
            moe_hidden_dim=16,
            num_experts=num_experts,
            top_k=2,
            moe_comm_backend="standard",
            **common,
        )
    else:
        raise ValueError(kind)
    return qwen3.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=qwen3._qwen3_norm(DIM),
        enable_weight_tying=False,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=qwen3._EMBEDDING_INIT
        ),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=qwen3._LINEAR_INIT),
        layers=_sdpa(layers),
    )


def tiny_model(
    kind: str, *, seed: int = 0, n_layers: int = 2, num_experts: int = 4
) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = tiny_config(kind, n_layers=n_layers, num_experts=num_experts).build()
    model.init_states()
    return model


def batch(step: int, size: int = 4) -> torch.Tensor:
    """Sequences t_{i+1} = (t_i + k) mod VOCAB (k in 1..3): learnable next tokens. Batch
    ``step`` of a fixed stream, so two runs (or a resumed run) see the same data."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    k = torch.randint(1, 4, (size, 1), generator=g)
    return (start + k * torch.arange(SEQ + 1)) % VOCAB


def injected_gradients(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Full gradients of every parameter for step ``step`` (by name and global shape: the same
    on every rank and in every layout)."""
    g = torch.Generator().manual_seed(2000 + step)
    shapes = sorted((n, tuple(p.shape)) for n, p in model.named_parameters())
    return {n: torch.randn(shape, generator=g) for n, shape in shapes}


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
    )


__all__ = ["batch", "injected_gradients", "loss_of", "tiny_config", "tiny_model"]
