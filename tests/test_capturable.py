"""``Muon(capturable=True)``: no host sync, the same bits as the host step, non-finite gradients
handled on the device; on a GPU, CUDA-graph replay equals eager."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import muonscale
from muonscale import Muon, NonFiniteGradientError


class _Net(nn.Module):
    """Muon matrices (wide, tall, square), an embedding and a head (AdamW ≥ 2-D, decayed) and a
    norm and biases (AdamW 1-D, no decay): both halves and both AdamW groups."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 24)
        self.down = nn.Linear(24, 8)
        self.mix = nn.Linear(8, 8, bias=False)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11)


def _grads(model: nn.Module, seed: int, *, nan_in: str | None = None) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device)
        if name == nan_in:
            p.grad.view(-1)[1] = float("nan")


@contextlib.contextmanager
def _no_host_reads():
    """Every way of reading a tensor's value on the host raises."""

    def refuse(self, *args, **kwargs):
        raise AssertionError("a capturable step read a tensor on the host")

    class RefuseScalarReads(TorchDispatchMode):  # reads inside an op's own binding too
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                raise AssertionError(f"a capturable step read a tensor on the host ({func})")
            return func(*args, **(kwargs or {}))

    names = ("item", "__bool__", "__float__", "__int__", "__index__", "tolist")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse)
        with RefuseScalarReads():
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _state(opt: Muon) -> list[torch.Tensor]:
    return [v.detach().clone().cpu() for s in opt.state.values() for v in s.values()]


def _pair(policy: str = "raise", **options):
    torch.manual_seed(0)
    host_model = _Net()
    device_model = copy.deepcopy(host_model)
    # float64 lrs: a scheduler then computes the same values for both (the capturable
    # optimizer holds its lr as a float64 device tensor)
    f64 = dict(dtype=torch.float64)

    def lr():  # each optimizer its own tensors (a scheduler writes them in place)
        return dict(lr=torch.tensor(0.02, **f64), adamw_lr=torch.tensor(3e-3, **f64))

    host = Muon(host_model, nonfinite=policy, **lr(), **options)
    dev = Muon(device_model, nonfinite=policy, capturable=True, **lr(), **options)
    return host_model, host, device_model, dev


def _schedulers(*opts: Muon) -> list[torch.optim.lr_scheduler.LRScheduler]:
    return [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7) for o in opts]


@pytest.mark.parametrize(
    "storage",
    [
        {},
        {"momentum_dtype": torch.bfloat16},
        {"state_precision": "int8"},
        {"state_precision": "int4"},
    ],
    ids=["param", "bf16_momentum", "int8_state", "int4_state"],
)
def test_capturable_step_reads_nothing_on_the_host_and_equals_the_host_step(storage):
    """Five steps with a StepLR schedule on both halves' tensor lrs; the third has a NaN
    gradient. The capturable step runs with every host read of a tensor patched to raise and
    makes the same bits as the host step (CPU: every scalar is rounded once from float64, as
    the host path's Python floats are), and the NaN step changes nothing."""
    host_model, host, dev_model, dev = _pair("skip", **storage)
    host_sched, dev_sched = _schedulers(host, dev)
    for step in range(5):
        nan_in = "up.weight" if step == 2 else None
        _grads(host_model, step, nan_in=nan_in)
        _grads(dev_model, step, nan_in=nan_in)
        before = [p.detach().clone() for p in dev_model.parameters()], _state(dev)
        host.step()
        with _no_host_reads():
            dev.step()
            dev_sched.step()  # writes the new lr into the device tensor in place
        host_sched.step()
        if nan_in:
            assert all(torch.equal(a, b) for a, b in zip(dev_model.parameters(), before[0]))
            assert all(torch.equal(a, b) for a, b in zip(_state(dev), before[1]))
        for (name, a), b in zip(host_model.named_parameters(), dev_model.parameters()):
            assert torch.equal(a, b), (step, name)
        assert all(torch.equal(a, b) for a, b in zip(_state(host), _state(dev)))
    assert host.skipped_steps == dev.skipped_steps == 1
    lrs = [g["lr"] for g in dev.param_groups]
    assert all(torch.is_tensor(lr) and lr.dtype == torch.float64 for lr in lrs)
    assert float(lrs[0]) == pytest.approx(0.02 * 0.7**5)


