"""DistributedMuon gathering the owners' bfloat16 updates (2 and 4 real gloo processes).

Exact references: with identical per-rank batches, each rank's reduced gradient is
Σ_r (g / N) summed in rank order in float32 (:func:`dp_average`), so single-process Muon fed
that gradient at the same Newton–Schulz dtype must give the same bits. With fp32 Newton–Schulz
and ``gather_updates=True`` the reference also rounds each update to bfloat16 before applying it
(:func:`rounding_updates`): what the owner applies.
"""

from __future__ import annotations

import contextlib
import hashlib

import pytest
import torch
from distributed_harness import shared_pool
from test_distributed_dp import UnevenModel, batch, loss_fn, make_model
from test_distributed_grad_edits import swap_parameters
from torch import nn

import muonscale
from muonscale import matrix_step
from muonscale.distributed import DistributedMuon
from muonscale.qkv import QKVLayout
from muonscale.scaling import update_scale
from muonscale.settings import PLAIN_MUON

pytestmark = pytest.mark.timeout(300)

BASE = dict(lr=0.02, weight_decay=0.1)
BF16_NS = dict(ns_dtype=torch.bfloat16)
FP32_NS = dict(ns_dtype=torch.float32)
QKV = QKVLayout(n_query_groups=1, q_per_group=3, head_dim=2)  # a (10, 10) weight: Q, K, V rows
CASES = {  # name: (Muon options, DistributedMuon options, reference rounds the updates)
    "bf16-ns": (BF16_NS, {}, False),
    "bf16-ns-cautious": ({**BF16_NS, "cautious_weight_decay": True}, {}, False),
    "bf16-ns-normuon": ({**BF16_NS, "normalize": "row"}, {}, False),
    "bf16-ns-row-splits": (
        {**BF16_NS, "splits": {"blocks.1.weight": 2, "blocks.2.weight": [3, 7]}},
        {},
        False,
    ),
    "bf16-ns-qkv": ({**BF16_NS, "splits": {"blocks.1.weight": QKV}, "qk_lr_scale": 2.0}, {}, False),
    "fp32-ns-opt-in": (FP32_NS, {"gather_updates": True}, True),
    "fp32-ns-opt-in-normuon": ({**FP32_NS, "normalize": "row"}, {"gather_updates": True}, True),
}


def dp_average(grad: torch.Tensor, world_size: int) -> torch.Tensor:
    """What the reduction gives for N identical gradients: g/N summed over ranks in order."""
    part = grad / world_size
    acc = part.clone()
    for _ in range(1, world_size):
        acc.add_(part)
    return acc


@contextlib.contextmanager
def rounding_updates():
    """Single-process Muon's last pass applies each update rounded to bfloat16."""
    plain = matrix_step.apply_updates_

    def rounded(params, updates, alphas, **kw):
        plain(params, [u.bfloat16() for u in updates], alphas, **kw)

    matrix_step.apply_updates_ = rounded
    try:
        yield
    finally:
        matrix_step.apply_updates_ = plain


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _step(model, opt, step, world_size=1, average=False):
    x, y = batch(step)
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    if average:
        for p in model.parameters():
            p.grad = dp_average(p.grad, world_size)
    opt.step()


def _same_batch(rank, world_size, steps=3):
    out = {}
    for name, (muon_kw, dist_kw, rounds) in CASES.items():
        ref = make_model(n_hidden=3)
        ref_opt = muonscale.Muon(ref, **BASE, **muon_kw)
        with rounding_updates() if rounds else contextlib.nullcontext():
            for step in range(steps):
                _step(ref, ref_opt, step, world_size, average=True)
        model = make_model(n_hidden=3)
        # tiny buckets: matrices split across buckets, several gathers per stream
        opt = DistributedMuon(model, **BASE, **muon_kw, **dist_kw, bucket_cap_mb=2e-4)
        digests = []
        for step in range(steps):
            _step(model, opt, step)
            digests.append(digest(model))
        bitwise = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
        gathered = sorted(opt._name(opt.params[i]) for i in opt.update_gather.gathered_units)
        out[name] = (bitwise, digests, gathered)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_same_batch_is_bitwise_single_process_and_replicas_agree(world_size):
    results = shared_pool(world_size).run(_same_batch)
    for name in CASES:
        bitwise = [r[name][0] for r in results]
        assert all(bitwise), f"{name}: bitwise per rank {bitwise}"
        per_rank = [r[name][1] for r in results]
        assert all(d == per_rank[0] for d in per_rank), f"{name}: replicas differ"
        # every hidden weight (the Muon matrices) travels as an update
        assert results[0][name][2] == [f"blocks.{k}.weight" for k in range(3)], name


