"""DistributedMuon on real gloo processes (2 and 4 ranks) against single-process Muon.

The single-process reference runs inside each worker (tiny model, no collectives), so each
test is one round trip to a shared pool of ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from distributed_harness import run_workers, shared_pool
from torch import nn

import muonscale
from muonscale.distributed import CollectiveError, DistributedMuon

pytestmark = pytest.mark.timeout(180)

VOCAB, DIM = 13, 8
OPTS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32)
DP_TOL = 8 * torch.finfo(torch.float32).eps  # ~1e-6
"""Distributed vs single-process fp32 weights (of order 1) after a few steps, where the
owners may sum the ranks' gradients in another order than one process: some float32 ulps."""


class TinyLM(nn.Module):
    """Embedding (AdamW), ``n_hidden`` Linear layers (Muon weights, AdamW biases of ``width``
    elements: not a multiple of the world size), LayerNorm and head (AdamW)."""

    def __init__(self, n_hidden: int = 3, width: int = 10):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Linear(DIM if i == 0 else width, width) for i in range(n_hidden)
        )
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, VOCAB)
        h = self.wte(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(self.norm(h))


def make_model(seed: int = 0, **kw) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kw)


def batch(step: int, size: int = 8, seq: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(VOCAB, (size, seq), generator=g), torch.randint(
        VOCAB, (size, seq), generator=g
    )


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train(model, opt, steps, *, rank=0, world_size=1, split=False, first_step=0):
    for step in range(first_step, first_step + steps):
        x, y = batch(step)
        if split:
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def reference(steps: int, model_kw=None, **opt_kw) -> nn.Module:
    model = make_model(**(model_kw or {}))
    train(model, muonscale.Muon(model, **{**OPTS, **opt_kw}), steps)
    return model


# ---------------------------------------------------------------------------- world size 1
def test_world_size_one_is_bitwise_muon():
    a, b = make_model(), make_model()
    oa = muonscale.Muon(a, **OPTS)
    ob = DistributedMuon(b, **OPTS, bucket_cap_mb=1e-4)  # several buckets
    assert ob.reduction.bucket_count > 3
    train(a, oa, 4)
    train(b, ob, 4)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    sa, sb = oa.state_dict(), ob.state_dict()
    assert sa["state"].keys() == sb["state"].keys()
    for k, entry in sa["state"].items():
        for name, value in entry.items():
            assert torch.equal(value, sb["state"][k][name]), (k, name)
    assert ob.last_step_wire_bytes == 0
    assert ob.optimizer_state_bytes() == oa.optimizer_state_bytes()


def test_parameters_are_fixed_after_construction():
    opt = DistributedMuon(make_model(), **OPTS)
    with pytest.raises(NotImplementedError, match="fixed at construction"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3, 3))]})
    with pytest.raises(ValueError, match="reduce_dtype"):
        DistributedMuon(make_model(), **OPTS, reduce_dtype=torch.int8)


# ---------------------------------------------------------------------------- equality
def _same_batch(rank, world_size, steps, model_kw, dist_kw, muon_kw=None):
    ref = reference(steps, model_kw, **(muon_kw or {}))
    model = make_model(**model_kw)
    opt = DistributedMuon(model, **OPTS, **(muon_kw or {}), **dist_kw)
    train(model, opt, steps)
    bitwise = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    return max_diff(ref, model), bitwise, opt.ownership_table()


@pytest.mark.parametrize("world_size", [2, 4])
def test_same_batch_matches_single_process(world_size):
    # 3 Muon matrices: at 4 ranks one rank owns nothing; tiny buckets split parameters.
    results = shared_pool(world_size).run(
        _same_batch, 4, dict(n_hidden=3), dict(bucket_cap_mb=2e-4)
    )
    diffs = [r[0] for r in results]
    print(
        f"\nsame batch, {world_size} ranks: max |dW| = {max(diffs):.3g}, "
        f"bitwise: {[r[1] for r in results]}"
    )
    assert max(diffs) <= DP_TOL
    if world_size == 4:
        assert "rank 3: 0 parameters" in results[0][2] or "0 parameters" in results[0][2]


