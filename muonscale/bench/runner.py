"""How a bench contender becomes a ``muonscale.train`` training run.

The only place where ``BenchConfig`` is translated into a ``TrainConfig``: every contender
gets the same preset, seed (model init and data order), schedule and token budget; only the
optimizer and its learning rate differ.

Contenders: ``adamw``, ``muon`` and ``torch-muon`` are ``muonscale.train`` optimizers;
``torch-muon-bf16`` is ``torch-muon`` left in bfloat16 (``torch-muon`` runs its Newton-Schulz
in float32 on CPU, see :mod:`muonscale.bench.torch_muon`); a ``--variants`` contender is the
``muon`` run with its optimizer rebuilt with the variant's options
(:mod:`muonscale.bench.variants`).
"""

from __future__ import annotations

import functools
import lzma
from collections.abc import Callable
from pathlib import Path
from typing import Any

from muonscale.bench.config import BenchConfig
from muonscale.train.config import TrainConfig, model_preset

DATA_DIR = Path(__file__).resolve().parent.parent / "data"


def base_optimizer(bench: BenchConfig, contender: str) -> str:
    """The ``muonscale.train`` optimizer a contender starts from."""
    if bench.variant_options(contender) is not None:
        return "muon"
    if contender == "torch-muon-bf16":
        return "torch-muon"
    return contender


def train_config_for(
    bench: BenchConfig, contender: str, lr: float, *, steps: int | None = None
) -> TrainConfig:
    """The ``TrainConfig`` of one contender (``steps`` overrides ``bench.steps``, for sweeps).

    Raises ``ValueError`` for a bad configuration, including a variant option that
    ``muonscale.Muon`` does not accept."""
    options = bench.variant_options(contender)
    if options is not None:
        from muonscale.bench.variants import check_options

        check_options(contender, options)
    context = model_preset(bench.model, **bench.model_overrides()).context_length
    micro_batch = bench.micro_batch_size or max(1, bench.tokens_per_step // context)
    return TrainConfig(
        model=bench.model,
        **bench.model_overrides(),
        optimizer=base_optimizer(bench, contender),
        data=bench.data,
        tokenizer=bench.tokenizer,
        bpe_vocab_size=bench.bpe_vocab_size,
        lr=lr,
        # AdamW has no Muon half: its run (and saved key) is the same at every --momentum,
        # --muon-adamw-lr and --muon-weight-decay
        **(
            {"weight_decay": bench.weight_decay}
            if base_optimizer(bench, contender) == "adamw"
            else {
                "weight_decay": bench.weight_decay
                if bench.muon_weight_decay is None
                else bench.muon_weight_decay,
                "momentum": bench.momentum,
                "adamw_lr": bench.muon_adamw_lr,
            }
        ),
        ns_dtype=bench.ns_dtype,
        momentum_dtype=bench.momentum_dtype,
        steps=bench.steps if steps is None else steps,
        micro_batch_size=micro_batch,
        tokens_per_step=bench.tokens_per_step,
        warmup_steps=bench.lr_warmup_steps,
        schedule=bench.schedule,
        eval_every=0,  # the bench evaluates every contender at the same steps itself
        eval_batches=bench.eval_batches,
        qk_clip=bench.qk_clip_for(contender),
        seed=bench.seed,
        device=bench.device,
        out_dir=None,
    )


def muon_options_for(bench: BenchConfig, contender: str, lr: float, model) -> dict | None:
    """The ``muonscale.Muon`` keyword arguments contender's run builds its optimizer with
    (``model``: its model); None for a contender without a ``muonscale.Muon``."""
    if base_optimizer(bench, contender) != "muon":
        return None
    from muonscale.train.optimizers import muon_options

    options = muon_options(model, train_config_for(bench, contender, lr))
    variant = bench.variant_options(contender)
    if variant:
        from muonscale.bench.variants import to_muon_kwargs

        options.update(to_muon_kwargs(variant))
    return options


@functools.lru_cache(maxsize=1)
def bundled_corpus_text(name: str) -> str:
    """The text of a bundled corpus (``muonscale/data/<name>.txt.xz``)."""
    return lzma.decompress((DATA_DIR / f"{name}.txt.xz").read_bytes()).decode("utf-8")


def newton_schulz_precision(bench: BenchConfig, contender: str) -> str | None:
    """How torch.optim.Muon's iteration runs for a torch contender (part of its run key)."""
    if contender == "torch-muon-bf16":
        return "bfloat16"
    if contender == "torch-muon":
        return "float32" if device_type(bench.device) == "cpu" else "bfloat16"
    return None


def device_type(device: str) -> str:
    """``cpu`` or ``cuda`` (``auto`` resolved)."""
    from muonscale.train.parallel import resolve_device

    return resolve_device(device).type


def make_run(bench: BenchConfig, contender: str, lr: float, *, steps: int | None = None):
    """A fresh training run for one contender."""
    from muonscale.train.schedule import build_scheduler
    from muonscale.train.trainer import TrainingRun

    config = train_config_for(bench, contender, lr, steps=steps)
    text = bundled_corpus_text(bench.corpus) if bench.corpus is not None else None
    run = TrainingRun(config, text=text)
    run.probe_max_logits = bench.tracks_max_logit(contender)
    options = bench.variant_options(contender)
    if options is not None:
        from muonscale.bench.variants import build_variant_optimizer

        run.optimizer = build_variant_optimizer(run.model, config, options)
        run.scheduler = build_scheduler(run.optimizer, run.schedule)
    if newton_schulz_precision(bench, contender) == "float32":
        from muonscale.bench.torch_muon import Float32NewtonSchulzRun

        return Float32NewtonSchulzRun(run)
    return run


def step_metric_readers(runs: dict[str, Any]) -> dict[str, Callable[[], dict[str, float]]]:
    """Each run's reader of its optimizer's figures after a step (``--tensorboard``)."""
    from muonscale.train.tensorboard_log import optimizer_figures

    readers = {}
    for name, run in runs.items():
        optimizer = getattr(run, "optimizer", None)  # a stand-in run may have none
        readers[name] = dict if optimizer is None else optimizer_figures(optimizer)
    return readers
