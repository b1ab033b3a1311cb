"""Muon momentum kept in one (k, *shape) stack per (param group, shape, dtype, device):
per-parameter state is a view into it, the state_dict format is unchanged, and every way state
can be replaced (load_state_dict, DCP's set_state_dict, assigning a tensor) is copied back into
the stacks so that training continues bitwise as if uninterrupted."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from muonscale import Muon

SHAPES = {"a": (12, 20), "b": (12, 20), "c": (20, 12), "d": (12, 20), "e": (8, 8)}


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}


def _grads(step, skip=()):
    g = torch.Generator().manual_seed(100 + step)
    grads = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    return {n: t for n, t in grads.items() if n not in skip}


def _step(params, opt, step, skip=()):
    grads = _grads(step, skip)
    for n, p in params.items():
        p.grad = grads[n].clone() if n in grads else None
    opt.step()


def _make(params, **kw):
    return Muon(list(params.items()), lr=0.02, weight_decay=0.1, **kw)


def test_momentum_is_a_view_into_one_stack_per_shape_and_dtype():
    params = _params()
    opt = _make(params)
    _step(params, opt, 0)
    bufs = {n: opt.state[p]["momentum_buffer"] for n, p in params.items()}
    base = {n: b._base for n, b in bufs.items()}
    assert all(b is not None for b in base.values())
    assert base["a"] is base["b"] is base["d"] and base["a"].shape == (3, 12, 20)
    assert base["c"] is not base["a"] and base["c"].shape == (1, 20, 12)
    # the state_dict format is unchanged: one parameter-shaped tensor per parameter
    sd = opt.state_dict()
    for i, (n, p) in enumerate(params.items()):
        assert sd["state"][i]["momentum_buffer"].shape == p.shape, n
        assert set(sd["state"][i]) == {"momentum_buffer"}


def test_parameters_without_gradient_keep_their_state():
    params = _params()
    opt = _make(params)
    _step(params, opt, 0)
    before = opt.state[params["b"]]["momentum_buffer"].clone()
    weight = params["b"].detach().clone()
    _step(params, opt, 1, skip=("b",))
    assert torch.equal(opt.state[params["b"]]["momentum_buffer"], before)
    assert torch.equal(params["b"], weight)


def test_new_state_joins_the_stack_without_touching_the_others():
    """A parameter whose first gradient comes later gets zero momentum in a rebuilt stack; the
    others' values move over unchanged: the result equals a run with separate optimizers."""
    params, twin = _params(), _params()
    opt = _make(params)
    singles = {n: _make({n: p}) for n, p in twin.items()}
    for k in range(4):
        skip = ("b",) if k < 2 else ()
        _step(params, opt, k, skip)
        grads = _grads(k, skip)
        for n, p in twin.items():
            p.grad = grads[n].clone() if n in grads else None
            singles[n].step()
    for n in params:
        torch.testing.assert_close(params[n], twin[n], rtol=0, atol=0)


def _uninterrupted(steps, **kw):
    params = _params()
    opt = _make(params, **kw)
    for k in range(steps):
        _step(params, opt, k, skip=("e",) if k == 1 else ())
    return params


def test_load_state_dict_then_step_equals_uninterrupted():
    for kw in ({}, {"momentum_dtype": torch.bfloat16}):
        expected = _uninterrupted(5, **kw)
        params = _params()
        opt = _make(params, **kw)
        for k in range(2):
            _step(params, opt, k, skip=("e",) if k == 1 else ())
        saved_params = {n: p.detach().clone() for n, p in params.items()}
        saved = copy.deepcopy(opt.state_dict())
        resumed = {n: nn.Parameter(t) for n, t in saved_params.items()}
        opt2 = _make(resumed, **kw)
        opt2.load_state_dict(saved)
        for k in range(2, 5):
            _step(resumed, opt2, k)
        for n in expected:
            assert torch.equal(resumed[n], expected[n]), (n, kw)
        base = opt2.state[resumed["a"]]["momentum_buffer"]._base
        assert base is not None and base is opt2.state[resumed["d"]]["momentum_buffer"]._base


