"""``muonscale train`` / ``bench`` never lose work and never train on a lie.

Oracles: an uninterrupted run (bitwise), the bytes of the previous checkpoint (unchanged), a
fresh run built with the new hyperparameters (group by group), and the error messages, which
must name the file or the parameter and the problem.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from bench_tiny import BENCH_TINY

import muonscale.train.checkpoint as checkpoint_module
from muonscale.cli import main
from muonscale.train.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from muonscale.train.config import MAX_BPE_VOCAB_SIZE, MAX_TOKENS_PER_STEP, TrainConfig
from muonscale.train.data import load_corpus
from muonscale.train.trainer import CheckpointExistsError, TrainingRun

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
    eval_every=0,
    out_dir=None,
)
MICRO_FLAGS = [
    "--n-layer",
    "2",
    "--d-model",
    "64",
    "--n-head",
    "4",
    "--context-length",
    "32",
    "--micro-batch-size",
    "4",
    "--eval-batches",
    "1",
    "--eval-every",
    "0",
    "--device",
    "cpu",
    "--no-progress",
    "--log-every",
    "1",
]
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def corpus() -> str:
    return load_corpus()


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(optimizer: str = "adamw", **overrides) -> TrainConfig:
    return TrainConfig(**{**MICRO, "optimizer": optimizer, "steps": 6, **overrides})


def _params(run: TrainingRun) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in run.model.named_parameters()}


def _assert_bitwise_equal(left: TrainingRun, right: TrainingRun) -> None:
    a, b = _params(left), _params(right)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} differs"


def _straight(corpus: str, optimizer: str, steps: int, **overrides) -> TrainingRun:
    run = TrainingRun(_config(optimizer, **overrides), text=corpus)
    for _ in range(steps):
        run.step()
    return run


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------ a new run overwrites nothing
def test_a_new_run_does_not_overwrite_an_earlier_runs_checkpoint(corpus, tmp_path):
    TrainingRun(_config(steps=3, out_dir=str(tmp_path)), text=corpus).run(progress=False)
    checkpoint = tmp_path / "checkpoint.pt"
    before = _digest(checkpoint)
    second = TrainingRun(_config(steps=2, out_dir=str(tmp_path)), text=corpus)
    with pytest.raises(CheckpointExistsError, match=r"checkpoint.pt.*--resume auto.*--overwrite"):
        second.run(progress=False)
    assert _digest(checkpoint) == before and read_checkpoint(checkpoint)["step"] == 3
    assert second.step_count == 0  # refused before training

    argv = ["train", *MICRO_FLAGS, "--steps", "2", "--out-dir", str(tmp_path)]
    assert main(argv) == 1
    assert _digest(checkpoint) == before
    assert main([*argv, "--overwrite"]) == 0
    assert read_checkpoint(checkpoint)["step"] == 2


# ------------------------------------------------------------------ signals
def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def _train_records(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    lines = metrics.read_text().splitlines()
    return [json.loads(line) for line in lines if '"event": "train"' in line]


def test_sigterm_saves_a_checkpoint_and_exits_nonzero_naming_it(tmp_path):
    command = [
        sys.executable,
        "-m",
        "muonscale",
        "train",
        *MICRO_FLAGS,
        "--steps",
        "100000",
        "--out-dir",
        str(tmp_path),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for(lambda: _train_records(tmp_path / "metrics.jsonl"), 120, "a training step")
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        process.wait(timeout=10)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    checkpoint = tmp_path / "checkpoint.pt"
    step = read_checkpoint(checkpoint)["step"]
    assert f"interrupted by SIGTERM; checkpoint at step {step}: {checkpoint}" in stderr
    assert step == _train_records(tmp_path / "metrics.jsonl")[-1]["step"]


def test_a_signal_during_the_final_save_is_deferred_until_it_is_written(
    corpus, tmp_path, monkeypatch
):
    write = checkpoint_module.write_durably

    def signalled_write(path, *chunks):
        os.kill(os.getpid(), signal.SIGINT)  # a second Ctrl-C while saving
        write(path, *chunks)

    monkeypatch.setattr(checkpoint_module, "write_durably", signalled_write)
    run = TrainingRun(_config(out_dir=str(tmp_path)), text=corpus)
    original_step = run.step

    def step():
        if run.step_count == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return original_step()

    run.step = step
    summary = run.run(progress=False)
    assert summary.interrupted and summary.signal == "SIGTERM" and summary.steps == 3
    saved = read_checkpoint(tmp_path / "checkpoint.pt")
    assert saved["step"] == 3
    expected = _straight(corpus, "adamw", 3)
    for name, value in _params(expected).items():
        assert torch.equal(saved["model"][name], value), name
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_an_interrupt_inside_optimizer_step_saves_whole_steps_only(corpus, tmp_path):
    """SIGINT after torch.optim.Muon updated the hidden matrices and before AdamW updated the
    rest: the step finishes, and the checkpoint equals an uninterrupted run's state."""
    config = _config("torch-muon", out_dir=str(tmp_path), resume="auto")
    run = TrainingRun(config, text=corpus)
    calls = []

    def interrupt_between_halves(optimizer, args, kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    run.optimizer.optimizers["muon"].register_step_post_hook(interrupt_between_halves)
    summary = run.run(progress=False)
    assert summary.interrupted and summary.steps == 2
    assert read_checkpoint(tmp_path / "checkpoint.pt")["step"] == 2
    _assert_bitwise_equal(run, _straight(corpus, "torch-muon", 2))

    resumed = TrainingRun(config, text=corpus)
    assert not resumed.run(progress=False).interrupted
    _assert_bitwise_equal(resumed, _straight(corpus, "torch-muon", 6))


# ------------------------------------------------------------------ changed hyperparameters
@pytest.mark.parametrize("optimizer", ["adamw", "muon", "torch-muon"])
def test_resume_applies_changed_hyperparameters(optimizer, corpus, tmp_path):
    first = _straight(corpus, optimizer, 3)
    first.save_checkpoint(tmp_path / "ckpt.pt")
    changes = dict(lr=1e-3, momentum=0.8, weight_decay=0.02)
    resumed = TrainingRun(_config(optimizer, **changes), text=corpus)
    resumed.load_checkpoint(tmp_path / "ckpt.pt")
    fresh = TrainingRun(_config(optimizer, **changes), text=corpus)  # what the flags build
    assert len(resumed.optimizer.param_groups) == len(fresh.optimizer.param_groups)
    for got, want in zip(resumed.optimizer.param_groups, fresh.optimizer.param_groups):
        assert {k: v for k, v in got.items() if k not in ("params", "lr")} == {
            k: v for k, v in want.items() if k not in ("params", "lr")
        }
        assert got["lr"] == pytest.approx(want["initial_lr"] * fresh.schedule(3), rel=1e-12)
    assert resumed.resume_changes == {
        "lr": (3e-3, 1e-3),
        "momentum": (0.95, 0.8),
        "weight_decay": (0.1, 0.02),
    }
    # the optimizer state (moments, momentum buffers) is the checkpoint's
    saved = first.optimizer.state_dict()
    loaded = resumed.optimizer.state_dict()
    flat = [s for s in (saved.get("optimizers") or {"": saved}).values()]
    flat_loaded = [s for s in (loaded.get("optimizers") or {"": loaded}).values()]
    for a, b in zip(flat, flat_loaded):
        for key in a["state"]:
            for name, value in a["state"][key].items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["state"][key][name]))


