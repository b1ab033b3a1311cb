"""Interleaved scheduling and evaluation points of the side-by-side runner (fake runs)."""

from dataclasses import dataclass

import pytest

from muonscale.bench.side_by_side import eval_steps_for, interleaved_order, run_side_by_side


def test_interleaved_order_is_round_robin():
    assert list(interleaved_order(["adamw", "muon"], 3)) == [
        (1, "adamw"),
        (1, "muon"),
        (2, "adamw"),
        (2, "muon"),
        (3, "adamw"),
        (3, "muon"),
    ]
    assert list(interleaved_order(["a", "b", "c"], 1)) == [(1, "a"), (1, "b"), (1, "c")]
    assert list(interleaved_order(["a"], 0)) == []


def test_eval_steps_cover_every_2_5_percent():
    points = eval_steps_for(400)
    assert points[0] == 0 and points[-1] == 400
    assert len(points) >= 41
    assert max(b - a for a, b in zip(points, points[1:])) <= 10
    assert eval_steps_for(7) == list(range(8))  # interval floors to 1 step
    assert eval_steps_for(50, 0.25) == [0, 12, 24, 36, 48, 50]  # the last step is always in
    with pytest.raises(ValueError):
        eval_steps_for(0)


@dataclass
class FakeStep:
    loss: float
    tokens: int = 64
    step_seconds: float = 0.01
    optimizer_seconds: float = 0.002


class FakeRun:
    """Records every call into a shared log; loss falls by ``rate`` per step."""

    def __init__(self, name, log, rate):
        self.name, self.log, self.rate, self.steps = name, log, rate, 0

    def step(self):
        self.steps += 1
        self.log.append(("step", self.name, self.steps))
        return FakeStep(loss=5.0 - self.rate * self.steps)

    def evaluate(self):
        self.log.append(("eval", self.name, self.steps))
        return 5.0 - self.rate * self.steps

    def optimizer_state_bytes(self):
        return {"adamw": 800, "muon": 400}[self.name]


def test_run_side_by_side_interleaves_steps_and_evaluates_all_at_the_same_steps():
    log = []
    runs = {"adamw": FakeRun("adamw", log, 0.1), "muon": FakeRun("muon", log, 0.2)}
    records = run_side_by_side(
        runs, {"adamw": 1e-3, "muon": 2e-3}, steps=4, eval_steps=[0, 2, 4], progress=False
    )
    assert log == [
        ("eval", "adamw", 0),
        ("eval", "muon", 0),
        ("step", "adamw", 1),
        ("step", "muon", 1),
        ("step", "adamw", 2),
        ("step", "muon", 2),
        ("eval", "adamw", 2),
        ("eval", "muon", 2),
        ("step", "adamw", 3),
        ("step", "muon", 3),
        ("step", "adamw", 4),
        ("step", "muon", 4),
        ("eval", "adamw", 4),
        ("eval", "muon", 4),
    ]
    muon = records["muon"]
    assert muon.lr == 2e-3
    assert muon.eval_steps == [0, 2, 4]
    assert muon.val_losses == pytest.approx([5.0, 4.6, 4.2])
    assert muon.train_losses == pytest.approx([4.8, 4.6, 4.4, 4.2])
    assert muon.eval_train_seconds == pytest.approx([0.0, 0.02, 0.04])
    assert muon.optimizer_state_bytes == 400
    assert records["adamw"].optimizer_state_bytes == 800
    assert sum(records["adamw"].tokens) == 4 * 64