def _waves(rank, world_size, steps):
    """Small update chunks: each owned matrix is its own wave, and each bucket's all-gather is
    launched as soon as its slice is final (before the later waves' Newton–Schulz)."""
    import os

    os.environ["MUONSCALE_UPDATE_CHUNK_MB"] = "1e-4"
    try:
        ref = reference(steps, dict(n_hidden=8))
        model = make_model(n_hidden=8)
        opt = DistributedMuon(model, **OPTS, bucket_cap_mb=1e-4)
        launched_before_wave = []
        update = opt._update_owned_units

        def recording(present, only=None):
            launched_before_wave.append(opt.comm.counter.calls_by_key["muon/all_gather"])
            return update(present, only=only)

        opt._update_owned_units = recording
        train(model, opt, steps)
    finally:
        del os.environ["MUONSCALE_UPDATE_CHUNK_MB"]
    bitwise = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    return bitwise, launched_before_wave


@pytest.mark.parametrize("world_size", [2, 4])
def test_gathers_start_while_later_matrices_are_orthogonalized(world_size):
    results = shared_pool(world_size).run(_waves, 3)
    assert all(bitwise for bitwise, _ in results)
    several = [launched for _, launched in results if len(launched) // 3 > 1]
    assert several  # some rank owns several matrices, so it runs several waves
    for launched in several:  # its later waves ran after some gathers had started
        assert max(launched[1 : len(launched) // 3]) > 0


def _launch_points(rank, world_size, steps, given):
    """For each bucket: how many gradients were ready when its reduce-scatter was launched,
    and how many when its own last one was (backward's order, recorded by hooks), for a
    DistributedMuon built from the module or from ``named_parameters()``."""
    ref = reference(steps, dict(n_hidden=6))
    model = make_model(n_hidden=6)
    params = model if given == "module" else model.named_parameters()
    opt = DistributedMuon(params, **OPTS, bucket_cap_mb=1e-4)
    reduction, launches, ready_order = opt.reduction, [], []
    for i, p in enumerate(reduction.params):  # after the reduction's own hooks
        p.register_post_accumulate_grad_hook(lambda _, i=i: ready_order.append(i))
    launch = reduction._launch

    def recording(bucket):
        launches.append((len(reduction._ready), bucket.params))
        return launch(bucket)

    reduction._launch = recording
    train(model, opt, steps)
    bitwise = all(torch.equal(p, q) for p, q in zip(ref.parameters(), model.parameters()))
    n = len(reduction.params)
    position = {i: k for k, i in enumerate(ready_order[:n])}  # the first backward's order
    return bitwise, [(ready, 1 + max(position[p] for p in params)) for ready, params in launches]


@pytest.mark.parametrize("given", ["module", "named_parameters"])
def test_reductions_start_when_their_gradients_are_ready(given):
    """Buckets follow the model's order reversed (backward's), whatever the param groups:
    each reduce-scatter starts when its own last gradient is ready. (In param-group order,
    the AdamW bucket with the embedding, ready last, held back every bucket after it.)"""
    for bitwise, launches in shared_pool(2).run(_launch_points, 2, given):
        assert bitwise
        assert all(ready == own_last for ready, own_last in launches), launches


def _overlap_switch(rank, world_size, steps):
    """The same small waves with and without overlap: bitwise-equal parameters and state, and
    without it no all-gather is launched before the last wave."""
    import os

    os.environ["MUONSCALE_UPDATE_CHUNK_MB"] = "1e-4"
    models, states, launched_before_wave = [], [], []
    try:
        for overlap in (True, False):
            model = make_model(n_hidden=8)
            opt = DistributedMuon(model, **OPTS, bucket_cap_mb=1e-4, overlap_gather=overlap)
            update = opt._update_owned_units

            def recording(present, only=None, opt=opt, update=update):
                launched_before_wave.append(opt.comm.counter.calls_by_key["muon/all_gather"])
                return update(present, only=only)

            if not overlap:
                opt._update_owned_units = recording
            train(model, opt, steps, rank=rank, world_size=world_size, split=True)
            models.append(model)
            states.append(opt.state_dict()["state"])
    finally:
        del os.environ["MUONSCALE_UPDATE_CHUNK_MB"]
    bitwise = all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
    same_state = all(
        torch.equal(v, states[1][k][name]) for k, e in states[0].items() for name, v in e.items()
    )
    waves_per_step = len(launched_before_wave) // steps
    # the counter is per step (taken at the end of step()): every wave of a step saw 0 gathers
    return bitwise, same_state, waves_per_step, max(launched_before_wave)


def test_overlap_gather_switch_is_bitwise_equal():
    results = shared_pool(2).run(_overlap_switch, 3)
    for bitwise, same_state, _waves, gathers_before_a_wave in results:
        assert bitwise and same_state
        assert gathers_before_a_wave == 0
    assert max(r[2] for r in results) > 1  # some rank ran several waves per step
    with pytest.raises(ValueError, match="overlap_gather"):
        DistributedMuon(make_model(), **OPTS, overlap_gather="yes")


def test_row_split_parameters_match_single_process():
    # a parameter orthogonalized as several row blocks (as a fused QKV) is still owned whole
    muon_kw = dict(splits={"blocks.1.weight": 2, "blocks.2.weight": [3, 7]}, nesterov=False)
    results = shared_pool(2).run(_same_batch, 3, dict(n_hidden=3), {}, muon_kw)
    assert max(r[0] for r in results) <= DP_TOL
    assert "2x5x10" in results[0][2]


def _split_batch(rank, world_size, steps):
    ref = reference(steps)
    model = make_model()
    opt = DistributedMuon(model, **OPTS)
    train(model, opt, steps, rank=rank, world_size=world_size, split=True)
    return max_diff(ref, model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_split_batch_drift(world_size):
    diffs = shared_pool(world_size).run(_split_batch, 5)
    print(f"\nbatch split over {world_size} ranks, 5 steps: max |dW| = {max(diffs):.3g}")
    assert max(diffs) <= 1e-3


def _bf16_reduce(rank, world_size, steps):
    ref = reference(steps)
    model = make_model()
    opt = DistributedMuon(model, **OPTS, reduce_dtype=torch.bfloat16)
    train(model, opt, steps, rank=rank, world_size=world_size, split=True)
    return max_diff(ref, model), opt.last_step_wire_breakdown


def test_bf16_reduce_stays_close():
    # bytes: see test_wire_bytes_by_hand; here the effect of rounding the reduced gradients
    diff, breakdown = shared_pool(2).run(_bf16_reduce, 3)[0]
    print(f"\nbf16 reduce, 2 ranks, 3 steps: max |dW| = {diff:.3g}")
    assert 0 < diff < 0.05


# ---------------------------------------------------------------------------- main copies
def bf16_models(seed: int = 0, **model_kw) -> tuple[TinyLM, TinyLM]:
    """A bf16 model and an fp32 model holding the same (bf16-rounded) values."""
    low = make_model(seed, **model_kw).bfloat16()
    high = make_model(seed, **model_kw)
    with torch.no_grad():
        for p, q in zip(high.parameters(), low.parameters()):
            p.copy_(q.float())
    return low, high


def inject_grads(model: nn.Module, step: int) -> None:
    """The same gradient on every rank, k/64 with |k| ≤ 40 (in the parameter's dtype): the
    bf16 mean over 2 or 4 ranks is then exact (every partial sum of g/N fits bf16's 8
    significant bits), so the distributed run sees exactly the reference's gradients."""
    g = torch.Generator().manual_seed(2000 + step)
    for p in model.parameters():
        p.grad = (torch.randint(-40, 41, p.shape, generator=g) / 64).to(p.dtype)


def train_injected(model, opt, steps, *, first_step=0):
    for step in range(first_step, first_step + steps):
        opt.zero_grad()
        inject_grads(model, step)
        opt.step()


def main_copies(opt: DistributedMuon) -> dict[str, torch.Tensor]:
    """{name: gathered main copy} from the full state (collective)."""
    full = opt.state_dict()["state"]
    return {opt._name(p): full[i]["main_param"] for i, p in enumerate(opt.params)}


def _main_params(rank, world_size, steps):
    low, ref = bf16_models()
    twin, _ = bf16_models()  # the same bf16 run without main copies: same wire bytes
    ref_opt = muonscale.Muon(ref, **OPTS)
    opt = DistributedMuon(low, **OPTS, main_params_dtype=torch.float32, bucket_cap_mb=2e-4)
    twin_opt = DistributedMuon(twin, **OPTS, bucket_cap_mb=2e-4)
    for o, m in ((ref_opt, ref), (opt, low), (twin_opt, twin)):
        train_injected(m, o, steps)
    mains = main_copies(opt)
    want = dict(ref.named_parameters())
    diff = max((mains[n] - want[n]).abs().max().item() for n in want)
    bitwise = all(torch.equal(mains[n], want[n]) for n in want)
    rounded = all(torch.equal(p, mains[n].bfloat16()) for n, p in low.named_parameters())
    fp32_state = all(
        v.dtype == torch.float32
        for s in opt.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    local_main = sum(s["main_param"].numel() for s in opt.state.values() if "main_param" in s)
    same_wire = opt.last_step_wire_breakdown == twin_opt.last_step_wire_breakdown
    return diff, bitwise, rounded, fp32_state, local_main, same_wire, opt.layout_stats()


@pytest.mark.parametrize("world_size", [2, 4])
def test_bf16_parameters_with_fp32_main_copies_match_fp32(world_size):
    """bf16 model, fp32 main copies where each rank updates (owned matrices, AdamW shards and
    fill): the same as single-process fp32 Muon from the rounded weights, given the same
    gradients; the model holds its main copies rounded; the wire carries bf16 as before."""
    results = shared_pool(world_size).run(_main_params, 3)
    diffs = [r[0] for r in results]
    print(
        f"\nbf16 + fp32 main copies, {world_size} ranks, 3 steps: max |dW| vs fp32 = "
        f"{max(diffs):.3g}, bitwise: {[r[1] for r in results]}"
    )
    assert max(diffs) <= DP_TOL
    for _, _, rounded, fp32_state, _, same_wire, stats in results:
        assert rounded and fp32_state and same_wire
        assert stats["fill_elements"] > 0  # main copies inside stream fills were exercised
    # every element has exactly one main copy over the ranks
    total = sum(p.numel() for p in make_model().parameters())
    assert sum(r[4] for r in results) == total
    assert max(r[4] for r in results) < total


def test_main_params_dtype_must_be_floating():
    with pytest.raises(ValueError, match="main_params_dtype"):
        DistributedMuon(make_model(), **OPTS, main_params_dtype=torch.int32)
    with pytest.raises(ValueError, match="main_params_dtype"):
        DistributedMuon(make_model(), **OPTS, main_params_dtype="float32")


# ---------------------------------------------------------------------------- wire bytes
class HandModel(nn.Module):
    """Four 8x8 Muon matrices and one 5-element AdamW vector: bytes computable by hand."""

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(8, 8) / 3) for _ in range(4))
        self.b = nn.Parameter(torch.zeros(5))

    def forward(self, x):  # (B, 8)
        for w in self.w:
            x = torch.tanh(x @ w)
        return x.sum() + self.b.sum()


def _wire(rank, world_size, precision):
    torch.manual_seed(0)
    model = HandModel()
    reduce_dtype = torch.bfloat16 if precision == "bf16" else None
    opt = DistributedMuon(model.named_parameters(), lr=0.01, reduce_dtype=reduce_dtype)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 8)).backward()
        assert opt.reduction.unlaunched_buckets() == 0  # every reduction started in backward
        opt.step()
    return opt.last_step_wire_bytes, opt.last_step_wire_breakdown


@pytest.mark.parametrize("world_size", [2, 4])
def test_wire_bytes_by_hand(world_size):
    n = world_size
    f = (n - 1) / n
    T = 4 * 64 // n  # elements per owner stream: 4 matrices spread evenly, no padding
    padded_b = -(-5 // n) * n  # AdamW vector padded to a multiple of N
    expected = {
        "muon/reduce_scatter": f * n * T * 4,
        "muon/all_gather": f * n * T * 4,
        "adamw/reduce_scatter": f * padded_b * 4,
        "adamw/all_gather": f * padded_b * 4,
        # [has-grad, non-finite] int32 flags of 5 params, and one [p.grad changed] flag
        "control/all_reduce": 2 * f * ((2 * 5 + 3) * 4),
    }
    for precision in ("fp32", "bf16"):
        want = dict(expected)
        if precision == "bf16":
            want["muon/reduce_scatter"] /= 2
        for total, breakdown in shared_pool(n).run(_wire, precision):
            assert breakdown == {k: int(v) for k, v in want.items()}
            assert total == sum(int(v) for v in want.values())


class UnevenModel(nn.Module):
    """Three 8x8 Muon matrices (uneven over 2 and 4 owners) and an 80-element AdamW vector:
    the vector levels the owner streams, bytes computable by hand."""

    def __init__(self):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(8, 8) / 3) for _ in range(3))
        self.b = nn.Parameter(torch.randn(80) / 10)

    def forward(self, x):  # (B, 8)
        y = x
        for w in self.w:
            y = torch.tanh(y @ w)
        return y.square().sum() + (self.b.view(10, 8) @ x.T).tanh().sum()


