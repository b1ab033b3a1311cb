"""``state_precision="int8"`` (and, where the test is the same, ``"int4"``: its own tests are in
``test_low_bit_state_4bit.py``): the step is the full-precision step from the dequantized
state (bitwise), the state written back is the float64 reference's quantization of the new
state, the stored bytes are codes + scales, checkpoints round-trip and convert, and a tiny
model trains as with full-precision state."""

from __future__ import annotations

import copy
import io
import math
import warnings
from pathlib import Path

import pytest
import torch
from compat_cases import BASE, SAVE_AT, Tiny, train
from torch import nn

import muonscale
from muonscale.block_quantization import BLOCK_SIZE, LINEAR_LEVELS, dynamic_values
from muonscale.block_quantization_4bit import BLOCK_SIZE_4BIT, de_values, unpack_nibbles
from muonscale.quantized_state import adamw_block_shape, momentum_block_shape

COMPAT = Path(__file__).parent / "assets" / "compat" / "single"
QUANTIZED = ["int8", "int4"]


class _Net(nn.Module):
    """Muon matrices with whole and short blocks per row, an embedding and a head (AdamW, rows
    of 300 entries: a whole block and a short one) and a 1-D norm (AdamW, one row)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 300)
        self.up = nn.Linear(300, 40, bias=False)
        self.down = nn.Linear(40, 300, bias=False)
        self.norm = nn.LayerNorm(300)
        self.head = nn.Linear(300, 30, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.norm(h + self.down(torch.relu(self.up(h)))))


def _grads(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)


def _blocks_per_entry(blockwise: torch.Tensor, cols: int, block: int = BLOCK_SIZE):
    return blockwise.repeat_interleave(block, dim=1)[:, :cols]


def _reference_absmax(x: torch.Tensor, block: int = BLOCK_SIZE) -> torch.Tensor:
    """float64 max |x| per block of each row of the (rows, cols) ``x``, per entry."""
    rows, cols = x.shape
    blocks = torch.stack([x[:, j : j + block].abs().amax(dim=1) for j in range(0, cols, block)], 1)
    return _blocks_per_entry(blocks, cols, block)


def _check_linear_codes(codes: torch.Tensor, values: torch.Tensor, block: tuple[int, int]):
    """``codes`` are the float64 reference's: round(x / s), s = absmax / 127 per block, except
    within float32 rounding of a half (there: one of the two neighbours)."""
    x = values.double().reshape(block)
    step = _reference_absmax(x) / LINEAR_LEVELS
    exact = x / torch.where(step > 0, step, 1.0)
    got = codes.reshape(block).double()
    near_half = (exact - exact.floor() - 0.5).abs() < 1e-4
    assert torch.equal(got[~near_half], exact.round()[~near_half])
    assert ((got - exact).abs()[near_half] <= 0.5 + 1e-4).all()


def _check_de4_codes(packed: torch.Tensor, values: torch.Tensor, block: tuple[int, int]):
    """``packed`` (two 4-bit codes per byte) holds, per entry, the dynamic-exponent map value
    nearest to x / absmax per 128-entry block (float64), ties aside."""
    rows, cols = block
    x = values.double().reshape(block)
    scale = _reference_absmax(x, BLOCK_SIZE_4BIT)
    normalized = x / torch.where(scale > 0, scale, 1.0)
    table = torch.tensor(de_values(), dtype=torch.float64)
    distance = (normalized[..., None] - table).abs()
    codes = unpack_nibbles(packed, cols).long()
    chosen = distance.gather(-1, codes[..., None]).squeeze(-1)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, -(-cols // 2))
    assert (chosen <= distance.min(dim=-1).values + 1e-6).all()


def _check_momentum_codes(state: dict, values: torch.Tensor, block: tuple[int, int]):
    """The stored momentum codes of ``state`` are the reference quantization of ``values``."""
    if "momentum_absmax" in state:
        _check_de4_codes(state["momentum_buffer"], values, block)
    else:
        assert state["momentum_buffer"].dtype == torch.int8
        _check_linear_codes(state["momentum_buffer"], values, block)


def _check_dynamic_codes(codes: torch.Tensor, values: torch.Tensor, signed: bool, block):
    """``codes`` index the table value nearest to x / absmax (float64), ties aside."""
    x = values.double().reshape(block)
    scale = _reference_absmax(x)
    normalized = x / torch.where(scale > 0, scale, 1.0)
    table = torch.tensor(dynamic_values(signed), dtype=torch.float64)
    distance = (normalized[..., None] - table).abs()
    chosen = distance.gather(-1, codes.reshape(block).long()[..., None]).squeeze(-1)
    assert (chosen <= distance.min(dim=-1).values + 1e-6).all()


def _dequantized_state(opt: muonscale.Muon, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The float32 values of ``p``'s quantized state, from its codes and scales (float64
    arithmetic: the reference of dequantization)."""
    s = opt.state[p]
    if "momentum_absmax" in s:  # 4-bit: a float32 map value × a float32 absmax, exact
        rows, cols = momentum_block_shape(opt.param_table.view(p, "flatten"))
        table = torch.tensor(de_values(), dtype=torch.float32).double()
        absmax = _blocks_per_entry(s["momentum_absmax"].double(), cols, BLOCK_SIZE_4BIT)
        values = table[unpack_nibbles(s["momentum_buffer"], cols).long()] * absmax
        return {"momentum_buffer": values.float().view(p.shape)}
    if "momentum_buffer" in s:
        rows, cols = momentum_block_shape(opt.param_table.view(p, "flatten"))
        step = _blocks_per_entry(s["momentum_scale"].double(), cols)
        values = s["momentum_buffer"].reshape(rows, cols).double() * step
        return {"momentum_buffer": values.float().view(p.shape)}
    rows, cols = adamw_block_shape(p)
    out = {}
    for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
        # the table as stored (float32); a float32 × float32 product is exact in float64
        table = torch.tensor(dynamic_values(signed), dtype=torch.float32).double()
        absmax = _blocks_per_entry(s[f"{key}_absmax"].double(), cols)
        values = table[s[key].reshape(rows, cols).long()] * absmax
        out[key] = values.float().view(p.shape)
    return out


