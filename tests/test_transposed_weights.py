"""Weights stored (in, out), as GPT-2's Conv1D does: the Muon matrix is the transpose.

Oracle: a Conv1D-stored weight W_s = Wᵀ stepped with a transposed view must equal the
nn.Linear-stored W stepped with a plain view, transposed back, for every scale rule and for a
Q/K/V split (which must cut output features, i.e. columns of W_s).
"""

import pickle

import pytest
import torch
from torch import nn

import muonscale
from muonscale import functional
from muonscale.matrices import MatrixView, row_blocks
from muonscale.params import transposed_weights
from muonscale.settings import MuonSettings


class Conv1D(nn.Module):
    """The storage convention of transformers.pytorch_utils.Conv1D: weight (nx, nf)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


def _step(param, grad, view, scale):
    buf = torch.zeros_like(param)
    functional.muon(
        [param],
        [grad],
        [buf],
        views=[view],
        lr=0.1,
        weight_decay=0.0,
        settings=MuonSettings(
            momentum=0.9,
            nesterov=True,
            ns_steps=5,
            coefficients="keller",
            ns_dtype=torch.float64,
            scale=scale,
        ),
        max_chunk_bytes=None,
    )


@pytest.mark.parametrize("scale", ["shape", "spectral", "match_rms_adamw", "unit_rms"])
@pytest.mark.parametrize("split", [None, 3])
def test_transposed_view_equals_linear_layout(scale, split):
    torch.manual_seed(0)
    d_in, d_out = 8, 24  # c_attn-like: out = 3 · in, so the aspect matters for shape/spectral
    linear = torch.randn(d_out, d_in, dtype=torch.float64)
    grad = torch.randn(d_out, d_in, dtype=torch.float64)
    parts = row_blocks([d_out // split] * split) if split else None
    reference = linear.clone()
    _step(reference, grad, MatrixView.build(reference.shape, row_partition=parts), scale)
    stored = linear.T.clone()  # (in, out)
    view = MatrixView.build(stored.shape, row_partition=parts, transposed=True)
    assert view.matrix_shapes == [(d_out // (split or 1), d_in)] * (split or 1)
    _step(stored, grad.T.clone(), view, scale)
    # Same matrices reach Newton–Schulz in the same orientation (tall ones are transposed
    # there), so the two layouts do identical float64 arithmetic: a few ulp at most.
    torch.testing.assert_close(stored.T, reference, rtol=0, atol=8 * torch.finfo(torch.float64).eps)


def test_scale_uses_true_aspect():
    # With scale="spectral" s = sqrt(out/in) = sqrt(3) for (in, out) = (8, 24); reading the
    # stored shape as (rows, cols) would give sqrt(1/3), 3x smaller.
    torch.manual_seed(1)
    stored = torch.zeros(8, 24, dtype=torch.float64)
    _step(
        stored,
        torch.randn(8, 24, dtype=torch.float64),
        MatrixView.build((8, 24), transposed=True),
        "spectral",
    )
    update = stored.T  # (out, in), every singular value ≈ lr · sqrt(3)
    sv = torch.linalg.svdvals(update)
    assert sv.max().item() == pytest.approx(
        0.1 * 3**0.5, rel=0.35
    )  # NS(keller) leaves σ in ~[0.7, 1.2]


def test_split_must_cover_output_features():
    with pytest.raises(ValueError, match="output features"):
        MatrixView.build((8, 24), row_partition=row_blocks([4, 4]), transposed=True)
    with pytest.raises(ValueError, match="2-D"):
        MatrixView.build((2, 8, 24), transposed=True)


def test_transposed_weights_finds_conv1d_only():
    model = nn.Sequential(Conv1D(24, 8), nn.Linear(24, 8), nn.Embedding(5, 8))
    assert transposed_weights(model) == {"0.weight"}
    odd = Conv1D(24, 8)
    odd.nf = 7  # not (in, out) by its own out-features attribute
    assert transposed_weights(odd) == set()


class LinearBlock(nn.Module):
    def __init__(self, fused: nn.Module, proj: nn.Module) -> None:
        super().__init__()
        self.c_attn, self.c_proj = fused, proj


def _pair(d_in=8, d_out=24):
    """The same weights stored as Conv1D (in, out) and as nn.Linear (out, in)."""
    torch.manual_seed(2)
    conv = LinearBlock(Conv1D(d_out, d_in), Conv1D(d_in, d_out))
    linear = LinearBlock(nn.Linear(d_in, d_out), nn.Linear(d_out, d_in))
    with torch.no_grad():
        for c, lin in ((conv.c_attn, linear.c_attn), (conv.c_proj, linear.c_proj)):
            c.weight.copy_(torch.randn_like(c.weight))
            lin.weight.copy_(c.weight.T)
            lin.bias.copy_(c.bias)
    return conv.double(), linear.double()


@pytest.mark.parametrize("scale", ["shape", "spectral"])
@pytest.mark.parametrize("split", [None, 3])
def test_muon_routes_conv1d_as_its_transpose(scale, split):
    conv, linear = _pair()
    kwargs = dict(lr=0.05, scale=scale, adamw_lr=0.01, ns_dtype=torch.float64)
    splits = {"c_attn.weight": split} if split else None
    opt_conv = muonscale.Muon(conv, splits=splits, **kwargs)
    opt_linear = muonscale.Muon(linear, splits=splits, **kwargs)
    assert opt_conv.param_table.is_transposed(
        conv.c_attn.weight
    ) and not opt_linear.param_table.is_transposed(linear.c_attn.weight)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        for c, lin in ((conv.c_attn, linear.c_attn), (conv.c_proj, linear.c_proj)):
            grad = torch.randn(lin.weight.shape, generator=g, dtype=torch.float64)
            lin.weight.grad, c.weight.grad = grad, grad.T.clone()
            c.bias.grad = lin.bias.grad = torch.randn(
                lin.bias.shape, generator=g, dtype=torch.float64
            )
        opt_conv.step()
        opt_linear.step()
    # The same float64 arithmetic on the same (out, in) matrices: a few ulp (as above).
    for c, lin in ((conv.c_attn, linear.c_attn), (conv.c_proj, linear.c_proj)):
        torch.testing.assert_close(
            c.weight.T, lin.weight, rtol=0, atol=8 * torch.finfo(torch.float64).eps
        )


def test_conv1d_splits_count_output_features():
    conv, _ = _pair(d_in=8, d_out=12)
    with pytest.raises(ValueError, match="do not divide 12"):  # 8 divides the input rows only
        muonscale.Muon(conv, splits={"c_attn.weight": 8}, adamw_lr=0.01)
    opt = muonscale.Muon(conv, splits={"c_attn.weight": 3}, adamw_lr=0.01)
    view = opt.param_table.view(conv.c_attn.weight, opt.param_groups[0]["matrix_mode"])
    assert view.matrix_shapes == [(4, 8)] * 3  # Q, K, V: output features × input features
    copy = pickle.loads(pickle.dumps(opt))
    assert copy.param_table.is_transposed(copy.param_groups[0]["params"][0])
