"""How a bench contender becomes a ``muonscale.train`` training run.

The only place where ``BenchConfig`` is translated into a ``TrainConfig``: every contender
gets the same preset, seed (model init and data order), schedule and token budget; only the
optimizer and its learning rate differ.
"""

from __future__ import annotations

from muonscale.bench.config import BenchConfig
from muonscale.train.config import TrainConfig, model_preset


def train_config_for(
    bench: BenchConfig, contender: str, lr: float, *, steps: int | None = None
) -> TrainConfig:
    """The ``TrainConfig`` of one contender (``steps`` overrides ``bench.steps``, for sweeps)."""
    context = model_preset(bench.model, **bench.model_overrides()).context_length
    micro_batch = bench.micro_batch_size or max(1, bench.tokens_per_step // context)
    return TrainConfig(
        model=bench.model,
        **bench.model_overrides(),
        optimizer=contender,
        data=bench.data,
        tokenizer=bench.tokenizer,
        bpe_vocab_size=bench.bpe_vocab_size,
        lr=lr,
        weight_decay=bench.weight_decay,
        ns_dtype=bench.ns_dtype,
        momentum_dtype=bench.momentum_dtype,
        steps=bench.steps if steps is None else steps,
        micro_batch_size=micro_batch,
        tokens_per_step=bench.tokens_per_step,
        warmup_steps=bench.lr_warmup_steps,
        schedule=bench.schedule,
        eval_every=0,  # the bench evaluates every contender at the same steps itself
        eval_batches=bench.eval_batches,
        seed=bench.seed,
        device=bench.device,
        out_dir=None,
    )


def make_run(bench: BenchConfig, contender: str, lr: float, *, steps: int | None = None):
    """A fresh ``TrainingRun`` for one contender."""
    from muonscale.train.trainer import TrainingRun

    return TrainingRun(train_config_for(bench, contender, lr, steps=steps))