def _split_batch(rank, world_size, steps=3):
    """Each rank its slice of the batch, against one process on the whole batch (both rounding
    updates to bfloat16 through fp32 Newton–Schulz)."""
    ref = make_model()
    ref_opt = muonscale.Muon(ref, **BASE, **FP32_NS)
    with rounding_updates():
        for step in range(steps):
            _step(ref, ref_opt, step)
    model = make_model()
    opt = DistributedMuon(model, **BASE, **FP32_NS, gather_updates=True)
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        loss_fn(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]).backward()
        opt.step()
    diff = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
    return diff, digest(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_batch_stays_within_bound(world_size):
    results = shared_pool(world_size).run(_split_batch)
    assert all(r[1] == results[0][1] for r in results)  # replicas identical
    # The averaged gradient differs from one process's by float32 rounding (the 1e-6 of the
    # parameter-gather tests); an update entry near a bfloat16 rounding boundary may then round
    # one unit the other way: at most 2^-7 of |U| (<= 1.2: Newton-Schulz lands singular values
    # in about [0.7, 1.2]), times lr and the scale rule's factor, once per step.
    steps, lr = 3, BASE["lr"]
    scale = max(update_scale(PLAIN_MUON.scale, 10, n) for n in (8, 10))  # (10, 8), (10, 10)
    bound = 1e-6 + steps * lr * scale * 1.2 * 2.0**-7
    assert max(r[0] for r in results) <= bound


def _wire(rank, world_size, reduce_dtype):
    # three 8x8 matrices (2 + 1 owners at 2 ranks, 1 + 1 + 1 + 0 at 4), an 80-element vector
    torch.manual_seed(0)
    model = UnevenModel()
    opt = DistributedMuon(
        model.named_parameters(), **BASE, **FP32_NS, gather_updates=True, reduce_dtype=reduce_dtype
    )
    for step in range(2):
        opt.zero_grad()
        model(torch.randn(3, 8, generator=torch.Generator().manual_seed(step))).backward()
        opt.step()
    return opt.last_step_wire_breakdown, opt.layout_stats()["muon_elements"], digest(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_wire_bytes_by_hand(world_size):
    n, f = world_size, (world_size - 1) / world_size
    by_hand = {2: [64, 128], 4: [0, 64, 64, 64]}[n]  # elements each rank owns
    padded = -(-80 // n) * n  # the AdamW vector in a flat bucket, padded to a multiple of N
    for reduce_dtype, grad_bytes in ((None, 4), (torch.bfloat16, 2)):
        results = shared_pool(n).run(_wire, reduce_dtype)
        assert all(r[2] == results[0][2] for r in results)  # replicas identical
        owned = [r[1] for r in results][0]
        assert sorted(owned) == by_hand
        for rank, (breakdown, _, _) in enumerate(results):
            want = {
                # to each other rank its owned gradients, no padding
                "muon/reduce_scatter": sum(owned[j] for j in range(n) if j != rank) * grad_bytes,
                # this rank's bf16 updates to every other rank, no padding
                "muon/all_gather": (n - 1) * owned[rank] * 2,
                "adamw/reduce_scatter": int(f * padded * 4),
                "adamw/all_gather": int(f * padded * 4),
                "control/all_reduce": int(2 * f * (2 * 4 + 3) * 4),  # 4 parameters' flags + 3
            }
            counted = {k: v for k, v in breakdown.items() if v}  # a rank owning nothing
            assert counted == {k: v for k, v in want.items() if v}, rank


def _resume_and_rebind(rank, world_size, path):
    """Uninterrupted 4 steps against 2 steps, a checkpoint, a fresh optimizer on new parameter
    objects (rebound once more after a step), 2 steps: the same bits."""
    opts = dict(**BASE, **BF16_NS, bucket_cap_mb=2e-4)
    whole = make_model()
    whole_opt = DistributedMuon(whole, **opts)
    for step in range(4):
        _step(whole, whole_opt, step)
    first = make_model()
    first_opt = DistributedMuon(first, **opts)
    for step in range(2):
        _step(first, first_opt, step)
    state = first_opt.state_dict()
    resumed = make_model()
    resumed.load_state_dict(first.state_dict())
    resumed_opt = DistributedMuon(resumed, **opts)
    resumed_opt.load_state_dict(state)
    _step(resumed, resumed_opt, 2)
    swap_parameters(resumed)
    resumed_opt.rebind_parameters(resumed.named_parameters())
    _step(resumed, resumed_opt, 3)
    bitwise = all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters()))
    return bitwise, bool(resumed_opt.update_gather.gathered_units), digest(resumed)


def test_resume_and_rebind_keep_the_bits(tmp_path):
    results = shared_pool(2).run(_resume_and_rebind, str(tmp_path))
    assert all(bitwise and gathered for bitwise, gathered, _ in results)
    assert results[0][2] == results[1][2]


# ---------------------------------------------------------------------------- one process
def test_world_size_one_bf16_ns_is_bitwise_muon():
    ref, model = make_model(), make_model()
    ref_opt = muonscale.Muon(ref, **BASE, **BF16_NS)
    opt = DistributedMuon(model, **BASE, **BF16_NS)
    assert opt.update_gather.gathered_units
    for step in range(3):
        _step(ref, ref_opt, step)
        _step(model, opt, step)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))


