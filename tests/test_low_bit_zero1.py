"""``DistributedMuon`` with int8 AdamW groups: ZeRO-1 segments (flat buckets' shards and the
owner streams' fill ranges) whose boundaries cut 256-entry blocks share each cut block's absmax
(one all-reduce (max) per step), so at 2 and 4 gloo ranks, with identical gradients injected,
the weights and the full state (codes and absmax of an embedding, a head, a norm and biases,
rows of 300 = 256 + 44 entries) equal single-process ``Muon(state_precision="int8")``'s
bitwise, and DCP checkpoints resume 2 → 2, 2 → 1 and 4 → 2 bitwise the uninterrupted run.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import load_checkpoint, one_thread, save_checkpoint, shared_pool
from test_low_bit_distributed import _assert_equal_state, _train_injected, _weights
from torch import nn

import muonscale

pytestmark = pytest.mark.timeout(120)

OPTIONS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=0.01)
STEPS, SAVE_AT = 3, 2
CUT = {
    2: {"embed.weight", "norm.weight"},
    4: {"embed.weight", "head.weight", "norm.bias", "norm.weight"},
}
"""Parameters with a block cut by a segment boundary: the embedding in the owner streams'
fill (at 4 ranks one of its blocks on three ranks), the others in a flat bucket."""


class Tiny(nn.Module):
    """Muon weights of 7200 and 4800 entries (uneven owners: AdamW fill levels the owner
    streams); an embedding, a head, a norm and biases (AdamW) whose rows span one to three
    blocks (310, 300 and 700 entries): the rows' blocks are cut in the fill and in a flat
    bucket at 2 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 310)
        self.up = nn.Linear(300, 24)
        self.mid = nn.Linear(24, 200)
        self.a = nn.Linear(300, 24)
        self.b = nn.Linear(300, 24)
        self.norm = nn.LayerNorm(700)
        self.head = nn.Linear(300, 3)


def _groups(model: nn.Module, vectors: str = "int8", precision: str = "int8") -> list[dict]:
    """The Muon weights and the AdamW tables (embedding, head) in ``precision``, the norm and
    biases in ``vectors``."""
    named = list(model.named_parameters())
    tables = ("embed.weight", "head.weight")
    return [
        {
            "params": [(n, p) for n, p in named if p.ndim == 2 and n not in tables],
            "state_precision": precision,
        },
        {
            "params": [(n, p) for n, p in named if n in tables],
            "algorithm": "adamw",
            "state_precision": precision,
        },
        {
            "params": [(n, p) for n, p in named if p.ndim < 2],
            "algorithm": "adamw",
            "state_precision": vectors if precision != "param" else "param",
        },
    ]


def _build(world_size: int, seed: int = 0, vectors: str = "int8", precision: str = "int8"):
    """The model and its optimizer (``world_size`` 1: plain Muon), groups as :func:`_groups`."""
    from muonscale.distributed import DistributedMuon

    torch.manual_seed(seed)
    model = Tiny()
    cls = muonscale.Muon if world_size == 1 else DistributedMuon
    return model, cls(_groups(model, vectors, precision), **OPTIONS)


def _run(rank: int, world_size: int, vectors: str = "int8") -> dict:
    model, opt = _build(world_size, vectors=vectors)
    with one_thread():
        _train_injected(model, opt, 0, STEPS)
    out = {
        "weights": _weights(model),
        "state": opt.state_dict()["state"],
        "float": opt.state_dict_in_precision("param")["state"],
    }
    if world_size > 1:
        out["cut"] = {opt.param_table.name(opt.params[i]) for i, _ in opt.block_scales.slots}
        out["wire"] = opt.last_step_wire_breakdown
        out["slots"] = len(opt.block_scales.slots)
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_int8_adamw_segments_equal_single_process_bitwise(world_size):
    want = _run(0, 1)
    adamw = [e for e in want["state"].values() if "exp_avg_absmax" in e]
    assert len(adamw) == 9 and all(e["exp_avg"].dtype == torch.uint8 for e in adamw)
    for rank, got in enumerate(shared_pool(world_size).run(_run)):
        for name, tensor in want["weights"].items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)
        _assert_equal_state(got["state"], want["state"], rank)
        _assert_equal_state(got["float"], want["float"], (rank, "state_dict_in_precision"))
        assert got["cut"] == CUT[world_size], got["cut"]
        # the step's one exchange: 2 float32 maxima per cut block, all-reduced (ring model)
        shared = 2 * (world_size - 1) * (2 * got["slots"] * 4) // world_size
        assert got["wire"]["block_scales/all_reduce"] == shared, got["wire"]


