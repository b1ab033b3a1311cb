"""The reference GPT: QKV layout against separately sliced weights, GQA, causality, counts."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from muonscale.train.config import ModelConfig, model_preset
from muonscale.train.model import GPT, CausalSelfAttention


def _small(**overrides) -> ModelConfig:
    values = dict(vocab_size=256, context_length=16, n_layer=2, d_model=48, n_head=6)
    return ModelConfig(**{**values, **overrides})


def _reference_attention(
    attn: CausalSelfAttention, x: torch.Tensor, n_head: int, n_kv: int
) -> torch.Tensor:
    """Attention computed from q/k/v weights sliced with explicit row indices (float64 math)."""
    layout = attn.layout
    weight = attn.qkv.weight.double()  # (rows, d)
    w_q, w_k, w_v = (weight[rows] for rows in (layout.q_rows(), layout.k_rows(), layout.v_rows()))
    head_dim = layout.head_dim
    batch, seq, _ = x.shape
    x = x.double()
    q = (x @ w_q.T).view(batch, seq, n_head, head_dim)
    k = (x @ w_k.T).view(batch, seq, n_kv, head_dim)
    v = (x @ w_v.T).view(batch, seq, n_kv, head_dim)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    outputs = []
    for h in range(n_head):
        g = h // (n_head // n_kv)  # query head h uses key/value head of its group
        scores = q[:, :, h] @ k[:, :, g].transpose(1, 2) / math.sqrt(head_dim)  # (B, T, T)
        scores = scores.masked_fill(~mask, float("-inf"))
        outputs.append(scores.softmax(-1) @ v[:, :, g])  # (B, T, hd)
    y = torch.cat(outputs, dim=-1)  # (B, T, H * hd), heads in order
    return y @ attn.proj.weight.double().T


@pytest.mark.parametrize("n_kv_head", [6, 3, 2, 1])
def test_attention_matches_sliced_qkv_reference(n_kv_head):
    torch.manual_seed(0)
    config = _small(n_kv_head=n_kv_head)
    attn = CausalSelfAttention(config)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 16, config.d_model)
    expected = _reference_attention(attn, x, config.n_head, n_kv_head)
    # float32 vs float64 on O(1) values: agreement to ~1e-5
    torch.testing.assert_close(attn(x).double(), expected, atol=2e-5, rtol=1e-4)


def test_qkv_layout_is_interleaved_by_group_and_exposed():
    model = GPT(_small(n_kv_head=2))
    layout = model.qkv_layout
    assert (layout.n_query_groups, layout.q_per_group, layout.head_dim) == (2, 3, 8)
    names = model.qkv_param_names()
    params = dict(model.named_parameters())
    assert names == ["blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"]
    for name in names:
        assert params[name].shape == (layout.rows, 48) == ((3 + 2) * 2 * 8, 48)  # GQA: fewer rows
    # group 0 rows: q0 q1 q2 k v (8 rows each); group 1 starts at row 40
    assert layout.k_rows()[:8].tolist() == list(range(24, 32))
    assert layout.v_rows()[8:].tolist() == list(range(72, 80))


def test_names_make_embeddings_and_head_recognisable():
    names = [n for n, _ in GPT(_small()).named_parameters()]
    assert names[:2] == ["wte.weight", "wpe.weight"] and "lm_head.weight" in names
    tied = [n for n, _ in GPT(_small(tie_embeddings=True)).named_parameters()]
    assert "lm_head.weight" not in tied  # shares wte.weight


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(mlp="swiglu", norm="rmsnorm", position="rotary", n_kv_head=2, bias=True),
        dict(tie_embeddings=True, position="rotary"),
    ],
)
def test_forward_is_causal_and_loss_matches_cross_entropy(overrides):
    torch.manual_seed(0)
    model = GPT(_small(**overrides)).eval()
    idx = torch.randint(0, 256, (2, 16))
    logits, loss = model(idx, idx)
    assert logits.shape == (2, 16, 256)
    assert loss.item() == pytest.approx(F.cross_entropy(logits.flatten(0, 1), idx.flatten()).item())
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    torch.testing.assert_close(model(changed)[0][:, :10], logits[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(model(changed)[0][:, 10:], logits[:, 10:])


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, context_length=16, n_layer=8, d_model=256, n_head=4)
    model = GPT(config)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    expected = 0.02 / math.sqrt(2 * 8)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(expected, rel=0.05)
    assert model.blocks[0].mlp.proj.weight.std().item() == pytest.approx(expected, rel=0.05)


def test_parameter_count_and_flops_of_gpt2_small_shapes():
    # GPT-2 small (tied, with biases, vocab 50257) has 124,439,808 parameters.
    config = model_preset("gpt2-small", vocab_size=50257, tie_embeddings=True, bias=True)
    with torch.device("meta"):
        model = GPT(config)
    assert model.num_parameters() == 124_439_808
    non_embedding = 124_439_808 - 50257 * 768 - 1024 * 768 + 50257 * 768  # head still multiplies
    assert model.num_parameters(exclude_embeddings=True) == non_embedding
    linear_weights = 12 * (768 * 3 * 768 + 768 * 768 + 2 * 768 * 3072) + 50257 * 768
    assert model.flops_per_token() == 3 * (2 * linear_weights + 4 * 12 * 1024 * 768)


def test_swiglu_hidden_width_rounds_to_64():
    assert ModelConfig(d_model=192, n_head=6, mlp="swiglu").hidden_dim == 512
    assert ModelConfig(d_model=768, n_head=12, mlp="swiglu").hidden_dim == 2048
