"""Across Megatron layouts: pipeline × tensor × data parallel, bf16 parameters with fp32 main
copies, global gradient clipping, non-finite gradients on one rank, checkpoints (resume, and
load at another data-parallel size). Oracle for every layout: the same model and gradients at
TP = PP = 1 (see layout_workers)."""

from __future__ import annotations

import math
import zlib

import layout_workers as L
import pytest
import torch

from muonscale import NonFiniteGradientError

STEPS = 3
BASE = dict(
    lr=0.02,
    weight_decay=0.1,
    muon_momentum=0.9,
    scale="unit_rms",
    adam_lr=0.01,
    grads_reduced=True,
)
"""Gradients arrive reduced (in ``main_grad``, as Megatron's DDP + finalize_model_grads leave
them), which is what pipeline parallelism needs."""
CLIP = 40.0
"""Below the gradient norm (≈ 330 for N(0, 1) gradients on the tiny GPT): every step clips."""


def _run(pool, fn=L.run_layout, **spec):
    spec.setdefault("steps", STEPS)
    spec.setdefault("grads_in", "main_grad")
    return pool.run(fn, spec, timeout=600)[0]


def expected_norm(params: dict, step: int) -> float:
    """‖g‖ of the injected full gradients at ``step`` (one tensor per canonical name)."""
    total = 0.0
    for name, value in params.items():
        g = torch.Generator().manual_seed(zlib.crc32(name.encode()) * 7919 + 1 + step)
        total += float(torch.randn(value.shape, generator=g).double().pow(2).sum())
    return math.sqrt(total)


@pytest.fixture(scope="module")
def reference(pool4):
    """TP 1 × PP 1 (× DP 4 replicas), tied embeddings, clipped."""
    return _run(pool4, tp=1, pp=1, tied=True, options=dict(BASE, clip_grad=CLIP))


def test_reference_norm_is_the_norm_of_the_full_gradient(reference):
    for step, norm in enumerate(reference["norms"]):
        assert norm == pytest.approx(expected_norm(reference["params"], step), rel=1e-6)
    assert min(reference["norms"]) > 2 * CLIP  # so clipping acts on every step


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (2, 1)])
def test_pipeline_and_tensor_parallel_match_one_rank(pool4, reference, tp, pp):
    """Same parameters and the same global (clipped) gradient norm at every layout: the norm
    counts TP shards once each, TP duplicates and DP replicas once, and the tied embedding's
    pipeline copy not at all."""
    run = _run(pool4, tp=tp, pp=pp, tied=True, options=dict(BASE, clip_grad=CLIP))
    delta = L.max_abs_diff(reference["params"], run["params"])
    print(
        f"\nTP{tp} x PP{pp} vs TP1 x PP1, clip {CLIP}: max|dW| = {delta:.3g}; norms {run['norms']}"
    )
    assert run["norms"] == pytest.approx(reference["norms"], rel=1e-6)
    assert delta <= 1e-6
    if pp == 2:
        assert "output_layer" not in run["summary"] or "shared" not in run["summary"]


def test_zero1_clipping_matches_one_rank(pool4, reference):
    """ZeRO-1 (TP 2 × DP 2, gradients reduce-scattered by the optimizer): the global norm sums
    the reduced shards over DP and TP ranks, counting TP duplicates once."""
    options = dict(BASE, grads_reduced=None, dp_mode="zero1", clip_grad=CLIP)
    run = _run(pool4, tp=2, pp=1, tied=True, grads_in="grad", options=options)
    assert run["dp_mode"] == "zero1"
    delta = L.max_abs_diff(reference["params"], run["params"])
    print(f"\nTP2 x DP2 zero1 vs TP1, clip {CLIP}: max|dW| = {delta:.3g}; norms {run['norms']}")
    assert run["norms"] == pytest.approx(reference["norms"], rel=1e-6)
    assert delta <= 1e-6


def test_clipping_acts(pool4, reference):
    """Without clipping the same run ends elsewhere (measured 1.9e-4: Muon's update does not
    depend on the gradient's scale and AdamW's hardly, so clipping moves parameters only through
    momentum and ε; the norms compared above are the sharp part of the oracle)."""
    unclipped = _run(pool4, tp=2, pp=2, tied=True, options=BASE)
    assert unclipped["norms"] == pytest.approx(reference["norms"], rel=1e-6)
    assert L.max_abs_diff(reference["params"], unclipped["params"]) > 1e-5


@pytest.fixture(scope="module")
def fp32_from_bf16(pool2):
    """fp32 model starting from the bf16-rounded weights: what exact fp32 main copies track."""
    return _run(pool2, tp=1, round_to_bf16=True, options=BASE)


def test_bf16_parameters_with_fp32_main_copies_track_fp32(pool2, fp32_from_bf16):
    # main_grad buffers present at construction (as under Megatron's DDP): detected as reduced
    unset = {k: v for k, v in BASE.items() if k != "grads_reduced"}
    run = _run(pool2, tp=2, dtype="bf16", ddp_like=True, options=unset)
    assert run["dp_mode"] == "replicated" and run["grads_reduced"] is True
    assert run["mains"] is not None
    delta = L.max_abs_diff(fp32_from_bf16["params"], run["mains"])
    in_place = _run(pool2, tp=2, dtype="bf16", options=dict(BASE, main_params_dtype=None))
    assert in_place["mains"] is None
    drift = L.max_abs_diff(fp32_from_bf16["params"], in_place["params"])
    print(f"\nbf16 TP2: fp32 main copies vs fp32 run {delta:.3g}; bf16 in place {drift:.3g}")
    assert delta <= 1e-6
    for name, main in run["mains"].items():  # the model holds its main copy, rounded
        assert torch.equal(run["params"][name], main.bfloat16().float()), name
    assert drift > 10 * max(delta, 1e-7)


