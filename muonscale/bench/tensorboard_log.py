"""``--tensorboard DIR``: the bench curves as TensorBoard event files.

One run folder per contender and seed, ``DIR/<contender>/seed<S>``, so TensorBoard overlays
the contenders. Scalars: ``val_loss`` (x: optimizer step), ``val_loss_vs_train_ms`` (x:
training milliseconds, evaluation excluded), ``train_loss`` (x: optimizer step) and, for a
contender that measured it (QK-clip, ``--track-max-logit``), ``max_attention_logit`` (x:
optimizer step), and every step's optimizer figures (a muonscale optimizer's step metrics,
``muon/ns_elements``, ``muon/update_rms/<group>``, …; the AdamW update RMS of the others,
``adamw/update_rms/<group>``: :mod:`muonscale.step_metrics`).
A run folder's older event files are replaced (a resumed bench writes the same curves again,
and TensorBoard would otherwise show them twice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path

from muonscale.bench.side_by_side import ContenderRecord


def write_tensorboard(
    per_seed: Mapping[int, Mapping[str, ContenderRecord]], folder: str | Path
) -> list[Path]:
    """Write the event files; return the run folders written."""
    from torch.utils.tensorboard import SummaryWriter

    written = []
    for seed, records in per_seed.items():
        for name, record in records.items():
            run_dir = Path(folder) / name / f"seed{seed}"
            for old in run_dir.glob("events.out.tfevents.*"):
                old.unlink()
            writer = SummaryWriter(log_dir=str(run_dir))
            try:
                for step, loss, seconds in zip(
                    record.eval_steps, record.val_losses, record.eval_train_seconds
                ):
                    if math.isfinite(loss):
                        writer.add_scalar("val_loss", loss, step)
                        writer.add_scalar("val_loss_vs_train_ms", loss, round(seconds * 1e3))
                for step, loss in enumerate(record.train_losses, 1):
                    writer.add_scalar("train_loss", loss, step)
                for step, logit in enumerate(record.max_attention_logits, 1):
                    writer.add_scalar("max_attention_logit", logit, step)
                for step, figures in enumerate(record.step_metrics, 1):
                    for tag, value in figures.items():
                        writer.add_scalar(tag, value, step)
            finally:
                writer.close()
            written.append(run_dir)
    return written


def write_tensorboard_or_say_why(
    per_seed: Mapping[int, Mapping[str, ContenderRecord]],
    folder: str | Path,
    log: Callable[[str], None],
) -> list[Path]:
    """:func:`write_tensorboard`, called after the report was written: an ``OSError`` (the
    folder gone, a full disk) is said through ``log`` and the bench goes on (returns [])."""
    try:
        return write_tensorboard(per_seed, folder)
    except OSError as error:
        log(
            f"bench: --tensorboard {folder}: the event files could not be written ({error}); "
            "the report is written without them"
        )
        return []
