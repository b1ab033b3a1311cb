"""Model builders for ``muonscale route package.module:callable`` in the tests."""

import torch
from torch import nn

from muonscale.train.config import model_preset
from muonscale.train.model import GPT


class Conv1D(nn.Module):
    """transformers' Conv1D storage: weight (in, out), ``nf`` out features."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))

    def forward(self, x):
        return x @ self.weight


def tiny_gpt() -> GPT:
    """muonscale's reference GPT at one layer: fused QKV weights with a ``qkv_layout``."""
    return GPT(model_preset("tiny", n_layer=1, d_model=32, n_head=2))


def conv1d_model() -> nn.Module:
    return nn.Sequential(Conv1D(24, 8), nn.Linear(24, 8))


def not_a_model() -> int:
    return 3
