"""Step metrics (``opt.enable_step_metrics()``): the counts come from what the step did, the
figures agree with float64 references computed from the parameters' change, nothing changes
when they are on, and the distributed forms combine their ranks into the one-process figures."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import muonscale
from muonscale.distributed import DistributedMuon
from tests.distributed_harness import run_workers

P = "muon/"


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 16), torch.nn.Linear(16, 24), torch.nn.Linear(24, 16)
    )


def _backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randint(50, (64,), generator=g)).square().mean().backward()


def _elements(*tensors: torch.Tensor) -> float:
    return float(sum(t.numel() for t in tensors))


def test_counts_come_from_the_step_not_the_groups():
    model = _model()
    emb, hidden, out = model[0], model[1], model[2]
    opt = muonscale.Muon(model, lr=0.02, adamw_lr=1e-3, nonfinite="skip")
    opt.enable_step_metrics()
    _backward(model, 0)
    opt.step()
    full = opt.read_step_metrics()
    assert full[P + "ns_tensors"] == 2
    assert full[P + "ns_elements"] == _elements(hidden.weight, out.weight)
    assert full[P + "adamw_elements"] == _elements(emb.weight, hidden.bias, out.bias)
    assert full[P + "skipped_tensors"] == 0

    opt.zero_grad()
    _backward(model, 1)
    hidden.weight.grad = None  # one Muon parameter without a gradient
    opt.step()
    partial = opt.read_step_metrics()
    assert partial[P + "ns_tensors"] == 1
    assert partial[P + "ns_elements"] == _elements(out.weight)
    assert partial[P + "skipped_elements"] == _elements(hidden.weight)

    opt.zero_grad()
    _backward(model, 2)
    out.weight.grad[0, 0] = float("nan")  # the whole step is skipped
    opt.step()
    skipped = opt.read_step_metrics()
    assert skipped[P + "ns_tensors"] == skipped[P + "adamw_tensors"] == 0
    assert skipped[P + "skipped_elements"] == _elements(*model.parameters())
    assert skipped[P + "skipped_steps"] == 1
    assert not any(k.startswith(P + "update_rms") for k in skipped)


def test_misrouted_parameters_show_the_embedding_on_the_muon_side():
    model = _model()
    # bare parameters: routing by tensor rank alone (strict=False accepts it), so the
    # embedding table is orthogonalized as if it were a hidden matrix
    with pytest.warns(UserWarning, match="tensor rank alone"):
        opt = muonscale.Muon(model.parameters(), lr=0.02, adamw_lr=1e-3, strict=False)
    opt.enable_step_metrics()
    _backward(model, 0)
    opt.step()
    read = opt.read_step_metrics()
    matrices = (model[0].weight, model[1].weight, model[2].weight)
    assert read[P + "ns_tensors"] == 3
    assert read[P + "ns_elements"] == _elements(*matrices)


def _step_with_snapshot(opt, model, seed):
    before = [p.detach().double().clone() for p in model.parameters()]
    _backward(model, seed)
    opt.step()
    opt.zero_grad()
    return before


def test_update_rms_and_singular_values_match_float64_references():
    """Each group's update RMS per unit lr is (W₁ − W₀(1 − ηλ)) / η; for a model with one Muon
    matrix, O = that change / (−s), whose singular values (float64 SVD) the sample reports."""
    model = _model()
    lr, wd, adamw_lr = 0.02, 0.1, 1e-3
    opt = muonscale.Muon(model, lr=lr, weight_decay=wd, adamw_lr=adamw_lr, ns_dtype=torch.float32)
    opt.enable_step_metrics()
    for seed in range(3):
        before = _step_with_snapshot(opt, model, seed)
        read = opt.read_step_metrics()
        params = list(model.parameters())
        for index, group in enumerate(opt.param_groups):
            changes = []
            for p in group["params"]:
                w0 = before[next(i for i, q in enumerate(params) if q is p)]
                decay = 1 - group["lr"] * group["weight_decay"]
                changes.append((p.detach().double() - w0 * decay) / group["lr"])
            flat = torch.cat([c.flatten() for c in changes])
            want = flat.square().mean().sqrt().item()
            got = read[f"{P}update_rms/group{index}_{group['algorithm']}"]
            # fp32 parameters: the change is resolved to ~eps32 · |W| / (lr · |update|)
            tol = 64 * torch.finfo(torch.float32).eps * max(p.abs().max().item() for p in params)
            assert got == pytest.approx(want, rel=1e-4, abs=tol / group["lr"])
    # the sampled matrix: the only Muon matrices are Linear weights; sample each in turn
    sv = read[P + "ns_sample/sv_max"], read[P + "ns_sample/sv_min"]
    assert 0 < sv[1] <= sv[0]
    assert read[P + "ns_sample/orthogonality_error"] == pytest.approx(
        max(abs(sv[0] - 1), abs(sv[1] - 1)), abs=1e-6
    )


def test_adamw_update_rms_of_8bit_moments_is_read_from_their_values():
    """``state_precision="int8"``: the AdamW figure is m̂ / (√v̂ + ε) of the stored moments'
    values (not of their codes). The step used the moments before they were stored, and the
    8-bit codes are within 1% of each block's largest entry (*Low-bit state*), so the figure
    matches the float64 change of the weights within a few percent."""
    model = _model()
    adamw_lr = 1e-3
    opt = muonscale.Muon(
        model, lr=0.02, adamw_lr=adamw_lr, ns_dtype=torch.float32, state_precision="int8"
    )
    opt.enable_step_metrics()
    params = list(model.parameters())
    for seed in range(3):
        before = _step_with_snapshot(opt, model, seed)
        read = opt.read_step_metrics()
        for index, group in enumerate(opt.param_groups):
            if group["algorithm"] != "adamw":
                continue
            changes = []
            for p in group["params"]:
                w0 = before[next(i for i, q in enumerate(params) if q is p)]
                decay = 1 - group["lr"] * group["weight_decay"]
                changes.append((p.detach().double() - w0 * decay) / group["lr"])
            want = torch.cat([c.flatten() for c in changes]).square().mean().sqrt().item()
            got = read[f"{P}update_rms/group{index}_adamw"]
            assert got == pytest.approx(want, rel=5e-2)


def test_sample_singular_values_are_those_of_the_applied_update():
    torch.manual_seed(0)
    layer = torch.nn.Linear(24, 16, bias=False)
    lr = 0.02
    opt = muonscale.Muon(
        [("w", layer.weight)], lr=lr, weight_decay=0.0, ns_dtype=torch.float32, scale="none"
    )
    opt.enable_step_metrics()
    w0 = layer.weight.detach().double().clone()
    layer.weight.grad = torch.randn(16, 24)  # full rank: every singular value is nonzero
    opt.step()
    read = opt.read_step_metrics()
    o = (w0 - layer.weight.detach().double()) / lr  # scale "none": W ← W − η O
    sv = torch.linalg.svdvals(o)
    # O is float32 before the update: its singular values to ~16 eps32 · ‖O‖, and the
    # change W₁ − W₀ loses log2(|W| / (lr |O|)) more bits
    tol = 16 * torch.finfo(torch.float32).eps * (1 + w0.abs().max().item() / lr)
    assert read[P + "ns_sample/sv_max"] == pytest.approx(sv.max().item(), abs=tol)
    assert read[P + "ns_sample/sv_min"] == pytest.approx(sv.min().item(), abs=tol)
    assert read[P + "ns_sample/rank_fraction"] == 1.0


def test_metrics_change_nothing_and_are_absent_when_off():
    off_model, on_model = _model(), _model()
    off = muonscale.Muon(off_model, lr=0.02, adamw_lr=1e-3)
    on = muonscale.Muon(on_model, lr=0.02, adamw_lr=1e-3)
    on.enable_step_metrics(timing=True)
    for seed in range(3):
        _step_with_snapshot(off, off_model, seed)
        _step_with_snapshot(on, on_model, seed)
    for a, b in zip(off_model.parameters(), on_model.parameters()):
        assert torch.equal(a, b)
    assert off.step_metrics is None
    with pytest.raises(RuntimeError, match="enable_step_metrics"):
        off.read_step_metrics()
    assert on.read_step_metrics()[P + "muon_update_seconds"] > 0
    # a copy (pickle, deepcopy: torch's optimizer state only) records nothing until enabled
    for copied in (pickle.loads(pickle.dumps(on)), copy.deepcopy(on)):
        assert copied.step_metrics is None


def test_capturable_step_counts_a_device_skip_at_read():
    model = _model()
    opt = muonscale.Muon(model, lr=0.02, adamw_lr=1e-3, nonfinite="skip", capturable=True)
    opt.enable_step_metrics()
    _backward(model, 0)
    model[1].weight.grad[0, 0] = float("inf")
    opt.step()
    read = opt.read_step_metrics()
    assert read[P + "ns_tensors"] == 0
    assert read[P + "skipped_elements"] == _elements(*model.parameters())


def _distributed_reads(rank: int, world_size: int, defer: bool, precision: str = "param"):
    model = _model()
    opt = DistributedMuon(
        model,
        lr=0.02,
        adamw_lr=1e-3,
        ns_dtype=torch.float32,
        defer_gather=defer,
        model=model,
        state_precision=precision,
    )
    opt.enable_step_metrics()
    reads = []
    for seed in range(2):
        _backward(model, seed)  # every rank the same batch: the one-process gradient
        if seed == 1:
            model[2].weight.grad = None
        opt.step()
        opt.zero_grad()
        local = opt.read_step_metrics()
        reads.append((local, opt.read_step_metrics(across_ranks=True), opt.last_step_wire_bytes))
    return reads


@pytest.mark.parametrize("defer,precision", [(False, "param"), (True, "param"), (False, "int8")])
def test_distributed_muon_sums_its_ranks_into_the_one_process_figures(defer, precision):
    """``int8``: AdamW's 8-bit moments sharded flat, blocks cut by the shard boundaries."""
    model = _model()
    single = muonscale.Muon(
        model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32, state_precision=precision
    )
    single.enable_step_metrics()
    expected = []
    for seed in range(2):
        _backward(model, seed)
        if seed == 1:
            model[2].weight.grad = None
        single.step()
        single.zero_grad()
        expected.append(single.read_step_metrics())
    per_rank = run_workers(_distributed_reads, 2, defer, precision)
    for step, want in enumerate(expected):
        combined = [reads[step][1] for reads in per_rank]
        assert combined[0] == combined[1]  # every rank reads the same combined figures
        got = combined[0]
        for name, value in want.items():
            if name.startswith(P + "ns_sample/"):
                continue  # each rank samples among the matrices it owns
            assert got[name] == pytest.approx(value, rel=1e-5), name
        assert got[P + "wire_bytes"] == sum(reads[step][2] for reads in per_rank) > 0
        assert got[P + "gather_wait_seconds"] >= 0
        # alone, a rank reports its own update squares (the matrices it owns)
        assert per_rank[0][step][0][P + "wire_bytes"] == per_rank[0][step][2]


