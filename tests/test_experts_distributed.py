"""Expert views under the distributed optimizers: ``DistributedMuon`` (each expert stack's
experts spread over owners, a contiguous range each) and ``DTensorMuon`` under FSDP2 (each
expert by the rank that holds it) at 2 and 4 gloo ranks equal single-process Muon bitwise on a
model with expert stacks (GPT-OSS's layout: (in, out), interleaved gate/up, per-expert biases)
and a dense fused gate/up weight, with identical gradients injected; plain Muon and NorMuon
(whose row state follows the expert view). ``DistributedMuon`` also with DBRX's 2-D
concatenations of experts, with the owners sending their ranges' bfloat16 updates (rounded
under fp32 Newton–Schulz, as the reference then rounds them), and with fp32 main copies of
bf16 stacks. The experts FSDP2 holds whole move no optimizer bytes, and expert state resumes
across world sizes through DCP (4 -> 2, 2 -> 1, 2 -> 4) and from plain Muon's state dict
bitwise; misshapen loaded state is refused. The plan itself (ranges of experts, their stream
pieces, their rows of a state tensor) is checked without floats."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from distributed_harness import shared_pool
from test_distributed_dp import main_copies
from test_distributed_update_gather import rounding_updates
from test_experts import Model
from test_experts_end_to_end import TinyMoE
from torch import nn

import muonscale
from muonscale import ExpertLayout

OPTIONS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=0.01)
STEPS = 3


class Concatenated(nn.Module):
    """Experts concatenated along dim 0 of 2-D weights, as DBRX stores them: ``w1`` (E·F, D)
    used as (out, in), ``w2`` (E·F, D) used per expert as (in, out); declared with
    ``splits``."""

    E, F, D = 4, 6, 8

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(self.E * self.F, self.D))
        self.w2 = nn.Parameter(torch.randn(self.E * self.F, self.D))
        self.dense = nn.Linear(self.D, self.D, bias=False)


CONCATENATED = dict(
    splits={
        "w1": ExpertLayout(n_experts=Concatenated.E),
        "w2": ExpertLayout(n_experts=Concatenated.E, transposed=True),
    }
)
pytestmark = pytest.mark.timeout(120)


def _train_injected(model, opt, first: int, last: int) -> None:
    """Steps ``first`` to ``last`` with the same gradients on every rank: k/64 with
    |k| ≤ 40 in each parameter's dtype (``tests/test_distributed_dp.py``'s: their mean over 2
    or 4 ranks is exact even in bfloat16), placed as each parameter is (a DTensor's shards)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for step in range(first, last):
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            grad = (torch.randint(-40, 41, p.shape, generator=g) / 64).to(p.dtype)
            if isinstance(p, DTensor):
                grad = distribute_tensor(grad, p.device_mesh, p.placements)
            p.grad = grad
        opt.step()


def _single_process(options: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    _train_injected(model, muonscale.Muon(model, **{**OPTIONS, **options}), 0, STEPS)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _distributed(rank: int, world_size: int, kind: str, options: dict) -> dict:
    from torch.distributed.tensor import DTensor

    from muonscale.distributed import DistributedMuon, DTensorMuon

    torch.manual_seed(0)
    model = Model()
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        opt = DTensorMuon(model, **OPTIONS, **options)
    else:
        opt = DistributedMuon(model, **OPTIONS, **options)
    _train_injected(model, opt, 0, STEPS)
    out = {}
    for name, p in model.named_parameters():
        whole = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = whole.detach().clone()
    if kind == "distributed":  # the stacks spread over owners
        out["spread"] = sorted(opt.param_table.name(opt.params[i]) for i in opt.expert_ranges)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("options", [{}, dict(normalize="row")], ids=["muon", "normuon"])
@pytest.mark.parametrize("kind", ["distributed", "dtensor"])
def test_expert_views_equal_single_process_bitwise(kind, options, world_size):
    want = _single_process(options)
    for rank, got in enumerate(shared_pool(world_size).run(_distributed, kind, options)):
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (kind, rank, name)
        if kind == "distributed":  # each stack stepped by several owners, an expert range each
            assert got["spread"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


def _concatenated_experts(rank: int, world_size: int) -> dict:
    from muonscale.distributed import DistributedMuon

    torch.manual_seed(0)
    model = Concatenated()
    opt = DistributedMuon(model, **OPTIONS, **CONCATENATED, normalize="row")
    _train_injected(model, opt, 0, STEPS)
    spread = {opt.param_table.name(opt.params[i]): len(r) for i, r in opt.expert_ranges.items()}
    return {"weights": _full(model), "spread": spread}


@pytest.mark.parametrize("world_size", [2, 4])
def test_concatenated_experts_spread_over_owners_bitwise(world_size):
    """2-D concatenations of experts (row blocks, each in its own orientation) spread over
    the owners as 3-D stacks do, with NorMuon's row state per range: single-process Muon's
    weights bitwise."""
    torch.manual_seed(0)
    model = Concatenated()
    opt = muonscale.Muon(model, **OPTIONS, **CONCATENATED, normalize="row")
    _train_injected(model, opt, 0, STEPS)
    want = _full(model)
    for rank, got in enumerate(shared_pool(world_size).run(_concatenated_experts)):
        for name, tensor in want.items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)
        assert sorted(got["spread"]) == ["w1", "w2"] and min(got["spread"].values()) > 1


GATHER_CASES = {  # name: (Muon options, DistributedMuon's, the reference rounds each update)
    "bf16-ns": (dict(ns_dtype=torch.bfloat16), {}, False),
    "fp32-ns-opt-in": ({}, dict(gather_updates=True), True),
    "fp32-ns-opt-in-normuon": (dict(normalize="row"), dict(gather_updates=True), True),
}
TINY_BUCKETS = dict(bucket_cap_mb=2e-4)  # ranges of experts cut across several buckets


def _gathering_updates(rank: int, world_size: int, case: str) -> dict:
    from muonscale.distributed import DistributedMuon
    from muonscale.distributed.data_parallel.buckets import ExpertRange

    options, dist_options, _ = GATHER_CASES[case]
    torch.manual_seed(0)
    model = Model()
    opt = DistributedMuon(model, **{**OPTIONS, **options}, **dist_options, **TINY_BUCKETS)
    _train_injected(model, opt, 0, STEPS)
    gathered = {u.param for u in opt.update_gather.gathered_units if isinstance(u, ExpertRange)}
    return {
        "weights": _full(model),
        "gathered": sorted(opt.param_table.name(opt.params[i]) for i in gathered),
        "buckets_per_range": _buckets_per_range(opt),
    }


def _buckets_per_range(opt) -> list[int]:
    """For each range of experts, the owner buckets its pieces lie in."""
    buckets: dict = {r: set() for ranges in opt.expert_ranges.values() for r in ranges}
    for s, stream in enumerate(opt.reduction.streams):
        for k, bucket in enumerate(stream.layout.buckets):
            for piece in bucket.pieces:
                if piece.unit in buckets:
                    buckets[piece.unit].add((s, k))
    return sorted(len(b) for b in buckets.values())


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(GATHER_CASES))
def test_owners_send_their_experts_updates_bitwise(case, world_size):
    """Each owner sends the bfloat16 update of its range of experts (Newton–Schulz in
    bfloat16, or ``gather_updates=True``: rounded) and every rank applies it to its own copy
    of those experts: single-process Muon's weights bitwise (applying rounded updates too,
    where the owners round them)."""
    options, _, rounds = GATHER_CASES[case]
    with rounding_updates() if rounds else contextlib.nullcontext():
        want = _single_process(options)
    for rank, got in enumerate(shared_pool(world_size).run(_gathering_updates, case)):
        for name, tensor in want.items():
            assert torch.equal(got["weights"][name], tensor), (case, rank, name)
        assert got["gathered"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
        assert got["buckets_per_range"][-1] > 1  # some range is cut across buckets


def _bf16_with_main_copies(rank: int, world_size: int) -> dict:
    """A bf16 model with fp32 main copies where each rank updates (its range of each stack's
    experts): the gathered main copies, the model's weights, and the main copy elements this
    rank holds."""
    from muonscale.distributed import DistributedMuon

    torch.manual_seed(0)
    model = Model().bfloat16()
    opt = DistributedMuon(model, **OPTIONS, main_params_dtype=torch.float32, **TINY_BUCKETS)
    _train_injected(model, opt, 0, STEPS)
    held = sum(s["main_param"].numel() for s in opt.state.values() if "main_param" in s)
    spread = sorted(opt.param_table.name(opt.params[i]) for i in opt.expert_ranges)
    return {"main": main_copies(opt), "weights": _full(model), "held": held, "spread": spread}


@pytest.mark.parametrize("world_size", [2, 4])
def test_main_copies_of_ranges_of_experts(world_size):
    """bf16 expert stacks with fp32 main copies: each owner keeps the main copy of its range
    of experts only (every element has one main copy over the ranks), the model holds them
    rounded, and they are single-process fp32 Muon's weights from the rounded weights, bit
    for bit (the injected gradients' bf16 mean is exact, so the owners step the reference's
    gradients)."""
    torch.manual_seed(0)
    ref = Model()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    _train_injected(ref, muonscale.Muon(ref, **OPTIONS), 0, STEPS)
    want = dict(ref.named_parameters())
    results = shared_pool(world_size).run(_bf16_with_main_copies)
    for rank, got in enumerate(results):
        for name, tensor in want.items():
            assert torch.equal(got["main"][name], tensor), (rank, name)
            assert torch.equal(got["weights"][name], got["main"][name].bfloat16()), (rank, name)
        assert got["spread"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert sum(r["held"] for r in results) == sum(p.numel() for p in ref.parameters())


EXPERTS_ONLY = [(r"^(?!mlp\.experts\.)", "adamw")]  # Muon on the expert stacks alone


def _expert_bytes(rank: int, world_size: int, options: dict) -> dict:
    """FSDP2 shards the expert dimension: each expert whole on one rank. The bytes the
    optimizer sends per step with the expert stacks as its only Muon parameters, and the
    weights after the steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from muonscale.distributed import DTensorMuon

    torch.manual_seed(0)
    model = Model()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    opt = DTensorMuon(model, rules=EXPERTS_ONLY, **OPTIONS, **options)
    sent = []
    for step in range(STEPS):
        _train_injected(model, opt, step, step + 1)
        sent.append(dict(opt.last_step_wire_breakdown))
    weights = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return {"sent": sent, "weights": weights}


def _single_process_experts_only(options: dict) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Model()
    _train_injected(
        model, muonscale.Muon(model, rules=EXPERTS_ONLY, **OPTIONS, **options), 0, STEPS
    )
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_experts_sharded_on_the_expert_dimension_move_no_optimizer_bytes(world_size):
    """Each expert is stepped by the rank that holds it: the Muon exchange sends nothing
    (only the non-finite check's control bytes remain), and the weights equal single-process
    Muon's bitwise."""
    want = _single_process_experts_only({})
    for rank, got in enumerate(shared_pool(world_size).run(_expert_bytes, {})):
        for step, breakdown in enumerate(got["sent"]):
            muon = {k: v for k, v in breakdown.items() if k.startswith("muon/")}
            assert sum(muon.values()) == 0, (rank, step, breakdown)
        for name, tensor in want.items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)
    print(f"\n{world_size} ranks, experts only, bytes per step: {got['sent'][-1]}")


def test_normuon_experts_share_only_their_row_statistics():
    """NorMuon keeps a row state replicated on every rank: the holders' row statistics reach
    the other ranks in one float32 all-reduce per step, the experts themselves move nothing."""
    options = dict(normalize="row")
    want = _single_process_experts_only(options)
    for rank, got in enumerate(shared_pool(2).run(_expert_bytes, options)):
        breakdown = got["sent"][-1]
        assert breakdown.get("muon/all_to_all", 0) == 0, breakdown
        assert breakdown.get("muon/all_reduce", 0) > 0, breakdown
        for name, tensor in want.items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)


SAVE_AT, TOTAL = 2, 4


MODELS = {  # name: (model, its options): 3 experts stored (in, out); 8 stored (out, in)
    "gpt_oss": (Model, {}),
    "gpt_oss-normuon": (Model, dict(normalize="row")),
    "qwen3_moe-normuon": (TinyMoE, dict(normalize="row")),  # row state resharded per expert
    "dbrx-normuon": (Concatenated, dict(normalize="row", **CONCATENATED)),
}


def _build(kind: str, world_size: int, model_name: str, seed: int = 0):
    """The expert model and its optimizer for ``kind`` at ``world_size`` (1: plain Muon)."""
    from muonscale.distributed import DistributedMuon, DTensorMuon

    make, options = MODELS[model_name]
    options = {**OPTIONS, **options}
    torch.manual_seed(seed)
    model = make()
    if world_size == 1:
        return model, muonscale.Muon(model, **options)
    if kind == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
        return model, DTensorMuon(model, **options)
    return model, DistributedMuon(model, **options)


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _save_at(rank: int, world_size: int, kind: str, model_name: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _build(kind, world_size, model_name)
    _train_injected(model, opt, 0, SAVE_AT)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def _resume_at(
    rank: int, world_size: int, kind: str, model_name: str, path: str
) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _build(
        kind, world_size, model_name, seed=123
    )  # other weights: all of them come loaded
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    _train_injected(model, opt, SAVE_AT, TOTAL)
    return _full(model)


def _uninterrupted(model_name: str) -> dict[str, torch.Tensor]:
    model, opt = _build("", 1, model_name)
    _train_injected(model, opt, 0, TOTAL)
    return _full(model)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("kind", ["distributed", "dtensor"])
def test_expert_state_resumes_across_world_sizes_bitwise(kind, model_name, tmp_path):
    """DCP checkpoints of expert stacks: saved at 4 ranks and resumed at 2, saved at 2 and
    resumed in one process; with identical gradients injected, each resumed run ends on the
    uninterrupted run's weights bit for bit (every layout computes single-process Muon's
    update)."""
    want = _uninterrupted(model_name)
    path4, path2 = str(tmp_path / "at4"), str(tmp_path / "at2")
    shared_pool(4).run(_save_at, kind, model_name, path4)
    for rank, got in enumerate(shared_pool(2).run(_resume_at, kind, model_name, path4)):
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), ("4 -> 2", rank, name)
    shared_pool(2).run(_save_at, kind, model_name, path2)
    got = _resume_at(0, 1, kind, model_name, path2)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), ("2 -> 1", name)


def test_expert_state_resumes_on_more_ranks_and_from_plain_muon_bitwise(tmp_path):
    """Narrower ranges: a DCP checkpoint saved at 2 ranks resumes at 4 (each owner keeps
    fewer experts' state), and plain Muon's ``state_dict`` loads into ``DistributedMuon`` at
    2 ranks; both end on the uninterrupted run's weights bit for bit."""
    model_name = "qwen3_moe-normuon"  # 8 experts a stack: 4 or 2 per owner, NorMuon's rows
    want = _uninterrupted(model_name)
    path2 = str(tmp_path / "at2")
    shared_pool(2).run(_save_at, "distributed", model_name, path2)
    for rank, got in enumerate(shared_pool(4).run(_resume_at, "distributed", model_name, path2)):
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), ("2 -> 4", rank, name)
    model, opt = _build("", 1, model_name)
    _train_injected(model, opt, 0, SAVE_AT)
    plain = str(tmp_path / "plain.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, plain)
    for rank, got in enumerate(shared_pool(2).run(_resume_from_plain, model_name, plain)):
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), ("plain Muon -> 2", rank, name)