def test_zero1_bf16_main_copies_track_fp32(pool4, pool2):
    """bf16 model under ZeRO-1 at TP 2 × DP 2: each DP rank keeps fp32 main copies of what it
    updates; gathered, they equal an fp32 run from the rounded weights given the same (bf16)
    gradients, and the model holds them rounded."""
    fp32 = _run(pool2, tp=1, round_to_bf16=True, bf16_grads=True, options=BASE)
    options = dict(BASE, grads_reduced=None, dp_mode="zero1")
    run = _run(pool4, tp=2, dtype="bf16", grads_in="grad", bf16_grads=True, options=options)
    assert run["dp_mode"] == "zero1" and run["mains"] is not None
    delta = L.max_abs_diff(fp32["params"], run["mains"])
    print(f"\nbf16 TP2xDP2 zero1: fp32 main copies vs fp32 run {delta:.3g}")
    assert delta <= 1e-6
    assert run["mains"].keys() == run["params"].keys()
    for name, main in run["mains"].items():
        assert torch.equal(run["params"][name], main.bfloat16().float()), name


@pytest.mark.parametrize("variant", [{}, dict(normalize="row")], ids=["muon", "normuon"])
def test_resume_with_main_copies_is_bit_identical(pool2, tmp_path, variant):
    """NorMuon: each TP rank saves its own rows of the replicated row moment; loading gathers
    them back into the whole replica, exactly."""
    options = dict(BASE, **variant)
    spec = dict(tp=2, dtype="bf16", steps=4, save_at=2, folder=str(tmp_path), options=options)
    uninterrupted = _run(pool2, L.run_and_save, **spec)
    resumed = _run(pool2, L.load_and_resume, **spec)
    assert L.max_abs_diff(uninterrupted["params"], resumed["params"]) == 0.0
    assert L.max_abs_diff(uninterrupted["mains"], resumed["mains"]) == 0.0
    assert uninterrupted["norms"][2:] == resumed["norms"]


@pytest.mark.parametrize("variant", [{}, dict(normalize="row")], ids=["muon", "normuon"])
def test_zero1_checkpoint_loads_at_another_data_parallel_size(pool4, pool2, tmp_path, variant):
    """Saved at TP 2 × DP 2 (ZeRO-1: the optimizer's state_dict is its full state over DP),
    loaded at TP 2 × DP 1: the run goes on as if uninterrupted."""
    options = dict(BASE, grads_reduced=None, dp_mode="zero1", **variant)
    spec = dict(tp=2, steps=4, save_at=2, folder=str(tmp_path), grads_in="grad", options=options)
    uninterrupted = _run(pool4, L.run_and_save, **spec)
    assert uninterrupted["dp_mode"] == "zero1"
    resumed = _run(pool2, L.load_and_resume, **dict(spec, options=dict(options, dp_mode="auto")))
    delta = L.max_abs_diff(uninterrupted["params"], resumed["params"])
    print(f"\nTP2xDP2 zero1 saved, TP2xDP1 ({resumed['dp_mode']}) resumed: max|dW| = {delta:.3g}")
    assert delta <= 1e-6


@pytest.mark.parametrize("dp_mode", ["replicated", "zero1"])
def test_nan_on_one_tensor_parallel_rank_skips_on_every_rank(pool2, dp_mode):
    """A NaN in rank 1's shard only: both ranks skip that step (no rank enters the TP
    exchange alone), and the run equals one without that step's update."""
    options = dict(BASE, nonfinite="skip", dp_mode=dp_mode, grads_reduced=dp_mode == "replicated")
    grads_in = "main_grad" if dp_mode == "replicated" else "grad"
    spec = dict(tp=2, steps=2, grads_in=grads_in, options=options, all_ranks=True)
    runs = pool2.run(L.run_layout, dict(spec, nan_at=(1, 1)), timeout=600)
    assert [r["skipped"] for r in runs] == [1, 1]
    one_step = _run(pool2, **dict(spec, steps=1))
    assert L.max_abs_diff(one_step["params"], runs[0]["params"]) == 0.0


def test_nan_on_one_rank_raises_on_every_rank(pool2):
    spec = dict(tp=2, steps=1, nan_at=(0, 1), options=BASE)
    outcomes = pool2.run(L.run_layout, spec, timeout=600, return_exceptions=True)
    assert [o.type_name for o in outcomes] == ["NonFiniteGradientError"] * 2, outcomes
    assert "another rank" in outcomes[0].message  # rank 0's gradients were finite
    assert NonFiniteGradientError.__name__ == "NonFiniteGradientError"


def test_bad_options_name_the_field():
    from muonscale.integrations.megatron import MegatronMuonConfig

    with pytest.raises(ValueError, match="clip_grad"):
        MegatronMuonConfig(clip_grad=-1.0)