def _pair(precision: str = "int8", **options):
    torch.manual_seed(0)
    model_q = _Net()
    model_f = copy.deepcopy(model_q)
    kw = dict(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32, **options)
    return (
        model_q,
        muonscale.Muon(model_q, state_precision=precision, **kw),
        model_f,
        muonscale.Muon(model_f, **kw),
    )


@pytest.mark.parametrize("precision", QUANTIZED)
@pytest.mark.parametrize("options", [{}, {"normalize": "row"}], ids=["stacked", "matrix_step"])
def test_quantized_step_is_the_float_step_from_the_dequantized_state(options, precision):
    """Each step of quantized state equals, bitwise, the full-precision step of an optimizer
    whose state is the quantized state dequantized (float64 reference of the formats); the
    state written back is the float64 reference's quantization of that step's new state.
    Plain Muon takes the stacked fast path; NorMuon (its row moment kept in float32) the
    matrix step. The Muon rows (300 and 40 entries) hold whole and short blocks of either
    format."""
    _check_steps_from_the_dequantized_state(*_pair(precision, **options), steps=3)


def _check_steps_from_the_dequantized_state(model_q, opt_q, model_f, opt_f, *, steps: int):
    """``steps`` steps of the quantized ``opt_q`` each equal the floating ``opt_f``'s from the
    dequantized state, bitwise, and write back the reference quantization of its new state."""
    pairs = list(zip(model_q.parameters(), model_f.parameters()))
    for step in range(steps):
        _grads(model_q, step)
        _grads(model_f, step)
        if step:
            with torch.no_grad():
                for pq, pf in pairs:
                    pf.copy_(pq)
                    values = _dequantized_state(opt_q, pq)
                    for key, value in opt_q.state[pq].items():
                        if key in opt_f.state[pf]:  # floating state (NorMuon's) as it is
                            opt_f.state[pf][key].copy_(values.get(key, value))
        opt_q.step()
        opt_f.step()
        for (name, pq), pf in zip(model_q.named_parameters(), model_f.parameters()):
            assert torch.equal(pq, pf), (step, name)
            sq, sf = opt_q.state[pq], opt_f.state[pf]
            if "momentum_buffer" in sq:
                block = momentum_block_shape(opt_q.param_table.view(pq, "flatten"))
                _check_momentum_codes(sq, sf["momentum_buffer"], block)
            else:
                assert torch.equal(sq["step"], sf["step"])
                _check_dynamic_codes(sq["exp_avg"], sf["exp_avg"], True, adamw_block_shape(pq))
                _check_dynamic_codes(
                    sq["exp_avg_sq"], sf["exp_avg_sq"], False, adamw_block_shape(pq)
                )