def _resume_from_plain(
    rank: int, world_size: int, model_name: str, path: str
) -> dict[str, torch.Tensor]:
    model, opt = _build("distributed", world_size, model_name, seed=123)
    assert opt.expert_ranges
    saved = torch.load(path, weights_only=True)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    _train_injected(model, opt, SAVE_AT, TOTAL)
    return _full(model)


def test_expert_ranges_refuse_lists_of_other_lengths():
    from muonscale.distributed.ownership import assign_expert_ranges

    shapes = [[(4, 8)] * 2, (8, 8)]
    with pytest.raises(ValueError, match="experts has 1 entries, shapes 2"):
        assign_expert_ranges(shapes, [2], 2)
    with pytest.raises(ValueError, match="sizes has 3 entries, shapes 2"):
        assign_expert_ranges(shapes, [2, 1], 2, sizes=[1, 2, 3])
    with pytest.raises(ValueError, match="parameter 0: 2 matrices do not split into 3"):
        assign_expert_ranges(shapes, [3, 1], 2)


def test_expert_rows_refuse_a_tensor_that_does_not_split_into_the_experts():
    from muonscale.distributed.data_parallel.buckets import ExpertRange
    from muonscale.distributed.data_parallel.layout import expert_rows

    r = ExpertRange(0, 1, 3, count=4, owner=1, start=6, numel=12, shape=(2, 2, 3))
    assert torch.equal(expert_rows(torch.arange(8), r), torch.arange(2, 6))
    with pytest.raises(ValueError, match=r"'w' state 'v': shape \(7,\) does not split into 4"):
        expert_rows(torch.arange(7), r, "parameter 'w' state 'v'")


