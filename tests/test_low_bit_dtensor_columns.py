"""``DTensorMuon`` with quantized state whose rows a placement cuts: TP's rowwise ``Shard(1)``
(a weight whose shard boundary cuts a block and one whose boundaries fall between blocks),
``Shard(1)`` of a 3-D expert stack (FSDP2's ``shard_placement_fn``), an uneven ``Shard(0)`` of
an expert stack (dim-0 chunks unlike its scales'), a ``Shard(0)`` 1-D bias and a ``Shard(1)``
table with 8-bit AdamW moments. A block cut by a shard boundary shares its scale across the
ranks, so with identical gradients injected on every rank, at 2 and 4 gloo ranks, int8 and
int4, the weights and the full state (codes and scales gathered) equal single-process
``muonscale.Muon``'s bitwise; each step all-reduces exactly the cut blocks' maxima (counted
from the shapes here); DCP checkpoints resume 2 → 1 and 4 → 2 bitwise against the
uninterrupted run at the destination; layouts that cannot be kept exact are refused by name.
"""

from __future__ import annotations

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
    experts={"experts": ExpertLayout(n_experts=4), "uneven": ExpertLayout(n_experts=3)},
)
STEPS, SAVE_AT = 3, 2
LAYOUT = {  # name: (shape, sharded dim, algorithm)
    "wo": ((10, 600), 1, "muon"),  # TP rowwise: boundaries at 300 (2 ranks), 150/300/450 (4)
    "wo_aligned": ((6, 1024), 1, "muon"),  # boundaries at multiples of 256: no block cut
    "experts": ((4, 6, 300), 1, "muon"),  # FSDP2 Shard(1) of a stack: rows of each expert
    "uneven": ((3, 6, 300), 0, "muon"),  # 2 + 1 experts: 12 + 6 rows against 9 + 9
    "bias": ((300,), 0, "adamw"),  # a 1-D shard: its one row cut
    "table": ((5, 600), 1, "adamw"),
}
PACKED_REFUSED = ("experts", "uneven")
"""int4 packs two columns per byte of rows that these layouts do not hold as one chunk."""


class Bag(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for name, (shape, _, _) in LAYOUT.items():
            self.register_parameter(name, nn.Parameter(torch.randn(shape, generator=g)))


def _groups(model: nn.Module, precision: str) -> list[dict]:
    """The Muon weights in ``precision`` (the stacks int8 under int4), AdamW's 8-bit."""
    named = dict(model.named_parameters())
    muon = [n for n, (_, _, a) in LAYOUT.items() if a == "muon"]
    packed = precision == "int4"
    first = [n for n in muon if not (packed and n in PACKED_REFUSED)]
    groups = [{"params": [(n, named[n]) for n in first], "state_precision": precision}]
    if packed:
        groups.append(
            {"params": [(n, named[n]) for n in PACKED_REFUSED], "state_precision": "int8"}
        )
    adamw = [(n, named[n]) for n, (_, _, a) in LAYOUT.items() if a == "adamw"]
    groups.append({"params": adamw, "algorithm": "adamw", "state_precision": "int8"})
    return groups


def _build(world_size: int, precision: str, seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonscale.distributed import DTensorMuon

    model = Bag(seed)
    if world_size == 1:
        return model, muonscale.Muon(_groups(model, precision), **OPTIONS)
    mesh = init_device_mesh("cpu", (world_size,))
    for name, (_, dim, _) in LAYOUT.items():
        p = getattr(model, name)
        model.register_parameter(
            name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(dim)]))
        )
    return model, DTensorMuon(_groups(model, precision), **OPTIONS)


def _inject(model: nn.Module, opt, first: int, last: int) -> None:
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    for step in range(first, last):
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            full = torch.randn(p.shape, generator=g)
            if isinstance(p, DTensor):
                whole = distribute_tensor(full, p.device_mesh, [Replicate()])
                full = whole.redistribute(p.device_mesh, p.placements)
            p.grad = full
        opt.step()


def _full(t):
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _result(model: nn.Module, opt) -> dict:
    state = opt.state_dict()["state"]
    return {
        "weights": {n: _full(p) for n, p in model.named_parameters()},
        "state": {i: {k: _full(v) for k, v in e.items()} for i, e in state.items()},
    }


