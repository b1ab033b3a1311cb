"""``DistributedMuon(state_precision="int8")``: each owner holds whole matrices (or a range of
whole experts, hence whole rows), so its int8 momentum is the one one process holds. At 2 and
4 gloo ranks, with identical gradients injected, the weights and the full state (codes and
scales; and ``state_dict_in_precision("param")``) equal single-process
``Muon(state_precision="int8")``'s bitwise, on a dense model
(rows of several 256-entry blocks, AdamW parameters in a floating group), on expert
concatenations and on 3-D expert stacks (one stored (in, out)) spread over owners. AdamW int8
groups are accepted (their ZeRO-1 segments: ``tests/test_low_bit_zero1.py``). Checkpoints: DCP
saved at 2 ranks resumes at 2 and in one process, and plain Muon's state dict (int8, or
floating: converted) loads at 2 ranks, each bitwise against one process. ``"int4"`` (the
momentum's 4-bit codes packed as rows of its block matrix, which owners of whole rows hold
whole) runs the same checks at 2 ranks, and loads int8 and floating state dicts.
"""

from __future__ import annotations

import copy

import pytest
import torch
from distributed_harness import load_checkpoint, one_thread, save_checkpoint, shared_pool
from test_experts_distributed import CONCATENATED, Concatenated
from torch import nn

import muonscale
from muonscale import ExpertLayout

pytestmark = pytest.mark.timeout(120)

OPTIONS = dict(lr=0.02, weight_decay=0.1, ns_dtype=torch.float32, adamw_lr=0.01)
STEPS, SAVE_AT = 3, 2
SPREAD = {"experts": {"w1", "w2"}, "stacked": {"experts"}}
"""The stacks spread over several owners (at least) at 2 and 4 ranks."""


class Dense(nn.Module):
    """Muon weights whose rows span one to two 256-entry blocks (300 = 256 + 44), with biases
    and a norm (AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(300, 12)
        self.mid = nn.Linear(12, 300)
        self.down = nn.Linear(300, 7)
        self.norm = nn.LayerNorm(7)


class Stacked(nn.Module):
    """A 3-D stack of 8 experts (out, in) whose rows span two blocks, one of 4 stored (in, out),
    and a dense weight: every parameter Muon."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(8, 6, 300))
        self.experts_t = nn.Parameter(torch.randn(4, 300, 5))
        self.dense = nn.Linear(300, 5, bias=False)


STACKED = dict(
    experts={
        "experts": ExpertLayout(n_experts=8),
        "experts_t": ExpertLayout(n_experts=4, transposed=True),
    }
)


def _groups(model: nn.Module, precision: str = "int8") -> list[dict]:
    """The Muon weights in an int8 group, everything else pinned to AdamW (floating)."""
    named = list(model.named_parameters())
    muon = [(n, p) for n, p in named if p.ndim == 2]
    adamw = [(n, p) for n, p in named if p.ndim < 2]
    return [{"params": muon, "state_precision": precision}, {"params": adamw, "algorithm": "adamw"}]


def _build(model_name: str, world_size: int, seed: int = 0, precision: str = "int8"):
    """The model and its optimizer (``world_size`` 1: plain Muon)."""
    from muonscale.distributed import DistributedMuon

    torch.manual_seed(seed)
    cls = muonscale.Muon if world_size == 1 else DistributedMuon
    if model_name == "dense":
        model = Dense()
        return model, cls(_groups(model, precision), **OPTIONS)
    if model_name == "stacked":
        model = Stacked()
        return model, cls(model, **OPTIONS, **STACKED, state_precision=precision)
    model = Concatenated()  # every parameter Muon: the constructor's state_precision
    return model, cls(model, **OPTIONS, **CONCATENATED, state_precision=precision)


def _train_injected(model, opt, first: int, last: int) -> None:
    """Steps ``first`` to ``last`` with the same gradients k/64, |k| ≤ 40, on every rank (their
    mean over 2 or 4 ranks is exact)."""
    for step in range(first, last):
        g = torch.Generator().manual_seed(100 + step)
        for p in model.parameters():
            p.grad = (torch.randint(-40, 41, p.shape, generator=g) / 64).to(p.dtype)
        opt.step()