def _load_misshapen(rank: int, world_size: int) -> list[str]:
    """Load full states whose momentum, main copy or row state of a spread stack has another
    shape: the errors, and whether this rank's state stayed as it was."""
    from muonscale.distributed import DistributedMuon

    torch.manual_seed(0)
    model = Model().bfloat16()
    options = dict(normalize="row", main_params_dtype=torch.float32)
    opt = DistributedMuon(model, **OPTIONS, **options)
    _train_injected(model, opt, 0, 1)
    saved = opt.state_dict()
    i = opt.index_of(model.mlp.experts.gate_up_proj)
    assert i in opt.expert_ranges
    before = {k: v.clone() for k, v in opt.state[opt.params[i]].items() if torch.is_tensor(v)}
    errors = []
    for key in ("momentum_buffer", "main_param", "row_second_moment"):
        bad = copy.deepcopy(saved)
        assert key in bad["state"][i], sorted(bad["state"][i])
        bad["state"][i][key] = bad["state"][i][key][:-1]  # one row short
        with pytest.raises(ValueError) as error:
            opt.load_state_dict(bad)
        errors.append(str(error.value))
    after = opt.state[opt.params[i]]
    assert all(torch.equal(after[k], v) for k, v in before.items())
    return errors


def test_loaded_state_of_another_shape_is_refused_naming_it():
    """A loaded state tensor of a stack spread over owners must have the whole stack's
    shape: otherwise ValueError naming the parameter and the key, and nothing changes (a copy
    into a range of experts would broadcast it)."""
    for errors in shared_pool(2).run(_load_misshapen):
        for key, error in zip(("momentum_buffer", "main_param", "row_second_moment"), errors):
            assert f"'{key}'" in error and "mlp.experts.gate_up_proj" in error, error


