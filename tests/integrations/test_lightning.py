"""muonscale.integrations.lightning under a real Lightning Trainer, on tiny GPT-2 and Llama.

Oracles: a plain torch loop with the same muonscale.Muon (clipping, accumulation, DDP at 2
gloo ranks) and an uninterrupted run (resume)."""

from __future__ import annotations

import os
import subprocess
import sys

import lightning as L
import pytest
import torch
from tiny_models import EMBEDDING_AND_HEAD, TokenData, algorithm_of, free_port, tiny_model

from muonscale.integrations import lightning as ms_lightning
from muonscale.integrations.hf import create_optimizer

HERE = os.path.dirname(os.path.abspath(__file__))

MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01}
PARAM_ATOL = 1e-4  # derived in test_hf.py: float32, two summation orders, 3 steps


class LM(L.LightningModule):
    def __init__(self, kind: str, seed: int = 0) -> None:
        super().__init__()
        self.model = tiny_model(kind, seed)
        self.kind = kind
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return ms_lightning.configure_optimizers(self, **MUON_KWARGS)

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        ms_lightning.configure_gradient_clipping(
            self, optimizer, gradient_clip_val, gradient_clip_algorithm
        )


def _fit(
    module, tmp_path, *, batch=4, n=64, ckpt_path=None, callbacks=(), sampler=None, **trainer_kwargs
):
    data = TokenData(n=n)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False, sampler=sampler)
    checkpointing = any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks)
    trainer_kwargs = {"accelerator": "cpu", "devices": 1, "logger": False, **trainer_kwargs}
    trainer = L.Trainer(
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=list(callbacks),
        enable_checkpointing=checkpointing,
        **trainer_kwargs,
    )
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def plain_loop(kind, steps, batch, max_grad_norm):
    model = tiny_model(kind)
    optimizer = create_optimizer(model, **MUON_KWARGS)
    data = TokenData()
    for step in range(steps):
        ids = torch.stack([data[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)])
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_routes_embeddings_and_head_to_adamw(kind):
    module = LM(kind)
    algorithms = algorithm_of(module.configure_optimizers())
    for name in EMBEDDING_AND_HEAD[kind]:
        assert algorithms["model." + name] == "adamw", name
    assert any(a == "muon" for a in algorithms.values())


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_loss_falls(kind, tmp_path):
    module = LM(kind)
    _fit(module, tmp_path, batch=8, max_steps=30)
    assert sum(module.losses[-3:]) < 0.5 * sum(module.losses[:3]), module.losses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_clipping_and_accumulation_match_plain_loop(kind, tmp_path):
    module = LM(kind)
    _fit(module, tmp_path, batch=2, max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05)
    reference = plain_loop(kind, steps=3, batch=4, max_grad_norm=0.05)
    unclipped = plain_loop(kind, steps=3, batch=4, max_grad_norm=None)
    got = dict(module.model.named_parameters())
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got[name].detach(), want.detach(), rtol=0, atol=PARAM_ATOL)
    far = max((got[n] - p).abs().max().item() for n, p in unclipped.named_parameters())
    assert far > 10 * PARAM_ATOL, (
        "clipping must change the result, or the comparison proves nothing"
    )


class _ClipsByOwnNorm:
    """An optimizer with its own clip_grad_norm_ (as the distributed ones have)."""

    def __init__(self):
        self.calls = []

    def clip_grad_norm_(self, max_norm):
        self.calls.append(max_norm)


def test_clipping_prefers_the_optimizers_own_norm():
    opt = _ClipsByOwnNorm()
    ms_lightning.configure_gradient_clipping(None, opt, 0.5, "norm")
    ms_lightning.configure_gradient_clipping(None, opt, None, None)
    assert opt.calls == [0.5]
    with pytest.raises(ValueError, match="by norm only"):
        ms_lightning.configure_gradient_clipping(None, opt, 0.5, "value")


