"""``DTensorMuon(state_precision="int8")`` (and ``"int4"``) against single-process
``muonscale.Muon``, with identical gradients injected on every rank, at 2 and 4 gloo ranks.

Shards of whole rows (FSDP2's ``Shard(0)``, TP's colwise ``Shard(0)``, replicas): every rank's
codes and scales are its rows of the ones one process holds. On dense weights whose rows span
two and three 256-entry blocks (one of 7 rows: uneven shards), a 3-D stack of experts and an
int8 AdamW table, the weights and the full state (codes and scales gathered) are one
process's bitwise; the scales are DTensors sharded with the rows. DCP checkpoints resume
4 → 2 and 2 → 1 bitwise, a floating DCP checkpoint loads into int8 state (converted, with the
warning) and steps as one process does, ``state_dict_in_precision("param")`` writes one
process's floating state.

Shards that cut rows (TP's rowwise ``Shard(1)`` of a weight whose boundary cuts a block and
of one whose boundaries fall between blocks, ``Shard(1)`` of a 3-D expert stack, an uneven
``Shard(0)`` of a stack, a ``Shard(0)`` 1-D bias and a ``Shard(1)`` table with 8-bit AdamW
moments), int8 and int4: a cut block shares its scale, so the weights and full state are one
process's bitwise; each step all-reduces exactly the cut blocks' maxima (counted from the
shapes); DCP resumes 2 → 1 and 4 → 2 bitwise; floating state converts as one process converts
it; layouts that cannot be kept exact are refused by name.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from distributed_harness import load_checkpoint, one_thread, save_checkpoint, shared_pool
from torch import nn

import muonscale
from muonscale import ExpertLayout
from muonscale.distributed.comm import ring_wire_bytes

pytestmark = [
    pytest.mark.timeout(150),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninit"),
]

OPTIONS = dict(
    lr=0.02,
    weight_decay=0.1,
    ns_dtype=torch.float32,
    adamw_lr=0.01,
    experts={"experts": ExpertLayout(n_experts=8)},
)
STEPS, SAVE_AT = 3, 2
EPS32 = torch.finfo(torch.float32).eps
SHAPES = {
    "up": (12, 600),  # rows of three blocks: 256 + 256 + 88
    "down": (7, 300),  # two blocks (256 + 44); 7 rows: shards of 4 / 3 and 2 / 2 / 2 / 1
    "experts": (8, 6, 300),  # a 3-D stack: whole experts on each rank
    "table": (11, 300),  # AdamW, int8 (rows of an embedding-like table)
    "bias": (12,),  # AdamW, floating: a 1-D Shard(0) cuts its one row
}
MUON = ("up", "down", "experts")


class Bag(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, shape in SHAPES.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g)))


def _groups(model: nn.Module, precision: str = "int8", bias: str = "param") -> list[dict]:
    """The Muon weights, the AdamW table and the bias in groups of these precisions."""
    named = dict(model.named_parameters())
    return [
        {"params": [(n, named[n]) for n in MUON], "state_precision": precision},
        {"params": [("table", named["table"])], "algorithm": "adamw", "state_precision": precision},
        {"params": [("bias", named["bias"])], "algorithm": "adamw", "state_precision": bias},
    ]


def _sharded(world_size: int, seed: int = 0) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = Bag(seed)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model


def _build(world_size: int, seed: int = 0, precision: str = "int8"):
    """The model and its optimizer: FSDP2 and DTensorMuon, or (``world_size`` 1) plain Muon."""
    from muonscale.distributed import DTensorMuon

    if world_size == 1:
        model = Bag(seed)
        return model, muonscale.Muon(_groups(model, precision), **OPTIONS)
    model = _sharded(world_size, seed)
    return model, DTensorMuon(_groups(model, precision), **OPTIONS)


def _inject(model: nn.Module, opt, first: int, last: int) -> None:
    """Steps ``first`` to ``last``, each with the same full gradients on every rank, sharded
    as the parameters are."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    for step in range(first, last):
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            full = torch.randn(p.shape, generator=g)
            if isinstance(p, DTensor):
                whole = distribute_tensor(full, p.device_mesh, [Replicate()] * p.device_mesh.ndim)
                full = whole.redistribute(p.device_mesh, p.placements)
            p.grad = full
        opt.step()


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _gathered(state: dict) -> dict:
    return {i: {k: _full(v) for k, v in e.items()} for i, e in state.items()}