# ---------------------------------------------------------------- the plan, without floats
RANGE_CASES = {  # name: (per parameter: experts and one expert's matrix shapes, world size)
    "one-expert": ([(1, [(8, 16)]), (1, [(16, 16)])], 2),
    "fewer-experts-than-ranks": ([(3, [(8, 16)]), (1, [(4, 4)])], 4),
    "many-experts": ([(8, [(8, 16), (8, 16)]), (8, [(16, 8)]), (1, [(32, 32)])], 4),
    "zero-size-stack": ([(4, [(0, 16)]), (6, [(8, 8)])], 2),
    "stack-and-dense": ([(4, [(16, 32)]), (1, [(16, 16)]), (1, [(8, 16)])], 3),
}


def _stacks(case: str):
    params, world_size = RANGE_CASES[case]
    shapes = [mats * count for count, mats in params]
    experts = [count for count, _ in params]
    sizes = [4 * sum(m * n for m, n in entry) for entry in shapes]
    return shapes, experts, sizes, world_size


@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_expert_ranges_cover_each_stack_once_with_one_range_per_owner(case):
    from muonscale.distributed.ownership import assign_expert_ranges, assign_owners

    shapes, experts, sizes, world_size = _stacks(case)
    plan = assign_expert_ranges(shapes, experts, world_size, sizes=sizes)
    assert len(plan) == len(shapes)
    for ranges, count in zip(plan, experts):
        firsts, stops = [r[1] for r in ranges], [r[2] for r in ranges]
        assert firsts == [0, *stops[:-1]] and stops[-1] == count, ranges  # [0, E) once
        assert all(first < stop for first, stop in zip(firsts, stops)), ranges
        owners = [r[0] for r in ranges]
        assert owners == sorted(set(owners)) and 0 <= owners[0] and owners[-1] < world_size
    if all(count == 1 for count in experts):  # a dense list: assign_owners' owners
        assert [r[0][0] for r in plan] == assign_owners(shapes, world_size, sizes=sizes)