def _weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _run(model_name: str, world_size: int, precision: str = "int8") -> dict:
    model, opt = _build(model_name, world_size, precision=precision)
    with one_thread():
        _train_injected(model, opt, 0, STEPS)
    as_float = opt.state_dict_in_precision("param")["state"]  # collective, as state_dict()
    return {
        "weights": _weights(model),
        "state": opt.state_dict()["state"],
        "float": as_float,
        "opt": opt,
    }


def _distributed(rank: int, world_size: int, model_name: str, precision: str) -> dict:
    out = _run(model_name, world_size, precision)
    opt = out.pop("opt")
    out["spread"] = sorted(opt.param_table.name(opt.params[i]) for i in opt.expert_ranges)
    return out


def _assert_equal_state(got: dict, want: dict, where) -> None:
    assert sorted(got) == sorted(want), where
    for index, entry in want.items():
        assert sorted(got[index]) == sorted(entry), (where, index)
        for key, value in entry.items():
            assert got[index][key].dtype == value.dtype, (where, index, key)
            assert torch.equal(got[index][key], value), (where, index, key)


@pytest.mark.parametrize(
    ("world_size", "precision"), [(2, "int8"), (4, "int8"), (2, "int4")], ids=str
)
@pytest.mark.parametrize("model_name", ["dense", "experts", "stacked"])
def test_quantized_momentum_of_owners_equals_single_process_bitwise(
    model_name, world_size, precision
):
    want = _run(model_name, 1, precision)
    codes = torch.int8 if precision == "int8" else torch.uint8
    assert any(v.dtype == codes for e in want["state"].values() for v in e.values())
    for rank, got in enumerate(shared_pool(world_size).run(_distributed, model_name, precision)):
        for name, tensor in want["weights"].items():
            assert torch.equal(got["weights"][name], tensor), (rank, name)
        _assert_equal_state(got["state"], want["state"], rank)
        _assert_equal_state(got["float"], want["float"], (rank, "state_dict_in_precision"))
        if model_name != "dense":  # each stack stepped by several owners, a range each
            assert SPREAD[model_name] <= set(got["spread"]), got["spread"]


def test_int8_adamw_groups_are_accepted():
    """Every group int8 (AdamW's too: its ZeRO-1 segments share the absmax of the blocks
    their boundaries cut, ``tests/test_low_bit_zero1.py``); in one process no block is cut,
    and the step is plain Muon's."""
    from muonscale.distributed import DistributedMuon

    model, ref = Dense(), Dense()
    ref.load_state_dict(model.state_dict())
    opt = DistributedMuon(model, **OPTIONS, state_precision="int8")  # one process: no group
    want = muonscale.Muon(ref, **OPTIONS, state_precision="int8")
    assert not opt.block_scales.slots
    _train_injected(model, opt, 0, 2)
    _train_injected(ref, want, 0, 2)
    _assert_equal_state(opt.state_dict()["state"], want.state_dict()["state"], "one process")
    assert any("exp_avg_absmax" in e for e in opt.state_dict()["state"].values())


def _save_at(rank: int, world_size: int, model_name: str, path: str, precision: str) -> None:
    model, opt = _build(model_name, world_size, precision=precision)
    _train_injected(model, opt, 0, SAVE_AT)
    save_checkpoint(model, opt, path)


def _resume_at(rank: int, world_size: int, model_name: str, path: str, precision: str) -> dict:
    model, opt = _build(model_name, world_size, seed=123, precision=precision)  # all loaded
    load_checkpoint(model, opt, path)
    with one_thread():
        _train_injected(model, opt, SAVE_AT, STEPS)
    return _weights(model)


def _resume_from(rank: int, world_size: int, path: str, precision: str) -> dict:
    saved = torch.load(path)
    model, opt = _build("experts", world_size, seed=123, precision=precision)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])  # state of the other precision: converted
    held = [e["momentum_buffer"] for e in opt.state.values() if "momentum_buffer" in e]
    codes = {"int8": torch.int8, "int4": torch.uint8, "param": torch.float32}
    assert held and {b.dtype for b in held} == {codes[precision]}
    with one_thread():
        _train_injected(model, opt, SAVE_AT, STEPS)
    return _weights(model)


