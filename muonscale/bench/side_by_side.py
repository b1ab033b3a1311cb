"""Run several contenders side by side in one process, steps interleaved.

Every contender is its own training run (same model init, data order, seed, schedule and
token budget; its own optimizer and learning rate). Steps are taken round-robin::

    step 1: A B C   step 2: A B C   ...

so a slow spell of the machine (another process, thermal throttling) hits every contender
alike and cancels in the ratios. Evaluations happen at the same steps for all contenders and
are not counted in the training time.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from muonscale.train.run_log import PlainProgress


class StepResultLike(Protocol):
    loss: float
    tokens: int
    step_seconds: float
    optimizer_seconds: float


class RunLike(Protocol):
    """What the bench needs from a training run (``muonscale.train.TrainingRun`` has it)."""

    def step(self) -> StepResultLike: ...

    def evaluate(self) -> float: ...

    def optimizer_state_bytes(self) -> int: ...


@dataclass
class ContenderRecord:
    """Everything measured for one contender during a side-by-side run."""

    name: str
    lr: float
    eval_steps: list[int] = field(default_factory=list)
    """Optimizer steps completed at each evaluation (the first is 0: before training)."""
    val_losses: list[float] = field(default_factory=list)
    eval_train_seconds: list[float] = field(default_factory=list)
    """Cumulative training seconds (step time only, no evaluation) at each evaluation."""
    train_losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    optimizer_seconds: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    optimizer_state_bytes: int = 0
    eval_seconds: float = 0.0
    diverged_at_step: int | None = None
    """Step whose loss was not finite; the contender stopped there (its later evaluations are
    NaN)."""
    max_attention_logits: list[float] = field(default_factory=list)
    """Per step, the largest attention logit of any head in its forwards (before the update
    and QK-clip's rescale), when the run measured it; empty otherwise."""
    max_logit_seconds: list[float] = field(default_factory=list)
    """Per step, the time the max-logit measurement took (part of ``step_seconds``)."""
    step_metrics: list[dict[str, float]] = field(default_factory=list)
    """Per step, the optimizer's step metrics (:mod:`muonscale.step_metrics`; the AdamW
    update RMS of other optimizers), when the run recorded them (``--tensorboard``)."""
    expert_tokens: list[list[list[int]]] = field(default_factory=list)
    """Per step, the tokens routed to each expert of each MoE block (n_layer x E) of an
    ``--mlp moe`` model; empty otherwise."""

    @property
    def train_seconds(self) -> float:
        return math.fsum(self.step_seconds)


def interleaved_order(names: Sequence[str], steps: int) -> Iterator[tuple[int, str]]:
    """``(step, name)`` pairs in execution order: round-robin over ``names`` for every step.

    ``step`` counts from 1 (the step about to be taken).
    """
    for step in range(1, steps + 1):
        for name in names:
            yield step, name


def eval_steps_for(steps: int, max_interval_fraction: float = 0.025) -> list[int]:
    """Steps after which to evaluate: 0, then at least every ``max_interval_fraction`` of the
    run (so >= 1 / fraction evaluations), and always the last step."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if not 0 < max_interval_fraction <= 1:
        raise ValueError(f"max_interval_fraction must be in (0, 1], got {max_interval_fraction}")
    interval = max(1, math.floor(steps * max_interval_fraction))
    points = list(range(0, steps + 1, interval))
    if points[-1] != steps:
        points.append(steps)
    return points


def _evaluate_all(
    runs: Mapping[str, RunLike], records: Mapping[str, ContenderRecord], step: int
) -> None:
    for name, run in runs.items():
        record = records[name]
        start = time.perf_counter()
        loss = math.nan if record.diverged_at_step is not None else float(run.evaluate())
        record.eval_seconds += time.perf_counter() - start
        record.eval_steps.append(step)
        record.val_losses.append(loss)
        record.eval_train_seconds.append(record.train_seconds)


def run_side_by_side(
    runs: Mapping[str, RunLike],
    lrs: Mapping[str, float],
    steps: int,
    eval_steps: Sequence[int],
    *,
    progress: bool = True,
    desc: str = "bench",
    divergence_errors: tuple[type[BaseException], ...] = (),
    after_step: Callable[[int, Mapping[str, ContenderRecord]], None] | None = None,
    step_metrics: Mapping[str, Callable[[], dict[str, float]]] | None = None,
) -> dict[str, ContenderRecord]:
    """Train every run for ``steps`` steps, interleaved, evaluating all at ``eval_steps``.

    A run whose ``step()`` raises one of ``divergence_errors`` (a NaN/inf loss) stops there;
    the others go on, and the report shows where it diverged. ``after_step(step, records)``
    is called once every run took step ``step`` (and was evaluated, at an evaluation step);
    the lockstep bench waits for its other workers there. ``step_metrics[name]()``: the
    figures of run ``name``'s last step, recorded after each of its steps.
    """
    records = {name: ContenderRecord(name=name, lr=lrs[name]) for name in runs}
    wanted = set(eval_steps)
    last_name = list(runs)[-1]
    bar = progress_bar(steps * len(runs), desc) if progress else None
    if 0 in wanted:
        _evaluate_all(runs, records, 0)
    for step, name in interleaved_order(list(runs), steps):
        record = records[name]
        if record.diverged_at_step is None:
            try:
                result = runs[name].step()
            except divergence_errors:
                record.diverged_at_step = step
            else:
                record.train_losses.append(float(result.loss))
                record.step_seconds.append(float(result.step_seconds))
                record.optimizer_seconds.append(float(result.optimizer_seconds))
                record.tokens.append(int(result.tokens))
                max_logit = getattr(result, "max_attention_logit", None)
                if max_logit is not None:
                    record.max_attention_logits.append(float(max_logit))
                    record.max_logit_seconds.append(float(result.max_logit_seconds))
                if step_metrics is not None:
                    record.step_metrics.append(step_metrics[name]())
                expert_tokens = getattr(result, "expert_tokens", None)
                if expert_tokens is not None:
                    record.expert_tokens.append(expert_tokens)
        if bar is not None:
            bar.update(1)
        if name == last_name and step in wanted:
            _evaluate_all(runs, records, step)
            if bar is not None:
                bar.set_postfix_str(
                    " ".join(f"{n}={r.val_losses[-1]:.3f}" for n, r in records.items()),
                    refresh=True,
                )
        if name == last_name and after_step is not None:
            after_step(step, records)
    if bar is not None:
        bar.close()
    for name, run in runs.items():
        records[name].optimizer_state_bytes = int(run.optimizer_state_bytes())
    return records


def progress_bar(total: int, desc: str):
    """A tqdm bar on stderr (a plain line per evaluation without tqdm)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is an optional ("bench") dependency
        return PlainProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