def _uneven(rank, world_size, precision, steps=3):
    reduce_dtype = torch.bfloat16 if precision == "bf16" else None
    models, opts = [], []
    for distributed in (False, True):
        torch.manual_seed(0)
        models.append(UnevenModel())
        cls = DistributedMuon if distributed else muonscale.Muon
        kw = dict(reduce_dtype=reduce_dtype, bucket_cap_mb=1e-4) if distributed else {}
        opts.append(cls(models[-1].named_parameters(), **OPTS, **kw))  # several buckets
    for step in range(steps):
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
        for model, opt in zip(models, opts):
            opt.zero_grad()
            model(x).backward()
            opt.step()
    bitwise = all(torch.equal(p, q) for p, q in zip(models[0].parameters(), models[1].parameters()))
    single, full = opts[0].state_dict()["state"], opts[1].state_dict()["state"]
    state_equal = single.keys() == full.keys() and all(
        torch.equal(value, full[k][name])
        for k, entry in single.items()
        for name, value in entry.items()
    )
    opt = opts[1]
    return opt.last_step_wire_breakdown, opt.layout_stats(), bitwise, state_equal


@pytest.mark.parametrize("world_size", [2, 4])
def test_fill_levels_owner_streams_exactly(world_size):
    """Muon traffic = ZeRO-1 AdamW's, to the byte, where the owners alone would pad; the
    update and the full state stay bitwise those of one process."""
    n = world_size
    f = (n - 1) / n
    control = 2 * f * ((2 * 4 + 3) * 4)  # int32: [has-grad, non-finite] of 4 params, [changed],
    # [backward passes, −backward passes]
    # fp32: the vector fills the gap (2 ranks own 128 / 64; 4 ranks 64 / 64 / 64 / 0), so the
    # streams hold 3 * 64 + 80 = 272 elements in all, T = 272 / N each, no padding: exactly
    # ZeRO-1 AdamW's reduce-scatter + all-gather of 272 elements
    fp32 = {
        "muon/reduce_scatter": f * 272 * 4,
        "muon/all_gather": f * 272 * 4,
        "control/all_reduce": control,
    }
    # bf16 reduce: no fill (AdamW gradients keep their dtype): the owners' streams are padded
    # to the longest (128 / 64 elements), the padding stays off the wire (rank r sends every
    # other owner its elements, and its own a_r to every other rank), and the vector goes in a
    # flat bucket
    longest = 128 if n == 2 else 64
    owned = [128, 64] if n == 2 else [64, 64, 64, 0]
    for precision in ("fp32", "bf16"):
        for rank, (breakdown, stats, bitwise, state_equal) in enumerate(
            shared_pool(n).run(_uneven, precision)
        ):
            want = fp32
            if precision == "bf16":
                assert sorted(stats["muon_elements"]) == sorted(owned)
                a = stats["muon_elements"]
                want = {
                    "muon/reduce_scatter": (sum(a) - a[rank]) * 2,
                    "muon/all_gather": (n - 1) * a[rank] * 4,
                    "adamw/reduce_scatter": f * 80 * 4,
                    "adamw/all_gather": f * 80 * 4,
                    "control/all_reduce": control,
                }
            assert breakdown == {k: int(v) for k, v in want.items()}
            if precision == "fp32":
                assert stats["padding_elements"] == 0 and stats["fill_elements"] == 80
                assert bitwise and state_equal
            else:
                assert stats["padding_elements"] == n * longest - 192