# ------------------------------------------------------------------ values that trained silently
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(grad_clip=-1.0), r"grad_clip must be >= 0.*-1.0"),
        (dict(seed=-1), r"seed must be in \[0, 9223372036854775807\], got -1"),
        (dict(bpe_vocab_size=10**9), f"bpe_vocab_size must be in \\[256, {MAX_BPE_VOCAB_SIZE:,}"),
        (dict(tokens_per_step=2**31), f"limit of {MAX_TOKENS_PER_STEP:,} tokens per step"),
        (dict(micro_batch_size=2**30), f"limit of {MAX_TOKENS_PER_STEP:,} tokens per step"),
    ],
)
def test_invalid_values_are_refused_up_front(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--grad-clip", "-1"], "grad_clip must be >= 0"),
        (["train", "--seed", "-1"], "seed must be in"),
        (["train", "--qk-clip", "0"], "qk_clip must be a finite number > 0"),
        (["train", "--qk-clip", "-5"], "qk_clip must be a finite number > 0"),
        (["train", "--bpe-vocab-size", "1000000000"], "bpe_vocab_size must be in"),
        (["train", "--tokens-per-step", str(2**31)], "tokens per step"),
        (["bench", "--tokens-per-step", str(2**31)], "tokens per step"),
        (["bench", "--seed", "-1"], "seed must be in"),
    ],
)
def test_cli_refuses_invalid_values_with_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ bench --out


def test_bench_out_is_checked_before_any_training(tmp_path, monkeypatch, capsys):
    import muonscale.bench.runner as runner

    def no_training(*args, **kwargs):
        raise AssertionError("a training run was built before --out was checked")

    monkeypatch.setattr(runner, "make_run", no_training)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *BENCH_TINY, "--out", str(blocker / "report")])
    assert exit_info.value.code == 2
    assert f"--out {blocker / 'report'} is not a writable folder" in capsys.readouterr().err


