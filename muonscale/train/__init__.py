"""Reference training stack: a nanoGPT-style model, a byte-level Shakespeare corpus and a
trainer that runs Muon, AdamW or torch.optim.Muon side by side.

Not imported by ``import muonscale``; import ``muonscale.train`` explicitly. Names load on
first use (PEP 562), so ``muonscale.train.config`` imports without torch.
"""

from __future__ import annotations

from muonscale.lazy_names import lazy_names

# Public name -> submodule defining it.
_LAZY = {
    "ModelConfig": "config",
    "TrainConfig": "config",
    "add_dataclass_arguments": "config",
    "dataclass_from_args": "config",
    "model_preset": "config",
    "ByteTokenizer": "data",
    "TokenDataset": "data",
    "load_corpus": "data",
    "GPT": "model",
    "HybridOptimizer": "optimizers",
    "build_optimizer": "optimizers",
    "optimizer_state_bytes": "optimizers",
    "LRSchedule": "schedule",
    "NonFiniteLossError": "trainer",
    "RunSummary": "trainer",
    "StepResult": "trainer",
    "TrainingRun": "trainer",
}


__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)

__all__ = sorted(_LAZY, key=str.casefold)