def _subgroups(rank, world_size, steps):
    """Two independent 2-rank data-parallel groups inside 4 ranks (group rank != global rank)."""
    group, all_groups = torch.distributed.new_subgroups(group_size=2)
    try:
        ref = reference(steps)
        model = make_model()
        opt = DistributedMuon(model, group, **OPTS)
        train(model, opt, steps, rank=opt.rank, world_size=opt.world_size, split=True)
        full = opt.state_dict()  # broadcasts from owners given as group ranks
        momentum = sum(1 for e in full["state"].values() if "momentum_buffer" in e)
        return opt.world_size, max_diff(ref, model), momentum
    finally:
        for g in all_groups:
            torch.distributed.destroy_process_group(g)


def test_explicit_process_group():
    for world_size, diff, momentum in shared_pool(4).run(_subgroups, 3):
        assert world_size == 2 and diff <= 1e-5 and momentum == 3


# ---------------------------------------------------------------------------- state
def _state_bytes(rank, world_size):
    model = make_model(n_hidden=4)
    opt = DistributedMuon(model, **OPTS)
    single = muonscale.Muon(make_model(n_hidden=4), **OPTS)
    single.init_all_state()
    n_adamw = sum(len(g["params"]) for g in opt.param_groups if g["algorithm"] == "adamw")
    return opt.optimizer_state_bytes(), single.optimizer_state_bytes(), n_adamw


