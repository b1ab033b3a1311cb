"""Routing is inspectable before training: ``summary()`` names transposed and split weights;
``strict`` judges routing by tensor rank alone: ``None`` (the default) refuses it where it is
certainly wrong, ``True`` always, ``False`` never (a warning)."""

import warnings

import pytest
import torch
from route_models import conv1d_model, tiny_gpt
from torch import nn

from muonscale import Muon, QKVLayout


def _line(summary: str, name: str) -> str:
    return next(line for line in summary.splitlines() if f" {name} " in line)


def test_summary_names_transposed_and_split_weights():
    model = tiny_gpt()
    splits = {name: model.qkv_layout for name in model.qkv_param_names()}
    opt = Muon(model, lr=0.02, splits=splits)
    qkv = _line(opt.summary(), "blocks.0.attn.qkv.weight")
    assert "split: 3 row blocks q k v" in qkv
    other = _line(opt.summary(), "blocks.0.attn.proj.weight")
    assert "split" not in other and "transposed" not in other

    opt = Muon(conv1d_model(), lr=0.02)
    summary = opt.summary()
    assert "transposed (stored in, out)" in _line(summary, "0.weight")
    assert "[" not in _line(summary, "1.weight")


def test_summary_names_equal_and_sized_splits():
    model = nn.Sequential(nn.Linear(8, 12), nn.Linear(8, 10))
    opt = Muon(model, lr=0.02, splits={"0.weight": 3, "1.weight": [4, 6]})
    assert "split: 3 row blocks [4, 4, 4]" in _line(opt.summary(), "0.weight")
    assert "split: 2 row blocks [4, 6]" in _line(opt.summary(), "1.weight")


def test_summary_names_per_head_splits():
    layout = QKVLayout(n_query_groups=2, q_per_group=2, head_dim=2)  # GQA: 4 q, 2 kv heads
    model = nn.Sequential(nn.Linear(8, layout.rows))
    opt = Muon(model, lr=0.02, splits={"0.weight": layout}, qkv_split="head")
    assert "split: 8 row blocks 4xq 2xk 2xv" in _line(opt.summary(), "0.weight")


def test_strict_refuses_rank_only_routing():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match="strict=True: .*routed to Muon by tensor rank"):
        Muon(model.parameters(), lr=0.02, strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon(model.named_parameters(), lr=0.02, strict=True)  # named: neither error nor warning
        # unnamed but pinned: no rank rule involved
        opt = Muon([{"params": [model[1].weight], "algorithm": "muon"}], lr=0.02, strict=True)
    groups = len(opt.param_groups)
    extra = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="strict=True"):
        opt.add_param_group({"params": list(extra.parameters())})
    assert len(opt.param_groups) == groups, "a refused group is not added"
    with pytest.raises(ValueError, match="strict must be None .*, False .* or True"):
        Muon(model.named_parameters(), lr=0.02, strict="yes")


def test_model_parameters_is_refused_by_default_naming_the_fix():
    """``Muon(model.parameters())`` puts the embedding on Muon: certain, so refused."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"instead of model\.parameters\(\).*strict=False"):
        Muon(model.parameters(), lr=0.02)


def test_strict_false_accepts_rank_only_routing_with_a_warning_bitwise_as_before():
    """``strict=False`` is 0.5.0's behaviour: a warning, and the same step as routing the
    same tensors by hand (2-D to Muon, 1-D to AdamW)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    pinned = [copy_param(p) for p in model.parameters()]
    with pytest.warns(UserWarning, match="routed to Muon by tensor rank"):
        opt = Muon(model.parameters(), lr=0.02, strict=False)
    by_hand = Muon(
        [
            {"params": [p for p in pinned if p.ndim >= 2], "algorithm": "muon"},
            {"params": [p for p in pinned if p.ndim < 2], "algorithm": "adamw"},
        ],
        lr=0.02,
    )
    for p, q in zip(model.parameters(), pinned):
        p.grad = torch.full_like(p, 0.5).add_(torch.arange(p.numel()).view(p.shape) / 10)
        q.grad = p.grad.clone()
    opt.step()
    by_hand.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), pinned))


def copy_param(p: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(p.detach().clone())


def test_a_list_of_matrices_steps_without_a_warning():
    """What ``torch.optim.Muon`` users pass: hidden matrices alone, unnamed."""
    w1, w2 = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = Muon([w1, w2], lr=0.02)
    w1.grad, w2.grad = torch.ones_like(w1), torch.ones_like(w2)
    before = w1.detach().clone()
    opt.step()
    assert not torch.equal(w1, before)


def test_a_mixed_unnamed_list_warns_and_steps():
    """Keller Jordan's style: hidden matrices with norm gains and biases, unnamed: not
    certainly wrong (no embedding), so a warning, and the step runs."""
    w, gain = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.ones(4))
    with pytest.warns(UserWarning, match="routed to Muon by tensor rank"):
        opt = Muon([w, gain], lr=0.02)
    w.grad, gain.grad = torch.ones_like(w), torch.ones_like(gain)
    opt.step()


def test_strict_survives_pickling():
    import pickle

    weight = nn.Parameter(torch.zeros(4, 4))
    opt = Muon([{"params": [weight], "algorithm": "muon"}], lr=0.02, strict=True)
    opt = pickle.loads(pickle.dumps(opt))
    with pytest.raises(ValueError, match="strict=True"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(4, 4))]})
