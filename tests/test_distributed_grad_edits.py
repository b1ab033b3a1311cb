"""DistributedMuon where frameworks meet it: a launcher without a process group, gradient edits
after backward (clipping, masking), accumulation without ``opt.no_sync()``, a model already
wrapped in DDP, and parameter objects swapped after construction (re-binding by name).

Oracles: single-process Muon on the whole batch with the same edit (2 and 4 gloo ranks), the
other reduction modes (bitwise), and an unswapped run (bitwise).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from distributed_harness import shared_pool
from test_distributed_dp import OPTS, batch, loss_fn, make_model, max_diff, reference
from torch import nn

import muonscale
from muonscale.distributed import DistributedMuon, DTensorMuon, distributed_muon

pytestmark = pytest.mark.timeout(180)

# Same tolerance as test_distributed_dp's same-batch test: float32, the rank sum vs one batch
# (a few ulp per gradient entry), amplified by ≲ 10^2 through Newton–Schulz, lr 0.02, 3 steps.
SAME_BATCH_ATOL = 1e-6
# Accumulated micro-batches add another summation order (as test_no_sync_*).
ACCUMULATION_ATOL = 1e-4


def _bitwise(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


# ---------------------------------------------------------------------------- launcher, no group
@pytest.mark.parametrize("build", [DistributedMuon, distributed_muon, DTensorMuon])
def test_world_size_without_process_group_raises(build, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        build(make_model().named_parameters(), **OPTS)
    monkeypatch.setenv("WORLD_SIZE", "1")  # world size 1, as documented
    assert build(make_model().named_parameters(), **OPTS).comm.world_size == 1


# ---------------------------------------------------------------------------- gradient edits
def edit_grads(model: nn.Module) -> None:
    """A mask and a rescale, the same on every rank: linear, so they commute with averaging."""
    model.blocks[1].weight.grad.zero_()
    for p in model.parameters():
        p.grad.mul_(0.5)


def train_edited(model, opt, steps, rank=0, world_size=1):
    for step in range(steps):
        x, y = batch(step)
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        edit_grads(model)
        opt.step()


def test_edits_after_backward_apply_at_world_size_one():
    ref = make_model()
    train_edited(ref, muonscale.Muon(ref, **OPTS), 3)
    unedited = reference(3)
    for reduce_at in ("backward", "step"):
        model = make_model()
        opt = DistributedMuon(model, **OPTS, reduce_at=reduce_at)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train_edited(model, opt, 3)
        assert _bitwise(ref, model), reduce_at
        warned = any("reduced again" in str(w.message) for w in caught)
        assert warned == (reduce_at == "backward")
    assert max_diff(ref, unedited) > 1e-3  # the edit matters


def _edits(rank, world_size, steps=3):
    ref = make_model()
    train_edited(ref, muonscale.Muon(ref, **OPTS), steps)
    models = {}
    for reduce_at in ("backward", "step"):
        models[reduce_at] = make_model()
        opt = DistributedMuon(models[reduce_at], **OPTS, reduce_at=reduce_at)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            train_edited(models[reduce_at], opt, steps, rank, world_size)
    return max_diff(ref, models["step"]), _bitwise(models["backward"], models["step"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_edits_after_backward_match_single_process(world_size):
    for diff, same in shared_pool(world_size).run(_edits):
        assert diff <= SAME_BATCH_ATOL
        assert same  # reduced again at step() from p.grad == reduced at step()


# ---------------------------------------------------------------------------- accumulation
def _accumulate(rank, world_size, how):
    ref = reference(3)
    model = make_model()
    wrapped, accumulate = model, _nothing
    if how == "ddp":
        wrapped = nn.parallel.DistributedDataParallel(model)
        opt = DistributedMuon(wrapped, **OPTS)
        accumulate = wrapped.no_sync  # what Trainer and Lightning call
    elif how == "no_sync":
        opt = DistributedMuon(model, **OPTS)
        accumulate = opt.no_sync
    else:
        opt = DistributedMuon(model, **OPTS, reduce_at=how)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(3):
            x, y = batch(step)
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            opt.zero_grad()
            with accumulate():
                (loss_fn(wrapped, x[:2], y[:2]) / 2).backward()
            (loss_fn(wrapped, x[2:], y[2:]) / 2).backward()
            opt.step()
    return max_diff(ref, model), [p.detach().clone() for p in model.parameters()]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("world_size", [2, 4])
def test_accumulation_without_opt_no_sync(world_size):
    """``reduce_at="step"``, ``"backward"`` without ``opt.no_sync()`` (reduced again at step)
    and a DDP-wrapped model under DDP's ``no_sync`` all equal the big batch."""
    pool = shared_pool(world_size)
    results = {how: pool.run(_accumulate, how) for how in ("no_sync", "step", "backward", "ddp")}
    for how, per_rank in results.items():
        for diff, _ in per_rank:
            assert diff <= ACCUMULATION_ATOL, how
    for how in ("step", "backward"):  # same local sums, same reduce-scatter
        for (_, got), (_, want) in zip(results[how], results["no_sync"]):
            assert all(torch.equal(a, b) for a, b in zip(got, want)), how


