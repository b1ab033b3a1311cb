"""``DistributedMuon`` (world size 1, gloo) against torch's optimizer contracts that it
implements itself rather than inheriting: ``load_state_dict`` runs torch's pre- and post-hooks,
and keys a hook writes into ``opt.state`` do not disturb steps or checkpoints."""

import copy

import pytest
import torch
import torch.distributed as dist
from test_torch_optim_contracts import (
    _load_post_hook_writing_state,
    _load_pre_hook_returning_a_copy,
)
from torch import nn

from muonscale import DistributedMuon

pytestmark = pytest.mark.timeout(120)


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
