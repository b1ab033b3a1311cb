"""Train a tiny torchtitan llama3 (random init from its model args, CPU) with muonscale through
torchtitan's optimizer container: embeddings, head and norms on AdamW, fused QKV split into
Q, K and V, checkpointed with DCP and resumed. Needs torchtitan (``make test-integrations``
builds a venv with it).

    PYTHONPATH=. .venv-integrations/bin/python examples/torchtitan_train.py
"""

import tempfile

import torch
import torch.distributed.checkpoint as dcp
import torchtitan.models.llama3 as llama3
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention

from muonscale.integrations.torchtitan import muonscale_optimizers

VOCAB, SEQ, DIM, HEADS = 128, 32, 64, 4


def tiny_llama3() -> torch.nn.Module:
    layers = llama3._build_llama3_layers(
        n_layers=2,
        dim=DIM,
        n_heads=HEADS,
        n_kv_heads=2,
        hidden_dim=128,
        attn_backend="flex",
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=500000, scaling="llama"),
    )
    for layer in layers:  # FlexAttention has no backward on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        layers=layers,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)
        ),
    )
    model = config.build()
    model.init_states()
    return model


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    start, k = (
        torch.randint(0, VOCAB, (8, 1), generator=g),
        torch.randint(1, 4, (8, 1), generator=g),
    )
    return (start + k * torch.arange(SEQ)) % VOCAB


def train(model, optimizers, steps: range) -> None:
    for step in steps:
        tokens = batch(step)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)
        )
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        if step % 10 == 0:
            print(f"step {step:3d}  loss {loss.item():.3f}")


torch.manual_seed(0)
model = tiny_llama3()
optimizers = muonscale_optimizers(lr=0.02, adamw_lr=0.01).build(model_parts=[model])
print(optimizers.optimizers[0].summary())
train(model, optimizers, range(0, 30))
with tempfile.TemporaryDirectory() as ckpt:
    dcp.save(
        {"model": model.state_dict(), "optimizer": optimizers.state_dict()}, checkpoint_id=ckpt
    )
    resumed = tiny_llama3()
    resumed_optimizers = muonscale_optimizers(lr=0.02, adamw_lr=0.01).build(model_parts=[resumed])
    state = {"model": resumed.state_dict(), "optimizer": resumed_optimizers.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    resumed.load_state_dict(state["model"])
    resumed_optimizers.load_state_dict(state["optimizer"])
print("resumed from DCP")
train(resumed, resumed_optimizers, range(30, 41))