@pytest.mark.filterwarnings("ignore:load_state_dict. state_precision differs")
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ("int8", "int8"),
        ("param", "int8"),
        ("int8", "param"),
        ("int4", "int4"),
        ("int8", "int4"),
        ("int4", "param"),
    ],
)
def test_plain_muon_state_dict_loads_at_2_ranks_bitwise(saved, loaded, tmp_path):
    """Plain Muon's state dict at step 2 into DistributedMuon at 2 ranks: codes copied,
    floating state quantized, quantized state dequantized or converted to the other format (as
    one process converts it): the weights of one process that loads the same state dict."""
    model, opt = _build("experts", 1, precision=saved)
    with one_thread():
        _train_injected(model, opt, 0, SAVE_AT)
    path = str(tmp_path / "plain.pt")
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    want = _resume_from(0, 1, path, loaded)
    for rank, got in enumerate(shared_pool(2).run(_resume_from, path, loaded)):
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), (saved, loaded, rank, name)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("model_name", ["dense", "experts", "stacked"])
def test_quantized_state_resumes_through_dcp_at_2_and_1_bitwise(model_name, precision, tmp_path):
    """Saved through DCP at 2 ranks (the full state: codes and scales gathered from the
    owners), resumed at 2 ranks and in one process: the uninterrupted run's weights."""
    want = _run(model_name, 1, precision)["weights"]
    path = str(tmp_path / "at2")
    shared_pool(2).run(_save_at, model_name, path, precision)
    for rank, got in enumerate(shared_pool(2).run(_resume_at, model_name, path, precision)):
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), ("2 -> 2", rank, name)
    got = _resume_at(0, 1, model_name, path, precision)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), ("2 -> 1", name)


def _with_option(rank: int, world_size: int, case: str, precision: str) -> dict[str, bool]:
    """{name: bitwise equal} (and whether the momentum held is quantized) of the run with
    ``case`` against its single-process reference, run here: fp32 main copies of a bf16 model
    against fp32 Muon from the same bf16-rounded weights; the owners' bf16 updates against Muon
    applying each update rounded to bf16."""
    from test_distributed_update_gather import rounding_updates

    from muonscale.distributed import DistributedMuon

    torch.manual_seed(0)
    model = Stacked()
    options = dict(OPTIONS, **STACKED, state_precision=precision)
    if case == "main_copies":
        model = model.bfloat16()
        ref = copy.deepcopy(model).float()
        opt = DistributedMuon(model, **options, main_params_dtype=torch.float32)
        _train_injected(model, opt, 0, STEPS)
        full = opt.state_dict()["state"]
        got = {opt.param_table.name(p): full[i]["main_param"] for i, p in enumerate(opt.params)}
        _train_injected(ref, muonscale.Muon(ref, **options), 0, STEPS)
    else:
        ref = copy.deepcopy(model)
        opt = DistributedMuon(model, **options, gather_updates=True)
        _train_injected(model, opt, 0, STEPS)
        got = _weights(model)
        with rounding_updates():
            _train_injected(ref, muonscale.Muon(ref, **options), 0, STEPS)
    held = [e["momentum_buffer"].dtype for e in opt.state.values() if "momentum_buffer" in e]
    out = {n: torch.equal(got[n], p.detach()) for n, p in ref.named_parameters()}
    codes = torch.int8 if precision == "int8" else torch.uint8
    return dict(out, held_codes=bool(held) and set(held) == {codes})


@pytest.mark.parametrize(
    ("case", "precision"),
    [("main_copies", "int8"), ("gather_updates", "int8"), ("main_copies", "int4")],
)
def test_quantized_momentum_with_main_copies_and_gathered_updates_bitwise(case, precision):
    """The quantized momentum of fp32 main copies (``main_params_dtype``) and of owners that
    send their bf16 updates (``gather_updates=True``), at 2 ranks: bitwise their references."""
    for rank, equal in enumerate(shared_pool(2).run(_with_option, case, precision)):
        assert equal and all(equal.values()), (case, rank, equal)