def test_dcp_set_state_dict_then_step_equals_uninterrupted():
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    class Bag(nn.Module):
        def __init__(self, tensors):
            super().__init__()
            for n, t in tensors.items():
                self.register_parameter(n, t)

    expected = _uninterrupted(5)
    model = Bag(_params())
    opt = _make(dict(model.named_parameters()))
    for k in range(2):
        _step(dict(model.named_parameters()), opt, k, skip=("e",) if k == 1 else ())
    model_sd, optim_sd = get_state_dict(model, opt)
    model_sd, optim_sd = copy.deepcopy(model_sd), copy.deepcopy(optim_sd)
    fresh = Bag({n: nn.Parameter(torch.zeros(s)) for n, s in SHAPES.items()})
    opt2 = _make(dict(fresh.named_parameters()))
    set_state_dict(fresh, opt2, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for k in range(2, 5):
        _step(dict(fresh.named_parameters()), opt2, k)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, expected[n]), n


def test_assigned_state_tensor_is_copied_into_the_stack():
    params, twin = _params(), _params()
    opt, opt2 = _make(params), _make(twin)
    _step(params, opt, 0)
    _step(twin, opt2, 0)
    replacement = torch.randn(SHAPES["a"])
    opt.state[params["a"]]["momentum_buffer"] = replacement.clone()
    opt2.state[twin["a"]]["momentum_buffer"].copy_(replacement)  # in place, stays a view
    _step(params, opt, 1)
    _step(twin, opt2, 1)
    for n in params:
        assert torch.equal(params[n], twin[n]), n
    assert opt.state[params["a"]]["momentum_buffer"]._base is not None


class _OpsOnMatrices(TorchDispatchMode):
    """Records the ops that read or write a tensor whose last dim is ``cols`` (the matrices and
    stacks of a test whose m×m Newton–Schulz products have another last dim), views and
    allocations left out."""

    IGNORED = {"empty", "select", "view", "transpose", "unbind", "t", "alias", "detach"}

    def __init__(self, cols):
        super().__init__()
        self.cols, self.ops = cols, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = []
        for a in [*args, *(kwargs or {}).values(), out]:
            tensors += list(a) if isinstance(a, (list, tuple)) else [a]
        name = func.overloadpacket.__name__
        hit = any(
            isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == self.cols for t in tensors
        )
        if hit and name not in self.IGNORED:
            self.ops.append(name)
        return out


def test_step_makes_no_copy_of_stacks_and_two_elementwise_passes():
    """After the first step (stacks built), a step over three same-shape matrices runs, on
    matrix-sized data: (a) the momentum update (one foreach) and the directions written into
    the Newton–Schulz input (one lerp per matrix, the cast folded in); the norm, one multiply
    of the stack by 1 or 2⁻ˢ per matrix (the guard against an overflowing X Xᵀ), and the
    iteration's products; (b) the weight decay and the update (one foreach each). No copy: the
    normalization is folded into the first step, the result is read where the iteration
    leaves it."""
    g = torch.Generator().manual_seed(0)
    params = {n: nn.Parameter(torch.randn(12, 20, generator=g)) for n in "abc"}
    opt = Muon(
        list(params.items()), lr=0.02, weight_decay=0.1, ns_method="plain", nonfinite="ignore"
    )
    for p in params.values():
        p.grad = torch.randn(12, 20, generator=g)
    opt.step()
    counter = _OpsOnMatrices(cols=20)
    with counter:
        opt.step()
    matmuls = ("bmm", "baddbmm", "linalg_vector_norm")
    elementwise = [op for op in counter.ops if op not in matmuls]
    assert elementwise == [
        "_foreach_lerp_",
        "lerp",
        "lerp",
        "lerp",
        "mul_",
        "_foreach_mul_",
        "_foreach_add_",
    ], counter.ops
