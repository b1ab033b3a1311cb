"""The optimizer's step metrics (:mod:`muonscale.step_metrics`) where Megatron's training loop
logs: its TensorBoard and W&B writers, and a piece of its ``log_string``."""

from __future__ import annotations

from typing import Any


def megatron_writers() -> tuple[Any, Any]:
    """Megatron's global TensorBoard and W&B writers (None each where not set up, or where
    ``megatron.training`` is not installed)."""
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return None, None
    return get_tensorboard_writer(), get_wandb_writer()


def log_step_metrics(
    optimizer: Any,
    iteration: int,
    *,
    writer: Any = None,
    wandb_writer: Any = None,
    across_ranks: bool = True,
) -> str:
    """Write ``optimizer``'s last step metrics at ``iteration`` as Megatron's ``training_log``
    writes its scalars (``writer.add_scalar``, ``wandb_writer.log``; default: Megatron's global
    writers), and return them as ``log_string`` items (``" name: value |"``). Call it on every
    rank at the iterations you log (``across_ranks``: one collective over every rank, which
    holds TP pieces and data-parallel owners)."""
    metrics = optimizer.read_step_metrics(across_ranks=across_ranks)
    if writer is None and wandb_writer is None:
        writer, wandb_writer = megatron_writers()
    for name, value in metrics.items():
        if writer is not None:
            writer.add_scalar(name, value, iteration)
    if wandb_writer is not None:
        wandb_writer.log(metrics, iteration)
    return "".join(f" {name}: {value:.6g} |" for name, value in metrics.items())