@pytest.mark.parametrize("value", ["bf16", 1, 0.0, torch.bfloat16])
def test_gather_updates_refuses_other_values(value):
    with pytest.raises(ValueError, match="gather_updates must be None"):
        DistributedMuon(make_model(), **BASE, gather_updates=value)


def test_which_matrices_gather_updates():
    def gathered(model, **kw):
        return len(DistributedMuon(model, **BASE, **kw).update_gather.gathered_units)

    assert gathered(make_model(), **FP32_NS) == 0  # fp32 Newton–Schulz: opt-in only
    assert gathered(make_model(), **FP32_NS, gather_updates=True) == 3
    assert gathered(make_model(), **BF16_NS, gather_updates=False) == 0
    # main copies: non-owners hold none, so the rounded parameters travel
    assert gathered(make_model().bfloat16(), **BF16_NS, main_params_dtype=torch.float32) == 0
    assert gathered(make_model(), **BF16_NS, main_params_dtype=torch.float64) == 0
    assert gathered(make_model().bfloat16(), **BF16_NS) == 0  # no byte to save


def test_ns_dtype_leaving_bfloat16_is_refused_at_step():
    model = make_model()
    opt = DistributedMuon(model, **BASE, **BF16_NS)
    for group in opt.param_groups:
        if group["algorithm"] == "muon":
            group["ns_dtype"] = torch.float32
    with pytest.raises(ValueError, match="gather_updates=True"):
        _step(model, opt, 0)


def _disagree(rank, world_size):
    try:
        DistributedMuon(make_model(), **BASE, **FP32_NS, gather_updates=True if rank else None)
    except ValueError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_on_sending_updates_are_refused_by_name():
    for message in shared_pool(2).run(_disagree):
        assert (
            message is not None and "blocks.0.weight" in message and "sends its update" in message
        )
