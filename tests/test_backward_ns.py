"""``Muon(orthogonalize_in_backward=True)``: the same parameters and state as the normal path,
bitwise on CPU (the hooks call the same functions of :mod:`muonscale.functional` on the same
values), and never a silent difference when gradients change after backward (clipping,
accumulation, replaced gradients): those steps fall back to the normal path with a warning.

Oracle: the same model, data and options without the option, compared with ``torch.equal``
after several steps (every per-matrix operation is independent of how matrices are batched on
CPU, so there is no tolerance to derive)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import muonscale
from muonscale.distributed import DistributedMuon, DTensorMuon

STEPS = 4
OPTIONS = dict(lr=0.05, weight_decay=0.1, momentum=0.9)


class Net(nn.Module):
    """Hidden matrices of several shapes (two of one shape, so buckets hold more than one),
    a conv kernel (flattened), a transposed-free head and an embedding for AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 12)
        self.a = nn.Linear(12, 24)
        self.b = nn.Linear(24, 24)
        self.c = nn.Linear(24, 24)
        self.unused = nn.Linear(24, 24)  # no gradient in some steps
        self.conv = nn.Conv1d(24, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, idx: torch.Tensor, use_unused: bool) -> torch.Tensor:
        h = torch.tanh(self.a(self.embed(idx)))
        h = torch.tanh(self.b(h)) + torch.tanh(self.c(h))
        if use_unused:
            h = h + torch.tanh(self.unused(h))
        h = self.conv(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def train(
    in_backward: bool,
    *,
    steps: int = STEPS,
    edit=None,
    micro_batches: int = 1,
    zero_grad=None,
    **options,
):
    torch.manual_seed(0)
    model = Net()
    opt = muonscale.Muon(model, **{**OPTIONS, **options}, orthogonalize_in_backward=in_backward)
    gen = torch.Generator().manual_seed(1)
    used_hooks = []
    for step in range(steps):
        for _ in range(micro_batches):
            idx = torch.randint(0, 11, (3, 7), generator=gen)
            model(idx, use_unused=step % 2 == 0).square().mean().backward()
        if in_backward:
            used_hooks.append(sum(b.result is not None for b in opt._backward_ns.buckets))
        if edit is not None:
            edit(model)
        opt.step()
        (zero_grad or opt.zero_grad)()
    return model, opt, used_hooks


def assert_same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def assert_same_state(a: torch.optim.Optimizer | dict, b: torch.optim.Optimizer | dict) -> None:
    sa, sb = (o if isinstance(o, dict) else o.state_dict()["state"] for o in (a, b))
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, value in sa[k].items():
            assert torch.equal(value, sb[k][key]), (k, key)


@pytest.mark.parametrize("nesterov", [True, False])
def test_equals_normal_path_bitwise(nesterov):
    ref, ref_opt, _ = train(False, nesterov=nesterov)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback may happen here
        got, opt, used = train(True, nesterov=nesterov)
    assert_same(ref, got)
    assert_same_state(ref_opt, opt)
    # the hooks did the work: all buckets in steps using every layer, all but the unused one's
    n = len(opt._backward_ns.buckets)
    assert used == [n, n - 1] * (STEPS // 2) and n >= 3


def test_equals_normal_path_other_options():
    options = dict(ns_method="gram", momentum_dtype=torch.float64, ns_dtype=torch.float64)
    ref, _, _ = train(False, **options)
    got, _, used = train(True, **options)
    assert_same(ref, got)
    assert all(used)


def clip(model: nn.Module) -> None:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e-3)
    assert norm > 1e-3  # the clipping is active: every gradient is scaled


def test_clipping_falls_back_with_a_warning():
    ref, ref_opt, _ = train(False, edit=clip)
    with pytest.warns(RuntimeWarning, match="modified in place after backward") as record:
        got, opt, used = train(True, edit=clip)
    assert len([w for w in record if "orthogonalize_in_backward" in str(w.message)]) == 1
    assert all(used)  # the hooks ran and their results were discarded
    assert_same(ref, got)
    assert_same_state(ref_opt, opt)


def test_replaced_gradient_falls_back():
    def replace(model):
        model.b.weight.grad = model.b.weight.grad * 0.5

    ref, _, _ = train(False, edit=replace)
    with pytest.warns(RuntimeWarning, match="was replaced after backward"):
        got, _, _ = train(True, edit=replace)
    assert_same(ref, got)


def test_gradient_accumulation_falls_back():
    ref, ref_opt, _ = train(False, micro_batches=2)
    with pytest.warns(RuntimeWarning, match="accumulated again"):
        got, opt, used = train(True, micro_batches=2)
    assert used == [0] * STEPS  # the second backward voided the first one's work
    assert_same(ref, got)
    assert_same_state(ref_opt, opt)


def test_zero_grad_between_backwards():
    """The optimizer's zero_grad voids the hooks' work, so the next backward alone counts; the
    model's zero_grad does not reach the optimizer: the second backward falls back."""
    torch.manual_seed(0)
    model = Net()
    model_ref = copy.deepcopy(model)
    opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=True)
    opt_ref = muonscale.Muon(model_ref, **OPTIONS)
    gen = torch.Generator().manual_seed(3)
    for zero in ("optimizer", "model"):
        first, second = (torch.randint(0, 11, (3, 7), generator=gen) for _ in range(2))
        for m, o in ((model, opt), (model_ref, opt_ref)):
            m(first, True).sum().backward()
            if zero == "optimizer":
                o.zero_grad()
            else:
                m.zero_grad(set_to_none=False)  # in place: the hooks' record is not reset
            m(second, True).sum().backward()
        if zero == "optimizer":
            assert all(b.result is not None for b in opt._backward_ns.buckets)
            opt.step()
        else:
            with pytest.warns(RuntimeWarning, match="accumulated again"):
                opt.step()
        opt_ref.step()
        for o in (opt, opt_ref):
            o.zero_grad()
        assert_same(model_ref, model)


