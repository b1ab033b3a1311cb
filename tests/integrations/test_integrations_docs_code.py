"""The README's and docs' Python blocks marked ``env: integrations`` (``tests/docs_blocks.py``)
run as written on tiny models, and what they build trains: the Trainer for two steps, the
LightningModule's optimizer and the torchtitan config's optimizers for one step each."""

from __future__ import annotations

import contextlib

import pytest
import torch
from docs_blocks import blocks_for, one_rank_world
from docs_stand_ins import build
from tiny_models import TokenData, tiny_model

import muonscale


def _training_args(ns, tmp_path):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )


def _titan_config(ns):
    from torchtitan.trainer import Trainer

    return Trainer.Config()


def _stand_ins(tmp_path) -> dict:
    hf = {
        "model": lambda ns: tiny_model("gpt2"),
        "args": lambda ns: _training_args(ns, tmp_path),
        "ds": lambda ns: TokenData(16),
    }
    return {
        "README.md": {**hf, "config": _titan_config},
        "docs/integrations.md": {**hf, "config": _titan_config},
    }


def _exercise(ns) -> None:
    if "trainer" in ns:
        trainer = ns["trainer"]
        trainer.train()
        assert isinstance(trainer.optimizer.optimizer, muonscale.Muon), type(trainer.optimizer)
        assert trainer.optimizer.optimizer.state
    if "LM" in ns:

        class Tiny(ns["LM"]):
            def __init__(self):
                super().__init__()
                self.model = tiny_model("gpt2")

        opt = Tiny().configure_optimizers()
        assert isinstance(opt, muonscale.Muon), type(opt)
    if "config" in ns:
        from titan_models import batch, loss_of
        from titan_models import tiny_model as titan_model

        model = titan_model("llama3")
        optimizers = ns["config"].optimizer.build(model_parts=[model])
        loss_of(model, batch(0)).backward()
        optimizers.step()
        assert all(isinstance(o, muonscale.Muon) and o.state for o in optimizers.optimizers)


@pytest.mark.parametrize("block", blocks_for("integrations"))
def test_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    with one_rank_world() if "Distributed" in block.code else contextlib.nullcontext():
        ns = build(block.path, block.stand_ins, _stand_ins(tmp_path))
        exec(compile(block.code, block.id, "exec"), ns)
        _exercise(ns)
