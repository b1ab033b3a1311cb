"""The two Muon arms of ``benchmarks/megatron_gpu.py`` come from ONE Megatron ``OptimizerConfig``:
Megatron-Core's ``TensorParallelMuon`` (through ``get_megatron_optimizer``, its CUDA-only
wrappers unwrapped) and muonscale (through ``MegatronMuonConfig.from_megatron``) are built with
equal settings, and on identical gradients in float32 at TP 1 they make the same update.

Conventions that differ between the two and how they are matched (docs/megatron.md):
  scale mode names       Megatron "spectral" = muonscale "unit_rms" (from_megatron renames)
  coefficients           Megatron "quintic" → the same (a, b, c) list (megatron_coefficients)
  matmul precision       "highest" → ns_dtype float32
  TP mode                "duplicated" → "exact" (at TP 1 every mode is the same)
  gradient clipping      off (see CONFIG): Megatron's is in the CUDA-only wrapper
  position embeddings    Muon in Megatron (it checks is_embedding_or_output_parameter only),
                         AdamW in muonscale: compared on the matrices both give Muon
"""

from __future__ import annotations

import megatron_workers as W
import pytest
import torch

from muonscale.integrations.megatron import megatron_coefficients

STEPS = 3
CONFIG = dict(
    optimizer="muon",
    lr=0.02,
    weight_decay=0.1,
    muon_momentum=0.9,
    muon_nesterov=True,
    muon_coefficient_type="quintic",
    muon_num_ns_steps=6,
    muon_scale_mode="spectral",
    muon_extra_scale_factor=0.2,
    muon_fp32_matmul_prec="highest",
    muon_split_qkv=True,
    muon_tp_mode="duplicated",
    adam_beta2=0.95,
    clip_grad=0.0,
)
"""Away from both libraries' defaults (momentum, Nesterov, coefficients, steps, scale factor),
so that a setting either side ignored would show. ``clip_grad=0``: Megatron clips in the wrapper
``get_megatron_optimizer`` puts around ``TensorParallelMuon`` (CUDA-only; stepped bare here),
muonscale inside its step; with clipping on, the two would see differently scaled gradients
from the second step on (the momentum mixes steps clipped by different factors)."""


@pytest.fixture(scope="module")
def arms(pool1):
    return pool1.run(W.muon_arms, {"config": CONFIG, "steps": STEPS}, timeout=600)[0]


def test_both_arms_read_one_optimizer_config_with_equal_settings(arms):
    theirs, ours = arms["settings"]["megatron"], arms["settings"]["muonscale"]
    assert theirs == ours
    expected = dict(
        lr=CONFIG["lr"],
        momentum=CONFIG["muon_momentum"],
        nesterov=True,
        weight_decay=CONFIG["weight_decay"],
        num_ns_steps=6,
        coefficients=megatron_coefficients("quintic", 6),
        scale=("spectral", 0.2),
        ns_dtype=str(torch.float32),
        split_qkv=True,
        tp_exact=True,
    )
    assert ours == expected


def test_muon_matrices_differ_only_by_the_position_embedding(arms):
    theirs, ours = set(arms["megatron_muon_names"]), set(arms["muonscale_muon_names"])
    assert theirs - ours == {"embedding.position_embeddings.weight"}
    assert ours <= theirs and any(n.endswith("linear_qkv.weight") for n in ours)


def test_same_update_as_megatron_muon_in_float32(arms):
    """Both run the same float32 iteration on the same momentum; they differ in rounding only
    (operation order, the normalization's eps). Bound per matrix, relative to the total update
    ‖ΔW‖_max: each of the steps × ns_steps Newton–Schulz iterations multiplies by at most
    |a| + |b| + |c| (≤ 13.9 for "quintic") and adds one k-term dot product's rounding,
    ≈ √k·eps (random-walk rounding; k ≤ 128, the largest inner dimension):
    3 · 6 · 13.9 · √128 · 2⁻²³ ≈ 3.4e-4 (measured when written: 1.1e-5). A convention mismatch
    moves it by far more: clipping on one side only 5e-4 to 1.3e-2; scale, Nesterov, QKV split
    or coefficients O(0.1-1)."""
    eps = torch.finfo(torch.float32).eps
    largest = max(sum(abs(c) for c in t) for t in megatron_coefficients("quintic", 6))
    tol = STEPS * CONFIG["muon_num_ns_steps"] * largest * 128**0.5 * eps
    worst = 0.0
    for name in arms["muonscale_muon_names"]:
        update = arms["muonscale"][name] - arms["init"][name]
        diff = (arms["megatron"][name] - arms["muonscale"][name]).abs().max()
        rel = float(diff / update.abs().max())
        worst = max(worst, rel)
        assert rel <= tol, f"{name}: |Δ| / |update| = {rel:.3g} > {tol:.3g}"
    print(f"worst |ΔW| / |update| over the Muon matrices: {worst:.3g} (bound {tol:.3g})")