def test_int8_state_bytes_are_codes_and_scales():
    model = _Net()
    opt = muonscale.Muon(model, lr=0.02, adamw_lr=3e-3, state_precision="int8")
    opt.init_all_state()
    blocks = math.ceil(300 / BLOCK_SIZE)  # rows of 300: one whole block and one short block
    muon = 40 * 300 + 4 * 40 * blocks + 300 * 40 + 4 * 300 * 1  # up (40, 300), down (300, 40)
    adamw = 0
    for rows, cols in ((30, 300), (1, 300), (1, 300), (30, 300)):  # embed, norm w/b, head
        adamw += 4 + 2 * (rows * cols + 4 * rows * math.ceil(cols / BLOCK_SIZE))
    assert opt.optimizer_state_bytes() == muon + adamw
    full = muonscale.Muon(_Net(), lr=0.02, adamw_lr=3e-3)
    full.init_all_state()
    assert opt.optimizer_state_bytes() < 0.3 * full.optimizer_state_bytes()


def test_state_precision_is_validated_and_refused_with_momentum_dtype():
    with pytest.raises(
        ValueError, match=r"state_precision must be one of \('param', 'int8', 'int4'\)"
    ):
        muonscale.Muon(_Net(), lr=0.02, adamw_lr=3e-3, state_precision="int2")
    for precision in QUANTIZED:
        with pytest.raises(ValueError, match="momentum_dtype=torch.bfloat16 contradicts"):
            muonscale.Muon(
                _Net(),
                lr=0.02,
                adamw_lr=3e-3,
                state_precision=precision,
                momentum_dtype=torch.bfloat16,
            )


def _steps(model, opt, steps):
    for step in steps:
        _grads(model, step)
        opt.step()


