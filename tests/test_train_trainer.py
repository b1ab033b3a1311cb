"""TrainingRun oracles: golden loss curves, resumed == uninterrupted (bitwise), NaN handling,
Ctrl-C, metrics log, gradient accumulation, optimizer state bytes.

Regenerate the golden curves (after an intended change of model, data or optimizer math)::

    MUONSCALE_REGEN_GOLDEN=1 .venv/bin/python -m pytest tests/test_train_trainer.py -k golden
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from muonscale.train.checkpoint import read_checkpoint
from muonscale.train.config import TrainConfig
from muonscale.train.data import load_corpus
from muonscale.train.trainer import NonFiniteLossError, TrainingRun

ASSETS = Path(__file__).parent / "assets"
OPTIMIZERS = ["adamw", "muon", "torch-muon"]
# A model far below "tiny" so that every test here runs in a fraction of a second per step.
MICRO = dict(
    n_layer=2,
    d_model=64,
    n_head=4,
    context_length=32,
    micro_batch_size=4,
    eval_batches=2,
    warmup_steps=3,
    device="cpu",
    log_every=1,
    out_dir=None,
)


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_corpus()


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    # These models are too small to gain from threads, and on a busy 2-core machine OpenMP
    # spin-waiting makes them many times slower. Restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(optimizer: str, **overrides) -> TrainConfig:
    return TrainConfig(**{**MICRO, "optimizer": optimizer, "steps": 10, **overrides})


def _params(run: TrainingRun) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in run.model.named_parameters()}


def _assert_bitwise_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), f"{name} differs"


# ------------------------------------------------------------------------ golden loss curves
# Tolerance 1e-4 absolute on losses near 5: float32 on CPU, where a different BLAS / oneDNN
# build or vector width changes summation order (~1e-7 relative per op, compounded over 10
# steps). Real regressions (lr off by 10%, a wrong QKV slice, a changed schedule or data
# order) move these losses by 1e-2 or more within 10 steps.
GOLDEN_TOLERANCE = 1e-4


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_golden_loss_curve(optimizer, corpus):
    run = TrainingRun(_config(optimizer), text=corpus)
    losses = [run.step().loss for _ in range(10)]
    losses.append(run.evaluate())
    path = ASSETS / f"golden_loss_{optimizer}.json"
    if os.environ.get("MUONSCALE_REGEN_GOLDEN"):
        record = {
            "config": _config(optimizer).to_dict(),
            "corpus": "bundled Shakespeare",
            "train_losses": losses[:-1],
            "val_loss_after": losses[-1],
            "torch": torch.__version__,
        }
        path.write_text(json.dumps(record, indent=1) + "\n")
        pytest.skip(f"regenerated {path}")
    golden = json.loads(path.read_text())
    expected = golden["train_losses"] + [golden["val_loss_after"]]
    assert losses == pytest.approx(expected, abs=GOLDEN_TOLERANCE, rel=0)
    assert losses[9] < losses[0] - 0.5  # and it actually learns


# ------------------------------------------------------------------------ resume
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resumed_run_equals_uninterrupted(optimizer, corpus, tmp_path):
    config = _config(optimizer, steps=6, tokens_per_step=2 * 4 * 32)  # 2 micro-batches/step
    straight = TrainingRun(config, text=corpus)
    straight_losses = [straight.step().loss for _ in range(6)]

    first = TrainingRun(config, text=corpus)
    losses = [first.step().loss for _ in range(3)]
    first.save_checkpoint(tmp_path / "ckpt.pt")
    # a different global RNG state must not matter: init and data order are seeded explicitly
    torch.manual_seed(1234)
    second = TrainingRun(config, text=corpus)
    second.load_checkpoint(tmp_path / "ckpt.pt")
    assert second.step_count == 3
    losses += [second.step().loss for _ in range(3)]

    assert losses == straight_losses  # bitwise
    _assert_bitwise_equal(_params(second), _params(straight))
    assert second.scheduler.get_last_lr() == straight.scheduler.get_last_lr()
    assert second.optimizer_state_bytes() == straight.optimizer_state_bytes()


def test_resume_with_more_steps_follows_the_new_schedule(corpus, tmp_path):
    run = TrainingRun(_config("adamw", steps=10), text=corpus)
    for _ in range(5):
        run.step()
    run.save_checkpoint(tmp_path / "ckpt.pt")
    longer = TrainingRun(_config("adamw", steps=40), text=corpus)
    longer.load_checkpoint(tmp_path / "ckpt.pt")
    expected = longer.config.lr * longer.schedule(5)
    assert longer.schedule.total_steps == 40
    assert [g["lr"] for g in longer.optimizer.param_groups] == pytest.approx([expected] * 2)
    assert longer.step().lr == pytest.approx(expected)
    assert longer.optimizer.param_groups[0]["lr"] == pytest.approx(
        longer.config.lr * longer.schedule(6)
    )


def test_checkpoint_of_another_model_is_refused(corpus, tmp_path):
    run = TrainingRun(_config("adamw"), text=corpus)
    run.save_checkpoint(tmp_path / "ckpt.pt")
    other = TrainingRun(_config("adamw", n_layer=1), text=corpus)
    with pytest.raises(ValueError, match="was written for model"):
        other.load_checkpoint(tmp_path / "ckpt.pt")
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        other.load_checkpoint(tmp_path / "missing.pt")


# ------------------------------------------------------------------------ the run() loop
def _inject(run: TrainingRun, at_step: int, action) -> None:
    """Call ``action(run)`` just before the step that would make step_count ``at_step + 1``."""
    original = run.step

    def step():
        if run.step_count == at_step:
            action(run)
        return original()

    run.step = step


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(corpus, tmp_path):
    config = _config("adamw", steps=8, checkpoint_every=2, eval_every=0, out_dir=str(tmp_path))
    run = TrainingRun(config, text=corpus)
    digests = {}

    def poison(run):
        digests["before"] = _file_digest(tmp_path / "checkpoint.pt")
        with torch.no_grad():
            run.model.lm_head.weight[0].fill_(float("nan"))

    _inject(run, 5, poison)
    with pytest.raises(
        NonFiniteLossError, match=r"loss is nan at step 6.*checkpoint.pt \(step 4\)"
    ):
        run.run(progress=False)
    checkpoint = tmp_path / "checkpoint.pt"
    assert _file_digest(checkpoint) == digests["before"]
    assert read_checkpoint(checkpoint)["step"] == 4
    with pytest.raises(NonFiniteLossError, match="not overwriting"):
        run.save_checkpoint(checkpoint)  # explicit saves of a bad state are refused too
    assert _file_digest(checkpoint) == digests["before"]
    events = [
        json.loads(line)["event"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ]
    assert events[-1] == "nonfinite_loss"
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary files left behind


def test_ctrl_c_saves_and_auto_resume_finishes_identically(corpus, tmp_path):
    straight = TrainingRun(_config("torch-muon", steps=6, eval_every=3), text=corpus)
    straight.run(progress=False)

    config = _config("torch-muon", steps=6, eval_every=3, out_dir=str(tmp_path), resume="auto")
    interrupted = TrainingRun(config, text=corpus)

    def ctrl_c(run):
        raise KeyboardInterrupt

    _inject(interrupted, 4, ctrl_c)
    summary = interrupted.run(progress=False)
    assert summary.interrupted and summary.steps == 4
    assert read_checkpoint(tmp_path / "checkpoint.pt")["step"] == 4

    resumed = TrainingRun(config, text=corpus)
    summary = resumed.run(progress=True)  # exercises the tqdm bar too
    assert not summary.interrupted and summary.steps == 6 and summary.tokens == 6 * 4 * 32
    _assert_bitwise_equal(_params(resumed), _params(straight))
    assert summary.val_loss == straight.evaluate()

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    events = [r["event"] for r in records]
    assert events.count("start") == 2 and "interrupted" in events
    train_steps = [r["step"] for r in records if r["event"] == "train"]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if r["event"] == "eval"] == [3, 6]
    last = [r for r in records if r["event"] == "train"][-1]
    assert {"loss", "lr", "tokens", "tokens_per_second", "optimizer_seconds"} <= last.keys()


# ------------------------------------------------------------------------ step details
def _step_recording_gradients(run: TrainingRun) -> tuple[Any, dict[str, torch.Tensor]]:
    """One step of ``run`` and the gradients ``optimizer.step()`` received."""
    grads: dict[str, torch.Tensor] = {}

    def record(*_):
        grads.update({n: p.grad.clone() for n, p in run.model.named_parameters()})

    handle = run.optimizer.register_step_pre_hook(record)
    try:
        return run.step(), grads
    finally:
        handle.remove()


def test_gradient_accumulation_matches_one_large_batch(corpus):
    # 2 micro-batches of 4 see the same windows as 1 micro-batch of 8 (same draw, split in rows)
    accumulated = TrainingRun(
        _config("adamw", micro_batch_size=4, tokens_per_step=256), text=corpus
    )
    large = TrainingRun(_config("adamw", micro_batch_size=8), text=corpus)
    (a, grads_a), (b, grads_b) = (_step_recording_gradients(r) for r in (accumulated, large))
    assert a.tokens == b.tokens == 256
    # The gradient (and the loss) is a mean over N = 256 token terms; the two runs only sum
    # them in another order (two partial means of 128, other matmul blockings). Reordering a
    # float32 sum of N terms moves it by at most ~N·eps times the terms' magnitude, taken as
    # the largest entry of each gradient. (Parameters are not compared: AdamW's first step,
    # lr·g/(|g| + ε), turns a rounding-level change of a gradient entry near ε into up to lr.)
    n_terms, eps = a.tokens, torch.finfo(torch.float32).eps
    assert a.loss == pytest.approx(b.loss, rel=n_terms * eps)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_b.items():
        tol = n_terms * eps * grad.abs().max().item()
        torch.testing.assert_close(grads_a[name], grad, atol=tol, rtol=0, msg=name)


def test_step_result_and_schedule(corpus):
    run = TrainingRun(_config("adamw", lr=1e-3, warmup_steps=4), text=corpus)
    results = [run.step() for _ in range(2)]
    assert [r.step for r in results] == [1, 2]
    assert [r.lr for r in results] == pytest.approx([0.25e-3, 0.5e-3])
    assert all(0 < r.optimizer_seconds < r.step_seconds for r in results)


def test_optimizer_state_bytes_are_exact(corpus):
    adamw = TrainingRun(_config("adamw"), text=corpus)
    adamw.step()
    n_params = adamw.model.num_parameters()
    n_tensors = len(list(adamw.model.parameters()))
    # exp_avg + exp_avg_sq in float32, plus one float32 step scalar per parameter
    assert adamw.optimizer_state_bytes() == 2 * 4 * n_params + 4 * n_tensors

    muon = TrainingRun(_config("torch-muon"), text=corpus)
    muon.step()
    hidden = sum(
        p.numel() for n, p in muon.model.named_parameters() if "blocks" in n and p.ndim == 2
    )
    rest = n_params - hidden
    n_rest = sum(1 for n, p in muon.model.named_parameters() if not ("blocks" in n and p.ndim == 2))
    assert muon.optimizer_state_bytes() == 4 * hidden + 2 * 4 * rest + 4 * n_rest


def test_bpe_run_and_short_data_file(corpus, tmp_path, monkeypatch):
    pytest.importorskip("tokenizers")
    monkeypatch.setenv("MUONSCALE_CACHE_DIR", str(tmp_path / "cache"))
    run = TrainingRun(_config("adamw", tokenizer="bpe", bpe_vocab_size=300), text=corpus[:100_000])
    assert run.model_config.vocab_size == 320  # 300 rounded up to a multiple of 64
    assert run.step().loss == pytest.approx(math.log(320), abs=0.1)  # uniform at init

    short = tmp_path / "short.txt"
    short.write_text("Words, words, words.")
    with pytest.raises(ValueError, match=f"data {short} is too short"):
        TrainingRun(_config("adamw", data=str(short)))


def test_qk_clip_holds_the_logged_max_logit(corpus):
    """One layer without QK-norm, Muon at a high lr (as tests/test_qk_clip.py): the logits of
    plain Muon grow far past tau; with --qk-clip the trainer probes every forward, rescales
    after step() and logs the maximum, which stays held. A tau that never clips leaves training
    bitwise unchanged (the probe is a side computation)."""
    tau, steps = 15.0, 50
    one_layer = dict(
        n_layer=1,
        warmup_steps=0,
        schedule="constant",
        grad_clip=None,
        lr=0.1,
        adamw_lr=3e-3,
        micro_batch_size=8,
        eval_every=0,
    )

    def logged(qk_clip):
        run = TrainingRun(_config("muon", steps=steps, qk_clip=qk_clip, **one_layer), text=corpus)
        return run, [run.step().max_attention_logit for _ in range(steps)]

    off, _ = logged(None)
    never, plain = logged(1e9)
    _assert_bitwise_equal(_params(off), _params(never))
    clipped_run, clipped = logged(tau)
    assert plain[0] < tau and plain[-1] > 2 * tau  # plain Muon: growing, well past tau
    first_clip = next(i for i, x in enumerate(plain) if x > tau)
    assert clipped[: first_clip + 1] == plain[: first_clip + 1]  # identical until the 1st clip
    # K2's order: the maximum is measured in the step's own forward and the rescale follows
    # the update, so the next forward may exceed tau by one step's growth, never more: it
    # stays far below the plain run's level (over the last 10 steps)
    assert max(clipped[-10:]) < min(plain[-10:])
    # the clip acts on the weights: a forward probe of the final weights is far below plain's
    x, _ = clipped_run.dataset.validation_batches(n_batches=1, batch_size=8)[0]
    with torch.no_grad():
        clipped_run.model(x, probe_max_logits=True)
        never.model(x, probe_max_logits=True)
    assert (
        max(m.max() for m in clipped_run.model.pop_max_attention_logits())
        < max(m.max() for m in never.model.pop_max_attention_logits()) / 2
    )
