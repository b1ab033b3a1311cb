"""muonscale.integrations.lightning under a real Lightning Trainer, on tiny GPT-2 and Llama.

Oracles: a plain torch loop with the same muonscale.Muon (clipping, accumulation) and an
uninterrupted run (resume)."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from tiny_models import EMBEDDING_AND_HEAD, TokenData, algorithm_of, tiny_model

from muonscale.integrations import lightning as ms_lightning
from muonscale.integrations.hf import create_optimizer

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

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        ms_lightning.configure_gradient_clipping(self, optimizer, gradient_clip_val, gradient_clip_algorithm)


def _fit(module, tmp_path, *, batch=4, n=64, ckpt_path=None, callbacks=(), **trainer_kwargs):
    loader = torch.utils.data.DataLoader(TokenData(n=n), batch_size=batch, shuffle=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), callbacks=list(callbacks),
        enable_checkpointing=bool(callbacks), **trainer_kwargs,
    )  # fmt: skip
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
    assert far > 10 * PARAM_ATOL, "clipping must change the result, or the comparison proves nothing"


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


@pytest.mark.xfail(strict=True, reason="open: the resumed run diverges from the uninterrupted "
                   "one in this setup (data order or loop state at the epoch boundary, not yet "
                   "diagnosed); the Trainer's optimizer.pt round trip is bit-exact in test_hf.py")
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_resume_is_bit_exact(kind, tmp_path):
    # 12 samples / batch 4 = 3 steps per epoch; the checkpoint is at an epoch boundary.
    full = LM(kind)
    _fit(full, tmp_path / "full", n=12, max_steps=6)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_top_k=-1, every_n_epochs=1)
    _fit(LM(kind), tmp_path / "first", n=12, max_epochs=1, callbacks=[ckpt])
    path = next((tmp_path / "ck").glob("*.ckpt"))
    resumed = LM(kind, seed=1)
    _fit(resumed, tmp_path / "second", n=12, max_steps=6, ckpt_path=str(path), callbacks=[
        L.pytorch.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ck2"))])
    want = dict(full.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, want[name]), name
