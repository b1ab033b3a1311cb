"""DTensorMuon keeps the momentum of its local shards in one stack per (param group, local
shard shape, dtype, device), as single-process Muon does (tests/test_stacked_state.py): each
state["momentum_buffer"] stays a DTensor with its parameter's placements, its local tensor a
view into the stack. Checked on 2 real gloo processes under FSDP2: the views alias one
storage, a step copies no momentum, and a run resumed from ``load_state_dict`` or from a DCP
checkpoint continues bitwise as the uninterrupted run (same mesh, same operations)."""

from __future__ import annotations

import copy
import gc
import io

import pytest
import torch
from distributed_harness import WorkerPool
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from muonscale.distributed.dtensor import DTensorMuon

pytestmark = pytest.mark.timeout(170)

# a, b, c: one stack per rank; d: its own (transposed shape); e: 7 rows, uneven shards (4 / 3)
SHAPES = {"a": (10, 12), "b": (10, 12), "c": (10, 12), "d": (12, 10), "e": (7, 12), "bias": (12,)}
OPTIONS = dict(lr=0.02, weight_decay=0.1, momentum=0.95, ns_dtype=torch.float32, adamw_lr=0.01)
SKIP = {1: ("e",)}  # step -> parameters without a gradient at that step (state kept)


class Bag(nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for n, s in SHAPES.items():
            self.register_parameter(n, nn.Parameter(torch.randn(s, generator=g)))


def _sharded_bag(world_size):
    bag = Bag()
    fully_shard(bag, mesh=init_device_mesh("cpu", (world_size,)))
    return bag


def _step(bag, opt, k):
    g = torch.Generator().manual_seed(100 + k)
    for n, p in bag.named_parameters():
        full = torch.randn(p.shape, generator=g)
        if n in SKIP.get(k, ()):
            p.grad = None
            continue
        replicated = distribute_tensor(full, p.device_mesh, [Replicate()])
        p.grad = replicated.redistribute(p.device_mesh, p.placements)
    opt.step()


def _local_params(bag):
    return {n: p.to_local().detach().clone() for n, p in bag.named_parameters()}


def _memory(t):
    """[first, last) byte addresses of ``t``'s elements (its local shard's, for a DTensor)."""
    t = t._local_tensor if isinstance(t, DTensor) else t
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


class _OpsOnMemory(TorchDispatchMode):
    """Records the name of every op with an argument or result that overlaps ``span``."""

    def __init__(self, span):
        super().__init__()
        self.span, self.ops = span, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = []
        for a in [*args, *(kwargs or {}).values(), out]:
            tensors += list(a) if isinstance(a, (list, tuple)) else [a]
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel():
                first, last = _memory(t)
                if first < self.span[1] and last > self.span[0]:
                    self.ops.append(func.overloadpacket.__name__)
                    break
        return out


def stacks_worker(rank, world_size):
    bag = _sharded_bag(world_size)
    opt = DTensorMuon(bag, **OPTIONS, nonfinite="ignore")
    _step(bag, opt, 0)
    params = dict(bag.named_parameters())
    bufs = {n: opt.state[params[n]]["momentum_buffer"] for n in "abcde"}
    layout = {
        n: (type(b).__name__, b.placements == params[n].placements, tuple(b.shape))
        for n, b in bufs.items()
    }
    memory = {n: _memory(b) for n, b in bufs.items()}
    local_shapes = {n: tuple(b.to_local().shape) for n, b in bufs.items()}
    # the next step: which ops touch the memory of the (10, 12) matrices' stack
    stack = min(memory[n][0] for n in "abc"), max(memory[n][1] for n in "abc")
    counter = _OpsOnMemory(stack)
    e_before = bufs["e"].to_local().clone()
    with counter:
        _step(bag, opt, 1)
    e_kept = torch.equal(opt.state[params["e"]]["momentum_buffer"].to_local(), e_before)
    same = all(_memory(opt.state[params[n]]["momentum_buffer"]) == memory[n] for n in bufs)
    saved = io.BytesIO()  # the state saves and loads as before: one DTensor per parameter
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)["state"]
    name_of = {id(p): n for n, p in params.items()}
    order = [name_of[id(p)] for g in opt.param_groups for p in g["params"]]  # state dict keys
    round_trip = sorted(order[i] for i in loaded if "momentum_buffer" in loaded[i]) == list(
        "abcde"
    ) and all(
        isinstance(loaded[i]["momentum_buffer"], DTensor)
        and torch.equal(loaded[i]["momentum_buffer"].to_local(), bufs[order[i]].to_local())
        for i in loaded
        if "momentum_buffer" in loaded[i]
    )
    del opt, bag, params, bufs
    gc.collect()
    return {
        "layout": layout,
        "memory": memory,
        "local": local_shapes,
        "ops": counter.ops,
        "same": same,
        "round_trip": round_trip,
        "e_kept": e_kept,
    }