class _RecordsBatches(L.Callback):
    def __init__(self):
        self.seen = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen.append((trainer.global_step, batch["input_ids"][:, 0].tolist()))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_resume_is_bit_exact(kind, tmp_path):
    """12 samples / batch 4 = 3 steps per epoch; checkpoint after step 3 (the epoch's last
    batch, on_train_batch_end), resume into a differently initialized model, 3 more steps.

    Lightning 2.6 resumes a plain DataLoader from its first batch while it keeps counting the
    interrupted epoch's batches, so only this checkpoint has the uninterrupted run's data order
    on resume: one taken mid-epoch, or by ``every_n_epochs`` (saved in on_train_epoch_end,
    restored as an epoch not yet completed: one extra step on batch 0), replays other batches
    (see docs/integrations.md). The batches are recorded to tell the two failures apart."""
    full, seen_full = LM(kind), _RecordsBatches()
    _fit(full, tmp_path / "full", n=12, max_steps=6, callbacks=[seen_full])
    ckpt = L.pytorch.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ck"), save_top_k=-1, every_n_train_steps=3
    )
    _fit(LM(kind), tmp_path / "first", n=12, max_epochs=1, callbacks=[ckpt])
    (path,) = (tmp_path / "ck").glob("*.ckpt")
    resumed, seen_resumed = LM(kind, seed=1), _RecordsBatches()
    _fit(
        resumed,
        tmp_path / "second",
        n=12,
        max_steps=6,
        ckpt_path=str(path),
        callbacks=[ckpt, seen_resumed],
    )
    assert seen_resumed.seen == seen_full.seen[3:], "data order after resume"
    want = dict(full.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, want[name]), name


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama"])
def test_ddp_two_ranks_match_single_process(kind, tmp_path):
    """torchrun, 2 gloo ranks, strategy="ddp", plain muonscale.Muon, batch 2 per rank with
    clipping = one process with batch 4 (an unshuffled DistributedSampler deals samples
    round-robin: the ranks' step-k batches together are samples 4k..4k+3)."""
    out = tmp_path / "ddp.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "lightning_ddp_worker.py"),
        kind,
        str(tmp_path),
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    reference = plain_loop(kind, steps=3, batch=4, max_grad_norm=0.05)
    unclipped = plain_loop(kind, steps=3, batch=4, max_grad_norm=None)
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got["model." + name], want.detach(), rtol=0, atol=PARAM_ATOL)
    far = max((got["model." + n] - p).abs().max().item() for n, p in unclipped.named_parameters())
    assert far > 10 * PARAM_ATOL, (
        "clipping must change the result, or the comparison proves nothing"
    )


@pytest.mark.timeout(300)
def test_fsdp2_two_ranks_match_single_process(tmp_path):
    """Lightning's FSDP2 path on CPU: torchrun, 2 gloo ranks, ModelParallelStrategy with
    fully_shard in configure_model; configure_optimizers builds DTensorMuon (whole matrices
    gathered to owners for Newton–Schulz). Batch 2 per rank with clipping = one process with
    batch 4 and plain muonscale.Muon. FSDP2 averages the ranks' gradients (reduce-scatter), as
    DDP does, so PARAM_ATOL's derivation (two summation orders, float32, 3 steps) holds."""
    out = tmp_path / "fsdp.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "lightning_fsdp_worker.py"),
        "llama",
        str(tmp_path),
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    reference = plain_loop("llama", steps=3, batch=4, max_grad_norm=0.05)
    unclipped = plain_loop("llama", steps=3, batch=4, max_grad_norm=None)
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got["model." + name], want.detach(), rtol=0, atol=PARAM_ATOL)
    far = max((got["model." + n] - p).abs().max().item() for n, p in unclipped.named_parameters())
    assert far > 10 * PARAM_ATOL, (
        "clipping must change the result, or the comparison proves nothing"
    )


class _PlainMuonLM(LM):
    """``configure_optimizers`` returning ``muonscale.Muon(self.parameters())``: no names."""

    def configure_optimizers(self):
        import muonscale

        return muonscale.Muon(self.parameters(), lr=MUON_KWARGS["lr"])


def test_unnamed_parameters_inside_lightning_are_refused_naming_configure_optimizers(tmp_path):
    """Inside Lightning, unnamed parameters are certain misrouting: refused, naming the fix a
    LightningModule can apply."""
    with pytest.raises(ValueError, match="unnamed") as refused:
        _fit(_PlainMuonLM("llama"), tmp_path, max_steps=1)
    message = str(refused.value)
    assert "muonscale.integrations.lightning.configure_optimizers(self" in message, message
    assert "MuonFactory" not in message and "named_parameters()" not in message


def test_step_metrics_reach_logged_metrics(tmp_path):
    """StepMetricsCallback: Muon's metrics in trainer.logged_metrics (what the loggers got), at
    the optimizer steps Lightning logs, with gradient accumulation (2 batches per step)."""
    from lightning.pytorch.loggers import CSVLogger

    module = LM("llama")
    trainer = _fit(
        module,
        tmp_path,
        n=16,
        callbacks=[ms_lightning.StepMetricsCallback()],
        logger=CSVLogger(str(tmp_path)),
        log_every_n_steps=1,
        accumulate_grad_batches=2,
        max_steps=2,
    )
    muon = [
        p
        for n, p in module.model.named_parameters()
        if p.ndim == 2 and n not in EMBEDDING_AND_HEAD["llama"]
    ]
    logged = trainer.logged_metrics
    assert logged["muon/ns_tensors"] == len(muon)
    assert logged["muon/ns_elements"] == sum(p.numel() for p in muon)
    assert logged["muon/update_rms/group0_muon"] > 0
    callback = trainer.callbacks[0]
    assert callback.optimizer.step_metrics.steps == trainer.global_step == 2
