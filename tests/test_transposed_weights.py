"""Weights stored (in, out), as GPT-2's Conv1D does: the Muon matrix is the transpose.

Oracle: a Conv1D-stored weight W_s = Wᵀ stepped with a transposed view must equal the
nn.Linear-stored W stepped with a plain view, transposed back, for every scale rule and for a
Q/K/V split (which must cut output features, i.e. columns of W_s).
"""

import pytest
import torch
from torch import nn

from muonscale import functional
from muonscale.matrices import MatrixView, row_blocks
from muonscale.params import transposed_weights


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
        [param], [grad], [buf], views=[view], lr=0.1, weight_decay=0.0, momentum=0.9,
        nesterov=True, ns_steps=5, coefficients="keller", ns_dtype=torch.float64, scale=scale,
        max_chunk_bytes=None,
    )  # fmt: skip


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
    _step(stored, torch.randn(8, 24, dtype=torch.float64), MatrixView.build((8, 24), transposed=True), "spectral")
    update = stored.T  # (out, in), every singular value ≈ lr · sqrt(3)
    sv = torch.linalg.svdvals(update)
    assert sv.max().item() == pytest.approx(0.1 * 3**0.5, rel=0.35)  # NS(keller) leaves σ in ~[0.7, 1.2]


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