# ---------------------------------------------------------------------------- DDP-wrapped model
def _ddp(rank, world_size, max_norm):
    ref = make_model()
    ref_opt = muonscale.Muon(ref, **OPTS)
    model = make_model()
    wrapped = nn.parallel.DistributedDataParallel(model)
    opt = DistributedMuon(wrapped, **OPTS)
    plain = make_model()
    plain_opt = DistributedMuon(plain, **OPTS)
    breakdowns = []
    for step in range(3):
        x, y = batch(step)
        xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        for m, o, inputs in (
            (ref, ref_opt, (x, y)),
            (wrapped, opt, (xs, ys)),
            (plain, plain_opt, (xs, ys)),
        ):
            o.zero_grad()
            loss_fn(m, *inputs).backward()
            if m is plain:
                o.clip_grad_norm_(max_norm)
            else:  # as Trainer clips a DDP model: p.grad holds the average
                torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm)
            o.step()
        breakdowns.append(opt.last_step_wire_breakdown)
    return opt.reduction.options.reduce_at, max_diff(ref, model), max_diff(plain, model), breakdowns


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_wrapped_model_is_reduced_once(world_size):
    for reduce_at, diff, diff_plain, breakdowns in shared_pool(world_size).run(_ddp, 0.5):
        assert reduce_at == "never"
        for breakdown in breakdowns:  # DDP averaged: no reduce-scatter of our own
            assert not any("reduce_scatter" in key for key in breakdown), breakdown
            assert breakdown["muon/all_gather"] > 0
        # clipping (max_norm 0.5 is active on this model) adds one norm's rounding
        assert diff <= ACCUMULATION_ATOL
        assert diff_plain <= ACCUMULATION_ATOL


def test_ddp_wrapped_model_refuses_a_second_reduction():
    import torch.distributed as dist
    from distributed_harness import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        wrapped = nn.parallel.DistributedDataParallel(make_model())
        with pytest.raises(ValueError, match="twice"):
            DistributedMuon(wrapped, **OPTS, reduce_at="backward")
        with pytest.raises(ValueError, match="reduce_at"):
            DistributedMuon(make_model(), **OPTS, reduce_at="later")
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------- re-binding
def swap_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """What accelerate's FSDP2 preparation does: new parameter objects, same names and values."""
    new = {}
    for module_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fresh = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            setattr(module, name, fresh)
            new[f"{module_name}.{name}" if module_name else name] = fresh
    return new


def _rebind(rank, world_size, swap_groups, dist_kw):
    models = [make_model(), make_model()]
    opts = [DistributedMuon(m, **OPTS, **dist_kw) for m in models]

    def train(m, opt, steps, first):
        for step in range(first, first + steps):
            x, y = batch(step)
            opt.zero_grad()
            loss_fn(m, x.chunk(world_size)[rank], y.chunk(world_size)[rank]).backward()
            if opt.reduction.options.reduce_at == "backward":
                assert opt.reduction.unlaunched_buckets() == 0  # the hooks follow the new params
            opt.step()

    for m, o in zip(models, opts):
        train(m, o, 1, 0)
    new = swap_parameters(models[0])
    if swap_groups:  # the framework also swaps the optimizer's groups (accelerate does)
        for group in opts[0].param_groups:
            group["params"] = [new[opts[0].param_names[id(p)]] for p in group["params"]]
    moved = opts[0].rebind_parameters(models[0].named_parameters())
    for m, o in zip(models, opts):
        train(m, o, 2, 1)
    same = _bitwise(models[0], models[1])
    bound = {id(p) for p in opts[0].params} == {id(p) for p in models[0].parameters()}
    state_a, state_b = opts[0].state_dict(), opts[1].state_dict()
    same_state = all(
        torch.equal(v, state_b["state"][k][name])
        for k, entry in state_a["state"].items()
        for name, v in entry.items()
    )
    return moved, same, bound, same_state


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("swap_groups", [False, True], ids=["model-only", "groups-swapped"])
def test_distributed_muon_follows_swapped_parameters(world_size, swap_groups):
    n_params = len(list(make_model().parameters()))
    for dist_kw in ({}, {"main_params_dtype": torch.float64}):
        for moved, same, bound, same_state in shared_pool(world_size).run(
            _rebind, swap_groups, dist_kw
        ):
            assert moved == (0 if swap_groups else n_params)
            assert same and bound and same_state