def _uninterrupted(rank: int, world_size: int, precision: str, path: str) -> dict:
    model, opt = _build(world_size, precision)
    _inject(model, opt, 0, SAVE_AT)
    save_checkpoint(model, opt, path)
    _inject(model, opt, SAVE_AT, STEPS)
    out = _result(model, opt)
    out["wire"] = opt.last_step_wire_breakdown
    floating = opt.state_dict_in_precision("param")["state"]
    out["float"] = {i: {k: _full(v) for k, v in e.items()} for i, e in floating.items()}
    return out


def _resumed(rank: int, world_size: int, precision: str, path: str) -> dict:
    model, opt = _build(world_size, precision, seed=123)
    load_checkpoint(model, opt, path)
    with one_thread():
        _inject(model, opt, SAVE_AT, STEPS)
    return _result(model, opt)


def _single_process(precision: str) -> dict:
    model, opt = _build(1, precision)
    with one_thread():
        _inject(model, opt, 0, STEPS)
    out = _result(model, opt)
    out["float"] = opt.state_dict_in_precision("param")["state"]
    return out


def _assert_equal(got: dict, want: dict, where) -> None:
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), (where, name)
    assert sorted(got["state"]) == sorted(want["state"]), where
    for index, entry in want["state"].items():
        assert sorted(got["state"][index]) == sorted(entry), (where, index)
        for key, value in entry.items():
            assert got["state"][index][key].dtype == value.dtype, (where, index, key)
            assert torch.equal(got["state"][index][key], value), (where, index, key)


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
    for name, (shape, dim, algorithm) in LAYOUT.items():
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
def reference() -> dict:
    return {precision: _single_process(precision) for precision in ("int8", "int4")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The uninterrupted runs (per rank) and their checkpoints, by (world size, precision)."""
    out = {}

    def run(world_size: int, precision: str):
        if (world_size, precision) not in out:
            path = str(tmp_path_factory.mktemp(f"{precision}_at_{world_size}"))
            got = shared_pool(world_size).run(_uninterrupted, precision, path)
            out[world_size, precision] = got, path
        return out[world_size, precision]

    return run


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_cut_rows_share_block_scales_and_equal_single_process_bitwise(
    runs, reference, world_size, precision
):
    want = reference[precision]
    held = {v.dtype for e in want["state"].values() for v in e.values()}
    assert torch.uint8 in held and (torch.int8 in held) == (precision == "int8" or True)
    got_runs, _ = runs(world_size, precision)
    expected = _block_scales_bytes(world_size, precision)
    assert expected > 0
    for rank, got in enumerate(got_runs):
        _assert_equal(got, want, (world_size, precision, rank))
        floating = {"weights": {}, "state": got["float"]}  # state_dict_in_precision("param")
        _assert_equal(floating, {"weights": {}, "state": want["float"]}, (precision, rank))
        assert got["wire"].get("block_scales/all_reduce") == expected, got["wire"]


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_cut_rows_resume_through_dcp_2_to_1_bitwise(runs, reference, precision):
    """Saved at 2 ranks (scales replicated where rows are cut), resumed in one process
    (muonscale.Muon): the uninterrupted one-process run."""
    _, path = runs(2, precision)
    _assert_equal(_resumed(0, 1, precision, path), reference[precision], ("2 -> 1", precision))


def test_cut_rows_resume_through_dcp_4_to_2_bitwise(runs):
    """Saved at 4 ranks, resumed at 2: the uninterrupted run at 2, weights and full state."""
    at2, _ = runs(2, "int8")
    _, path4 = runs(4, "int8")
    for rank, got in enumerate(shared_pool(2).run(_resumed, "int8", path4)):
        _assert_equal(got, at2[rank], ("4 -> 2", rank))


def _refusals(rank: int, world_size: int) -> dict[str, str]:
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
    for rank, errors in enumerate(shared_pool(2).run(_refusals)):
        for name, message in errors.items():
            assert f"parameter '{name}'" in message, (rank, name, message)
            assert "state_precision='param'" in message or "'int8'" in message, message
            reason = "contiguous" if name == "moe.w13" else "packs two columns"
            assert reason in message, (rank, name, message)
