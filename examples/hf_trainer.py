"""Train a tiny Llama (random init from a config, CPU) with the Hugging Face Trainer and
muonscale.Muon, embeddings and head on AdamW. Needs transformers >= 5 and accelerate.

    PYTHONPATH=. python examples/hf_trainer.py
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from muonscale.integrations import hf


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=256, seq=32, vocab=128):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (start + torch.randint(1, 4, (n, 1), generator=g) * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main():
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=16,
        max_steps=60,
        logging_steps=10,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        lr_scheduler_type="cosine",
        warmup_steps=5,
    )
    trainer = Trainer(
        model,
        args,
        train_dataset=Tokens(),
        optimizer_cls_and_kwargs=(hf.MuonFactory, {"lr": 0.02, "adamw_lr": 0.01}),
    )
    trainer.train()
    print(trainer.optimizer.optimizer.summary())


if __name__ == "__main__":
    main()