def test_momentum_shards_live_in_stacks_and_a_step_copies_none():
    with WorkerPool(2) as pool:
        results = pool.run(stacks_worker)
    for rank, res in enumerate(results):
        for n, (kind, same_placements, shape) in res["layout"].items():
            assert kind == "DTensor" and same_placements and shape == SHAPES[n], (rank, n)
        # a, b, c: consecutive slots of one allocation, the (3, 5, 12) stack of this rank's
        # shards (FSDP2: rows 0-4 and 5-9); d and e lie elsewhere
        mem, slot = res["memory"], 5 * 12 * 4
        assert res["local"]["a"] == (5, 12) and res["local"]["e"] == (4 - rank, 12), rank
        starts = sorted(mem[n][0] for n in "abc")
        assert starts == [starts[0], starts[0] + slot, starts[0] + 2 * slot], (rank, mem)
        stack = (starts[0], starts[0] + 3 * slot)
        for n in "de":
            assert mem[n][1] <= stack[0] or mem[n][0] >= stack[1], (rank, n, mem)
        assert res["same"], rank  # a step keeps the buffers where they are
        assert res["round_trip"], rank
        assert res["e_kept"], rank  # no gradient at that step: its momentum is untouched
        # the momentum pass of the step: one foreach over the buffers (B.lerp_(G, 1 − μ)), then
        # each direction read from its slot (G.lerp(B, μ), Nesterov): no copy_, stack, cat or
        # clone of the momentum, and nothing else touches it
        assert res["ops"] == ["_foreach_lerp_"] + ["lerp"] * 3, (rank, res["ops"])


def _resume_worker(rank, world_size, path, how, done, total):
    """``done`` steps, then (fresh model and optimizer) the state through ``how``, then the
    rest; returns the local parameter shards and whether the momentum was re-stacked."""
    bag = _sharded_bag(world_size)
    opt = DTensorMuon(bag, **OPTIONS)
    for k in range(done):
        _step(bag, opt, k)
    model_sd = {n: p.detach().clone() for n, p in bag.state_dict().items()}
    optim_sd = copy.deepcopy(opt.state_dict())
    if how == "dcp":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        msd, osd = get_state_dict(bag, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    del opt, bag
    gc.collect()
    resumed = _sharded_bag(world_size)
    with torch.no_grad():  # a fresh model with other values: the checkpoint must restore them
        for p in resumed.parameters():
            p.to_local().normal_()
    opt = DTensorMuon(resumed, **OPTIONS)
    if how == "dcp":
        msd, osd = get_state_dict(resumed, opt)  # creates sharded state (zero-lr step)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            resumed, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    else:
        resumed.load_state_dict(model_sd)
        opt.load_state_dict(optim_sd)
    for k in range(done, total):
        _step(resumed, opt, k)
    params = dict(resumed.named_parameters())
    starts = sorted(_memory(opt.state[params[n]]["momentum_buffer"])[0] for n in "abc")
    slot = params["a"].to_local().numel() * 4
    restacked = starts == [starts[0], starts[0] + slot, starts[0] + 2 * slot]
    out = {"params": _local_params(resumed), "restacked": restacked}
    del opt, resumed, params
    gc.collect()
    return out


def uninterrupted_worker(rank, world_size, total):
    bag = _sharded_bag(world_size)
    opt = DTensorMuon(bag, **OPTIONS)
    for k in range(total):
        _step(bag, opt, k)
    out = _local_params(bag)
    del opt, bag
    gc.collect()
    return out


def resume_worker(rank, world_size, path, how):
    return _resume_worker(rank, world_size, path, how, done=2, total=5)


@pytest.mark.parametrize("how", ["load_state_dict", "dcp"])
def test_resumed_equals_uninterrupted_bitwise(how, tmp_path):
    with WorkerPool(2) as pool:
        expected = pool.run(uninterrupted_worker, 5)
        resumed = pool.run(resume_worker, str(tmp_path / "ckpt"), how)
    for rank, (exp, res) in enumerate(zip(expected, resumed)):
        assert res["restacked"], rank
        for n in SHAPES:
            assert torch.equal(res["params"][n], exp[n]), (how, rank, n)