def _dtensor_reads(rank: int, world_size: int):
    import gc

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonscale.distributed import DTensorMuon

    model = _model()
    # the embedding under a name routing knows ("wte"), as the model itself routes it
    full = [(n.replace("0.", "wte.", 1), p) for n, p in model.named_parameters()]
    grads = [dict(zip([n for n, _ in full], g)) for g in _fixed_grads()]
    mesh = init_device_mesh("cpu", (world_size,))
    named = [
        (n, torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])))
        for n, p in full
    ]
    opt = DTensorMuon(named, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32, splits={})
    opt.enable_step_metrics()
    reads = []
    for step in range(2):
        for n, p in named:
            if not (step == 1 and n == "2.weight"):
                p.grad = distribute_tensor(grads[step][n], mesh, [Shard(0)])
        opt.step()
        opt.zero_grad()
        reads.append((opt.read_step_metrics(across_ranks=True), opt.last_step_wire_bytes))
    del named, opt
    gc.collect()
    return reads


def _fixed_grads() -> list[list[torch.Tensor]]:
    """Two steps' gradients, both at the initial weights (every layout is handed the same)."""
    model = _model()
    out = []
    for seed in range(2):
        _backward(model, seed)
        out.append([p.grad.clone() for p in model.parameters()])
        model.zero_grad()
    return out


def test_dtensor_muon_sums_its_ranks_into_the_one_process_figures():
    model = _model()
    single = muonscale.Muon(model, lr=0.02, adamw_lr=1e-3, ns_dtype=torch.float32)
    single.enable_step_metrics()
    expected = []
    for seed, grads in enumerate(_fixed_grads()):
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        if seed == 1:
            model[2].weight.grad = None
        single.step()
        single.zero_grad()
        expected.append(single.read_step_metrics())
    per_rank = run_workers(_dtensor_reads, 2)
    for step, want in enumerate(expected):
        got = per_rank[0][step][0]
        assert got == per_rank[1][step][0]
        for name, value in want.items():
            if name.startswith(P + "ns_sample/"):
                continue  # shards: no orthogonality sample
            assert got[name] == pytest.approx(value, rel=1e-5), name
        assert got[P + "wire_bytes"] == sum(r[step][1] for r in per_rank) > 0
