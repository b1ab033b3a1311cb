"""The bench's maximum attention logit: report.json / report.md fields, max_logit.png,
TensorBoard, and QK-clip holding the measured maximum at tau (``--variants NAME=qk_clip:TAU``,
``--track-max-logit`` for the contenders without it)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig
from muonscale.bench.runner import make_run
from muonscale.bench.store import run_key

pytestmark = pytest.mark.timeout(60)

EPS32 = torch.finfo(torch.float32).eps
TAU = 1e-3  # far below the tiny model's initial maxima (~0.06): the first step clips
TINY = dict(
    n_layer=1,
    d_model=32,
    n_head=2,
    steps=3,
    tokens_per_step=256,
    eval_batches=1,
    lr_warmup_steps=1,
    memory_probe_steps=0,
    timing_warmup_steps=0,
    progress=False,
)


def _same_batch_every_step(config, contender, lr, steps=None):
    """The bench's run, its every step fed step 0's batch: with a learning rate too small to
    move a float32 weight, the logits measured at step t + 1 are those of step t's batch under
    the weights QK-clip rescaled after step t."""
    run = make_run(config, contender, lr, steps=steps)
    train_batch = run.dataset.train_batch
    run.dataset.train_batch = lambda **kw: train_batch(**{**kw, "step": 0})
    return run


def test_report_plot_and_tensorboard_hold_the_max_logit_and_clip_caps_it(tmp_path):
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    config = BenchConfig(
        **TINY,
        # lr 1e-30: every update, weight decay included, leaves each float32 weight unchanged
        # (the AdamW half too: it follows the contender's lr)
        variants=[f"clip=qk_clip:{TAU},lr:1e-30"],
        muon_adamw_lr=None,
        track_max_logit=True,
        out=str(tmp_path / "out"),
        tensorboard=str(tmp_path / "tb") if tensorboard else None,
    )
    report = run_bench(config, make_run=_same_batch_every_step, stream=open("/dev/null", "w"))
    out = tmp_path / "out"
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))
    assert (out / "max_logit.png").stat().st_size > 0
    assert "![max_logit.png](max_logit.png)" in (out / "report.md").read_text()
    for name in ("adamw", "muon", "clip"):
        c = report["contenders"][name]
        curve = c["curves"]["max_attention_logit"]
        assert len(curve) == TINY["steps"] and all(x > 0 for x in curve)
        assert c["max_attention_logit"] == max(curve)
        assert c["final_max_attention_logit"] == curve[-1]
        assert 0 < c["max_logit_ms"] and 0 < c["max_logit_step_fraction"] < 1
    assert report["contenders"]["muon"]["qk_clip_tau"] is None
    assert report["contenders"]["muon"]["qk_clip_steps"] is None

    clip = report["contenders"]["clip"]
    curve = clip["curves"]["max_attention_logit"]
    assert clip["qk_clip_tau"] == TAU
    assert clip["qk_clip_steps"] == sum(x > TAU for x in curve) >= 1
    assert curve[0] > TAU  # the first step measured the unclipped maxima and clipped
    # After a clip step, head h's logits are gamma_h times the measured ones: q and k rows were
    # each multiplied by sqrt(gamma_h) rounded to float32 (2 roundings each), and the logits
    # recomputed through sums of d_model = 32 (projection) and head_dim = 16 (q . k) products
    # of float32 roundings; the maximum head lands on tau within (32 + 16 + 4) eps, x4 margin.
    tolerance = 4 * (32 + 16 + 4) * EPS32
    for before, after in zip(curve, curve[1:]):
        if before > TAU:
            assert abs(after - TAU) <= TAU * tolerance

    if tensorboard:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tb" / "clip" / "seed0"))
        events.Reload()
        logged = [e.value for e in events.Scalars("max_attention_logit")]
        assert logged == pytest.approx(curve, rel=EPS32)  # TensorBoard stores float32


def test_without_clip_or_tracking_nothing_is_measured_and_the_run_key_tells_them_apart():
    plain = BenchConfig(**TINY, variants=[f"clip=qk_clip:{TAU}"])
    tracked = BenchConfig(**TINY, variants=[f"clip=qk_clip:{TAU}"], track_max_logit=True)
    assert not plain.tracks_max_logit("muon") and plain.tracks_max_logit("clip")
    assert make_run(plain, "muon", 0.02).step().max_attention_logit is None
    tracked_step = make_run(tracked, "muon", 0.02).step()
    assert tracked_step.max_attention_logit > 0 and tracked_step.max_logit_seconds > 0

    def key(bench, name):
        return run_key(bench, name, 0.02, kind="run", steps=3)

    # a saved muon run without maxima is not reused for --track-max-logit; a clip run is
    assert key(plain, "muon") != key(tracked, "muon")
    assert key(plain, "clip") == key(tracked, "clip")
