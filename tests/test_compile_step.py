"""``torch.compile(opt.step)`` gives the eager step's results bit for bit: ``Muon`` with AdamW
groups (a OneCycleLR cycling both halves' momentum) and ``DistributedMuon`` at world size 1.
The step runs eagerly inside the compiled region (:mod:`muonscale.compile_boundary`)."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from muonscale import DistributedMuon, Muon

pytestmark = [
    pytest.mark.timeout(300),
    # torch.compile's own import of torch.jit, not this project's code
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


class TinyLM(nn.Module):
    """Embedding and head (AdamW), a hidden matrix (Muon), a norm and a bias (AdamW)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)

    def forward(self, ids):
        return self.head(self.norm(torch.relu(self.hidden(self.embed(ids)))))


def _train(model, opt, compiled, steps=3):
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=2e-2, total_steps=10, base_momentum=0.8, max_momentum=0.9
    )
    step = torch.compile(opt.step) if compiled else opt.step
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 11, (4, 6), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        step()
        sched.step()


def _assert_same(a, b, opt_a, opt_b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    sa, sb = opt_a.state_dict(), opt_b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for i, s in sa["state"].items():
        for key, value in s.items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)


def test_compiled_muon_step_matches_eager():
    eager_model = TinyLM()
    compiled_model = copy.deepcopy(eager_model)
    eager = Muon(eager_model, lr=1e-2)
    compiled = Muon(compiled_model, lr=1e-2)
    assert {g["algorithm"] for g in compiled.param_groups} == {"muon", "adamw"}
    _train(
        compiled_model, compiled, compiled=True
    )  # first: in a fresh process, before any eager step
    _train(eager_model, eager, compiled=False)
    _assert_same(eager_model, compiled_model, eager, compiled)
    adamw = [g for g in compiled.param_groups if g["algorithm"] == "adamw"]
    assert all(g["betas"][0] < 0.9 for g in adamw), "OneCycleLR must have moved AdamW's beta1"


def test_compiled_distributed_muon_step_matches_eager_at_world_size_1(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        eager_model = TinyLM()
        compiled_model = copy.deepcopy(eager_model)
        eager = DistributedMuon(eager_model.named_parameters(), lr=1e-2)
        compiled = DistributedMuon(compiled_model.named_parameters(), lr=1e-2)
        _train(
            compiled_model, compiled, compiled=True
        )  # first: in a fresh process, before any eager step
        _train(eager_model, eager, compiled=False)
        _assert_same(eager_model, compiled_model, eager, compiled)
    finally:
        dist.destroy_process_group()
