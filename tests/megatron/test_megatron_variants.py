"""The Muon variants through the Megatron adapter at TP 2 (linear_qkv / linear_fc1 split by
rows, linear_proj / linear_fc2 by columns) end where single-process :class:`muonscale.Muon`
ends on the same full model and gradients: NorMuon (at the owner of each whole matrix, its
row statistics shared over the TP group, the row moment replicated), cautious weight decay
(elementwise on shards) and the AOL preconditioner (whole matrices at the owner), and
``qk_lr_scale`` (the Q and K pieces of each rank's linear_qkv shard). ZeRO-1 (TP 2 × DP 2)
too, for NorMuon's owner-held moments."""

from __future__ import annotations

import pytest
import torch
import variant_workers as V

from muonscale.newton_schulz import resolve_schedule

STEPS = 3
VARIANTS = {
    "normuon": dict(normalize="row"),
    "cautious": dict(cautious_weight_decay=True),
    "aol": dict(preconditioner="aol"),
    "all": dict(normalize="row", cautious_weight_decay=True, preconditioner="aol"),
    "qk_lr_scale": dict(qk_lr_scale=2.0),  # Q and K blocks of the split linear_qkv
}
LARGEST_DIM = 256
"""The longest side of a TINY matrix (gated fc1: 2·128 × 64): the longest dot product."""


def tolerance(variant: dict) -> float:
    """Bound on max|ΔW| / max|W − W₀| per tensor between two float32 runs that round
    differently (other stacking of Newton–Schulz, sums over ranks in another order): each of
    the STEPS × ns_steps iterations multiplies an error by at most |a| + |b| + |c| and adds a
    k-term dot product's rounding, ≈ √k·eps (random-walk rounding)."""
    aol = variant.get("preconditioner") == "aol"
    steps = 4 if aol else 5
    schedule = resolve_schedule("turbo_muon" if aol else "keller", steps)[0]
    largest = max(sum(abs(c) for c in t) for t in schedule)
    return STEPS * steps * largest * LARGEST_DIM**0.5 * torch.finfo(torch.float32).eps


def worst_relative(ref: dict, run: dict) -> tuple[float, str]:
    worst, where = 0.0, ""
    for name, value in ref["params"].items():
        moved = float((value - ref["init"][name]).abs().max())
        rel = float((run["params"][name] - value).abs().max()) / moved
        if rel > worst:
            worst, where = rel, name
    return worst, where


def _run(pool, **spec):
    spec.setdefault("steps", STEPS)
    return pool.run(V.run_variant, spec, timeout=600)[0]


@pytest.fixture(scope="module")
def plain(pool2):
    return _run(pool2, impl="muon", variant={})


@pytest.mark.parametrize("name", list(VARIANTS))
def test_tp2_variant_matches_single_process_muon(pool2, plain, name):
    variant = VARIANTS[name]
    ref = _run(pool2, impl="muon", variant=variant)
    tp2 = _run(pool2, impl="megatron", tp=2, variant=variant)
    assert ref["init"].keys() == tp2["init"].keys()
    assert all(torch.equal(ref["init"][n], tp2["init"][n]) for n in ref["init"])
    tol = tolerance(variant)
    worst, where = worst_relative(ref, tp2)
    effect, _ = worst_relative(plain, ref)  # the variant against plain Muon
    print(
        f"\n{name}: TP2 vs Muon max|dW|/|W-W0| = {worst:.3g} ({where}), tol {tol:.3g}; "
        f"variant vs plain Muon {effect:.3g}"
    )
    assert worst <= tol, where
    assert effect > 10 * tol  # the variant changed the result, so the comparison can fail
    if variant.get("normalize") == "row":
        assert tp2["breakdown"].get("muon_tp_rows/all_reduce", 0) > 0


def test_zero1_normuon_matches_single_process_muon(pool4):
    """TP 2 × DP 2, gradients averaged by the optimizer (ZeRO-1): the DP owner of each
    matrix's TP pieces keeps a replica of its whole row moment, stepped from the statistics
    its TP owner shares."""
    variant = VARIANTS["all"]
    ref = _run(pool4, impl="muon", variant=variant)
    run = _run(pool4, impl="megatron", tp=2, variant=variant)
    assert run["dp_mode"] == "zero1"
    worst, where = worst_relative(ref, run)
    print(f"\nzero1 TP2xDP2, all variants: max|dW|/|W-W0| = {worst:.3g} ({where})")
    assert worst <= tolerance(variant), where