def test_nonfinite_gradient_changes_nothing():
    torch.manual_seed(0)
    model = Net()
    opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=True)
    idx = torch.randint(0, 11, (3, 7))
    model(idx, True).sum().backward()
    opt.step()
    opt.zero_grad()
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    (model(idx, True).sum() * float("nan")).backward()
    with pytest.raises(muonscale.NonFiniteGradientError):
        opt.step()
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    assert_same_state(opt, before["state"])


def test_state_dict_round_trip_and_resume():
    """Stop after two steps, load the state into a new optimizer with the option, go on:
    equal to the uninterrupted normal run."""
    ref, _, _ = train(False)
    torch.manual_seed(0)
    model = Net()
    opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=True)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        if step == 2:
            saved = copy.deepcopy(opt.state_dict())
            opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=True)
            opt.load_state_dict(saved)
        idx = torch.randint(0, 11, (3, 7), generator=gen)
        model(idx, use_unused=step % 2 == 0).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert_same(ref, model)


def test_load_state_dict_between_backward_and_step_voids_the_hooks_work():
    torch.manual_seed(0)
    model = Net()
    opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=True)
    model(torch.randint(0, 11, (3, 7)), True).sum().backward()
    opt.load_state_dict(opt.state_dict())
    assert all(b.result is None for b in opt._backward_ns.buckets)
    opt.step()  # the normal path; no warning needed, nothing was stale
    assert opt.state


def test_option_changed_between_backward_and_step_falls_back():
    torch.manual_seed(0)
    model = Net()
    ref_model = copy.deepcopy(model)
    opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=True)
    ref = muonscale.Muon(ref_model, **OPTIONS)
    idx = torch.randint(0, 11, (3, 7))
    for m, o in ((model, opt), (ref_model, ref)):
        m(idx, True).sum().backward()
        o.param_groups[0]["momentum"] = 0.5
    with pytest.warns(RuntimeWarning, match="option of the param group changed"):
        opt.step()
    ref.step()
    assert_same(ref_model, model)


def test_refused_with_capturable_and_bad_values():
    model = Net()
    with pytest.raises(ValueError, match="orthogonalize_in_backward.*capturable"):
        muonscale.Muon(model, capturable=True, orthogonalize_in_backward=True)
    with pytest.raises(ValueError, match="orthogonalize_in_backward must be True or False"):
        muonscale.Muon(model, orthogonalize_in_backward="yes")


@pytest.mark.parametrize("cls", [DistributedMuon, DTensorMuon])
def test_refused_by_the_distributed_optimizers(cls):
    model = Net()
    match = f"{cls.__name__} does not support orthogonalize_in_backward=True"
    with pytest.raises(ValueError, match=match):
        cls(model, orthogonalize_in_backward=True)


def test_pickled_copy_keeps_the_option():
    torch.manual_seed(0)
    model = Net()
    opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=True)
    clone = copy.deepcopy(opt)
    assert clone.orthogonalize_in_backward and clone._backward_ns.buckets
    assert clone._backward_ns.buckets[0].params[0] is not opt._backward_ns.buckets[0].params[0]


def test_frozen_parameter_is_updated_in_step_only():
    """A Muon parameter frozen at construction gets no hook; one given a gradient by hand is
    updated in step() as usual, the rest from the hooks: equal to the normal path."""
    results = []
    for flag in (False, True):
        torch.manual_seed(0)
        model = Net()
        model.b.weight.requires_grad_(False)
        opt = muonscale.Muon(model, **OPTIONS, orthogonalize_in_backward=flag)
        model(torch.randint(0, 11, (3, 7)), True).sum().backward()
        model.b.weight.grad = torch.ones_like(model.b.weight)
        opt.step()
        results.append(model)
    assert_same(*results)