def test_capturable_raise_reports_at_the_next_step_and_keeps_everything_unchanged():
    """``"raise"``: the NaN step and every step until the error is reported are no-ops; the
    error names the parameter, comes at the next ``step()`` (here the record is on the host at
    once), then the optimizer carries on and equals a host optimizer that skipped the bad
    step."""
    host_model, host, dev_model, dev = _pair("raise")
    for step in range(2):
        _grads(host_model, step)
        _grads(dev_model, step)
        host.step()
        dev.step()
    before = [p.detach().clone() for p in dev_model.parameters()], _state(dev)
    _grads(dev_model, 7, nan_in="head.weight")
    with _no_host_reads():
        dev.step()  # no-op on the device, nothing raised: no host read allowed
    _grads(dev_model, 8)
    with pytest.raises(NonFiniteGradientError, match="head.weight"):
        dev.step()
    assert all(torch.equal(a, b) for a, b in zip(dev_model.parameters(), before[0]))
    assert all(torch.equal(a, b) for a, b in zip(_state(dev), before[1]))
    dev.check_finite()  # reported once
    for step in (2, 3):
        _grads(host_model, step)
        _grads(dev_model, step)
        host.step()
        dev.step()
    for a, b in zip(host_model.parameters(), dev_model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("report", ["check_finite", "state_dict"])
def test_capturable_raise_at_explicit_check_and_state_dict(report):
    _, _, dev_model, dev = _pair("raise")
    _grads(dev_model, 0, nan_in="embed.weight")
    dev.step()
    with pytest.raises(NonFiniteGradientError, match="embed.weight"):
        getattr(dev, report)()
    dev.check_finite()  # cleared


def test_capturable_state_dict_round_trip_keeps_the_lr_tensors():
    """Loading keeps the lr tensors a graph may have captured (values copied in) and moves
    AdamW's step counters to the parameters' device; resumed equals uninterrupted."""
    host_model, host, dev_model, dev = _pair("raise")
    for step in range(2):
        _grads(dev_model, step)
        dev.step()
    saved = copy.deepcopy(dev.state_dict())
    model_copy = copy.deepcopy(dev_model)
    resumed = Muon(model_copy, lr=0.5, adamw_lr=0.5, capturable=True)
    lrs = [g["lr"] for g in resumed.param_groups]
    resumed.load_state_dict(saved)
    assert all(g["lr"] is lr for g, lr in zip(resumed.param_groups, lrs))
    assert float(lrs[0]) == pytest.approx(0.02)
    _grads(dev_model, 5)
    _grads(model_copy, 5)
    dev.step()
    resumed.step()
    for a, b in zip(dev_model.parameters(), model_copy.parameters()):
        assert torch.equal(a, b)


def test_capturable_is_validated_and_refused_by_the_distributed_optimizers():
    with pytest.raises(ValueError, match="capturable must be a bool"):
        Muon(_Net(), capturable=1)
    # refused in the constructor, before any process group is needed
    with pytest.raises(ValueError, match="DistributedMuon does not support capturable"):
        muonscale.DistributedMuon(_Net(), capturable=True)
    with pytest.raises(ValueError, match="DTensorMuon does not support capturable"):
        muonscale.DTensorMuon(_Net(), capturable=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["raise", "skip", "ignore"])
def test_cuda_graph_replay_equals_eager_bitwise(policy):
    """The recipe of docs/cuda_graphs.md: warm up on a side stream, capture ``step()``, then
    replay with new gradients copied into the static ones and the lr changed in place; the
    eager capturable optimizer on a copy gets the same bits (the graph runs the same kernels)."""
    torch.manual_seed(0)
    eager_model = _Net().cuda()
    graph_model = copy.deepcopy(eager_model)
    make = dict(lr=torch.tensor(0.02, device="cuda"), nonfinite=policy, capturable=True)
    eager, graphed = Muon(eager_model, **make), Muon(graph_model, **make)
    _grads(graph_model, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up: state, lr tensors, workspaces, Triton autotune
            graphed.step()
    torch.cuda.current_stream().wait_stream(side)
    _grads(eager_model, 0)
    for _ in range(3):
        eager.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    static = {n: p.grad for n, p in graph_model.named_parameters()}
    for step in range(1, 5):
        nan_in = "down.weight" if step == 2 and policy != "ignore" else None
        _grads(eager_model, step, nan_in=nan_in)
        for n, p in eager_model.named_parameters():
            static[n].copy_(p.grad)
        for g_eager, g_graph in zip(eager.param_groups, graphed.param_groups):
            g_eager["lr"].fill_(0.02 / step)
            g_graph["lr"].fill_(0.02 / step)
        graph.replay()
        eager.step()
        if policy == "raise" and nan_in:
            for opt in (graphed, eager):  # replay cannot raise: the check reports it
                with pytest.raises(NonFiniteGradientError, match="down.weight"):
                    opt.check_finite()
        torch.cuda.synchronize()
        for a, b in zip(eager_model.parameters(), graph_model.parameters()):
            assert torch.equal(a, b), step
    if policy == "skip":
        assert eager.skipped_steps == graphed.skipped_steps == 1
