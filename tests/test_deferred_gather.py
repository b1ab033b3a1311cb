"""``DistributedMuon(defer_gather=True)`` against the undeferred path (2 and 4 gloo processes).

Deferring changes only when the gathered parameters land, never what lands, so every case is
bitwise: the same model, data and options with and without ``defer_gather`` must give the same
parameters after every step, on every rank. Each rank trains on its own slice of the batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distributed_harness import shared_pool
from test_distributed_dp import OPTS, VOCAB, batch, loss_fn, make_model
from test_distributed_update_gather import digest
from torch import nn

from muonscale.distributed import CollectiveError, DistributedMuon
from muonscale.distributed.data_parallel.deferred_gather import PendingGather

pytestmark = pytest.mark.timeout(300)

STEPS = 3
TINY = dict(bucket_cap_mb=2e-4)  # several gathers per stream and flat buckets


class TiedLM(nn.Module):
    """Tied head through ``F.linear`` on the embedding's weight, a weight read by the parent
    although its module never runs, and a parameter on the root itself."""

    def __init__(self, width: int = 10):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
        self.mix = nn.Linear(width, width, bias=False)  # never called: F.linear on its weight
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        h = self.wte(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        h = F.linear(h, self.mix.weight) * self.gain
        return F.linear(h, self.wte.weight)


def tied_model(seed: int = 0) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM()


CASES = {  # name: (model factory, options)
    "fp32": (make_model, {}),
    "bf16-update-gather": (make_model, {"gather_updates": True}),
    "bf16-reduce": (make_model, {"reduce_dtype": torch.bfloat16, "gather_updates": True}),
    "tied": (tied_model, {}),
    "tied-update-gather": (tied_model, {"gather_updates": True}),
}


def _run(rank, world_size, factory, options, *, defer, compiled=False, schedule=False):
    """Train STEPS steps on this rank's slice; return each step's loss (what the forward
    saw) and the last digest, whether each step() left a gather in flight, the seconds
    waited."""
    model = factory()
    opt = DistributedMuon(model, **OPTS, **TINY, **options, defer_gather=defer)
    forward = torch.compile(model, backend="eager") if compiled else model
    scheduler = (
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)) if schedule else None
    )
    digests, deferred, waited = [], [], 0.0
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        loss = loss_fn(forward, x, y)
        waited += opt.gather_wait_seconds  # the previous step's gathers, landed in the forward
        loss.backward()
        digests.append(loss.item())
        opt.step()
        deferred.append(opt.deferred is not None and opt.deferred.pending)
        if scheduler is not None:
            scheduler.step()  # between step() and the forward: the gathers keep their lr
    opt.wait_for_parameters()
    digests.append(digest(model))
    return digests, deferred, waited


def _compare(rank, world_size, compiled=False, schedule=False):
    kw = dict(compiled=compiled, schedule=schedule)
    out = {}
    for name, (factory, options) in CASES.items():
        plain = _run(rank, world_size, factory, options, defer=False, **kw)
        deferred = _run(rank, world_size, factory, options, defer=True, **kw)
        out[name] = (plain[0], deferred[0], deferred[1], deferred[2])
    return out


def _check(results):
    for name in CASES:
        for rank, r in enumerate(results):
            plain, deferred, in_flight, waited = r[name]
            assert deferred == plain, f"{name}, rank {rank}: deferred differs from undeferred"
            assert all(in_flight), f"{name}, rank {rank}: step() left no gather in flight"
            assert waited > 0.0
        final = [r[name][1][-1] for r in results]  # the parameters' digest (losses: per slice)
        assert all(d == final[0] for d in final), f"{name}: replicas differ"


@pytest.mark.parametrize("world_size", [2, 4])
def test_deferred_is_bitwise_undeferred(world_size):
    _check(shared_pool(world_size).run(_compare))


def test_deferred_with_lr_schedule_is_bitwise_undeferred():
    _check(shared_pool(2).run(_compare, False, True))


def test_deferred_under_torch_compile_is_bitwise_undeferred():
    _check(shared_pool(2).run(_compare, True, False))


def _writers(rank, world_size, defer):
    """Readers and writers between step() and the next forward: the model's load_state_dict,
    the optimizer's state_dict, a write after wait_for_parameters(), a second step() without
    a forward."""
    model = make_model()
    opt = DistributedMuon(model, **OPTS, **TINY, gather_updates=True, defer_gather=defer)
    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    out = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        if step == 0:
            model.load_state_dict(snapshot)  # must not be overwritten by the gathers
        elif step == 1:
            state = opt.state_dict()
            out.append(sorted((k, digest_tensors(v)) for k, v in state["state"].items()))
            opt.wait_for_parameters()
            with torch.no_grad():
                model.head.weight.mul_(0.5)
        else:
            opt.step()  # again, without a forward
        opt.wait_for_parameters()
        out.append(digest(model))
    return out


def digest_tensors(entry):
    return [(k, v.sum().item()) for k, v in sorted(entry.items()) if isinstance(v, torch.Tensor)]


@pytest.mark.parametrize("world_size", [2])
def test_writers_between_step_and_forward_see_landed_parameters(world_size):
    pool = shared_pool(world_size)
    plain = pool.run(_writers, False)
    deferred = pool.run(_writers, True)
    assert deferred == plain


class _FailingWork:
    def wait(self):
        raise RuntimeError("connection reset by peer")


def test_failure_in_pre_hook_names_the_previous_steps_gather():
    model = make_model()
    opt = DistributedMuon(model, **OPTS, defer_gather=True)
    loss_fn(model, *batch(0)).backward()
    opt.step()
    every = frozenset(range(len(opt.params)))
    opt.deferred.hand_off([PendingGather(_FailingWork(), lambda: None, every)])
    with pytest.raises(CollectiveError, match=r"all-gather of the previous step\(\)"):
        model(batch(1)[0])


def test_defer_gather_needs_the_model():
    model = make_model()
    with pytest.raises(ValueError, match="defer_gather=True needs the model"):
        DistributedMuon(model.named_parameters(), **OPTS, defer_gather=True)
    with pytest.raises(ValueError, match="defer_gather must be True or False"):
        DistributedMuon(model, **OPTS, defer_gather=1)
    opt = DistributedMuon(list(model.named_parameters()), **OPTS, defer_gather=True, model=model)
    assert opt.deferred is not None
