"""``muonscale train`` refuses, before its first step, a run that could not be saved, would
replace another run's checkpoint or resumes from NaN; it reports what a resume changes, rebuilds
a damaged BPE cache, and names a full disk during a ``--parallel`` save.

Oracles: the bytes of the checkpoint already there (unchanged), the metrics (no step was
trained), the messages (they name the files and tensors), and for ``--qk-clip`` under
``--parallel fsdp`` single-process Muon + QK-clip (bitwise, the bound
tests/test_options_reach_layouts.py holds DTensorMuon to). The data-loss cases run the real CLI
(``muonscale.cli.main``, once as its own process) on a one-layer model in a temporary folder.
The full-disk cases mount a tmpfs: as root only, and under ``CI=true`` they fail, not skip.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import traceback
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from distributed_harness import WorkerPool

from muonscale.cli import main
from muonscale.train.checkpoint import CheckpointError, read_checkpoint, write_checkpoint
from muonscale.train.config import TrainConfig
from muonscale.train.data import load_corpus
from muonscale.train.run_guards import check_writable
from muonscale.train.trainer import NonFiniteLossError, TrainingRun

pytestmark = pytest.mark.timeout(240)

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(
    n_layer=1,
    d_model=32,
    n_head=2,
    context_length=16,
    micro_batch_size=2,
    eval_every=0,
    eval_batches=1,
    warmup_steps=1,
    log_every=1,
    device="cpu",
)
FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in TINY.items()] + ["--no-progress"]


def _train(out_dir: Path, *args: str) -> int:
    return main(["train", *FLAGS, "--out-dir", str(out_dir), *args])


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _trained_steps(out_dir: Path) -> list[int]:
    metrics = out_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["step"] for r in records if r["event"] == "train"]


@contextmanager
def _one_rank_group(tmp_path: Path):
    """A gloo group of one process (this one), as torchrun would give a --parallel run."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _run(out_dir: Path, **overrides) -> TrainingRun:
    config = TrainConfig(**{**TINY, "steps": 2, "out_dir": str(out_dir), **overrides})
    return TrainingRun(config, text=load_corpus())