def test_bench_prints_the_table_before_writing_files(tmp_path, monkeypatch, capsys):
    import muonscale.bench.report as report

    def full_disk(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(report, "write_report", full_disk)
    with pytest.raises(OSError, match="No space left"):
        main(["bench", *BENCH_TINY, "--out", str(tmp_path / "bench")])
    table = capsys.readouterr().out
    assert "| adamw |" in table and "| muon |" in table


# ------------------------------------------------------------------ damaged checkpoints
@pytest.fixture
def good_checkpoint(corpus, tmp_path) -> tuple[TrainingRun, Path]:
    run = _straight(corpus, "adamw", 1)
    return run, run.save_checkpoint(tmp_path / "checkpoint.pt")


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "zero-byte":
        path.write_bytes(b"")
    elif how == "text":
        path.write_text("not a checkpoint, just notes\n" * 10)
    elif how == "flipped":
        middle = len(data) // 2
        for i in range(middle, middle + 64):
            data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "foreign-torch-save":
        torch.save({"model": {}}, path)


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("zero-byte", "is empty"),
        ("text", "is not a muonscale checkpoint"),
        ("flipped", "is corrupted: the sha256"),
        ("truncated", "has no muonscale digest trailer: it is truncated"),
        ("foreign-torch-save", "has no muonscale digest trailer"),
    ],
)
def test_damaged_checkpoints_name_the_file_and_the_problem(good_checkpoint, how, message):
    run, path = good_checkpoint
    _damage(path, how)
    with pytest.raises(CheckpointError, match=f"checkpoint {path} {message}"):
        run.load_checkpoint(path)


def test_a_checkpoint_missing_a_key_names_it(good_checkpoint):
    run, path = good_checkpoint
    state = read_checkpoint(path)
    del state["optimizer"]
    write_checkpoint(state, path)
    with pytest.raises(
        CheckpointError, match=rf"checkpoint {path} lacks the entries \['optimizer'\]"
    ):
        run.load_checkpoint(path)


def test_full_disk_on_save_names_the_file_and_keeps_the_previous_checkpoint(
    good_checkpoint, monkeypatch
):
    run, path = good_checkpoint
    before = _digest(path)

    def full_disk(temporary, *chunks):
        temporary.write_bytes(bytes(chunks[0][:100]))  # a partial file, as a real ENOSPC leaves
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_module, "write_durably", full_disk)
    run.step()
    with pytest.raises(OSError, match=f"could not write checkpoint {path}: No space left"):
        run.save_checkpoint(path)
    assert _digest(path) == before
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.pt"]


def test_stale_temporaries_are_removed_by_the_next_save(good_checkpoint):
    run, path = good_checkpoint
    dead_pid = 2**22 + 1  # above Linux's largest pid_max: no such process
    stale = path.with_name(f".checkpoint.pt.tmp-{dead_pid}")
    stale.write_bytes(b"half a checkpoint")
    live = path.with_name(f".checkpoint.pt.tmp-{os.getppid()}")  # a save still in progress
    live.write_bytes(b"being written")
    run.save_checkpoint(path)
    assert not stale.exists() and live.exists()


def test_the_temporary_is_fsynced_before_it_replaces_the_checkpoint(good_checkpoint, monkeypatch):
    run, path = good_checkpoint
    events = []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def recording_replace(source, target):
        events.append(("replace", str(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    run.save_checkpoint(path)
    kinds = [kind for kind, _ in events]
    assert kinds == ["fsync", "replace", "fsync"]
    assert ".checkpoint.pt.tmp-" in events[0][1]  # the data, then the folder entry
    assert events[2][1] == str(path.parent)


# ------------------------------------------------------------------ a failed start leaves no group
@pytest.fixture
def one_rank_torchrun_environment(monkeypatch):
    """torchrun's variables for a one-rank group on a free loopback port."""
    from distributed_harness import free_port

    port = free_port()
    for name, value in dict(
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    ).items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("parallel", ["dp", "fsdp"])
def test_closing_a_parallel_run_lets_go_of_what_holds_its_groups(
    corpus, one_rank_torchrun_environment, parallel
):
    """FSDP2 and the distributed optimizers hold process groups; a gloo group they keep alive
    past ``destroy_process_group()`` ends at interpreter exit, where it can abort the rank."""
    import torch.distributed as dist

    run = TrainingRun(_config("muon", parallel=parallel, steps=2), text=corpus)
    run.step()
    parallelism = run.parallel
    run.close()
    assert not dist.is_initialized()
    for holder, names in (
        (run, ("model", "forward_model", "optimizer", "scheduler")),
        (parallelism, ("model", "forward_model", "optimizer")),
    ):
        for name in names:
            assert getattr(holder, name) is None, f"{type(holder).__name__}.{name} kept"


def test_a_run_that_fails_to_build_leaves_the_process_group_it_joined(
    corpus, one_rank_torchrun_environment
):
    """A rank still holding its gloo group at interpreter exit can abort there ("terminate
    called without an active exception"), after the clear error: the run leaves the group it
    created before the error reaches the caller."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="vocab_size=64 is smaller than the tokenizer's 256"):
        TrainingRun(_config("muon", parallel="dp", vocab_size=64), text=corpus)
    assert not dist.is_initialized()
