"""Keys that torch's ``load_state_dict`` hooks write into ``opt.state`` (as torch's own hook
tests do, ported in ``test_torch_optim_contracts.py``) leave steps, checkpoints and the state
byte count alone: ``Muon``, and ``DistributedMuon`` and ``DTensorMuon`` at world size 1 (gloo),
whose ``load_state_dict`` also runs torch's pre- and post-hooks."""

import copy

import pytest
import torch
import torch.distributed as dist
from test_torch_optim_contracts import (
    _load_post_hook_writing_state,
    _load_pre_hook_returning_a_copy,
    _steps,
)
from test_torch_optim_contracts import _model as _conv_model
from torch import nn

import muonscale
from muonscale import DistributedMuon, Muon

pytestmark = [
    pytest.mark.timeout(120),
    # a convolution given by its named parameters, without its model: flattened on purpose
    pytest.mark.filterwarnings("ignore::muonscale.optimizer_groups.UnknownLayoutWarning"),
]


def test_non_parameter_state_keys_survive_steps_and_round_trips():
    """Keys a hook wrote into ``opt.state`` stay through steps and state-dict round trips, and
    leave the update and the state byte count alone."""
    model, reference = _conv_model(), _conv_model()
    opt = Muon(model.named_parameters())
    ref = Muon(reference.named_parameters())
    opt.register_load_state_dict_post_hook(_load_post_hook_writing_state)
    for _ in range(2):
        _steps(opt, model, n=1)
        _steps(ref, reference, n=1)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.state["ran_load_state_dict_post_hook"] is True
    assert opt.optimizer_state_bytes() == ref.optimizer_state_bytes()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))


def _step(model, opt, seed):
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


@pytest.mark.bare_tensors  # torch's OptimizerInfo cases pass bare tensors
@pytest.mark.parametrize("pre", [False, True], ids=["post_hook", "pre_post_hook"])
def test_load_state_dict_hooks_run(world_of_one, pre):
    """TestOptimRenewed.test_load_state_dict_post_hook / _pre_post_hook, for DistributedMuon."""
    opt = DistributedMuon([torch.rand(2, 3, requires_grad=True)], lr=1e-3)
    if pre:
        opt.register_load_state_dict_pre_hook(_load_pre_hook_returning_a_copy)
    opt.register_load_state_dict_post_hook(_load_post_hook_writing_state)
    opt.load_state_dict(opt.state_dict())
    assert opt.state["ran_load_state_dict_pre_hook2"] is pre
    assert opt.state["ran_load_state_dict_post_hook"] is True


def test_hook_keys_leave_steps_and_checkpoints_alone(world_of_one):
    model, reference = _model(), _model()
    opt = DistributedMuon(model.named_parameters(), lr=1e-2)
    ref = DistributedMuon(reference.named_parameters(), lr=1e-2)
    opt.register_load_state_dict_post_hook(_load_post_hook_writing_state)
    for seed in range(2):
        _step(model, opt, seed)
        _step(reference, ref, seed)
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.optimizer_state_bytes() == ref.optimizer_state_bytes()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_dtensor_muon_hook_keys_leave_steps_and_state_bytes_alone(world_of_one):
    """The same for DTensorMuon (its own state byte count), on a 1-rank mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    weights = [nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])) for _ in "ab"]
    weights[1].data.copy_(weights[0].detach())
    opt, ref = (muonscale.distributed_muon([("fc.weight", w)], lr=1e-2) for w in weights)
    assert type(opt) is muonscale.DTensorMuon
    opt.register_load_state_dict_post_hook(_load_post_hook_writing_state)
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        grad = torch.randn(8, 4, generator=g)
        for w, o in zip(weights, (opt, ref)):
            w.grad = distribute_tensor(grad, mesh, [Shard(0)])
            o.step()
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.state["ran_load_state_dict_post_hook"] is True
    assert opt.optimizer_state_bytes() == ref.optimizer_state_bytes()
    assert torch.equal(weights[0].full_tensor(), weights[1].full_tensor())
    del opt, ref, weights, mesh
