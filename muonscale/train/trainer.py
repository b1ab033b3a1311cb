"""One training run: model, data, optimizer and schedule built from a ``TrainConfig``.

``TrainingRun(config).run()`` is the ``muonscale train`` loop; the benchmarks drive
``.step()`` / ``.evaluate()`` themselves. Everything is seeded and the data order is a pure
function of ``(seed, step)``, so saving a checkpoint, building a fresh ``TrainingRun`` and
loading it continues bit-identically on CPU.

With ``config.parallel`` ("dp" or "fsdp", under torchrun) a :class:`Parallelism` joins the
process group, shards or wraps the model, splits every global batch between the ranks and
makes them agree on the loss and on stopping; checkpoints are then DCP folders
(:mod:`muonscale.train.dcp_checkpoint`). Only rank 0 writes ``metrics.jsonl`` and prints.
"""

from __future__ import annotations

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from muonscale.qk_clip import QKClip
from muonscale.train import run_checkpoint
from muonscale.train.config import TrainConfig
from muonscale.train.data import TokenDataset, load_corpus, make_tokenizer
from muonscale.train.dcp_checkpoint import FOLDER as SHARDED_FOLDER
from muonscale.train.model import GPT
from muonscale.train.optimizers import build_optimizer, optimizer_state_bytes
from muonscale.train.parallel import Parallelism, resolve_device
from muonscale.train.run_checkpoint import CHECKPOINT_NAME
from muonscale.train.run_guards import (
    CheckpointExistsError,
    NonFiniteLossError,
    first_nonfinite,
)
from muonscale.train.run_log import MetricsLog, progress_bar
from muonscale.train.schedule import build_scheduler, schedule_for
from muonscale.train.stop_signals import StopSignals

__all__ = [
    "CheckpointExistsError",
    "NonFiniteLossError",
    "RunSummary",
    "StepResult",
    "TrainingRun",
    "build_optimizer",
]

METRICS_NAME = "metrics.jsonl"


@dataclass(frozen=True, kw_only=True)
class StepResult:
    step: int
    """Optimizer steps completed, this one included (1 after the first step)."""
    loss: float
    """Mean training loss over the step's micro-batches (before the update)."""
    lr: float
    """Learning rate of this update: peak lr times the schedule multiplier."""
    tokens: int
    """Tokens processed in this step (all micro-batches)."""
    step_seconds: float
    """Wall time of the whole step: data, forward, backward, clipping, optimizer."""
    optimizer_seconds: float
    """Wall time of ``optimizer.step()`` alone (device-synchronized)."""
    max_attention_logit: float | None = None
    """With qk_clip: the largest attention logit of any head in this step's forwards (MAX over
    the ranks), measured before the update and the clip; also without qk_clip when
    ``TrainingRun.probe_max_logits`` is set (this rank's); None otherwise."""
    max_logit_seconds: float | None = None
    """Time the max-logit probe took in this step's forwards (part of ``step_seconds``); None
    when not probed."""
    expert_tokens: list[list[int]] | None = None
    """With ``mlp="moe"``: tokens routed to each expert (n_layer x E) in this step's forwards,
    over the global batch (summed over the ranks); None otherwise."""


@dataclass(kw_only=True)
class RunSummary:
    steps: int
    """Optimizer steps completed in total (including steps before a resume)."""
    tokens: int
    """Training tokens processed in total."""
    train_loss: float | None
    """Loss of the last step run here (None when no step ran)."""
    val_loss: float | None
    """Last validation loss (None when never evaluated)."""
    seconds: float
    """Wall time of this ``run()`` call."""
    interrupted: bool
    """True when stopped by Ctrl-C or SIGTERM (at a step boundary); a checkpoint was saved."""
    signal: str | None = None
    """Name of the signal that stopped the run (SIGINT, SIGTERM), when one did."""
    checkpoint: str | None
    """Path of the last checkpoint written (None when out_dir is None)."""


