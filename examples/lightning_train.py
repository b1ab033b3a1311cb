"""Train a tiny GPT-2 (random init from a config, CPU) with Lightning and muonscale.Muon,
embeddings on AdamW, gradient clipping wired. Needs lightning and transformers.

    PYTHONPATH=. python examples/lightning_train.py
"""

import lightning as L
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from muonscale.integrations import lightning as ms_lightning


class LM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = GPT2LMHeadModel(
            GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4)
        )

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return ms_lightning.configure_optimizers(self, lr=0.02, adamw_lr=0.01)

    def configure_gradient_clipping(
        self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None
    ):
        ms_lightning.configure_gradient_clipping(
            self, optimizer, gradient_clip_val, gradient_clip_algorithm
        )


def main():
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, 128, (256, 1), generator=g)
    ids = (start + torch.randint(1, 4, (256, 1), generator=g) * torch.arange(32)) % 128
    loader = torch.utils.data.DataLoader(ids, batch_size=16, shuffle=True)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=60,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(LM(), loader)


if __name__ == "__main__":
    main()
