"""steps_to_adamw_final_loss_ratio and friends on hand-computed synthetic curves."""

import math

import pytest

from muonscale.bench.metrics import (
    median_after_warmup,
    ratio,
    steps_to_final_loss_ratio,
    steps_to_reach,
)

STEPS = [0, 10, 20, 30]
LOSSES = [4.0, 3.0, 2.0, 1.5]


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (2.5, 15.0),  # halfway between (10, 3.0) and (20, 2.0)
        (2.0, 20.0),  # exactly on an evaluation
        (2.75, 12.5),  # a quarter of the way: 10 + 0.25/1.0 * 10
        (1.75, 25.0),  # between (20, 2.0) and (30, 1.5): 20 + 0.25/0.5 * 10
        (5.0, 0.0),  # already below at the first evaluation
        (4.0, 0.0),
    ],
)
def test_steps_to_reach_interpolates_linearly(target, expected):
    assert steps_to_reach(STEPS, LOSSES, target) == pytest.approx(expected, abs=1e-12)


def test_steps_to_reach_never_reached_is_none():
    assert steps_to_reach(STEPS, LOSSES, 1.4) is None


def test_steps_to_reach_uses_the_first_crossing():
    # dips below 2.0 at step 20, rises again, dips again at 40: the first crossing counts
    steps, losses = [0, 10, 20, 30, 40], [3.0, 2.5, 1.5, 2.5, 1.0]
    assert steps_to_reach(steps, losses, 2.0) == pytest.approx(15.0)


def test_steps_to_reach_ignores_nan_evaluations():
    # a NaN never compares <= target, so a diverged curve "never reaches"
    assert steps_to_reach([0, 10], [3.0, math.nan], 2.0) is None


def test_steps_to_reach_length_mismatch():
    with pytest.raises(ValueError, match="differ in length"):
        steps_to_reach([0, 1], [1.0], 0.5)


def test_steps_to_final_loss_ratio_hand_computed():
    adamw_steps, adamw_losses = [0, 10, 20, 40], [4.0, 3.5, 3.0, 2.6]
    muon_steps, muon_losses = [0, 10, 20, 40], [4.0, 3.0, 2.5, 2.0]
    # AdamW final loss 2.6; muon crosses between (10, 3.0) and (20, 2.5):
    # 10 + (3.0 - 2.6) / 0.5 * 10 = 18 steps; AdamW needed 40 -> 0.45
    got = steps_to_final_loss_ratio(adamw_steps, adamw_losses, muon_steps, muon_losses)
    assert got == pytest.approx(0.45, abs=1e-12)
    # AdamW against itself: reaches its final loss at its last step -> 1.0
    assert steps_to_final_loss_ratio(
        adamw_steps, adamw_losses, adamw_steps, adamw_losses
    ) == pytest.approx(1.0)


def test_steps_to_final_loss_ratio_never_reached_is_none():
    assert steps_to_final_loss_ratio([0, 10], [4.0, 2.0], [0, 10], [4.0, 2.5]) is None
    assert steps_to_final_loss_ratio([], [], [0], [1.0]) is None


def test_median_after_warmup_and_ratio():
    assert median_after_warmup([100.0, 50.0, 1.0, 2.0, 3.0], warmup=2) == 2.0
    assert median_after_warmup([5.0, 7.0], warmup=10) == 6.0  # too short: all values
    with pytest.raises(ValueError):
        median_after_warmup([], 0)
    assert ratio(3.0, 4.0) == 0.75
    assert ratio(None, 4.0) is None
    assert ratio(1.0, 0.0) is None