def _save_at(rank: int, world_size: int, path: str) -> None:
    model, opt = _build(world_size)
    _train_injected(model, opt, 0, SAVE_AT)
    save_checkpoint(model, opt, path)


def _resume_at(rank: int, world_size: int, path: str) -> dict:
    model, opt = _build(world_size, seed=123)  # everything loaded
    load_checkpoint(model, opt, path)
    with one_thread():
        _train_injected(model, opt, SAVE_AT, STEPS)
    return {"weights": _weights(model), "state": opt.state_dict()["state"]}


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_int8_adamw_segments_resume_through_dcp_bitwise(tmp_path):
    """Saved through DCP at 2 and 4 ranks (codes gathered, absmax all-reduced), resumed at 2
    ranks and in one process: the uninterrupted run's weights and state."""
    want = _run(0, 1)
    at2, at4 = str(tmp_path / "at2"), str(tmp_path / "at4")
    shared_pool(2).run(_save_at, at2)
    shared_pool(4).run(_save_at, at4)
    for path, where in ((at2, "2 -> 2"), (at4, "4 -> 2")):
        for rank, got in enumerate(shared_pool(2).run(_resume_at, path)):
            for name, tensor in want["weights"].items():
                assert torch.equal(got["weights"][name], tensor), (where, rank, name)
            _assert_equal_state(got["state"], want["state"], (where, rank))
    got = _resume_at(0, 1, at2)
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), ("2 -> 1", name)
    _assert_equal_state(got["state"], want["state"], "2 -> 1")


def test_int8_and_floating_adamw_segments_in_one_bucket_bitwise():
    """The tables int8, the norm and biases floating: one flat bucket holds both (its store
    keeps codes and floating moments), at 2 ranks bitwise one process."""
    want = _run(0, 1, "param")
    moments = [e["exp_avg"] for e in want["state"].values() if "exp_avg" in e]
    assert sorted(m.dtype == torch.uint8 for m in moments) == [False] * 7 + [True] * 2
    for rank, got in enumerate(shared_pool(2).run(_run, "param")):
        for name, tensor in want["weights"].items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)
        _assert_equal_state(got["state"], want["state"], rank)
        assert got["cut"] == {"embed.weight"}, got["cut"]


def _resume_plain(rank: int, world_size: int, path: str) -> dict:
    saved = torch.load(path)
    model, opt = _build(world_size, seed=123)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])  # floating state: quantized whole, then segmented
    with one_thread():
        _train_injected(model, opt, SAVE_AT, STEPS)
    return {"weights": _weights(model), "state": opt.state_dict()["state"]}


@pytest.mark.filterwarnings("ignore:load_state_dict. state_precision differs")
def test_floating_state_dict_loads_into_int8_segments_bitwise(tmp_path):
    """Plain Muon's floating state dict at step 2 into int8 DistributedMuon at 2 ranks: the
    weights and state of one process that loads the same state dict."""
    model, opt = _build(1, precision="param")
    with one_thread():
        _train_injected(model, opt, 0, SAVE_AT)
    path = str(tmp_path / "plain.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    want = _resume_plain(0, 1, path)
    for rank, got in enumerate(shared_pool(2).run(_resume_plain, path)):
        for name, tensor in want["weights"].items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)
        _assert_equal_state(got["state"], want["state"], rank)


def _with_main_copies(rank: int, world_size: int) -> dict[str, bool]:
    """{name: bitwise equal} of the fp32 main copies of a bf16 model against fp32 Muon from
    the same bf16-rounded weights, run here."""
    from muonscale.distributed import DistributedMuon

    torch.manual_seed(0)
    model = Tiny().bfloat16()
    ref = copy.deepcopy(model).float()
    opt = DistributedMuon(_groups(model), **OPTIONS, main_params_dtype=torch.float32)
    _train_injected(model, opt, 0, STEPS)
    full = opt.state_dict()["state"]
    got = {opt.param_table.name(p): full[i]["main_param"] for i, p in enumerate(opt.params)}
    _train_injected(ref, muonscale.Muon(_groups(ref), **OPTIONS), 0, STEPS)
    held = [e["exp_avg"].dtype for e in opt.state.values() if "exp_avg_absmax" in e]
    out = {n: torch.equal(got[n], p.detach()) for n, p in ref.named_parameters()}
    return dict(out, held_codes=bool(held) and set(held) == {torch.uint8})


def test_int8_adamw_segments_of_main_copies_bitwise():
    """fp32 main copies (``main_params_dtype``) of a bf16 model step int8 AdamW segments at 2
    ranks: bitwise fp32 single-process Muon."""
    for rank, equal in enumerate(shared_pool(2).run(_with_main_copies)):
        assert equal and all(equal.values()), (rank, equal)