def _finish(run: TrainingRun) -> TrainingRun:
    try:
        run.run(progress=False)
    finally:
        run.close()
    return run


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------ --resume OTHER
def test_resuming_another_run_does_not_replace_this_out_dirs_checkpoint(tmp_path, capsys):
    first, second = tmp_path / "first", tmp_path / "second"
    assert _train(first, "--steps", "3") == 0
    assert _train(second, "--steps", "2") == 0
    kept, source = second / "checkpoint.pt", first / "checkpoint.pt"
    before = _digest(kept)
    capsys.readouterr()

    command = [sys.executable, "-m", "muonscale", "train", *FLAGS, "--out-dir", str(second)]
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    refused = subprocess.run(
        [*command, "--resume", str(source), "--steps", "4"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 1, refused.stderr[-3000:]
    message = refused.stderr
    assert str(source) in message and str(kept) in message and "--overwrite" in message
    assert _digest(kept) == before and _trained_steps(second) == [1, 2]  # nothing trained

    # allowed: the out-dir's own checkpoint, an out-dir without one, or --overwrite
    assert _train(second, "--resume", str(kept), "--steps", "3") == 0
    assert read_checkpoint(kept)["step"] == 3
    assert _train(tmp_path / "third", "--resume", str(source), "--steps", "4") == 0
    assert read_checkpoint(tmp_path / "third" / "checkpoint.pt")["step"] == 4
    assert _train(second, "--resume", str(source), "--steps", "5", "--overwrite") == 0
    assert read_checkpoint(kept)["step"] == 5
    assert _digest(source) != _digest(kept) and read_checkpoint(source)["step"] == 3


# ------------------------------------------------------------------ an unwritable target
@pytest.mark.parametrize("overwrite", [True, False])
def test_a_folder_where_the_checkpoint_goes_is_refused_before_training(tmp_path, capsys, overwrite):
    (tmp_path / "checkpoint.pt").mkdir()
    flags = ["--overwrite"] if overwrite else []
    assert _train(tmp_path, "--steps", "3", *flags) == 1
    message = capsys.readouterr().err
    assert f"{tmp_path / 'checkpoint.pt'} is a folder, expected a file" in message
    assert _trained_steps(tmp_path) == []


def test_a_file_where_the_parallel_checkpoints_go_is_refused(tmp_path):
    (tmp_path / "checkpoints").write_text("not a folder")
    with pytest.raises(OSError, match=r"checkpoints is a file, expected a folder"):
        check_writable(tmp_path / "checkpoints", folder=True)
    check_writable(tmp_path / "new" / "checkpoints", folder=True)  # created and writable
    assert (tmp_path / "new" / "checkpoints").is_dir()


# ------------------------------------------------------------------ a NaN checkpoint
def _poison(state: dict, where: str) -> str:
    """Put a NaN into the checkpoint ``state``; return the tensor's name in the message."""
    if where == "parameter":  # byte 255 never occurs in UTF-8 text: no batch reads that row
        state["model"]["wte.weight"][255, 0] = float("nan")
        return "wte.weight"
    entry = next(iter(state["optimizer"]["state"].values()))
    key = next(k for k, v in entry.items() if torch.is_tensor(v) and v.is_floating_point())
    entry[key].view(-1)[0] = float("nan")
    return f"optimizer state {key!r}"


@pytest.mark.parametrize("where", ["parameter", "optimizer"])
def test_a_nan_checkpoint_is_refused_at_resume_naming_the_tensor(tmp_path, capsys, where):
    assert _train(tmp_path, "--steps", "2") == 0
    checkpoint = tmp_path / "checkpoint.pt"
    state = read_checkpoint(checkpoint)
    name = _poison(state, where)
    write_checkpoint(state, checkpoint)
    before = _digest(checkpoint)
    capsys.readouterr()

    assert _train(tmp_path, "--resume", "auto", "--steps", "6") == 1
    message = capsys.readouterr().err
    assert f"{checkpoint} holds NaN/inf in {name}" in message, message
    assert "last good" not in message  # the NaN checkpoint is not called good
    assert _digest(checkpoint) == before and _trained_steps(tmp_path) == [1, 2]


@pytest.mark.parametrize("optimizer", ["muon", "torch-muon"])
def test_a_save_of_a_nan_optimizer_state_is_refused_naming_it(tmp_path, optimizer):
    """What a resume refuses is never saved: the earlier checkpoint stays."""
    run = _run(tmp_path, optimizer=optimizer)
    run.run(progress=False)
    checkpoint = tmp_path / "checkpoint.pt"
    before = _digest(checkpoint)
    inner = getattr(run.optimizer, "optimizers", {"": run.optimizer})  # torch-muon: a hybrid
    state = next(s for opt in inner.values() for s in opt.state.values())
    key = next(k for k, v in state.items() if torch.is_tensor(v) and v.is_floating_point())
    state[key].view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteLossError, match=rf"optimizer state '{key}' of .* holds NaN/inf"):
        run.save_checkpoint(checkpoint)
    assert _digest(checkpoint) == before


# ------------------------------------------------------------------ the other kind, auto
def test_resume_auto_refuses_a_checkpoint_of_the_other_kind(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    _run(single).run(progress=False)
    with _one_rank_group(tmp_path):
        _finish(_run(sharded, parallel="dp"))
        run = _run(single, parallel="dp", resume="auto", steps=4)
        with pytest.raises(CheckpointError, match=r"found .*single.checkpoint\.pt, the "):
            _finish(run)
        assert run.step_count == 0
    run = _run(sharded, resume="auto", steps=4)
    with pytest.raises(CheckpointError, match=r"found .*sharded.checkpoints, the checkpoint of a "):
        run.run(progress=False)
    assert run.step_count == 0
    assert _trained_steps(single) == [1, 2] and _trained_steps(sharded) == [1, 2]


def test_a_parallel_resume_of_another_run_is_refused_and_its_own_step_folder_is_not(tmp_path):
    from muonscale.train.run_guards import CheckpointExistsError

    first, second = tmp_path / "first", tmp_path / "second"
    with _one_rank_group(tmp_path):
        _finish(_run(first, parallel="dp"))
        _finish(_run(second, parallel="dp"))
        latest = (second / "checkpoints" / "latest").read_bytes()
        source = first / "checkpoints"
        run = _run(second, parallel="dp", resume=str(source), steps=4)
        with pytest.raises(CheckpointExistsError, match=rf"--resume {source} would save .* over"):
            _finish(run)
        assert run.step_count == 0 and (second / "checkpoints" / "latest").read_bytes() == latest
        (own,) = (second / "checkpoints").glob("step-*")
        assert _finish(_run(second, parallel="dp", resume=str(own), steps=3)).step_count == 3


# ------------------------------------------------------------------ reported changes
def test_resume_reports_a_new_seed_data_or_tokens_per_step(tmp_path, capsys):
    _run(tmp_path).run(progress=False)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(load_corpus())
    tokens = 2 * TINY["micro_batch_size"] * TINY["context_length"]
    config = TrainConfig(
        **{**TINY, "steps": 3, "out_dir": str(tmp_path), "resume": "auto"},
        seed=7,
        data=str(corpus),
        tokens_per_step=tokens,
    )
    run = TrainingRun(config)
    run.run(progress=False)
    assert run.resume_changes["seed"] == (0, 7)
    assert run.resume_changes["data"] == (None, str(corpus))
    assert run.resume_changes["tokens_per_step"] == (tokens // 2, tokens)
    err = capsys.readouterr().err
    assert "resuming with seed=7 (the checkpoint had 0)" in err
    assert f"resuming with tokens_per_step={tokens}" in err
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start = [r for r in records if r["event"] == "start"][-1]
    assert start["step"] == 2 and start["resume_changes"]["seed"] == [0, 7]


def test_an_unchanged_batch_written_out_is_no_change(tmp_path):
    _run(tmp_path).run(progress=False)
    tokens = TINY["micro_batch_size"] * TINY["context_length"]  # what None means
    run = _run(tmp_path, resume="auto", steps=3, tokens_per_step=tokens)
    run.run(progress=False)
    assert run.resume_changes == {}


# ------------------------------------------------------------------ the BPE cache
def test_a_truncated_bpe_cache_is_rebuilt_naming_the_file(tmp_path):
    pytest.importorskip("tokenizers")
    from muonscale.train.bpe import BPETokenizer

    text = load_corpus()[:20_000]
    first = BPETokenizer.trained_on(text, 300, directory=tmp_path)
    (cached,) = tmp_path.glob("bpe-300-*.json")
    whole = cached.read_bytes()
    cached.write_bytes(whole[: len(whole) // 2])
    with pytest.warns(UserWarning, match=rf"{cached}.*unreadable.*training it again"):
        again = BPETokenizer.trained_on(text, 300, directory=tmp_path)
    sample = text[:2000]
    assert torch.equal(again.encode(sample), first.encode(sample))
    assert cached.read_bytes() == whole  # replaced by the same tokenizer, whole
    assert not list(tmp_path.glob(".*tmp*"))


# ------------------------------------------------------------------ a full disk, --parallel
def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":  # CI runs as root and must run these
        pytest.fail(f"CI must be able to mount a tmpfs: {reason}")
    pytest.skip(reason)


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def tmpfs(tmp_path):
    """A 16 MiB tmpfs at ``tmp_path/disk``, unmounted afterwards even when the test fails."""
    if os.geteuid() != 0:
        _unavailable("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    done = _mount("-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk))
    if done.returncode:
        _unavailable(f"mount -t tmpfs failed: {done.stderr.strip()}")
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], timeout=30).returncode:
            subprocess.run(["umount", "-l", str(disk)], timeout=30)


def _shrink_to(disk: Path, free_bytes: int) -> None:
    """Remount ``disk`` so that about ``free_bytes`` stay free."""
    stats = os.statvfs(disk)
    used = (stats.f_blocks - stats.f_bfree) * stats.f_frsize
    done = _mount("-o", f"remount,size={(used + free_bytes) // 1024}k", str(disk))
    assert done.returncode == 0, done.stderr


def _torchrun_train(out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", "-m", "muonscale", "train", "--parallel", "dp"]
    command += [*FLAGS, "--pg-timeout-s", "30", "--out-dir", str(out_dir), *args]
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        command, env=environment, capture_output=True, text=True, timeout=180, cwd=ROOT
    )


def test_a_full_disk_during_a_parallel_save_names_it_and_keeps_latest(tmpfs):
    from muonscale.train.dcp_checkpoint import _verify

    out_dir = tmpfs / "run"
    with _one_rank_group(tmpfs.parent):  # the first 2 steps in this process: a world-size-1 save
        _finish(_run(out_dir, parallel="dp"))
    root = out_dir / "checkpoints"
    (folder,) = root.glob("step-*")
    size = sum(f.stat().st_size for f in folder.iterdir())
    _shrink_to(tmpfs, size // 2)  # room for half a checkpoint

    full = _torchrun_train(out_dir, "--steps", "4", "--resume", "auto")
    assert full.returncode != 0
    assert "No space left on device" in full.stderr, full.stderr[-3000:]
    assert f"{root / 'latest'} still names the last good checkpoint, step 2" in full.stderr
    assert "CheckpointException" not in full.stderr and "]: Traceback" not in full.stderr
    assert not list(root.glob(".step-*"))  # the partial folder gave its space back
    verified, state = _verify(root)
    assert verified == folder and state["step"] == 2


def test_a_write_failure_torch_does_not_name_is_probed_for_space(tmpfs):
    """torch's zip writer turns ENOSPC into "unexpected pos"; a probe write names it."""
    from torch.distributed.checkpoint.api import CheckpointException

    from muonscale.train.dcp_checkpoint import _save_failure

    root = tmpfs / "checkpoints"
    temporary = root / ".step-00000004-0.tmp"
    temporary.mkdir(parents=True)
    with pytest.raises(OSError), open(tmpfs / "filler", "wb") as filler:
        while True:
            filler.write(bytes(1 << 20))
            filler.flush()
    hidden = RuntimeError("unexpected pos 704 vs 598")
    failure = CheckpointException("save", {1: (hidden, traceback.StackSummary())})
    message = _save_failure(temporary, root, failure)
    assert message.startswith(f"could not write checkpoint {temporary} (on rank 1): No space")
    assert "no earlier checkpoint" in message and not temporary.exists()


# ------------------------------------------------------------------ --qk-clip under fsdp
QK_TAU = 0.01  # a quarter of the smallest initial maximum logit: the first step clips every head


def qk_clip_fsdp_worker(rank, world_size, n_kv_head):
    """The trainer's --parallel fsdp optimizer and QK-clip (row-sharded DTensor QKV weights)
    against single-process Muon + QK-clip, given the same gradients and maxima."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    from muonscale.qk_clip import QKClip
    from muonscale.train.model import GPT
    from muonscale.train.optimizers import build_optimizer
    from muonscale.train.parallel import Parallelism

    # 6 heads of 8 (MHA: 3 x 48 QKV rows a head, GQA: 2 q + k + v per group): the 144 or 96
    # rows split at row 72 or 48, inside a head's or a group's block
    config = TrainConfig(
        **{**TINY, "d_model": 48, "n_head": 6, "n_kv_head": n_kv_head, "n_layer": 2},
        qk_clip=QK_TAU,
        lr=0.02,
        out_dir=None,
    )
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(GPT(config.model_config()))
    single, sharded = models
    single_optimizer = build_optimizer("muon", single, config)
    parallel = Parallelism("fsdp", device="cpu", pg_timeout_s=60)
    sharded_optimizer = parallel.build(sharded, config)
    single_clip = QKClip(single.qk_clip_targets(), tau=QK_TAU)
    sharded_clip = QKClip(sharded.qk_clip_targets(), tau=QK_TAU)
    tokens = torch.randint(0, 256, (3, 2, 17), generator=torch.Generator().manual_seed(1))
    maxima = []
    for batch in tokens:
        _, loss = single(batch[:, :-1], batch[:, 1:], probe_max_logits=True)
        loss.backward()
        step_maxima = single.pop_max_attention_logits()
        maxima.append(torch.stack(step_maxima).min().item())
        gradients = {n: p.grad for n, p in single.named_parameters()}
        for name, p in sharded.named_parameters():
            whole = distribute_tensor(gradients[name], p.device_mesh, [Replicate()])
            p.grad = whole.redistribute(p.device_mesh, p.placements)
        single_optimizer.step()
        single_clip([m.clone() for m in step_maxima])
        sharded_optimizer.step()
        sharded_clip([m.clone() for m in step_maxima])
        single_optimizer.zero_grad(set_to_none=True)
        sharded_optimizer.zero_grad(set_to_none=True)
    sharded_params = dict(sharded.named_parameters())
    differences = {}
    for name, p in single.named_parameters():
        other = sharded_params[name]
        other = other.full_tensor() if isinstance(other, DTensor) else other
        differences[name] = (p.detach() - other.detach()).abs().max().item()
    parallel.close()
    return {"differences": differences, "min_maxima": maxima}


def qk_clip_fsdp_cases(rank, world_size):
    return {n_kv_head: qk_clip_fsdp_worker(rank, world_size, n_kv_head) for n_kv_head in (6, 3)}


@pytest.fixture(scope="module")
def qk_clip_fsdp():
    with WorkerPool(2) as pool:
        return pool.run(qk_clip_fsdp_cases)[0]


@pytest.mark.parametrize("n_kv_head", [6, 3], ids=["mha", "gqa"])
def test_qk_clip_under_fsdp_at_two_ranks_equals_one_process(qk_clip_fsdp, n_kv_head):
    result = qk_clip_fsdp[n_kv_head]
    assert result["min_maxima"][0] > QK_TAU  # every head clipped at the first step
    assert result["differences"] == dict.fromkeys(result["differences"], 0.0)


def test_a_metrics_write_that_fails_names_the_file():
    from muonscale.train.run_log import MetricsLog

    full = Path("/dev/full")  # every write: ENOSPC
    if not full.exists():
        pytest.skip("/dev/full is absent")
    log = MetricsLog(full)
    with pytest.raises(OSError, match="could not append to /dev/full: No space left on device"):
        log.write(event="start", step=0)
    with suppress(OSError):  # the buffered line cannot be flushed either
        log.close()