def _result(model: nn.Module, opt) -> dict:
    """Full weights, and the full state of ``state_dict()`` (codes and scales gathered)."""
    return {
        "weights": {n: _full(p) for n, p in model.named_parameters()},
        "state": _gathered(opt.state_dict()["state"]),
    }


def _layout_of_scales(model: nn.Module, opt) -> dict[str, tuple]:
    """Per int8 state tensor: (placements equal the parameter's, local shape)."""
    out = {}
    for name, p in model.named_parameters():
        for key, value in opt.state[p].items():
            if key in ("momentum_scale", "exp_avg_absmax", "exp_avg_sq_absmax"):
                out[f"{name}/{key}"] = (
                    value.placements == p.placements,
                    tuple(value.to_local().shape),
                    tuple(p.to_local().shape),
                )
    return out


def _uninterrupted(rank: int, world_size: int, path: str) -> dict:
    """The int8 run; its state saved through DCP at step ``SAVE_AT`` to ``path``."""
    model, opt = _build(world_size)
    _inject(model, opt, 0, SAVE_AT)
    save_checkpoint(model, opt, path)
    _inject(model, opt, SAVE_AT, STEPS)
    as_float = _gathered(opt.state_dict_in_precision("param")["state"])
    return dict(_result(model, opt), scales=_layout_of_scales(model, opt), float=as_float)


def _resumed(rank: int, world_size: int, path: str) -> dict:
    """A fresh model (other weights) and optimizer at ``world_size``, the DCP checkpoint at
    ``path`` loaded, the rest of the steps."""
    model, opt = _build(world_size, seed=123)
    load_checkpoint(model, opt, path)
    with one_thread():
        _inject(model, opt, SAVE_AT, STEPS)
    return _result(model, opt)


def _single_process() -> dict:
    model, opt = _build(1)
    with one_thread():
        _inject(model, opt, 0, STEPS)
    return dict(_result(model, opt), float=opt.state_dict_in_precision("param")["state"])


def _assert_equal(got: dict, want: dict, where) -> None:
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), (where, name)
    assert sorted(got["state"]) == sorted(want["state"]), where
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry), (where, index)
        for key, value in entry.items():
            assert got["state"][index][key].dtype == value.dtype, (where, index, key)
            assert torch.equal(got["state"][index][key], value), (where, index, key)


@pytest.fixture(scope="module")
def reference() -> dict:
    return _single_process()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, tuple[list[dict], str]]:
    """The uninterrupted int8 runs at 2 and 4 ranks (per rank) and their checkpoints."""
    out = {}
    for world_size in (2, 4):
        path = str(tmp_path_factory.mktemp(f"int8_at_{world_size}"))
        out[world_size] = shared_pool(world_size).run(_uninterrupted, path), path
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_int8_state_under_fsdp2_equals_single_process_bitwise(runs, reference, world_size):
    held = {v.dtype for e in reference["state"].values() for v in e.values()}
    assert {torch.int8, torch.uint8} <= held  # the Muon momentum and AdamW's moments
    for rank, got in enumerate(runs[world_size][0]):
        _assert_equal(got, reference, (world_size, rank))
        floating = {"weights": {}, "state": got["float"]}  # state_dict_in_precision("param")
        _assert_equal(floating, {"weights": {}, "state": reference["float"]}, (world_size, rank))