def _swap_dtensor_parameters(bag: nn.Module) -> dict[str, nn.Parameter]:
    """New DTensor parameter objects with the same mesh, placements and local values."""
    from torch.distributed.tensor import DTensor

    new = {}
    for name, p in list(bag.named_parameters()):
        local = p.to_local().detach().clone()
        fresh = DTensor.from_local(
            local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
        )
        new[name] = nn.Parameter(fresh, requires_grad=p.requires_grad)
        setattr(bag, name, new[name])
    return new


def _dtensor_rebind(rank, world_size, kind, swap_groups):
    """DTensorMuon on DTensor parameters with injected sharded gradients: 1 step, swap the
    parameter objects (same values), re-bind by name, 2 more steps; against an unswapped run."""
    from test_dtensor_muon import OPTIONS, SHAPES, SPLITS, Bag, _full_tensors, _grads, _shard_like
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    init = _full_tensors(SHAPES, 0)
    bags = [Bag(init), Bag(init)]
    for bag in bags:
        if kind == "fsdp":
            fully_shard(bag, mesh=mesh)
        else:  # tensor-parallel-like placements: Shard(1) matrices, Shard(0) QKV, replicated 1-D
            for name, t in init.items():
                placement = Replicate() if t.ndim < 2 else Shard(0 if name == "qkv" else 1)
                bag.register_parameter(
                    name, nn.Parameter(distribute_tensor(t.clone(), mesh, [placement]))
                )
    opts = [DTensorMuon(list(b.named_parameters()), splits=SPLITS, **OPTIONS) for b in bags]

    def train(bag, opt, first, steps):
        for k in range(first, first + steps):
            grads = _grads(SHAPES, k)
            for n, p in bag.named_parameters():
                p.grad = _shard_like(grads[n], p)
            opt.step()
            opt.zero_grad(set_to_none=True)

    for bag, opt in zip(bags, opts):
        train(bag, opt, 0, 1)
    old = dict(bags[0].named_parameters())
    new = _swap_dtensor_parameters(bags[0])
    if swap_groups:  # the framework also swaps the optimizer's groups (accelerate does)
        for group in opts[0].param_groups:
            group["params"] = [new[opts[0].param_names[id(p)]] for p in group["params"]]
    moved = opts[0].rebind_parameters(bags[0].named_parameters())
    for bag, opt in zip(bags, opts):
        train(bag, opt, 1, 2)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    pa, pb = dict(bags[0].named_parameters()), dict(bags[1].named_parameters())
    same = all(torch.equal(local(pa[n]), local(pb[n])) for n in pa)
    bound = all(pa[n] is new[n] and pa[n] is not old[n] for n in pa)
    names_b = {id(p): n for n, p in pb.items()}
    state_b = {names_b[id(p)]: s for p, s in opts[1].state.items()}
    same_state = len(opts[0].state) == len(opts[1].state) == len(pa) and all(
        opts[0].param_names[id(p)] == n
        and p is pa[n]
        and all(torch.equal(local(v), local(state_b[n][key])) for key, v in s.items())
        for p, s in opts[0].state.items()
        for n in [opts[0].param_names[id(p)]]
    )
    moved_expected = 0 if swap_groups else len(pa)
    return moved == moved_expected, same, bound, same_state


@pytest.mark.parametrize("kind", ["fsdp", "tp"])
@pytest.mark.parametrize("swap_groups", [False, True], ids=["model-only", "groups-swapped"])
def test_dtensor_muon_follows_swapped_parameters(kind, swap_groups):
    for result in shared_pool(2).run(_dtensor_rebind, kind, swap_groups):
        assert result == (True, True, True, True)