class TrainingRun:
    """Builds model, data, optimizer and LR scheduler for ``config`` (seeded by config.seed).

    ``text``: use this text instead of ``load_corpus(config.data)`` (tests, notebooks).
    """

    def __init__(self, config: TrainConfig, *, text: str | None = None) -> None:
        self.config = config
        self.parallel: Parallelism | None = None
        if config.parallel != "none":
            self.parallel = Parallelism(
                config.parallel, device=config.device, pg_timeout_s=config.pg_timeout_s
            )
        try:
            self._build(config, text)
        except BaseException:
            self.close()  # a rank that exits holding the group aborts at interpreter exit
            raise

    def _build(self, config: TrainConfig, text: str | None) -> None:
        """Model, data, optimizer, schedule and run state (after the process group)."""
        self.device = self.parallel.device if self.parallel else resolve_device(config.device)
        self.rank = self.parallel.rank if self.parallel else 0
        self.model_config = config.model_config()
        source = "<text>" if text is not None else (config.data or "bundled Shakespeare corpus")
        if text is None:
            text = load_corpus(config.data)
        self.tokenizer = make_tokenizer(config, text)
        if self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"vocab_size={self.model_config.vocab_size} is smaller than the tokenizer's "
                f"{self.tokenizer.vocab_size}"
            )
        self.dataset = TokenDataset.from_text(
            text,
            self.tokenizer,
            context_length=self.model_config.context_length,
            val_fraction=config.val_fraction,
            source=str(source),
        )
        self.validation_set = self.dataset.validation_batches(
            n_batches=config.eval_batches, batch_size=config.micro_batch_size
        )
        self.accumulation_steps = config.gradient_accumulation_steps
        self.tokens_per_step = config.tokens_per_micro_batch * self.accumulation_steps

        cuda_devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda_devices), torch.device(self.device):
            torch.manual_seed(config.seed)  # model init only; the global RNG is left as it was
            self.model = GPT(self.model_config)
        self.forward_model = self.model  # DDP's wrapper under --parallel dp with adamw
        self.rows = slice(None)  # rows of each global micro-batch this rank reads
        if self.parallel is None:
            self.optimizer = build_optimizer(config.optimizer, self.model, config)
        else:
            self.rows = self.parallel.rows(config.micro_batch_size)
            self.optimizer = self.parallel.build(self.model, config)
            self.forward_model = self.parallel.forward_model
        self.schedule = schedule_for(config)
        self.scheduler = build_scheduler(self.optimizer, self.schedule)
        self.qk_clip = self._build_qk_clip() if config.qk_clip is not None else None
        self.probe_max_logits = self.qk_clip is not None
        """Measure every head's exact maximum logit in each step's forwards: on with qk_clip;
        a caller may turn it on without (the bench's --track-max-logit) to record it."""
        self.step_count = 0
        self.last_checkpoint: tuple[str, int] | None = None  # (path, step) of the last good save
        # hyperparameters that differ from the loaded checkpoint's: name -> (saved, now)
        self.resume_changes: dict[str, tuple[Any, Any]] = {}
        self.mid_update = False
        """Whether a step was interrupted between ``optimizer.step()`` and its count."""
        self._signals: StopSignals | None = None  # this rank's signal handlers, in run()
        # under --parallel: the signal some rank had received by the last step's agreement
        self.agreed_signal: str | None = None

    def _build_qk_clip(self) -> QKClip:
        """QK-clip over the unwrapped model's fused QKV weights (whole, or FSDP2's row-sharded
        DTensors), maxima MAX-reduced over the data-parallel ranks (the default group under
        --parallel)."""
        return QKClip(self.model.qk_clip_targets(), tau=self.config.qk_clip)

    # ------------------------------------------------------------------ one step
    def _autocast(self):
        if self.config.autocast == "none":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> StepResult:
        """One optimizer step: ``accumulation_steps`` forward/backward passes, gradient
        clipping, ``optimizer.step()`` (timed on its own), scheduler step.

        Raises :class:`NonFiniteLossError` (before touching the parameters) on a NaN/inf loss.
        """
        config = self.config
        self._synchronize()
        start = time.perf_counter()
        self.model.train()
        micro_batches = self.dataset.train_batch(
            seed=config.seed,
            step=self.step_count,
            batch_size=config.micro_batch_size,
            micro_steps=self.accumulation_steps,
        )
        loss_sum = torch.zeros((), device=self.device)
        for index, (inputs, targets) in enumerate(micro_batches):
            inputs = inputs[self.rows].to(self.device, non_blocking=True)
            targets = targets[self.rows].to(self.device, non_blocking=True)
            last = index == len(micro_batches) - 1
            with self._accumulating(reduce=last):
                with self._autocast():
                    _, loss = self.forward_model(
                        inputs, targets, probe_max_logits=self.probe_max_logits
                    )
                (loss / self.accumulation_steps).backward()
            loss_sum += loss.detach()
        if self.parallel is None:
            loss_value = (loss_sum / self.accumulation_steps).item()
        else:  # every rank: the global mean loss and whether some rank was signalled
            received = self._signals.signal if self._signals is not None else None
            loss_value, self.agreed_signal = self.parallel.agree(
                loss_sum / self.accumulation_steps, received
            )
        if not math.isfinite(loss_value):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(self._nonfinite_message(loss_value))
        if config.grad_clip and self.parallel is not None:
            self.parallel.clip_grad_norm_(config.grad_clip)
        elif config.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_clip)
        lr = config.lr * self.schedule(self.step_count)
        self._synchronize()
        optimizer_start = time.perf_counter()
        self.mid_update = True  # until step_count counts it: not a state to checkpoint
        self.optimizer.step()
        self._synchronize()
        optimizer_seconds = time.perf_counter() - optimizer_start
        max_logit = probe_seconds = None
        if self.qk_clip is not None:  # the same rescale on every rank (maxima MAX-reduced)
            self.land_parameters()  # it rescales weights a deferred gather still writes
            max_logit = self.qk_clip(self.model.pop_max_attention_logits()).max().item()
        elif self.probe_max_logits:  # recorded only: this rank's maxima, nothing rescaled
            max_logit = max(m.max().item() for m in self.model.pop_max_attention_logits())
        if self.probe_max_logits:
            probe_seconds = self.model.pop_probe_seconds()
        expert_tokens = None
        if self.model.moe_blocks():
            expert_tokens = self.model.pop_expert_tokens().tolist()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step_count += 1
        self.mid_update = False
        return StepResult(
            step=self.step_count,
            loss=loss_value,
            lr=lr,
            tokens=self.tokens_per_step,
            step_seconds=time.perf_counter() - start,
            optimizer_seconds=optimizer_seconds,
            max_attention_logit=max_logit,
            max_logit_seconds=probe_seconds,
            expert_tokens=expert_tokens,
        )

    def _accumulating(self, *, reduce: bool):
        if self.parallel is None:
            return nullcontext()
        return self.parallel.accumulating(reduce)

    def _nonfinite_message(self, loss_value: float) -> str:
        where = "no checkpoint was saved in this run"
        if self.last_checkpoint is not None:
            where = (
                f"last good checkpoint: {self.last_checkpoint[0]} (step {self.last_checkpoint[1]})"
            )
        return (
            f"training loss is {loss_value} at step {self.step_count + 1}; stopped without "
            f"updating the parameters or saving; {where}. Try a lower --lr or --grad-clip."
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation set (``eval_batches`` micro-batches)."""
        self.land_parameters()
        was_training = self.model.training
        self.model.eval()
        losses = []
        for inputs, targets in self.validation_set:
            with self._autocast():
                _, loss = self.model(inputs.to(self.device), targets.to(self.device))
            losses.append(loss.float())
        self.model.train(was_training)
        return torch.stack(losses).mean().item()

    def land_parameters(self) -> None:
        """Land the parameter gathers a ``DistributedMuon(defer_gather=True)`` step left in
        flight, before code that reads or writes parameters outside the forward."""
        wait = getattr(self.optimizer, "wait_for_parameters", None)
        if wait is not None:
            wait()

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors (exact, counted from the tensors)."""
        return optimizer_state_bytes(self.optimizer)

    def describe(self) -> str:
        """One line about the run: model, data, optimizer, batch, device."""
        cfg, model = self.config, self.model_config
        resumed = f", resuming at step {self.step_count}" if self.step_count else ""
        return (
            f"{cfg.model} GPT ({self.model.num_parameters() / 1e6:.2f}M params, {model.n_layer} "
            f"layers, d={model.d_model}, ctx={model.context_length}{self._moe_text()}), "
            f"{self.tokenizer.name} "
            f"tokens from {self.dataset.source} ({len(self.dataset.train_tokens):,} train / "
            f"{len(self.dataset.val_tokens):,} val), optimizer {cfg.optimizer} lr={cfg.lr:g}, "
            f"{self.tokens_per_step:,} tokens/step ({self.accumulation_steps} x "
            f"{cfg.micro_batch_size} x {model.context_length}), {cfg.steps} steps on "
            f"{self.device}{resumed}" + (f", {self.parallel.describe()}" if self.parallel else "")
        )

    def _moe_text(self) -> str:
        model = self.model_config
        if model.mlp != "moe":
            return ""
        return f", MoE {model.experts} experts of width {model.hidden_dim}, top {model.top_k}"

    # ------------------------------------------------------------------ checkpoints
    def first_nonfinite(self) -> tuple[str, int, int] | None:
        """(name, NaN/inf entries, entries) of the first parameter or optimizer state tensor
        that is not finite, on any rank (collective under --parallel), or None."""
        bad = first_nonfinite(self.model, self.optimizer)
        if self.parallel is not None:
            bad = next((b for b in self.parallel.comm.all_gather_object(bad) if b), None)
        return bad

    def parameters_finite(self) -> bool:
        """Whether every parameter and optimizer state tensor is finite (collective)."""
        return self.first_nonfinite() is None

    def save_checkpoint(self, path: str | os.PathLike) -> Path:
        """Write model, optimizer, scheduler, step, RNG states and config to ``path``
        (:func:`muonscale.train.run_checkpoint.save`: atomic, fsynced, digest; refuses
        non-finite parameters or state, so the last good checkpoint is never overwritten)."""
        return run_checkpoint.save(self, path)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore a checkpoint written by :meth:`save_checkpoint`; this run's hyperparameters
        replace the checkpoint's (:func:`muonscale.train.run_checkpoint.load`)."""
        run_checkpoint.load(self, path)

    # ------------------------------------------------------------------ the loop
    def run(self, progress: bool = True, tensorboard: str | Path | None = None) -> RunSummary:
        """Train until ``config.steps``: evaluate every ``eval_every`` steps and at the end, log
        JSONL metrics every ``log_every`` steps, checkpoint every ``checkpoint_every`` steps and
        at the end.

        SIGINT (Ctrl-C) and SIGTERM stop the run at the next step boundary, never inside a
        step; a checkpoint is saved and ``interrupted=True`` returned. Signals arriving during
        that save are deferred until it is written. A NaN/inf loss raises
        :class:`NonFiniteLossError` and leaves the last good checkpoint in place. Refuses
        (:class:`CheckpointExistsError`) to start a new run over an earlier run's checkpoint
        unless it resumes from that checkpoint or ``config.overwrite`` is set, and (``OSError``)
        when the checkpoint could not be written; both before any training.

        ``tensorboard``: also write TensorBoard event files into this folder (rank 0; see
        :mod:`muonscale.train.tensorboard_log`)."""
        config = self.config
        started = time.perf_counter()
        out_dir = Path(config.out_dir) if config.out_dir else None
        name = SHARDED_FOLDER if self.parallel is not None else CHECKPOINT_NAME
        checkpoint_path = out_dir / name if out_dir else None
        resume_path = run_checkpoint.resume_path(self, out_dir, checkpoint_path)
        run_checkpoint.check_out_dir(self, checkpoint_path, resume_path)
        if resume_path is not None:
            self.load_checkpoint(resume_path)
            for name, (saved, now) in self.resume_changes.items():
                if self.rank == 0:
                    print(
                        f"muonscale train: resuming with {name}={now} (the checkpoint had {saved})",
                        file=sys.stderr,
                    )
        with StopSignals() as stop:
            self._signals = stop
            try:
                summary = self._run_loop(progress, checkpoint_path, out_dir, stop, tensorboard)
            finally:
                self._signals = None
        summary.seconds = time.perf_counter() - started
        return summary

    def _run_loop(
        self,
        progress: bool,
        checkpoint_path: Path | None,
        out_dir: Path | None,
        stop,
        tensorboard: str | Path | None = None,
    ) -> RunSummary:
        config = self.config
        log = MetricsLog(out_dir / METRICS_NAME if out_dir and self.rank == 0 else None)
        log.write(
            event="start",
            step=self.step_count,
            config=config.to_dict(),
            parameters=self.model.num_parameters(),
            flops_per_token=self.model.flops_per_token(),
            tokens_per_step=self.tokens_per_step,
            resume_changes={k: list(v) for k, v in self.resume_changes.items()},
        )
        bar = progress_bar(progress and self.rank == 0, total=config.steps, initial=self.step_count)
        if bar is not None:
            bar.write(self.describe())
        board = None
        if tensorboard is not None and self.rank == 0:
            from muonscale.train.tensorboard_log import TrainTensorBoard

            board = TrainTensorBoard(tensorboard, self.optimizer, every=config.log_every, log=log)
        result: StepResult | None = None
        val_loss: float | None = None
        interrupted = False
        window_tokens, window_seconds = 0, 0.0
        try:
            while self.step_count < config.steps:
                if self._stop_signal(stop) is not None:
                    raise KeyboardInterrupt
                if board is not None:
                    board.before_step(self.step_count, config.steps)
                result = self.step()
                if board is not None:
                    board.after_step(result)
                window_tokens += result.tokens
                window_seconds += result.step_seconds
                last = self.step_count == config.steps
                if bar is not None:
                    bar.update(1)
                if config.log_every and (self.step_count % config.log_every == 0 or last):
                    tokens_per_second = window_tokens / max(window_seconds, 1e-9)
                    log.write(event="train", **asdict(result), tokens_per_second=tokens_per_second)
                    if bar is not None:
                        bar.set_postfix(
                            loss=f"{result.loss:.4f}", tok_s=f"{tokens_per_second:,.0f}"
                        )
                    window_tokens, window_seconds = 0, 0.0
                if config.eval_every and (self.step_count % config.eval_every == 0 or last):
                    val_loss = self.evaluate()
                    log.write(event="eval", step=self.step_count, val_loss=val_loss)
                    if board is not None:
                        board.evaluated(self.step_count, val_loss)
                    if bar is not None:
                        bar.write(f"step {self.step_count}: val loss {val_loss:.4f}")
                if (
                    checkpoint_path
                    and config.checkpoint_every
                    and self.step_count % config.checkpoint_every == 0
                ):
                    self.save_checkpoint(checkpoint_path)
        except KeyboardInterrupt as interrupt:
            interrupted = True
            log.write(event="interrupted", step=self.step_count, signal=self._stop_signal(stop))
            if self.mid_update:  # the parameters hold part of a step: save nothing
                last = self.last_checkpoint
                kept = f"{last[0]} (step {last[1]}) is kept" if last else "none was saved"
                interrupt.add_note(
                    "muonscale train: interrupted inside optimizer.step() of step "
                    f"{self.step_count + 1}, so the parameters hold part of that step and "
                    f"nothing is saved; the last checkpoint: {kept}"
                )
                raise
        except NonFiniteLossError as error:
            log.write(event="nonfinite_loss", step=self.step_count, message=str(error))
            raise
        finally:
            if bar is not None:
                bar.close()
            if board is not None:
                board.close(self.step_count)
            log.close()
        stop.saving = True
        if checkpoint_path is not None and self.last_checkpoint != (
            str(checkpoint_path),
            self.step_count,
        ):
            self.save_checkpoint(checkpoint_path)
        return RunSummary(
            steps=self.step_count,
            tokens=self.step_count * self.tokens_per_step,
            train_loss=result.loss if result else None,
            val_loss=val_loss,
            seconds=0.0,
            interrupted=interrupted,
            signal=self._stop_signal(stop) or ("SIGINT" if interrupted else None),
            checkpoint=str(checkpoint_path) if checkpoint_path else None,
        )

    def _stop_signal(self, stop: StopSignals) -> str | None:
        """The signal that stops the run at this step boundary: this process's, or under
        --parallel the one the ranks agreed on in the last step (so all stop together)."""
        return self.agreed_signal if self.parallel is not None else stop.signal

    def close(self) -> None:
        """Leave the process group (when this run joined it) and release optimizer hooks.
        Under --parallel the run first lets go of its model, optimizer and schedule, which hold
        the process groups (see :meth:`Parallelism.close`); it cannot step after this."""
        if self.parallel is not None:
            for name in ("scheduler", "optimizer", "qk_clip", "forward_model", "model"):
                if hasattr(self, name):
                    setattr(self, name, None)
            self.parallel.close()