@pytest.mark.parametrize("world_size", [2, 4])
def test_scales_are_sharded_with_the_rows(runs, world_size):
    """Scales (rows, ⌈cols / 256⌉) with the parameter's placements: a rank's scale rows are
    the block rows of its shard (an expert's 6 rows each, for the stack)."""
    for rank, got in enumerate(runs[world_size][0]):
        scales = got["scales"]
        assert sorted(scales) == sorted(
            ["up/momentum_scale", "down/momentum_scale", "experts/momentum_scale"]
            + ["table/exp_avg_absmax", "table/exp_avg_sq_absmax"]
        )
        for key, (same_placements, local, shard) in scales.items():
            name = key.split("/")[0]
            cols = SHAPES[name][-1]
            rows = shard[0] * (SHAPES[name][1] if name == "experts" else 1)
            assert same_placements, (rank, key)
            assert local == (rows, -(-cols // 256)), (world_size, rank, key, local, shard)


def test_int8_state_resumes_through_dcp_4_to_2_and_2_to_1_bitwise(runs, reference):
    """Saved at 4 ranks, resumed at 2: the uninterrupted run at 2 (weights and full state);
    saved at 2, resumed in one process (muonscale.Muon): the uninterrupted one-process run."""
    at2, path2 = runs[2]
    _, path4 = runs[4]
    for rank, got in enumerate(shared_pool(2).run(_resumed, path4)):
        _assert_equal(got, at2[rank], ("4 -> 2", rank))
    _assert_equal(_resumed(0, 1, path2), reference, "2 -> 1")


def _save_floating(rank: int, world_size: int, path: str) -> None:
    model, opt = _build(world_size, precision="param")
    _inject(model, opt, 0, SAVE_AT)
    save_checkpoint(model, opt, path)


def _floating_into_int8(rank: int, world_size: int, path: str) -> dict:
    """The floating checkpoint read by a floating optimizer of the model (DCP needs the
    checkpoint's keys), its state loaded into the int8 one (converted), one step."""
    from muonscale.distributed import DTensorMuon

    model, reader = _build(world_size, seed=123, precision="param")
    load_checkpoint(model, reader, path)
    opt = DTensorMuon(_groups(model), **OPTIONS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.load_state_dict(reader.state_dict())
    del reader
    with one_thread():
        _inject(model, opt, SAVE_AT, STEPS)
    return dict(_result(model, opt), warnings=[str(w.message) for w in caught])


def test_floating_dcp_checkpoint_loads_into_int8_state_and_steps_as_one_process(tmp_path):
    """Saved with floating state at 2 ranks, loaded into int8 DTensorMuon at 2 ranks: the state
    quantized on each shard, the weights and state after a step those of one process that
    loads the floating state dict into int8 Muon."""
    model, opt = _build(1, precision="param")
    with one_thread():
        _inject(model, opt, 0, SAVE_AT)
        converted = muonscale.Muon(_groups(model), **OPTIONS)
        with pytest.warns(UserWarning, match=r"state_precision differs.*'param' -> 'int8'"):
            converted.load_state_dict(opt.state_dict())
        _inject(model, converted, SAVE_AT, STEPS)
    want = _result(model, converted)
    path = str(tmp_path / "floating")
    shared_pool(2).run(_save_floating, path)
    for rank, got in enumerate(shared_pool(2).run(_floating_into_int8, path)):
        assert any("'param' -> 'int8'" in w for w in got["warnings"]), (rank, got["warnings"])
        _assert_equal(got, want, rank)


TENSOR_PARALLEL = {"up": 0, "down": None, "experts": 0, "table": None, "bias": None}
"""Dim each parameter is sharded on by tensor parallelism (colwise: 0), or None: replicated."""


def _tensor_parallel(rank: int, world_size: int) -> dict:
    """Every state int8 (the replicated bias too), parameters distributed as by TP's colwise
    plan and replicas: each rank holds whole rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muonscale.distributed import DTensorMuon

    mesh = init_device_mesh("cpu", (world_size,))
    model = Bag()
    for name, p in list(model.named_parameters()):
        dim = TENSOR_PARALLEL[name]
        placement = Replicate() if dim is None else Shard(dim)
        whole = nn.Parameter(distribute_tensor(p.detach(), mesh, [placement]))
        model.register_parameter(name, whole)
    opt = DTensorMuon(_groups(model, bias="int8"), **OPTIONS)
    _inject(model, opt, 0, STEPS)
    return _result(model, opt)


def test_int8_state_under_tensor_parallel_rows_and_replicas_equals_one_process_bitwise():
    """TP's colwise Shard(0) and replicated parameters (a 1-D AdamW bias included) at 2
    ranks: the weights and full state of one process."""
    model = Bag()
    opt = muonscale.Muon(_groups(model, bias="int8"), **OPTIONS)
    with one_thread():
        _inject(model, opt, 0, STEPS)
    want = _result(model, opt)
    assert want["state"][len(SHAPES) - 1]["exp_avg"].dtype == torch.uint8  # the bias: 8-bit
    for rank, got in enumerate(shared_pool(2).run(_tensor_parallel)):
        _assert_equal(got, want, ("tensor parallel", rank))


def test_one_process_without_a_group_equals_muon_bitwise(reference):
    """DTensorMuon on plain tensors (no process group) with int8 state is muonscale.Muon."""
    from muonscale.distributed import DTensorMuon

    model = Bag()
    opt = DTensorMuon(_groups(model), **OPTIONS)
    with one_thread():
        _inject(model, opt, 0, STEPS)
    _assert_equal(_result(model, opt), reference, "one process")


# ---------------------------------------------------------------- rows cut by a placement
CUT_OPTIONS = dict(
    lr=0.02,
    weight_decay=0.1,
    ns_dtype=torch.float32,
    adamw_lr=0.01,
    experts={"experts": ExpertLayout(n_experts=4), "uneven": ExpertLayout(n_experts=3)},
)
CUT_LAYOUT = {  # name: (shape, sharded dim, algorithm)
    "up": ((7, 300), 0, "muon"),  # whole rows (4 + 3, 2 + 2 + 2 + 1), int4's packed ones too
    "wo": ((10, 600), 1, "muon"),  # TP rowwise: boundaries at 300 (2 ranks), 150/300/450 (4)
    "wo_aligned": ((6, 1024), 1, "muon"),  # boundaries at multiples of 256: no block cut
    "experts": ((4, 6, 300), 1, "muon"),  # FSDP2 Shard(1) of a stack: rows of each expert
    "uneven": ((3, 6, 300), 0, "muon"),  # 2 + 1 experts: 12 + 6 rows against 9 + 9
    "bias": ((300,), 0, "adamw"),  # a 1-D shard: its one row cut
    "table": ((5, 600), 1, "adamw"),
}
PACKED_REFUSED = ("experts", "uneven")
"""int4 packs two columns per byte of rows that these layouts do not hold as one chunk."""


class CutBag(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, (shape, _, _) in CUT_LAYOUT.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g)))


def _cut_groups(
    model: nn.Module, precision: str, adamw: str = "int8", stacks: str | None = None
) -> list[dict]:
    """The Muon weights in ``precision``, the stacks in a group of their own in ``stacks``
    (int8 under int4, which refuses them), AdamW's in ``adamw``."""
    named = dict(model.named_parameters())
    stacks = "int8" if stacks is None and precision == "int4" else stacks
    muon = [n for n, (_, _, a) in CUT_LAYOUT.items() if a == "muon"]
    first = [n for n in muon if stacks is None or n not in PACKED_REFUSED]
    groups = [{"params": [(n, named[n]) for n in first], "state_precision": precision}]
    if stacks is not None:
        groups.append(
            {"params": [(n, named[n]) for n in PACKED_REFUSED], "state_precision": stacks}
        )
    moments = [(n, named[n]) for n, (_, _, a) in CUT_LAYOUT.items() if a == "adamw"]
    groups.append({"params": moments, "algorithm": "adamw", "state_precision": adamw})
    return groups


def _build_cut(world_size: int, precision: str, seed: int = 0, two_dims: bool = False):
    """The model and its optimizer: each parameter sharded on its dim of :data:`CUT_LAYOUT`
    over the ranks (``two_dims``: over mesh dim 1 of a 2 × 2 mesh, whose dim 0 shards the
    others' rows as FSDP × TP does and replicates the rest), or (``world_size`` 1) plain
    Muon."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from muonscale.distributed import DTensorMuon

    model = CutBag(seed)
    if world_size == 1:
        return model, muonscale.Muon(_cut_groups(model, precision), **CUT_OPTIONS)
    mesh = init_device_mesh("cpu", (2, world_size // 2) if two_dims else (world_size,))
    for name, (_, dim, _) in CUT_LAYOUT.items():
        p = getattr(model, name)
        placements = [Shard(dim)]
        if two_dims:
            placements.insert(0, Shard(0) if dim else Replicate())
        model.register_parameter(
            name, nn.Parameter(distribute_tensor(p.detach(), mesh, placements))
        )
    return model, DTensorMuon(_cut_groups(model, precision), **CUT_OPTIONS)


def _cut_uninterrupted(rank: int, world_size: int, precision: str, path: str) -> dict:
    model, opt = _build_cut(world_size, precision)
    _inject(model, opt, 0, SAVE_AT)
    save_checkpoint(model, opt, path)
    opt.enable_step_metrics()
    _inject(model, opt, SAVE_AT, STEPS)
    out = _result(model, opt)
    out["wire"] = opt.last_step_wire_breakdown
    out["metrics"] = opt.read_step_metrics(across_ranks=True)
    floating = opt.state_dict_in_precision("param")["state"]
    out["float"] = {i: {k: _full(v) for k, v in e.items()} for i, e in floating.items()}
    return out


def _cut_resumed(rank: int, world_size: int, precision: str, path: str) -> dict:
    model, opt = _build_cut(world_size, precision, seed=123)
    load_checkpoint(model, opt, path)
    with one_thread():
        _inject(model, opt, SAVE_AT, STEPS)
    return _result(model, opt)


def _cut_single_process(precision: str) -> dict:
    model, opt = _build_cut(1, precision)
    with one_thread():
        _inject(model, opt, 0, SAVE_AT)
        opt.enable_step_metrics()
        _inject(model, opt, SAVE_AT, STEPS)
    out = _result(model, opt)
    out["metrics"] = opt.read_step_metrics()
    out["float"] = opt.state_dict_in_precision("param")["state"]
    return out


def _cut_blocks(cols: int, world_size: int, block: int) -> int:
    """Blocks of a row of ``cols`` that torch's chunks over ``world_size`` ranks cut."""
    size = -(-cols // world_size)
    starts = range(size, cols, size)
    return len({s // block for s in starts if s % block})


def _block_scales_bytes(world_size: int, precision: str) -> int:
    """The step's all-reduced bytes of cut blocks' maxima (float32, ring model): the Muon
    momentum's in one all-reduce, AdamW's two moments' in another."""
    block = 128 if precision == "int4" else 256
    muon = adamw = 0
    for name, (shape, dim, algorithm) in CUT_LAYOUT.items():
        cols = shape[-1] if len(shape) != 1 else shape[0]
        rows = 1 if len(shape) == 1 else shape[0]
        column_cut = len(shape) == 1 or dim == len(shape) - 1
        if algorithm == "muon" and column_cut:
            size = block if name not in PACKED_REFUSED or precision != "int4" else 256
            muon += rows * _cut_blocks(cols, world_size, size)
        elif algorithm == "adamw":
            adamw += 2 * rows * _cut_blocks(cols, world_size, 256)
    f32 = torch.finfo(torch.float32).bits // 8
    return sum(ring_wire_bytes("all_reduce", f32 * n, world_size) for n in (muon, adamw) if n)


@pytest.fixture(scope="module")
def cut_reference() -> dict:
    return {precision: _cut_single_process(precision) for precision in ("int8", "int4")}


@pytest.fixture(scope="module")
def cut_runs(tmp_path_factory) -> dict:
    """The uninterrupted runs (per rank) and their checkpoints, by (world size, precision)."""
    out = {}

    def run(world_size: int, precision: str):
        if (world_size, precision) not in out:
            path = str(tmp_path_factory.mktemp(f"{precision}_at_{world_size}"))
            got = shared_pool(world_size).run(_cut_uninterrupted, precision, path)
            out[world_size, precision] = got, path
        return out[world_size, precision]

    return run


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_cut_rows_share_block_scales_and_equal_single_process_bitwise(
    cut_runs, cut_reference, world_size, precision
):
    want = cut_reference[precision]
    held = {v.dtype for e in want["state"].values() for v in e.values()}
    assert {torch.int8, torch.uint8} <= held  # int8 momentum (the stacks'), AdamW's moments
    packed = any("momentum_absmax" in e for e in want["state"].values())
    assert packed == (precision == "int4")
    got_runs, _ = cut_runs(world_size, precision)
    expected = _block_scales_bytes(world_size, precision)
    assert expected > 0
    for rank, got in enumerate(got_runs):
        _assert_equal(got, want, (world_size, precision, rank))
        floating = {"weights": {}, "state": got["float"]}  # state_dict_in_precision("param")
        _assert_equal(floating, {"weights": {}, "state": want["float"]}, (precision, rank))
        assert got["wire"].get("block_scales/all_reduce") == expected, got["wire"]
        # step metrics read the stored moments' values: one process's figures, summed over
        # the ranks in another order (float32 rounding of sums of at most the largest
        # parameter's entries)
        rel = max(math.prod(shape) for shape, _, _ in CUT_LAYOUT.values()) * EPS32
        for name, value in want["metrics"].items():
            if "ns_sample/" in name or name.endswith("wire_bytes"):
                continue  # shards: no orthogonality sample; one process: no traffic
            assert got["metrics"][name] == pytest.approx(value, rel=rel), name


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cut_rows_resume_through_dcp_2_to_1_bitwise(cut_runs, cut_reference, precision):
    """Saved at 2 ranks (scales replicated where rows are cut), resumed in one process
    (muonscale.Muon): the uninterrupted one-process run."""
    _, path = cut_runs(2, precision)
    _assert_equal(
        _cut_resumed(0, 1, precision, path), cut_reference[precision], ("2 -> 1", precision)
    )


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cut_rows_resume_through_dcp_4_to_2_bitwise(cut_runs, precision):
    """Saved at 4 ranks, resumed at 2: the uninterrupted run at 2, weights and full state."""
    at2, _ = cut_runs(2, precision)
    _, path4 = cut_runs(4, precision)
    for rank, got in enumerate(shared_pool(2).run(_cut_resumed, precision, path4)):
        _assert_equal(got, at2[rank], ("4 -> 2", precision, rank))


def _cut_on_2d_mesh(rank: int, world_size: int, precision: str, path: str) -> dict:
    model, opt = _build_cut(world_size, precision, two_dims=True)
    _inject(model, opt, 0, SAVE_AT)
    save_checkpoint(model, opt, path)
    _inject(model, opt, SAVE_AT, STEPS)
    return _result(model, opt)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cut_rows_on_a_2d_mesh_equal_single_process_and_resume_in_one_process(
    cut_reference, tmp_path, precision
):
    """A 2 × 2 mesh (rows sharded on one dim, where the scales keep that placement, columns
    on the other, replicated or cut): weights and full state one process's bitwise, and the
    DCP checkpoint (scales made whole over the cutting dim only) resumes in one process."""
    want = cut_reference[precision]
    for rank, got in enumerate(shared_pool(4).run(_cut_on_2d_mesh, precision, str(tmp_path))):
        _assert_equal(got, want, ("2 x 2", precision, rank))
    resumed = _cut_resumed(0, 1, precision, str(tmp_path))
    _assert_equal(resumed, want, ("2 x 2 -> 1", precision))


def _cut_floating_into_quantized(rank: int, world_size: int, precision: str) -> dict:
    """Floating state of two steps loaded into quantized state (converted: quantized whole
    where rows are cut), then the last step."""
    from muonscale.distributed import DTensorMuon

    model, _ = _build_cut(world_size, "param")
    cls = DTensorMuon if world_size > 1 else muonscale.Muon
    floating = cls(_cut_groups(model, "param", "param", stacks="param"), **CUT_OPTIONS)
    with one_thread():
        _inject(model, floating, 0, SAVE_AT)
        opt = cls(_cut_groups(model, precision), **CUT_OPTIONS)
        with pytest.warns(UserWarning, match=r"state_precision differs.*'param' -> "):
            opt.load_state_dict(floating.state_dict())
        _inject(model, opt, SAVE_AT, STEPS)
    return _result(model, opt)


def test_floating_state_loads_into_cut_rows_as_one_process_converts_it():
    """Floating state loaded into int4 (and int8) state whose rows are cut, at 2 ranks: the
    weights and state after the next step are one process's that loads the same floating
    state."""
    want = _cut_floating_into_quantized(0, 1, "int4")
    for rank, got in enumerate(shared_pool(2).run(_cut_floating_into_quantized, "int4")):
        _assert_equal(got, want, ("param -> int4", rank))


def _cut_refusals(rank: int, world_size: int) -> dict[str, str]:
    """The error of each quantized layout that cannot be kept exact (``"no error"`` if
    built)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonscale.distributed import DTensorMuon

    mesh = init_device_mesh("cpu", (world_size,))
    cases = {  # name: (shape, placement, algorithm, precision)
        "moe.w13": ((4, 6, 300), Shard(2), "adamw", "int8"),  # a flattened row's columns
        "moe.experts": ((4, 6, 300), Shard(1), "muon", "int4"),  # packed rows not one chunk
        "attn.wo.weight": ((10, 602), Shard(1), "muon", "int4"),  # 301 columns: half a byte
    }
    out = {}
    for name, (shape, placement, algorithm, precision) in cases.items():
        p = nn.Parameter(distribute_tensor(torch.randn(shape), mesh, [placement]))
        experts = {name: ExpertLayout(n_experts=shape[0])} if name.endswith("experts") else {}
        group = {"params": [(name, p)], "algorithm": algorithm, "state_precision": precision}
        try:
            DTensorMuon([group], lr=0.02, adamw_lr=0.01, experts=experts)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
        DTensorMuon([dict(group, state_precision="param")], lr=0.02, adamw_lr=0.01, experts=experts)
    return out


def test_layouts_that_cannot_share_scales_exactly_are_refused_by_name():
    """Columns of a flattened row that are not contiguous (a shard of a trailing dim), and
    int4's packed bytes that a layout does not hold as one chunk: refused at construction,
    naming the parameter (floating state builds)."""
    for rank, errors in enumerate(shared_pool(2).run(_cut_refusals)):
        for name, message in errors.items():
            assert f"parameter '{name}'" in message, (rank, name, message)
            assert "state_precision='param'" in message or "'int8'" in message, message
            reason = "contiguous" if name == "moe.w13" else "packs two columns"
            assert reason in message, (rank, name, message)
