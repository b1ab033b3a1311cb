"""Steps and timing: one training step as Megatron's loop runs it, and the phases of a run."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .arms import (
    ARMS,
    CPU_STANDINS,
    GPU_ONLY_REASONS,
    Arm,
    build_arm,
    describe_muon_config,
    muon_optimizer_config,
    muon_settings,
)
from .device import Device
from .model import Batches, resolve_spec
from .report import med, sanity, summarize

if TYPE_CHECKING:  # the config lives in the entry script, benchmarks/megatron_gpu.py
    from megatron_gpu import BenchConfig


def train_step(
    arm: Arm, batches: Batches, step: int, n_micro: int, device: Device, phase: str
) -> None:
    """One optimizer step of ``n_micro`` micro-batches, as Megatron's loop; records the times
    (total, forward+backward incl. gradient reduction, optimizer step), loss and grad norm."""
    data = [batches.get(step, m) for m in range(n_micro)]
    device.sync()
    t0 = time.perf_counter()
    arm.zero_grad_buffer()
    arm.optimizer.zero_grad()
    loss_sum = torch.zeros((), device=device.torch_device)
    for inputs, labels in data:
        loss = arm.model(inputs, batches.positions, batches.mask, labels=labels).mean() / n_micro
        loss.backward()
        loss_sum += loss.detach()
    arm.finalize_grads()
    device.sync()
    t1 = time.perf_counter()
    result = arm.optimizer.step()
    device.sync()
    t2 = time.perf_counter()
    times = arm.times.setdefault(phase, {"step": [], "fwd_bwd": [], "opt": []})
    times["step"].append(t2 - t0)
    times["fwd_bwd"].append(t1 - t0)
    times["opt"].append(t2 - t1)
    arm.losses.append(float(loss_sum))
    arm.grad_norms.append(arm.grad_norm(result))


@torch.no_grad()
def eval_loss(arm: Arm, batches: Batches) -> float:
    """Loss on the fixed batch, averaged over data-parallel ranks."""
    from megatron.core import parallel_state as ps

    inputs, labels = batches.fixed()
    loss = arm.model(inputs, batches.positions, batches.mask, labels=labels).mean().float()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return loss.item() / ps.get_data_parallel_world_size()


def run(cfg: BenchConfig, device: Device, result: dict, save: Callable[[], None]) -> None:
    """Build the arms, measure; fills ``result`` step by step (``save`` after each phase)."""
    from megatron.core import parallel_state as ps

    t_start = time.perf_counter()

    def time_left() -> float:
        return cfg.budget_s - (time.perf_counter() - t_start) if cfg.budget_s else math.inf

    spec = resolve_spec(cfg.spec)
    batches = Batches(cfg, device)
    dp = ps.get_data_parallel_world_size()
    tokens_per_micro = cfg.micro_batch * cfg.seq * dp
    result["meta"].update(spec=spec, dp=dp, tokens_per_micro_batch=tokens_per_micro)
    names = ARMS if device.cuda else tuple(CPU_STANDINS.get(n, n) for n in ARMS)
    if not device.cuda:
        result["not_measured"] = {n: f"not measured: {why}" for n, why in GPU_ONLY_REASONS.items()}
    optimizer_config = muon_optimizer_config(cfg)  # the one config of both Muon arms

    arms: dict[str, Arm] = {}
    for name in names:  # build + warm-up alone: the arm's own peak memory
        base = device.allocated()
        device.reset_peak()
        arm = arms[name] = build_arm(name, cfg, spec, device, optimizer_config)
        arm.loss_before = eval_loss(arm, batches)
        for step in range(cfg.warmup):
            train_step(arm, batches, step, 1, device, "warmup")
        device.sync()
        arm.memory.update(peak_bytes=device.peak() - base, resident_bytes=device.allocated() - base)
    result["meta"]["muonscale_dp_mode"] = getattr(arms["muonscale"].optimizer, "dp_mode", None)
    muon_arm = arms[CPU_STANDINS["megatron_muon"] if not device.cuda else "megatron_muon"]
    settings = {a.name: muon_settings(a.optimizer) for a in (arms["muonscale"], muon_arm)}
    result["muon_config"] = describe_muon_config(optimizer_config, arms["muonscale"].model)
    result["muon_config"]["settings_read_back"] = settings
    a, b = settings.values()
    result["muon_config"]["same_settings"] = {k: a[k] == b[k] for k in a}
    result["phases_done"].append("build+warmup")
    save()

    rounds_done = 0
    for r in range(cfg.rounds):  # interleaved: A B, B A, ...
        order = list(arms.values()) if r % 2 == 0 else list(reversed(arms.values()))
        for arm in order:
            for i in range(cfg.steps_per_round):
                train_step(
                    arm, batches, cfg.warmup + r * cfg.steps_per_round + i, 1, device, "one_micro"
                )
        rounds_done += 1
        if time_left() < 0:
            break
    result["rounds_done"] = rounds_done
    result["phases_done"].append("one_micro")
    summarize(cfg, arms, result, tokens_per_micro)
    save()

    if cfg.accum:
        per_arm = {
            a.name: cfg.accum * med(a.times["one_micro"]["fwd_bwd"])
            + med(a.times["one_micro"]["opt"])
            for a in arms.values()
        }
        estimate = cfg.accum_rounds * sum(per_arm.values())
        if estimate > time_left():
            result["accum_point"] = (
                f"skipped: needs ~{estimate:.0f}s, {time_left():.0f}s left of --budget-s"
            )
        else:
            first = cfg.warmup + cfg.rounds * cfg.steps_per_round
            for r in range(cfg.accum_rounds):
                order = list(arms.values()) if r % 2 == 0 else list(reversed(arms.values()))
                for arm in order:
                    train_step(arm, batches, first + r, cfg.accum, device, "accum")
            result["accum_point"] = "measured"
            result["phases_done"].append("accum")
        summarize(cfg, arms, result, tokens_per_micro)

    for arm in arms.values():
        result["arms"][arm.name]["loss_after"] = eval_loss(arm, batches)
    result["sanity"] = sanity(result)
    result["phases_done"].append("loss")