def test_state_is_sharded():
    results = shared_pool(4).run(_state_bytes)
    per_rank = [r[0] for r in results]
    single = results[0][1]
    print(f"\nstate bytes per rank (4 ranks): {per_rank}, single process: {single}")
    steps = 4 * results[0][2]  # the AdamW step counters (float32 scalars) live on every rank
    assert sum(per_rank) == single + 3 * steps
    assert max(per_rank) < 0.5 * single


# ---------------------------------------------------------------------------- global ops
def _clip(rank, world_size, max_norm):
    ref = make_model()
    ref_opt = muonscale.Muon(ref, **OPTS)
    x, y = batch(0)
    loss_fn(ref, x, y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    ref_opt.step()
    model = make_model()
    opt = DistributedMuon(model, **OPTS)
    loss_fn(model, x.chunk(world_size)[rank], y.chunk(world_size)[rank]).backward()
    norm = opt.clip_grad_norm_(max_norm)
    opt.step()
    return norm.item(), ref_norm.item(), max_diff(ref, model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_clip_grad_norm_matches_single_process(world_size):
    for norm, ref_norm, diff in shared_pool(world_size).run(_clip, 0.1):
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert ref_norm > 0.1  # clipping was active
        assert diff <= 1e-4


@pytest.mark.parametrize("max_norm", [-1.0, float("nan")])
def test_clip_grad_norm_rejects_negative_or_nan_max_norm(max_norm):
    model = make_model()
    opt = DistributedMuon(model, **OPTS)  # world size 1: no process group needed
    x, y = batch(0)
    loss_fn(model, x, y).backward()
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm_(max_norm)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # the refused call changed nothing: the step still runs on unclipped gradients
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _nonfinite(rank, world_size, policy):
    model = make_model()
    opt = DistributedMuon(model, **OPTS, nonfinite=policy)
    train(model, opt, 1)
    before = [p.detach().clone() for p in model.parameters()]
    state_before = opt.state_dict()
    bad = model.blocks[1].weight  # owned by some rank; the NaN comes from rank 1's gradient
    handle = bad.register_hook(lambda g: g * float("nan")) if rank == 1 else None
    x, y = batch(1)
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    error = None
    try:
        opt.step()
    except muonscale.NonFiniteGradientError as exc:
        error = str(exc)
    if handle is not None:
        handle.remove()
    unchanged = all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    state_after = opt.state_dict()
    state_same = all(
        torch.equal(v, state_after["state"][k][n])
        for k, e in state_before["state"].items()
        for n, v in e.items()
    )
    train(model, opt, 1, first_step=2)  # the optimizer keeps working
    return error, unchanged, state_same, opt.skipped_steps


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nan_on_one_rank_is_agreed(policy):
    for error, unchanged, state_same, skipped in shared_pool(2).run(_nonfinite, policy):
        assert unchanged and state_same
        if policy == "raise":
            assert error is not None and "blocks.1.weight" in error
        else:
            assert error is None and skipped == 1


def _no_sync(rank, world_size):
    ref = reference(3)
    model = make_model()
    opt = DistributedMuon(model, **OPTS)
    for step in range(3):
        x, y = batch(step)
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        opt.zero_grad()
        with opt.no_sync():
            (loss_fn(model, x[:2], y[:2]) / 2).backward()
        (loss_fn(model, x[2:], y[2:]) / 2).backward()
        opt.step()
    return max_diff(ref, model)


def test_no_sync_accumulation_equals_big_batch():
    for diff in shared_pool(2).run(_no_sync):
        print(f"\nno_sync, 2 micro-batches x 2 ranks vs one batch: max |dW| = {diff:.3g}")
        assert diff <= 1e-4


# ---------------------------------------------------------------------------- bad input
def _mismatch(rank, world_size):
    model = make_model(width=10 if rank == 0 else 11)
    try:
        DistributedMuon(model, **OPTS)
    except ValueError as exc:
        return str(exc)
    return None


def test_parameter_mismatch_raises_everywhere():
    for message in shared_pool(2).run(_mismatch):
        assert message is not None and "blocks.0.weight" in message and "rank 1" in message


def _fault(rank, world_size):
    model = make_model()
    opt = DistributedMuon(model, **OPTS)
    train(model, opt, 1)
    if rank == 1:

        def broken(*args, **kwargs):
            raise RuntimeError("injected failure on rank 1")

        opt._update_owned_units = broken
    start = time.monotonic()
    try:
        train(model, opt, 1, first_step=1)
    except Exception as exc:  # noqa: BLE001
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, None, time.monotonic() - start


def test_one_rank_raising_does_not_hang_the_others():
    (t0, m0, s0), (t1, m1, s1) = run_workers(_fault, 2, pg_timeout_s=4, timeout=90)
    assert t1 == "RuntimeError" and "injected" in m1
    assert t0 == CollectiveError.__name__ and "timeout" in m0
    assert s0 < 60


# ---------------------------------------------------------------------- ranks that disagree
def _options_differ(rank, world_size, option, values):
    model = make_model()
    try:
        DistributedMuon(model, **OPTS, **{option: values[rank]})
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.parametrize(
    "option, values",
    [("bucket_cap_mb", (25.0, 2.0)), ("reduce_dtype", (None, torch.bfloat16))],
)
def test_options_that_differ_between_ranks_are_named(option, values):
    """Options that shape the collectives are agreed at construction: both ranks raise, naming
    the option and each rank's value (instead of a gloo abort in the first reduction)."""
    messages = shared_pool(2).run(_options_differ, option, values, timeout=60)
    for message in messages:
        assert message is not None and repr(option) in message
        assert f"{values[0]!r} on rank 0" in message and f"{values[1]!r} on rank 1" in message


def _skipped_step(rank, world_size):
    model = make_model()
    opt = DistributedMuon(model, **OPTS)
    try:
        for step in range(3):
            x, y = batch(step)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            if rank == 1 and step == 0:
                continue  # this rank skips one step()
            opt.step()
    except RuntimeError as error:
        return str(error)
    return None


def test_a_rank_that_skips_step_is_named():
    """One rank skips a step(): at the next step every rank raises, naming the backward
    passes each ran, instead of training one step apart and hanging at the end."""
    start = time.monotonic()
    messages = shared_pool(2).run(_skipped_step, timeout=60)
    assert time.monotonic() - start < 60
    for message in messages:
        assert message is not None and "backward passes" in message and "skipped step()" in message
