"""``state_precision="int4"``'s own tests (those it shares with ``"int8"`` are parametrized in
``test_low_bit_state.py``): the stored bytes are packed 4-bit codes + a float32 absmax per
128-entry block, checkpoints convert between int8 and int4 (each with a warning) and are
written in int4 by name, and the step on convolutions and expert stacks is the floating step
(packed rows that are not the parameter's shape).
``DistributedMuon``'s int4 tests are in ``test_low_bit_distributed.py``."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from test_low_bit_state import (
    _check_steps_from_the_dequantized_state,
    _Net,
    _pair,
    _steps,
)
from torch import nn

import muonscale
from muonscale.block_quantization import BLOCK_SIZE
from muonscale.block_quantization_4bit import BLOCK_SIZE_4BIT

KW = dict(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
EXPERTS = dict(experts={"experts": muonscale.ExpertLayout(n_experts=4)})


class _Shapes(nn.Module):
    """A convolution (flattened: rows of 27 entries, odd) and a 3-D expert stack (its
    experts' rows of 33 entries, odd) besides a 2-D weight: int4's packed rows of the block
    matrix are not the parameter's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 6, 33))
        self.dense = nn.Linear(33, 130, bias=False)


def test_int4_state_bytes_are_packed_codes_and_scales():
    opt = muonscale.Muon(_Net(), lr=0.02, adamw_lr=3e-3, state_precision="int4")
    opt.init_all_state()
    muon = 0
    for rows, cols in ((40, 300), (300, 40)):  # up, down: two 4-bit codes per byte
        muon += rows * math.ceil(cols / 2) + 4 * rows * math.ceil(cols / BLOCK_SIZE_4BIT)
    adamw = 0
    for rows, cols in ((30, 300), (1, 300), (1, 300), (30, 300)):  # embed, norm w/b, head
        adamw += 4 + 2 * (rows * cols + 4 * rows * math.ceil(cols / BLOCK_SIZE))
    assert opt.optimizer_state_bytes() == muon + adamw


def test_a_fresh_int4_momentum_is_the_quantization_of_zero():
    """The bytes a new int4 momentum starts from are those quantizing a zero momentum writes
    (the codes of 0, odd rows padded alike), and they read back as +0.0."""
    from muonscale.quantized_state import quantized_momentum, quantized_momentum_state

    model = _Shapes()  # rows of 27 and 33 entries (odd) and of 33
    opt = muonscale.Muon(model, **KW, **EXPERTS, state_precision="int4")
    opt.init_all_state()
    for p in model.parameters():
        view = opt.param_table.view(p, "flatten")
        fresh = opt.state[p]
        assert fresh["momentum_buffer"].dtype == torch.uint8
        zero = quantized_momentum_state(torch.zeros(p.shape), view, "int4")
        for key, value in zero.items():
            assert torch.equal(fresh[key], value), key
        values = quantized_momentum(fresh, view).values()
        assert torch.equal(values, torch.zeros(p.shape)) and not values.signbit().any()


def _assert_same_state(a: dict, b: dict) -> None:
    """The state of two state dicts: the same keys, dtypes and bits."""
    assert a["state"].keys() == b["state"].keys()
    for i, entry in a["state"].items():
        assert entry.keys() == b["state"][i].keys()
        for key, value in entry.items():
            other = b["state"][i][key]
            assert value.dtype == other.dtype and torch.equal(value, other), (i, key)


def test_checkpoints_convert_between_int8_and_int4():
    """int4 → int8 and int8 → int4 (param ↔ int4 is parametrized with int8's test): as loading
    the floating state, one conversion through float32, each load naming its conversion."""
    model_q, opt_q, _, _ = _pair("int4")
    _steps(model_q, opt_q, range(2))
    int8_a, int8_b, int4_a = (
        muonscale.Muon(copy.deepcopy(model_q), **KW, state_precision=precision)
        for precision in ("int8", "int8", "int4")
    )
    with pytest.warns(UserWarning, match="'int4' -> 'int8'"):
        int8_a.load_state_dict(opt_q.state_dict())
    with pytest.warns(UserWarning, match="'param' -> 'int8'"):
        int8_b.load_state_dict(opt_q.state_dict_in_precision("param"))
    _assert_same_state(int8_a.state_dict(), int8_b.state_dict())
    with pytest.warns(UserWarning, match="'int8' -> 'int4'"):
        int4_a.load_state_dict(int8_a.state_dict())
    with pytest.warns(UserWarning, match="'param' -> 'int4'"):
        opt_q.load_state_dict(int8_a.state_dict_in_precision("param"))
    _assert_same_state(int4_a.state_dict(), opt_q.state_dict())
    _steps(model_q, opt_q, range(2, 3))  # and trains


def test_state_dict_in_precision_int4_is_the_named_conversion():
    """A floating optimizer's ``state_dict_in_precision("int4")`` leaves it unchanged and loads
    into an int4 optimizer without a warning, as its floating state dict loads converted."""
    _, opt_q, model_f, opt_f = _pair("int4")
    _steps(model_f, opt_f, range(2))
    before = copy.deepcopy(opt_f.state_dict())
    as_int4 = opt_f.state_dict_in_precision("int4")
    assert {g["state_precision"] for g in as_int4["param_groups"]} == {"int4"}
    _assert_same_state(before, opt_f.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt_q.load_state_dict(as_int4)
    converted = copy.deepcopy(opt_q.state_dict())
    with pytest.warns(UserWarning, match="'param' -> 'int4'"):
        opt_q.load_state_dict(opt_f.state_dict())
    _assert_same_state(converted, opt_q.state_dict())


def test_int4_step_on_convolutions_and_expert_stacks_is_the_float_step():
    """On a convolution and an expert stack, each int4 step equals the floating step from the
    dequantized state, bitwise, and writes back the reference codes (packed (rows, ⌈cols / 2⌉)
    of the block matrix: (8, 14) and (24, 17))."""
    torch.manual_seed(0)
    model_q = _Shapes()
    model_f = copy.deepcopy(model_q)
    opt_q = muonscale.Muon(model_q, **KW, **EXPERTS, state_precision="int4")
    opt_f = muonscale.Muon(model_f, **KW, **EXPERTS)
    _check_steps_from_the_dequantized_state(model_q, opt_q, model_f, opt_f, steps=2)
    shapes = {
        n: tuple(opt_q.state[p]["momentum_buffer"].shape) for n, p in model_q.named_parameters()
    }
    assert shapes == {"conv.weight": (8, 14), "experts": (24, 17), "dense.weight": (130, 17)}