@pytest.mark.parametrize("precision", QUANTIZED)
def test_quantized_state_dict_round_trip_resumes_bitwise(precision):
    model_a, opt_a, _, _ = _pair(precision)
    model_b = copy.deepcopy(model_a)
    _steps(model_a, opt_a, range(2))
    buffer = io.BytesIO()
    torch.save({"model": model_a.state_dict(), "opt": opt_a.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert {g["state_precision"] for g in saved["opt"]["param_groups"]} == {precision}
    model_b.load_state_dict(saved["model"])
    opt_b = muonscale.Muon(
        model_b, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32, state_precision=precision
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same precision: nothing to convert, no warning
        opt_b.load_state_dict(saved["opt"])
    _steps(model_a, opt_a, range(2, 4))
    _steps(model_b, opt_b, range(2, 4))
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
        for key, value in opt_a.state[pa].items():
            assert value.dtype == opt_b.state[pb][key].dtype
            assert torch.equal(value, opt_b.state[pb][key]), key


@pytest.mark.parametrize(
    "options",
    [
        {"state_precision": "int8"},
        {"state_precision": "int4"},
        {"momentum_dtype": torch.float32},
    ],
    ids=["int8", "int4", "float32_momentum"],
)
def test_float32_state_of_bfloat16_parameters_survives_load_state_dict(options):
    """torch's load casts floating state to the parameter's dtype: the float32 block scales
    (and a float32 momentum) of bfloat16 parameters come back with every bit, and the resumed
    run steps as the uninterrupted one."""
    torch.manual_seed(0)
    model_a = _Net().to(torch.bfloat16)
    model_b = copy.deepcopy(model_a)

    def build(model):
        return muonscale.Muon(model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32, **options)

    def steps(model, opt, seeds):
        for seed in seeds:
            g = torch.Generator().manual_seed(seed)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
            opt.step()

    opt_a = build(model_a)
    steps(model_a, opt_a, range(2))
    wide = [
        v
        for s in opt_a.state.values()
        for k, v in s.items()
        if k != "step" and v.dtype == torch.float32
    ]
    assert wide and any(v.to(torch.bfloat16).float().ne(v).any() for v in wide)  # bf16 loses bits
    model_b.load_state_dict(model_a.state_dict())
    opt_b = build(model_b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        for key, value in opt_a.state[pa].items():
            assert value.dtype == opt_b.state[pb][key].dtype, key
            assert torch.equal(value, opt_b.state[pb][key]), key
    steps(model_a, opt_a, range(2, 4))
    steps(model_b, opt_b, range(2, 4))
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("precision", QUANTIZED)
def test_float_and_quantized_checkpoints_convert_on_load(precision):
    """A full-precision checkpoint loads into quantized state (the float64 reference's codes)
    and the reverse (dequantized), each with a warning naming the conversion."""
    model_q, opt_q, model_f, opt_f = _pair(precision)
    _steps(model_f, opt_f, range(2))
    _steps(model_q, opt_q, range(2))
    float_state = copy.deepcopy(opt_f.state_dict())
    assert all("state_precision" not in g for g in float_state["param_groups"])  # 0.5.0's keys
    with pytest.warns(UserWarning, match=f"state_precision differs.*'param' -> '{precision}'"):
        opt_q.load_state_dict(float_state)
    for pq, pf in zip(model_q.parameters(), model_f.parameters()):
        sq, sf = opt_q.state[pq], opt_f.state[pf]
        if "momentum_buffer" in sq:
            block = momentum_block_shape(opt_q.param_table.view(pq, "flatten"))
            _check_momentum_codes(sq, sf["momentum_buffer"], block)
        else:
            _check_dynamic_codes(sq["exp_avg"], sf["exp_avg"], True, adamw_block_shape(pq))
    assert {g["state_precision"] for g in opt_q.param_groups} == {precision}
    _steps(model_q, opt_q, range(2, 3))  # and trains
    quantized_state = opt_q.state_dict()
    with pytest.warns(UserWarning, match=f"'{precision}' -> 'param'"):
        opt_f.load_state_dict(quantized_state)
    for pq, pf in zip(model_q.parameters(), model_f.parameters()):
        for key, value in _dequantized_state(opt_q, pq).items():
            assert opt_f.state[pf][key].dtype == torch.float32
            assert torch.equal(opt_f.state[pf][key], value), key
    assert "momentum_scale" not in str(opt_f.state_dict()["state"].keys())
    assert "momentum_absmax" not in str(opt_f.state_dict()["state"].keys())


# the compat model's bare 3-D "experts" keep 0.5.0's flatten view, and so its warning
@pytest.mark.filterwarnings("ignore::muonscale.optimizer_groups.UnknownLayoutWarning")
def test_a_saved_0_5_0_checkpoint_loads_into_int8_state_and_trains():
    record = torch.load(COMPAT / "muon.pt", weights_only=False)
    model = Tiny(seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(record["params"][n])
    opt = muonscale.Muon(model, **BASE, state_precision="int8")
    with pytest.warns(UserWarning, match="converted"):
        opt.load_state_dict(record["state_dict"])
    for i, s in opt.state_dict()["state"].items():
        if "momentum_buffer" in s:
            assert s["momentum_buffer"].dtype == torch.int8 and "momentum_scale" in s, i
        else:
            assert s["exp_avg"].dtype == torch.uint8 and "exp_avg_absmax" in s, i
    train(model, opt, range(SAVE_AT, SAVE_AT + 2))
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("precision", QUANTIZED)
def test_orthogonalize_in_backward_with_quantized_state_equals_the_step(precision):
    torch.manual_seed(0)
    model_a = _Net()
    model_b = copy.deepcopy(model_a)
    kw = dict(lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32, state_precision=precision)
    opt_a = muonscale.Muon(model_a, **kw)
    opt_b = muonscale.Muon(model_b, orthogonalize_in_backward=True, **kw)
    x = torch.randint(30, (4, 5), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, opt in ((model_a, opt_a), (model_b, opt_b)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
        for key, value in opt_a.state[pa].items():
            assert torch.equal(value, opt_b.state[pb][key]), key


class _Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 48)
        self.up = nn.Linear(48, 96, bias=False)
        self.down = nn.Linear(96, 48, bias=False)
        self.head = nn.Linear(48, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.down(torch.relu(self.up(h))))


@pytest.mark.parametrize("quantized", QUANTIZED)
def test_quantized_state_trains_a_tiny_model_as_full_precision_state(quantized):
    """A regression task: after 30 steps the quantized run's loss is within 2 % of the way the
    full-precision run came down from the start (two seeds). A smoke test of the step, not a
    measure of quality."""
    for seed in range(2):
        losses = {}
        for precision in ("param", quantized):
            torch.manual_seed(seed)
            model, target = _Small(), _Small()
            opt = muonscale.Muon(
                model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32, state_precision=precision
            )
            x = torch.randint(16, (32, 4), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                y = target(x)
            curve = []
            for _ in range(30):
                opt.zero_grad()
                loss = (model(x) - y).square().mean()
                loss.backward()
                opt.step()
                curve.append(loss.item())
            with torch.no_grad():
                losses[precision] = (curve[0], (model(x) - y).square().mean().item())
        (start, full), (_, low) = losses["param"], losses[quantized]
        assert full < 0.5 * start, losses
        assert abs(low - full) <= 0.02 * (start - full), (seed, losses)


def test_a_layout_not_tested_with_quantized_state_refuses_it():
    class Layout(muonscale.Muon):
        pass

    with pytest.raises(ValueError, match="Layout does not support state_precision='int8'"):
        Layout(_Small(), lr=0.02, adamw_lr=3e-3, state_precision="int8")
    groups = [{"params": list(_Small().parameters()), "state_precision": "int8"}]
    with pytest.raises(ValueError, match="Layout does not support state_precision='int8'"):
        Layout(groups, lr=0.02, adamw_lr=3e-3)  # a param group's own precision as well


@pytest.mark.parametrize("precision", QUANTIZED)
def test_quantized_state_in_small_chunks_equals_one_chunk(precision):
    """Chunks of a few KiB (the Muon update a parameter at a time, AdamW's moments a few rows
    at a time, the step counter advanced once) give the bits of one chunk."""
    from muonscale.memory import UNCHUNKED, MemoryBudget

    runs = []
    for budget in (UNCHUNKED, 4096):
        torch.manual_seed(0)
        model = _Net()
        opt = muonscale.Muon(model, lr=0.02, adamw_lr=3e-3, state_precision=precision)
        opt.memory = MemoryBudget(update_chunk_bytes=budget)
        _steps(model, opt, range(2))
        runs.append((model, opt))
    (model_a, opt_a), (model_b, opt_b) = runs
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
        for key, value in opt_a.state[pa].items():
            assert torch.equal(value, opt_b.state[pb][key]), key
    assert all(float(s["step"]) == 2 for s in opt_b.state.values() if "step" in s)


def test_int8_state_default_bounds_are_a_quarter_of_floating_state(monkeypatch):
    """With 8-bit state, the update chunk and Newton–Schulz workspace bounds left at their
    defaults are divided by 4 (1 stored byte per entry instead of 4); bounds set otherwise
    are kept. The step passes them to the update."""
    from muonscale import functional
    from muonscale.memory import DEFAULT_NS_WORKSPACE_BYTES, MemoryBudget, chunk_bytes_for
    from muonscale.quantized_state import quantized_state_budget

    cpu = torch.device("cpu")
    quarter = quantized_state_budget(MemoryBudget(), cpu)
    assert quarter.update_chunk_bytes == chunk_bytes_for("per_device", cpu) // 4
    assert quarter.ns_workspace_bytes == DEFAULT_NS_WORKSPACE_BYTES // 4
    chosen = MemoryBudget(update_chunk_bytes=4096, ns_workspace_bytes=2**20)
    assert quantized_state_budget(chosen, cpu) == chosen
    seen = []
    real = functional.muon

    def spy(*args, **kwargs):
        seen.append((kwargs["max_chunk_bytes"], kwargs["max_workspace_bytes"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(functional, "muon", spy)
    for precision in ("param", "int8"):
        model = _Net()
        opt = muonscale.Muon(model, lr=0.02, adamw_lr=3e-3, state_precision=precision)
        opt.memory = MemoryBudget()
        _steps(model, opt, range(1))
    assert seen == [
        ("per_device", DEFAULT_NS_WORKSPACE_BYTES),
        (quarter.update_chunk_bytes, quarter.ns_workspace_bytes),
    ]


def test_int8_adamw_takes_strided_and_bfloat16_parameters():
    """A transposed (non-contiguous) AdamW parameter steps as its contiguous copy, bitwise; a
    bfloat16 parameter steps as a float32 one with the same values and gradients, its result
    rounded to bfloat16 once per step."""
    g = torch.Generator().manual_seed(3)
    strided = nn.Parameter(torch.randn(30, 20, generator=g).t())
    dense = nn.Parameter(strided.detach().contiguous())
    low = nn.Parameter(strided.detach().to(torch.bfloat16))
    wide = nn.Parameter(low.detach().float())
    for p in (strided, dense, low, wide):
        opt = muonscale.Muon(
            [{"params": [p], "algorithm": "adamw", "weight_decay": 0.1}],
            lr=0.02,
            adamw_lr=1e-2,
            state_precision="int8",
        )
        for step in range(2):
            grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step))
            p.grad = grad.to(torch.bfloat16).to(p.dtype)  # the same values for low and wide
            opt.step()
    assert not strided.is_contiguous() and torch.equal(strided, dense)
    assert low.dtype == torch.bfloat16
    # each step rounds once (half a bfloat16 ulp: 2⁻⁸ relative) a value within 2 lr of the end
    bound = 2**-7 * (wide.detach().abs() + 2 * 1e-2)
    assert ((low.float() - wide.detach()).abs() <= bound).all()


def test_state_dict_in_precision_is_the_named_conversion():
    """``state_dict_in_precision`` writes the other precision's checkpoint without touching the
    optimizer; it loads without a conversion warning, as the loaded-and-converted state."""
    model_q, opt_q, model_f, opt_f = _pair()
    _steps(model_q, opt_q, range(2))
    _steps(model_f, opt_f, range(2))
    before = copy.deepcopy(opt_q.state_dict())
    as_float = opt_q.state_dict_in_precision("param")
    assert all("state_precision" not in g for g in as_float["param_groups"])
    after = opt_q.state_dict()
    for i, entry in before["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, after["state"][i][key]), key
    target = muonscale.Muon(copy.deepcopy(model_q), lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(as_float)
    targets = [p for g in target.param_groups for p in g["params"]]
    sources = [p for g in opt_q.param_groups for p in g["params"]]
    for pq, pt in zip(sources, targets):
        for key, value in _dequantized_state(opt_q, pq).items():
            assert torch.equal(target.state[pt][key], value), key
    as_int8 = opt_f.state_dict_in_precision("int8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt_q.load_state_dict(as_int8)
    converted = copy.deepcopy(opt_q.state_dict())
    with pytest.warns(UserWarning, match="'param' -> 'int8'"):
        opt_q.load_state_dict(opt_f.state_dict())
    for i, entry in converted["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, opt_q.state_dict()["state"][i][key]), key
    with pytest.raises(ValueError, match="state_precision must be one of"):
        opt_f.state_dict_in_precision("int2")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("precision", QUANTIZED)
def test_quantized_state_through_distributed_checkpoint_resumes_bitwise(tmp_path, precision):
    """torch.distributed.checkpoint (one process): codes and scales (int4: packed) saved and
    loaded into a fresh optimizer's state dict, then the same steps as the uninterrupted run,
    bitwise."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build():
        torch.manual_seed(0)
        model = _Net()
        return model, muonscale.Muon(
            model, lr=0.02, adamw_lr=3e-3, ns_dtype=torch.float32, state_precision=precision
        )

    model_a, opt_a = build()
    _steps(model_a, opt_a, range(2))
    model_sd, optim_sd = get_state_dict(model_a, opt_a)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))
    model_b, opt_b = build()
    with torch.no_grad():  # nothing of the run survives but what the checkpoint holds
        for p in model_b.parameters():
            p.zero_()
    opt_b.init_all_state()
    model_sd, optim_sd = get_state_dict(model_b, opt_b)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    set_state_dict(
        model_b, opt_b, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    _steps(model_a, opt_a, range(2, 4))
    _steps(model_b, opt_b, range(2, 4))
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)
        for key, value in opt_a.state[pa].items():
            assert value.dtype == opt_b.state[pb][key].dtype, key
            assert torch.equal(value, opt_b.state[pb][key]), key
