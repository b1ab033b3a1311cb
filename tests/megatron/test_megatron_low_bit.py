"""Quantized state (``state_precision="int8"``, and the 4-bit momentum) through the Megatron
adapter on 2 gloo ranks, with identical gradients injected on every rank.

Blocks are segments of a row, so a rank that holds whole rows quantizes as one process does:
at TP 1 the state equals single-process :class:`muonscale.Muon`'s bitwise, and at TP 2 the
column-parallel weights' state too (the state depends on the gradients only). A piece that
holds columns of its rows (row-parallel weights, TP-sharded biases) shares the scales of the
blocks it cuts over the TP group: at TP 2 every parameter's gathered codes and scales equal
one process's, and the all-reduce carries the bytes its shapes say. The weights are not
bitwise one process's even with floating state (the adapter batches Newton–Schulz otherwise;
under TP the exchange too), so each quantized step is checked bitwise against the adapter's
floating step taken from the same weights and the dequantized state
(``state_dict_in_precision("param")``), and the weights against one process's within the
float32 bound of the variant tests. ZeRO-1 equals the replicated run bitwise (fp32 and bf16
models with main copies; at TP 2 the column pieces too: the owners of a row-parallel weight and
a bias's flat shards share the cut blocks' maxima); checkpoints resume bitwise (ZeRO-1 and
replicated load each other's), and a column piece converts between precisions at load as one
process does. ZeRO-1 refuses by name only AdamW state of a piece of several rows whose blocks
the TP shard cuts; ``float_state_params`` keeps named parameters floating."""

from __future__ import annotations

import copy

import megatron_workers as W
import pytest
import torch
import variant_workers as V
from test_megatron_variants import tolerance, worst_relative

STEPS = 3
WIDE_FFN = dict(W.TINY, ffn_hidden_size=200)
"""``linear_fc2`` (64, 200) at TP 2: rank 1's columns [100, 200) touch two 128-entry blocks
(int4) where its own 100 columns make one, so its scales have another shape than the
piece's own blocks would give."""
ROW_PARALLEL = ("*.linear_proj.weight", "*.linear_fc2.weight")
CUT_BIASES = ("*.linear_qkv.bias", "*.linear_fc1.bias")
"""Column-parallel biases: TP 2 cuts their one row of AdamW blocks."""


def _options(**extra) -> dict:
    return dict(
        lr=V.COMMON["lr"],
        weight_decay=V.COMMON["weight_decay"],
        muon_momentum=V.COMMON["momentum"],
        scale=V.COMMON["scale"],
        adam_lr=V.COMMON["adam_lr"],
        ns_dtype=torch.float32,
        **extra,
    )


def _megatron(model, **extra):
    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    return megatron_muon([model], MegatronMuonConfig().replaced(**_options(**extra)))


