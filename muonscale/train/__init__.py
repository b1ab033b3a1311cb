"""Reference training stack: a nanoGPT-style model, a byte-level Shakespeare corpus and a
trainer that runs Muon, AdamW or torch.optim.Muon side by side.

Not imported by ``import muonscale``; import ``muonscale.train`` explicitly.
"""

from muonscale.train.config import (
    ModelConfig,
    TrainConfig,
    add_dataclass_arguments,
    dataclass_from_args,
    model_preset,
)
from muonscale.train.data import ByteTokenizer, TokenDataset, load_corpus
from muonscale.train.model import GPT
from muonscale.train.optimizers import HybridOptimizer, build_optimizer, optimizer_state_bytes
from muonscale.train.schedule import LRSchedule
from muonscale.train.trainer import NonFiniteLossError, RunSummary, StepResult, TrainingRun

__all__ = [
    "GPT",
    "ByteTokenizer",
    "HybridOptimizer",
    "LRSchedule",
    "ModelConfig",
    "NonFiniteLossError",
    "RunSummary",
    "StepResult",
    "TokenDataset",
    "TrainConfig",
    "TrainingRun",
    "add_dataclass_arguments",
    "build_optimizer",
    "dataclass_from_args",
    "load_corpus",
    "model_preset",
    "optimizer_state_bytes",
]