def _plan_ranges(case: str):
    """Every parameter of ``case`` laid out as DataParallelLayout lays it: a stack with
    several owners as ranges of experts, anything else whole."""
    from muonscale.distributed.data_parallel.layout import expert_range
    from muonscale.distributed.ownership import assign_expert_ranges
    from muonscale.matrices import MatrixView

    shapes, experts, sizes, world_size = _stacks(case)
    units, owners, numels, views = [], {}, {}, {}
    for i, (ranges, count, entry) in enumerate(
        zip(assign_expert_ranges(shapes, experts, world_size, sizes=sizes), experts, shapes)
    ):
        m, n = entry[0]
        per = len(entry) // count
        views[i] = MatrixView.build((count, per * m, n), experts=count)
        numels[i] = count * per * m * n
        if len(ranges) == 1:
            owners[i] = ranges[0][0]
            units.append(i)
        else:
            units += [expert_range(i, views[i], *r) for r in ranges]
    return units, owners, numels, views, world_size


@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_owner_stream_pieces_tile_each_range_of_experts(case):
    """Tiny buckets: the pieces of every owned unit (a parameter, or a range of experts), each
    marked with its unit, tile its elements of the flattened parameter exactly once, all in
    its owner's slices."""
    from muonscale.distributed.data_parallel.buckets import (
        ExpertRange,
        plan_owner_streams,
        unit_param,
    )

    units, owners, numels, _, world_size = _plan_ranges(case)
    streams = plan_owner_streams(units, numels, owners, world_size, bucket_elems=96)
    for u in units:
        start, numel = (u.start, u.numel) if isinstance(u, ExpertRange) else (0, numels[u])
        owner = u.owner if isinstance(u, ExpertRange) else owners[u]
        pieces = sorted(
            (piece.param_start, piece.length, bucket.rank_of(piece), piece.param)
            for bucket in streams.buckets
            for piece in bucket.pieces
            if piece.unit == u
        )
        covered = start
        for piece_start, length, rank, param in pieces:
            assert piece_start == covered and rank == owner, (u, pieces)
            assert param == unit_param(u), (u, pieces)
            covered += length
        assert covered == start + numel, (u, pieces)
    for rank in range(world_size):
        assert streams.owned_numel(rank) == sum(
            streams.numels[u]
            for u in units
            if (u.owner if isinstance(u, ExpertRange) else owners[u]) == rank
        )


@pytest.mark.parametrize("case", list(RANGE_CASES))
def test_expert_rows_of_a_range_are_its_flat_slice(case):
    from muonscale.distributed.data_parallel.buckets import ExpertRange
    from muonscale.distributed.data_parallel.layout import expert_rows

    units, _, numels, views, _ = _plan_ranges(case)
    for u in units:
        if not isinstance(u, ExpertRange):
            continue
        whole = torch.arange(numels[u.param]).view(views[u.param].param_shape)
        part = expert_rows(whole, u)
        assert part.shape == u.shape
        stack = views[u.param]  # the sub-stack's view, and one expert's
        assert stack.experts_view(u.stop - u.first).param_shape == u.shape
        per = len(stack.matrix_shapes) // stack.experts
        assert stack.experts_view().matrix_shapes == stack.matrix_shapes[:per]
        assert torch.equal(part.reshape(-1), whole.view(-1)[u.start : u.start + u.numel])