def _named_state(opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every parameter's state by name, TP pieces gathered into the whole (canonical order;
    a column piece's scales placed among its blocks); ZeRO-1: of the full state of its
    ``state_dict()`` (collective)."""
    if opt.dp_mode == "zero1":
        saved = _saved_by_name(opt.state_dict())
        return {pl.name: W.whole_state(opt, pl, saved.get(pl.name, {})) for pl in opt.plans}
    return {plan.name: W.whole_state(opt, plan) for plan in opt.plans}


def _reference(precision: str, floating: tuple[str, ...] = (), shape: dict = W.TINY) -> dict:
    """Single-process Muon on the TP 1 model with ``state_precision=precision`` (AdamW
    floating under ``floating`` names)."""
    from megatron.core import parallel_state as ps

    W.setup_parallel(1)
    model = W.build_gpt(shape, seed=0)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = V._reference_muon(model, {"state_precision": precision})
    for group in opt.param_groups:  # before any state exists
        if group["param_names"] and all(n in floating for n in group["param_names"]):
            group["state_precision"] = "param"
    names = {id(p): n for g in opt.param_groups for n, p in zip(g["param_names"], g["params"])}
    for step in range(STEPS):
        W.inject_gradients(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = {
        names[id(p)]: {k: v.clone() for k, v in s.items() if v.dim() > 0}
        for p, s in opt.state.items()
    }
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    ps.destroy_model_parallel()
    return dict(params=params, state=state, init=init)


def _adamw_names() -> tuple[str, ...]:
    from megatron.core import parallel_state as ps

    from muonscale.integrations.megatron.plan import MegatronGroups, plan_parameters

    W.setup_parallel(1)
    model = W.build_gpt(W.TINY, seed=0)
    plans = plan_parameters([model], MegatronGroups.from_megatron(None), split_qkv=True)
    ps.destroy_model_parallel()
    return tuple(pl.name for pl in plans if pl.algorithm == "adamw")


def _model(seed: int, bf16: bool, shape: dict = W.TINY):
    model = W.build_gpt(shape, seed=seed)
    return model.bfloat16() if bf16 else model


def _inject(model, step: int) -> None:
    """:func:`megatron_workers.inject_gradients` into a model of any dtype: the float32
    gradients it draws, rounded to each parameter's dtype."""
    params = list(model.parameters())
    dtypes = [p.dtype for p in params]
    for p in params:
        p.data = p.data.float()
    W.inject_gradients(model, step)
    for p, dtype in zip(params, dtypes):
        p.data, p.grad = p.data.to(dtype), p.grad.to(dtype)


def _run(
    tp: int,
    steps: int = STEPS,
    resume_at: int | None = None,
    bf16: bool = False,
    resume_with: dict | None = None,
    shape: dict = W.TINY,
    **extra,
) -> dict:
    """The adapter at ``tp`` for ``steps`` steps; ``resume_at``: a new model and optimizer
    (``resume_with``: options that replace ``extra``'s) loaded from the state dict (and
    weights) after that many steps take the rest. ``bf16``: a bf16 model, the optimizer
    stepping fp32 main copies. ``shape``: the GPT's."""
    from megatron.core import parallel_state as ps

    W.setup_parallel(tp)
    model = _model(0, bf16, shape)
    opt = _megatron(model, **extra)
    for step in range(steps):
        if step == resume_at:
            saved = opt.state_dict()
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
            del opt
            model = _model(1, bf16, shape)  # other weights: all come from the checkpoint
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(weights[n])
            opt = _megatron(model, **{**extra, **(resume_with or {})})
            opt.load_state_dict(saved)
        _inject(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
    named = dict(model.named_parameters())
    out = dict(
        params={n: W.gather_full(p) for n, p in named.items()},
        state=_named_state(opt),
        dp_mode=opt.dp_mode,
        wire=dict(opt.last_step_wire_breakdown),
        sharded={  # TP-sharded parameters: (algorithm, whole shape, partition_dim, stride)
            pl.name: (pl.algorithm, W.full_shape(named[pl.name]), pl.partition_dim, stride)
            for pl in opt.plans
            if pl.partition_dim is not None
            for stride in [int(getattr(named[pl.name], "partition_stride", 1))]
        },
    )
    if opt.dp_mode == "replicated":  # the main copies (ZeRO-1 holds them in its state)
        out["main"] = {pl.name: W.gather_full(named[pl.name], pl.param) for pl in opt.plans}
    ps.destroy_model_parallel()
    return out


def _quantized_steps_equal_float_steps(tp: int, precision: str) -> list[str]:
    """At ``tp``, the quantized optimizer and a floating one side by side: before each step the
    floating one takes the quantized one's weights and its state converted to floating values
    (``state_dict_in_precision("param")``: the dequantized state); after it the weights must
    match bitwise. Returns the names of the parameters that did not."""
    from megatron.core import parallel_state as ps

    W.setup_parallel(tp)
    model_q, model_f = W.build_gpt(W.TINY, seed=0), W.build_gpt(W.TINY, seed=0)
    opt_q = _megatron(model_q, state_precision=precision, dp_mode="replicated")
    opt_f = _megatron(model_f, dp_mode="replicated")
    plans_f = {pl.name: pl for pl in opt_f.plans}
    mismatched = set()
    for step in range(STEPS):
        with torch.no_grad():
            for plan_q in opt_q.plans:
                plans_f[plan_q.name].param.copy_(plan_q.param)
        # a copy: torch's load keeps the saved step counters themselves
        opt_f.load_state_dict(copy.deepcopy(opt_q.state_dict_in_precision("param")))
        for model in (model_q, model_f):
            W.inject_gradients(model, step)
        opt_q.step()
        opt_f.step()
        for plan_q in opt_q.plans:
            if not torch.equal(plan_q.param, plans_f[plan_q.name].param):
                mismatched.add(plan_q.name)
    ps.destroy_model_parallel()
    return sorted(mismatched)


def _saved_by_name(saved: dict) -> dict[str, dict[str, torch.Tensor]]:
    """A state dict's state (tensors of 1 dim or more) by parameter name."""
    out = {}
    for group in saved["param_groups"]:
        for name, index in zip(group["param_names"], group["params"]):
            state = saved["state"].get(index, {})
            out[name] = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim()}
    return out


def _conversion_references(shape: dict) -> dict:
    """Single-process Muon on ``shape`` after STEPS steps: its int4 state converted to floating
    and to int8 (``state_dict_in_precision``), and its floating state loaded into int4 state."""
    import warnings

    from megatron.core import parallel_state as ps

    W.setup_parallel(1)
    out = {}
    for precision in ("int4", "param"):
        model = W.build_gpt(shape, seed=0)
        opt = V._reference_muon(model, {"state_precision": precision})
        for step in range(STEPS):
            W.inject_gradients(model, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if precision == "int4":
            out["int4_as_param"] = _saved_by_name(opt.state_dict_in_precision("param"))
            out["int4_as_int8"] = _saved_by_name(opt.state_dict_in_precision("int8"))
        else:
            loaded = V._reference_muon(model, {"state_precision": "int4"})
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the conversion's warning
                loaded.load_state_dict(copy.deepcopy(opt.state_dict()))
            out["param_into_int4"] = _saved_by_name(loaded.state_dict())
    ps.destroy_model_parallel()
    return out


def _conversions(tp: int, shape: dict, dp_mode: str = "replicated") -> dict:
    """The adapter at ``tp`` on ``shape`` in ``dp_mode`` after STEPS steps, its state
    converted as the references' (:func:`_conversion_references`): an int4 run's state dict
    loaded into a floating optimizer, its ``state_dict_in_precision("int8")`` into an int8
    one, and a floating run's state dict into an int4 one; each optimizer's gathered state."""
    import warnings

    from megatron.core import parallel_state as ps

    W.setup_parallel(tp)
    out, saved = {}, {}
    for precision in ("int4", "param"):
        model = W.build_gpt(shape, seed=0)
        opt = _megatron(model, state_precision=precision, dp_mode=dp_mode)
        for step in range(STEPS):
            W.inject_gradients(model, step)
            opt.step()
            opt.zero_grad(set_to_none=True)
        saved[precision] = copy.deepcopy(opt.state_dict())
        if precision == "int4":
            saved["int4_as_int8"] = copy.deepcopy(opt.state_dict_in_precision("int8"))
    for name, source, precision in (
        ("int4_as_param", "int4", "param"),
        ("int4_as_int8", "int4_as_int8", "int8"),
        ("param_into_int4", "param", "int4"),
    ):
        opt = _megatron(W.build_gpt(shape, seed=0), state_precision=precision, dp_mode=dp_mode)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the conversion's warning
            opt.load_state_dict(saved[source])
        out[name] = _named_state(opt)
    ps.destroy_model_parallel()
    return out


def run_zero1_tp2(rank: int, world_size: int) -> dict:
    """ZeRO-1 and the replicated optimizer at TP 2 (and the data-parallel size the pool
    leaves), every state quantized: int8, and int4 on ``WIDE_FFN`` (pieces whose touched
    blocks outnumber their own), and resumes from one mode into the other."""
    torch.set_num_threads(1)
    wide = dict(state_precision="int4", shape=WIDE_FFN)
    out = {}
    for precision, extra in (("int8", dict(state_precision="int8")), ("int4", wide)):
        for mode in ("zero1", "replicated"):
            out[f"{mode}_{precision}"] = _run(2, dp_mode=mode, **extra)
    out["zero1_to_replicated"] = _run(
        2, resume_at=2, resume_with=dict(dp_mode="replicated"), dp_mode="zero1", **wide
    )
    out["replicated_to_zero1"] = _run(
        2, resume_at=2, resume_with=dict(dp_mode="zero1"), dp_mode="replicated", **wide
    )
    out["zero1_resumed"] = _run(2, resume_at=2, dp_mode="zero1", **wide)
    return out


def check_zero1_tp2(per_rank: list[dict], refs: dict | None = None) -> None:
    """:func:`run_zero1_tp2`'s results (every rank's): ZeRO-1's weights and gathered state
    equal the replicated run's bitwise, the row-parallel weights' momenta and the TP-sharded
    biases' moments (whose blocks the TP shard cuts) included, and one process's (``refs``:
    its state by precision); resumes, across the modes and within ZeRO-1, equal the
    uninterrupted run."""
    runs = per_rank[0]
    for precision in ("int8", "int4"):
        zero1, replicated = runs[f"zero1_{precision}"], runs[f"replicated_{precision}"]
        assert zero1["dp_mode"] == "zero1" and replicated["dp_mode"] == "replicated"
        W.assert_same_state(zero1["params"], replicated["params"], f"{precision} params")
        W.assert_same_state(zero1["state"], replicated["state"], f"{precision} state")
        assert _quantized(zero1["state"]) == set(zero1["state"])
        assert _columns(zero1) >= {"linear_proj.weight", "linear_fc2.weight", "linear_fc1.bias"}
        if refs is not None:
            W.assert_same_state(zero1["state"], refs[precision]["state"], f"{precision} ref")
    whole = runs["replicated_int4"]
    for resumed in ("zero1_to_replicated", "replicated_to_zero1", "zero1_resumed"):
        W.assert_same_state(runs[resumed]["params"], whole["params"], f"{resumed} params")
        W.assert_same_state(runs[resumed]["state"], whole["state"], f"{resumed} state")


def _columns(run: dict) -> set[str]:
    """The last two parts of the names of a TP 2 run's pieces that hold columns of their
    rows."""
    return {
        ".".join(n.split(".")[-2:])
        for n, (_, shape, dim, _) in run["sharded"].items()
        if dim == 1 or len(shape) == 1
    }


def _shared_scales_bytes(run: dict, precision: str, tp: int = 2) -> int:
    """What one TP rank sends in a step's all-reduces (max) of the shared blocks' maxima
    (float32) over its TP group, with one data-parallel rank: the Muon rows × cut blocks of
    every row-parallel weight, the AdamW two moments × cut blocks of every TP-sharded bias."""
    block = 256 if precision == "int8" else 128
    muon = adamw = 0
    for algorithm, shape, dim, stride in run["sharded"].values():
        if algorithm == "muon" and dim == 1:
            muon += 4 * shape[0] * _cut_blocks(shape[1], tp * stride, block)
        elif algorithm == "adamw" and len(shape) == 1:
            adamw += 2 * 4 * _cut_blocks(shape[0], tp * stride, 256)
    assert muon and adamw
    return sum(2 * (tp - 1) * nbytes // tp for nbytes in (muon, adamw))


def run_low_bit(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    adamw = _adamw_names()
    out = dict(
        adamw=adamw,
        ref8=_reference("int8"),
        ref8_float_adamw=_reference("int8", adamw),
        ref4=_reference("int4"),
        tp1=_run(1, state_precision="int8", dp_mode="replicated"),
        tp1_int4=_run(1, state_precision="int4", dp_mode="replicated"),
        tp1_resumed=_run(1, resume_at=2, state_precision="int8", dp_mode="replicated"),
        zero1=_run(1, state_precision="int8", dp_mode="zero1", float_state_params=adamw),
        zero1_int4=_run(1, state_precision="int4", dp_mode="zero1", float_state_params=adamw),
        tp1_int4_float_adamw=_run(
            1, state_precision="int4", dp_mode="replicated", float_state_params=adamw
        ),
        bf16=_run(1, bf16=True, state_precision="int8", dp_mode="replicated"),
        bf16_resumed=_run(1, resume_at=2, bf16=True, state_precision="int8", dp_mode="replicated"),
        bf16_zero1=_run(
            1, bf16=True, state_precision="int8", dp_mode="zero1", float_state_params=adamw
        ),
        bf16_float_adamw=_run(
            1, bf16=True, state_precision="int8", dp_mode="replicated", float_state_params=adamw
        ),
        tp1_float_adamw=_run(
            1, state_precision="int8", dp_mode="replicated", float_state_params=adamw
        ),
        zero1_resumed=_run(
            1, resume_at=2, state_precision="int8", dp_mode="zero1", float_state_params=adamw
        ),
        tp2=_run(2, state_precision="int8", dp_mode="replicated"),
        tp2_int4=_run(2, state_precision="int4", dp_mode="replicated"),
        tp1_mismatched=_quantized_steps_equal_float_steps(1, "int8"),
        tp1_int4_mismatched=_quantized_steps_equal_float_steps(1, "int4"),
        tp2_resumed=_run(2, resume_at=2, state_precision="int8", dp_mode="replicated"),
        tp2_mismatched=_quantized_steps_equal_float_steps(2, "int8"),
        tp2_int4_mismatched=_quantized_steps_equal_float_steps(2, "int4"),
        tp2_float_columns=_run(
            2,
            state_precision="int8",
            dp_mode="replicated",
            float_state_params=ROW_PARALLEL + CUT_BIASES,
        ),
        zero1_tp2=run_zero1_tp2(rank, world_size),
        conversion_refs=_conversion_references(WIDE_FFN),
        conversions=_conversions(2, WIDE_FFN),
        conversions_zero1=_conversions(2, WIDE_FFN, "zero1"),
        wide_ref4=_reference("int4", shape=WIDE_FFN),
        wide_tp2_int4=_run(2, state_precision="int4", dp_mode="replicated", shape=WIDE_FFN),
        wide_tp2_int4_resumed=_run(
            2, resume_at=2, state_precision="int4", dp_mode="replicated", shape=WIDE_FFN
        ),
        zero1_int8_adamw=_run(1, state_precision="int8", dp_mode="zero1"),
        zero1_to_replicated=_run(
            1,
            resume_at=2,
            resume_with=dict(dp_mode="replicated"),
            state_precision="int8",
            dp_mode="zero1",
        ),
        replicated_to_zero1=_run(
            1,
            resume_at=2,
            resume_with=dict(dp_mode="zero1"),
            state_precision="int8",
            dp_mode="replicated",
        ),
    )
    return out


@pytest.fixture(scope="module")
def per_rank(pool2):
    return pool2.run(run_low_bit, timeout=600)


@pytest.fixture(scope="module")
def results(per_rank):
    return per_rank[0]


def _quantized(state: dict) -> set[str]:
    return {n for n, s in state.items() if set(s) & {*W.SCALE_BLOCKS}}


def _assert_weights_close(run: dict, ref: dict) -> None:
    """Within the bound of two float32 runs whose Newton–Schulz rounds otherwise (the
    adapter's orthogonalizer batches matrices as one process does not): floating state moves
    the weights by the same rounding, so it is no property of the quantized state (that the
    quantized step is the floating step from the dequantized state is checked bitwise)."""
    worst, where = worst_relative(ref, run)
    assert worst <= tolerance({}), where


def test_tp1_replicated_int8_equals_single_process(results):
    """TP 1 on 2 data-parallel replicas: the state (int8 momentum, 8-bit AdamW moments) equals
    one process's bitwise, and each step is the adapter's floating step from it."""
    run, ref = results["tp1"], results["ref8"]
    assert run["dp_mode"] == "replicated"
    W.assert_same_state(run["state"], ref["state"], "state")
    assert _quantized(run["state"]) == set(run["state"])  # every state quantized, AdamW's too
    assert results["tp1_mismatched"] == []
    _assert_weights_close(run, ref)


def test_tp1_replicated_int4_momentum_equals_single_process(results):
    run, ref = results["tp1_int4"], results["ref4"]
    W.assert_same_state(run["state"], ref["state"], "state")
    assert any("momentum_absmax" in s for s in run["state"].values())
    assert results["tp1_int4_mismatched"] == []
    _assert_weights_close(run, ref)


def test_zero1_muon_int8_equals_replicated_bitwise(results):
    """ZeRO-1 owners hold whole matrices: weights and full state equal the replicated run's
    (same float_state_params: AdamW floating) bitwise, and the state one process's."""
    run, replicated = results["zero1"], results["tp1_float_adamw"]
    ref = results["ref8_float_adamw"]
    assert run["dp_mode"] == "zero1"
    W.assert_same_state(run["params"], replicated["params"], "params")
    W.assert_same_state(run["state"], replicated["state"], "state")
    quantized = _quantized(run["state"])
    assert quantized and not quantized & set(results["adamw"])
    assert quantized == _quantized(ref["state"])
    for name in quantized:
        W.assert_same_state(run["state"][name], ref["state"][name], name)
    _assert_weights_close(run, ref)


def test_zero1_int8_adamw_equals_replicated_bitwise(results):
    """AdamW's 8-bit moments in ZeRO-1's flat shards (blocks cut by the shard boundaries share
    their scale over the ranks): weights and full state equal the replicated run's bitwise."""
    run, replicated = results["zero1_int8_adamw"], results["tp1"]
    assert run["dp_mode"] == "zero1"
    W.assert_same_state(run["params"], replicated["params"], "params")
    W.assert_same_state(run["state"], replicated["state"], "state")
    assert _quantized(run["state"]) == set(run["state"])  # AdamW's state quantized too


def test_zero1_bf16_main_copies_int8_equals_replicated_bitwise(results):
    """bf16 models: the int8 momentum of the fp32 main copies, at their ZeRO-1 owners."""
    run, replicated = results["bf16_zero1"], results["bf16_float_adamw"]
    assert all(p.dtype == torch.bfloat16 for p in run["params"].values())
    W.assert_same_state(run["params"], replicated["params"], "params")
    state = {n: dict(s) for n, s in run["state"].items()}
    main = {n: s.pop("main_param") for n, s in state.items()}
    W.assert_same_state(main, replicated["main"], "main copies")
    assert all(m.dtype == torch.float32 for m in main.values())
    W.assert_same_state(state, replicated["state"], "state")
    assert _quantized(run["state"]) == _quantized(results["zero1"]["state"])
    assert _quantized(results["bf16"]["state"]) == set(results["bf16"]["state"])


def test_zero1_muon_int4_equals_replicated_bitwise(results):
    run, replicated = results["zero1_int4"], results["tp1_int4_float_adamw"]
    W.assert_same_state(run["params"], replicated["params"], "params")
    W.assert_same_state(run["state"], replicated["state"], "state")
    assert any("momentum_absmax" in s for s in run["state"].values())


@pytest.mark.parametrize("layout", ["tp1", "zero1", "tp2", "bf16"])
def test_state_dict_resumes_bitwise(results, layout):
    """At the same layout (``bf16``: fp32 main copies, saved in the state dict)."""
    resumed, whole = results[f"{layout}_resumed"], results[layout]
    W.assert_same_state(resumed["params"], whole["params"], "params")
    W.assert_same_state(resumed["state"], whole["state"], "state")


@pytest.mark.parametrize("resumed", ["zero1_to_replicated", "replicated_to_zero1"])
def test_int8_state_resumes_across_data_parallel_modes(results, resumed):
    """At TP 1 (DP 2), ZeRO-1's full state dict (8-bit AdamW shards gathered with their
    shared scales) loads into the replicated optimizer, and the replicated one's into ZeRO-1:
    bitwise the uninterrupted run, weights and state."""
    run, whole = results[resumed], results["tp1"]
    assert run["dp_mode"] == resumed.rsplit("_", 1)[-1]
    W.assert_same_state(run["params"], whole["params"], "params")
    W.assert_same_state(run["state"], whole["state"], "state")


def test_tp2_column_parallel_state_equals_single_process(results):
    """The state depends on the gradients only: the gathered codes and scales of the
    column-parallel weights (and the AdamW state of whole-row shards) are one process's, with
    the parameters that hold columns of their rows kept floating by ``float_state_params``."""
    run, ref = results["tp2_float_columns"], results["ref8"]
    quantized = _quantized(run["state"])
    assert any(n.endswith("linear_qkv.weight") for n in quantized)
    assert any(n.endswith("word_embeddings.weight") for n in quantized)
    floating = ("linear_proj.weight", "linear_fc2.weight", "linear_qkv.bias", "linear_fc1.bias")
    assert not any(n.endswith(floating) for n in quantized)
    for name in quantized:
        W.assert_same_state(run["state"][name], ref["state"][name], name)


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_tp2_every_state_equals_single_process(results, precision):
    """Row-parallel weights and TP-sharded biases (``partition_stride`` 2: ``linear_fc1``'s)
    hold columns of their rows and share the scales of the blocks they cut over the TP group:
    every parameter's gathered codes and scales equal one process's bitwise."""
    run = results["tp2" if precision == "int8" else "tp2_int4"]
    ref = results["ref8" if precision == "int8" else "ref4"]
    assert _quantized(run["state"]) == set(run["state"])
    columns = [n for n, (_, shape, dim, _) in run["sharded"].items() if dim == 1 or len(shape) == 1]
    assert any(n.endswith("linear_proj.weight") for n in columns)
    assert any(n.endswith("linear_fc1.bias") for n in columns)
    W.assert_same_state(run["state"], ref["state"], "state")
    _assert_weights_close(run, ref)


def test_tp2_column_scales_of_their_own_shape_step_and_resume(results):
    """A piece whose touched blocks outnumber its own columns' blocks (``WIDE_FFN``): its
    scales take the touched blocks' shape, the state equals one process's bitwise, and a
    resume at the same layout (loaded through scales of that shape) is bitwise the
    uninterrupted run."""
    run, ref = results["wide_tp2_int4"], results["wide_ref4"]
    W.assert_same_state(run["state"], ref["state"], "state")
    resumed = results["wide_tp2_int4_resumed"]
    W.assert_same_state(resumed["params"], run["params"], "params")
    W.assert_same_state(resumed["state"], run["state"], "state")


def _cut_blocks(cols: int, pieces: int, block: int) -> int:
    """Blocks of a row of ``cols`` that a split into ``pieces`` equal chunks cuts (a chunk
    boundary inside the block)."""
    chunk = cols // pieces
    return len({q // block for q in range(chunk, cols, chunk) if q % block})


def test_tp2_shared_scales_bytes_from_shapes(results):
    """One all-reduce (max) per param group over the TP group, of the shared blocks' maxima
    (float32): the Muon group's rows × cut blocks of every row-parallel weight, the AdamW
    group's two moments × cut blocks of every TP-sharded bias; ZeRO-1 at DP 1 the same (its
    AdamW maxima in one all-reduce over data parallel, none at DP 1, then over TP)."""
    for precision in ("int8", "int4"):
        run = results["tp2" if precision == "int8" else "tp2_int4"]
        want = _shared_scales_bytes(run, precision)
        assert run["wire"]["tp_block_scales/all_reduce"] == want, (precision, run["wire"])
        zero1 = results["zero1_tp2"][f"zero1_{precision}"]
        want = _shared_scales_bytes(zero1, precision)
        assert zero1["wire"]["tp_block_scales/all_reduce"] == want, (precision, zero1["wire"])
    assert "tp_block_scales/all_reduce" not in results["tp2_float_columns"]["wire"]


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_tp2_quantized_step_equals_float_step_from_dequantized_state(results, precision):
    assert results["tp2_mismatched" if precision == "int8" else "tp2_int4_mismatched"] == []


def test_zero1_tp2_equals_replicated_bitwise(per_rank, results):
    """ZeRO-1 at TP 2 (DP 1; DP 2 in ``test_megatron_dp``): the owners of a row-parallel
    weight share its cut blocks' scales over the TP group as the replicated optimizer does,
    and a TP-sharded bias's flat data-parallel segments share the maxima of the whole bias's
    blocks over data parallel, then over TP."""
    refs = {"int8": results["ref8"], "int4": results["wide_ref4"]}
    check_zero1_tp2([r["zero1_tp2"] for r in per_rank], refs)


def test_zero1_refuses_multi_row_tp_cut_adamw_state_by_name():
    """What ZeRO-1 still refuses: AdamW state of a piece of several rows whose blocks the TP
    shard cuts (a 2-D parameter routed to AdamW, ``partition_dim=1``); a row-parallel Muon
    weight and a TP-sharded bias of the same cut are taken, and every piece under
    ``dp_mode="replicated"``."""
    from muonscale.integrations.megatron.low_bit import refuse_cut_rows
    from muonscale.integrations.megatron.plan import ParamPlan

    def plan(name, shape, algorithm, dim):
        return ParamPlan(name, torch.zeros(shape), algorithm, "", False, 2, dim)

    wide = plan("head.proj.weight", (4, 100), "adamw", 1)
    taken = [plan("mlp.fc2.weight", (4, 100), "muon", 1), plan("mlp.fc1.bias", (100,), "adamw", 0)]
    groups = [{"params": [(pl.name, pl.param) for pl in [wide, *taken]]}]
    refuse_cut_rows(taken, groups, "int8", zero1=True)
    refuse_cut_rows([wide, *taken], groups, "int8", zero1=False)
    with pytest.raises(ValueError) as error:
        refuse_cut_rows([wide, *taken], groups, "int8", zero1=True)
    message = str(error.value)
    assert "'head.proj.weight'" in message and "partition_dim=1" in message
    assert "float_state_params=('*.proj.weight',)" in message
    assert "dp_mode='replicated'" in message


@pytest.mark.parametrize("dp_mode", ["replicated", "zero1"])
@pytest.mark.parametrize("conversion", ["int4_as_param", "int4_as_int8", "param_into_int4"])
def test_tp2_column_state_converts_as_one_process(results, conversion, dp_mode):
    """Converting state between precisions at TP 2 (``WIDE_FFN``: pieces whose touched blocks
    outnumber their own): an int4 checkpoint loaded into floating state, an int4 run's
    ``state_dict_in_precision("int8")`` loaded into int8 state, a floating checkpoint loaded
    into int4 state (quantized under the shared maxima at load), replicated and ZeRO-1 (the
    full state of its ``state_dict()``): every parameter's gathered state equals one
    process's same conversion bitwise."""
    runs = results["conversions" if dp_mode == "replicated" else "conversions_zero1"]
    got, want = runs[conversion], results["conversion_refs"][conversion]
    assert any(n.endswith("linear_fc2.weight") for n in got)
    W.assert_same_state(got, want, conversion)
