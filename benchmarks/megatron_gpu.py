"""Megatron-Core GPT under Megatron's own DDP: tokens/s of muonscale vs Megatron's Adam (issue 7).

GPU (NCCL), from the repository root, with megatron-core 0.19.2 installed or carried as the
wheels of ``bash .ci/megatron_site.sh`` (``.megatron-site/``)::

    PYTHONPATH=.:.megatron-site torchrun --nproc-per-node 1 benchmarks/megatron_gpu.py \\
        --out runs/megatron_gpu.json                  # one GPU, GPT-2-medium shapes, ~1 minute
    PYTHONPATH=.:.megatron-site torchrun --nproc-per-node 8 benchmarks/megatron_gpu.py --tp 2

``benchmarks/gpu.py`` runs the first line as its Megatron leg. CPU smoke (gloo, tiny model)::

    PYTHONPATH=. .venv-megatron/bin/torchrun --nproc-per-node 2 benchmarks/megatron_gpu.py --smoke
    PYTHONPATH=. .venv-megatron/bin/python benchmarks/megatron_gpu.py --smoke   # one process

Two arms on two identically built models (same seeds, hence the same initial weights; the JSON
checks it with the loss of both on one fixed batch), fed the same batches:

* ``megatron_adam``: ``get_megatron_optimizer(OptimizerConfig(optimizer="adam", bf16=True,
  ...), [model])``: Megatron's ``Float16OptimizerWithFloat16Params`` (fp32 main parameters,
  global gradient-norm clipping) around Adam (TE or apex ``FusedAdam`` when installed, else
  ``torch.optim.AdamW``; ``meta.adam_impl`` says which);
* ``muonscale``: ``megatron_muon([model], MegatronMuonConfig(...))``, which reads Megatron DDP's
  ``main_grad`` (``dp_mode="replicated"``), keeps fp32 main copies of the bf16 parameters and
  clips the global gradient norm the same way.

The model is Megatron's ``GPTModel`` (local layer spec; Transformer Engine's with ``--spec te``,
or ``auto`` when ``transformer_engine`` imports), bf16 parameters in ``Float16Module``, wrapped in
Megatron's ``DistributedDataParallel`` (fp32 gradient buffers, no overlap, no distributed
optimizer), as ``megatron.training`` builds it. One step, as Megatron's training loop runs it:
``zero_grad_buffer()`` and ``optimizer.zero_grad()``; forward/backward of each micro-batch (loss
mean ÷ micro-batches); ``finalize_model_grads([model])``; ``optimizer.step()``.

Measured (shared/DESIGN.md, "Metrics"): each arm first runs its warm-up steps alone, which also
gives its peak memory (``torch.cuda.max_memory_allocated`` minus what was allocated before the
arm was built, i.e. its model, gradient buffers, optimizer state and activations); then timed
rounds interleave the arms (A B, B A, ...), ``torch.cuda.synchronize()`` around each step and
between backward and optimizer step; medians of step time, forward+backward time and optimizer
step time. Reported: tokens/s of each arm at one micro-batch per step and, with ``--accum K``,
at K micro-batches per step (measured when it fits ``--budget-s``, and composed from the
one-micro-batch medians: K·t_fwd_bwd + t_opt, which counts the per-step buffer zeroing and
gradient reduction K times, slightly against both arms); ``throughput_ratio`` = muonscale ÷
megatron_adam; the loss on a fixed batch before and after, each step's training loss and
gradient norm (sanity: same start, finite, decreasing, same first-step gradient norm).

What the CPU smoke covers, and what only a GPU run does. Megatron's DDP allocates its gradient
buffers on ``torch.cuda.current_device()`` (distributed/param_and_grad_buffer.py L1184) and
``Float16OptimizerWithFloat16Params`` accepts only ``torch.cuda.*Tensor`` parameters and makes
CUDA tensors (optimizer/optimizer.py L1009, L690), so neither runs on CPU. ``--smoke`` therefore
runs the same harness (flags, Megatron ``GPTModel`` + ``Float16Module`` in bf16 built twice with
equal weights, corpus batches split over DP, interleaved rounds, accumulation, table, JSON,
loss checks) with: ``muonscale`` = ``megatron_muon`` on the unwrapped bf16 model (no
``main_grad``: the optimizer averages ``.grad`` over DP itself; fp32 main params and clipping as
on GPU) and, in place of ``megatron_adam``, ``adamw_cpu_standin`` = ``torch.optim.AdamW`` with
the same hyper-parameters directly on the bf16 parameters (no weight decay for 1-D tensors, as
Megatron's default groups), DP mean and ``clip_grad_norm_`` by hand (exact at the smoke's TP 1). Only a GPU run covers Megatron's DDP (``main_grad`` buffers,
``finalize_model_grads``), ``get_megatron_optimizer`` and muonscale reading ``main_grad``, NCCL,
CUDA timing and memory. Nothing of torch.cuda is replaced on the GPU path.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ARMS = ("megatron_adam", "muonscale")
CPU_STANDIN = "adamw_cpu_standin"
SPECS = ("auto", "local", "te")


def _option(default: Any, kind: type, help: str, **argparse_options: Any) -> Any:
    """A config field that is also a command-line flag (``kind`` parses it, ``help`` documents)."""
    return field(default=default, metadata={"kind": kind, "help": help, **argparse_options})


@dataclass(kw_only=True)
class BenchConfig:
    """Shapes, optimizer hyper-parameters and timing of the benchmark; every field is a flag."""

    layers: int = _option(24, int, "transformer layers (GPT-2 medium: 24)")
    hidden: int = _option(1024, int, "hidden size (GPT-2 medium: 1024)")
    heads: int = _option(16, int, "attention heads")
    query_groups: int = _option(0, int, "key/value heads (GQA); 0 = heads (plain multi-head)")
    ffn_hidden: int = _option(0, int, "MLP hidden size; 0 = 4 x hidden")
    seq: int = _option(1024, int, "sequence length (tokens per sequence)")
    vocab: int = _option(
        50304, int, "vocabulary size (>= 256: the data are the bundled corpus's bytes)"
    )
    micro_batch: int = _option(8, int, "sequences per micro-batch per data-parallel rank")
    tp: int = _option(1, int, "tensor-parallel size (must divide the number of processes)")
    spec: str = _option("auto", str, "layer spec: local, te (Transformer Engine), auto = te if it imports", choices=SPECS)  # fmt: skip
    lr: float = _option(3e-4, float, "learning rate of both arms (muonscale's AdamW half too)")
    weight_decay: float = _option(0.1, float, "decoupled weight decay of both arms")
    clip_grad: float = _option(1.0, float, "global gradient-norm clip of both arms (0 = off)")
    warmup: int = _option(2, int, "untimed steps per arm before the timed rounds")
    rounds: int = _option(3, int, "timed rounds; each runs every arm for --steps-per-round steps")
    steps_per_round: int = _option(4, int, "timed steps per arm per round")
    accum: int = _option(64, int, "micro-batches per step of the accumulation point (64 x 8 x 1024 = 0.5M tokens); 0 = skip")  # fmt: skip
    accum_rounds: int = _option(1, int, "timed accumulation steps per arm (interleaved)")
    budget_s: float = _option(0.0, float, "wall-clock budget in seconds: the accumulation point is measured only if it fits (0 = no limit)")  # fmt: skip
    seed: int = _option(0, int, "seed of the weights (both arms) and of the batches")
    out: str = _option("", str, "write the JSON result to this path (rank 0)")
    smoke: bool = _option(False, bool, "tiny model on CPU with gloo (see the module docstring for what it covers)")  # fmt: skip

    def __post_init__(self) -> None:
        positive = ("layers", "hidden", "heads", "seq", "micro_batch", "tp", "rounds",
                    "steps_per_round", "accum_rounds")  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        for name in ("query_groups", "ffn_hidden", "warmup", "accum", "budget_s", "clip_grad", "weight_decay"):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}"
                )
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads}")
        groups = self.query_groups or self.heads
        if self.heads % groups:
            raise ValueError(f"--heads {self.heads} is not a multiple of --query-groups {groups}")
        if self.heads % self.tp or groups % self.tp:
            raise ValueError(f"--tp {self.tp} must divide --heads {self.heads} and the query groups {groups}")  # fmt: skip
        if self.vocab < 256 or self.vocab % self.tp:
            raise ValueError(f"--vocab must be >= 256 (byte tokens) and a multiple of --tp, got {self.vocab}")  # fmt: skip
        if self.seq < 2:
            raise ValueError(f"--seq must be >= 2, got {self.seq}")

    @property
    def num_query_groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


SMOKE_DEFAULTS = dict(layers=2, hidden=64, heads=4, query_groups=2, seq=32, vocab=256,
                      micro_batch=2, warmup=1, rounds=2, steps_per_round=3, accum=2, lr=3e-3)  # fmt: skip
"""--smoke replaces these defaults (flags given explicitly still win)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Defaults: one H200, GPT-2-medium shapes; --smoke: " + ", ".join(f"{k}={v}" for k, v in SMOKE_DEFAULTS.items()),
    )  # fmt: skip
    for f in fields(BenchConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        kind, help_text = meta.pop("kind"), meta.pop("help")
        default = f.default if f.default is not MISSING else None
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=default, help=f"{help_text} (default {default if default != '' else 'none'})", **meta)  # fmt: skip
    return parser


def parse_config(argv: list[str] | None = None) -> BenchConfig:
    """Flags → :class:`BenchConfig`; a bad value exits with the parser's usage and a message."""
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.smoke:
        parser.set_defaults(**SMOKE_DEFAULTS)
    args = parser.parse_args(argv)
    try:
        return BenchConfig(**vars(args))
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


# ---------------------------------------------------------------------------------------------
# Device helpers: the only CUDA-specific calls of the script


class Device:
    """Synchronization and memory counters: CUDA's on GPU, no-ops / peak RSS on CPU."""

    def __init__(self, smoke: bool) -> None:
        self.cuda = not smoke
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.torch_device = torch.device("cuda", local_rank) if self.cuda else torch.device("cpu")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated()
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def name(self) -> str:
        return torch.cuda.get_device_name() if self.cuda else "cpu"


def cpu_shims() -> None:
    """(--smoke only) Megatron-Core's local attention takes its scratch buffer from a CUDA-only
    ``GlobalMemoryBuffer`` and forks the CUDA RNG for dropout; replace both on CPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.utils import GlobalMemoryBuffer

    class CPUBuffer(GlobalMemoryBuffer):
        def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tensor_shape, dtype=dtype)

    ps._GLOBAL_MEMORY_BUFFER = CPUBuffer()
    mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


# ---------------------------------------------------------------------------------------------
# Model, data, arms


def resolve_spec(spec: str) -> str:
    """``auto`` → ``te`` when transformer_engine imports, else ``local``."""
    if spec != "auto":
        return spec
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return "local"
    return "te"


def seed_weights(cfg: BenchConfig, device: Device) -> None:
    """Reset every RNG Megatron initializes weights from, so both arms start equal."""
    torch.manual_seed(cfg.seed)
    if device.cuda:
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(cfg.seed)
    else:
        cpu_shims()


def build_gpt(cfg: BenchConfig, spec: str, device: Device) -> nn.Module:
    """Megatron's GPTModel with bf16 parameters inside ``Float16Module`` (as megatron.training)."""
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=cfg.layers,
        hidden_size=cfg.hidden,
        num_attention_heads=cfg.heads,
        num_query_groups=cfg.num_query_groups,
        ffn_hidden_size=cfg.ffn_hidden_size,
        tensor_model_parallel_size=cfg.tp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        use_cpu_initialization=not device.cuda,
    )
    layer_spec = (
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        if spec == "te"
        else gpt_layer_specs.get_gpt_layer_local_spec()
    )
    gpt = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=cfg.vocab,
        max_sequence_length=cfg.seq,
        position_embedding_type="learned_absolute",
    )
    return Float16Module(config, gpt.to(device.torch_device))


class Batches:
    """Windows of the bundled corpus (bytes): batch ``(step, micro)`` is a pure function of the
    seed, the same for both arms; each data-parallel rank keeps its slice of the global batch."""

    def __init__(self, cfg: BenchConfig, device: Device) -> None:
        from megatron.core import parallel_state as ps

        from muonscale.train.data import ByteTokenizer, load_corpus

        self.cfg = cfg
        self.tokens = ByteTokenizer().encode(load_corpus()).to(torch.int64)
        if self.tokens.numel() <= cfg.seq + 1:
            raise ValueError(f"--seq {cfg.seq} is longer than the corpus ({self.tokens.numel()} tokens)")  # fmt: skip
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.device = device.torch_device
        self.positions = torch.arange(cfg.seq, device=self.device).unsqueeze(0).expand(cfg.micro_batch, -1)  # fmt: skip
        self.mask = torch.triu(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device=self.device), 1)[None, None]  # fmt: skip

    def get(self, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (micro_batch, seq) on this rank."""
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + step * 1009 + micro)
        global_batch = self.cfg.micro_batch * self.dp_size
        starts = torch.randint(
            0, self.tokens.numel() - self.cfg.seq - 1, (global_batch,), generator=g
        )
        mine = starts.chunk(self.dp_size)[self.dp_rank].tolist()
        window = torch.stack([self.tokens[s : s + self.cfg.seq + 1] for s in mine]).to(self.device)
        return window[:, :-1], window[:, 1:]

    def fixed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out batch both arms are evaluated on before and after training."""
        return self.get(step=-1, micro=0)


@dataclass
class Arm:
    """One contender: a model, its optimizer and the two gradient hooks of Megatron's loop."""

    name: str
    model: nn.Module
    optimizer: Any
    zero_grad_buffer: Callable[[], None]
    finalize_grads: Callable[[], None]
    grad_norms: list[float | None] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    times: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    memory: dict[str, int] = field(default_factory=dict)
    loss_before: float = math.nan

    def grad_norm(self, step_result: Any) -> float | None:
        """Megatron's step returns (success, grad_norm, zeros); muonscale keeps last_grad_norm."""
        if isinstance(step_result, tuple) and len(step_result) == 3:
            return None if step_result[1] is None else float(step_result[1])
        norm = getattr(self.optimizer, "last_grad_norm", None)
        return None if norm is None else float(norm)


def build_arm(name: str, cfg: BenchConfig, spec: str, device: Device) -> Arm:
    """Build the model (seeded identically for every arm) and the arm's optimizer."""
    seed_weights(cfg, device)
    model = build_gpt(cfg, spec, device)
    if device.cuda:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )

        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        )
        model = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)
        zero_grad_buffer = model.zero_grad_buffer
        finalize = lambda: finalize_model_grads([model])  # noqa: E731
    else:
        zero_grad_buffer = finalize = lambda: None  # noqa: E731
    if name == "muonscale":
        from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

        optimizer = megatron_muon(
            [model],
            MegatronMuonConfig(
                lr=cfg.lr, weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad,
                adam_beta1=0.9, adam_beta2=0.95, main_params_dtype=torch.float32,
                dp_mode="replicated",
            ),
        )  # fmt: skip
    elif name == "megatron_adam":
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", bf16=True, params_dtype=torch.bfloat16, lr=cfg.lr,
                weight_decay=cfg.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
                clip_grad=cfg.clip_grad, use_distributed_optimizer=False,
            ),
            [model],
        )  # fmt: skip
    elif name == CPU_STANDIN:
        optimizer = StandinAdamW(model, cfg)
        finalize = lambda: standin_mean_over_dp(model)  # noqa: E731
    else:
        raise ValueError(f"unknown arm {name!r}")
    return Arm(name, model, optimizer, zero_grad_buffer, finalize)


class StandinAdamW(torch.optim.AdamW):
    """(--smoke only) What ``get_megatron_optimizer`` builds underneath when TE and apex are
    absent, on the model's own parameters: ``torch.optim.AdamW``, no weight decay for 1-D
    tensors, global-norm clip before the step (``clip_grad_norm_``: exact at TP 1)."""

    def __init__(self, model: nn.Module, cfg: BenchConfig) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        super().__init__(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
        self.clip_grad, self.last_grad_norm = cfg.clip_grad, None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"]]
        max_norm = self.clip_grad if self.clip_grad > 0 else math.inf
        self.last_grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return super().step(closure)


def standin_mean_over_dp(model: nn.Module) -> None:
    """(--smoke stand-in for Megatron's DDP) mean of ``.grad`` over the data-parallel group."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)
                p.grad.div_(dist.get_world_size(group))


# ---------------------------------------------------------------------------------------------
# Steps and timing


def train_step(arm: Arm, batches: Batches, step: int, n_micro: int, device: Device, phase: str) -> None:  # fmt: skip
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
    names = ARMS if device.cuda else ("muonscale", CPU_STANDIN)

    arms: dict[str, Arm] = {}
    for name in names:  # build + warm-up alone: the arm's own peak memory
        base = device.allocated()
        device.reset_peak()
        arm = arms[name] = build_arm(name, cfg, spec, device)
        arm.loss_before = eval_loss(arm, batches)
        for step in range(cfg.warmup):
            train_step(arm, batches, step, 1, device, "warmup")
        device.sync()
        arm.memory.update(peak_bytes=device.peak() - base, resident_bytes=device.allocated() - base)
    result["meta"]["muonscale_dp_mode"] = getattr(arms["muonscale"].optimizer, "dp_mode", None)
    result["phases_done"].append("build+warmup")
    save()

    rounds_done = 0
    for r in range(cfg.rounds):  # interleaved: A B, B A, ...
        order = list(arms.values()) if r % 2 == 0 else list(reversed(arms.values()))
        for arm in order:
            for i in range(cfg.steps_per_round):
                train_step(arm, batches, cfg.warmup + r * cfg.steps_per_round + i, 1, device, "one_micro")  # fmt: skip
        rounds_done += 1
        if time_left() < 0:
            break
    result["rounds_done"] = rounds_done
    result["phases_done"].append("one_micro")
    summarize(cfg, arms, result, tokens_per_micro)
    save()

    if cfg.accum:
        per_arm = {a.name: cfg.accum * med(a.times["one_micro"]["fwd_bwd"]) + med(a.times["one_micro"]["opt"]) for a in arms.values()}  # fmt: skip
        estimate = cfg.accum_rounds * sum(per_arm.values())
        if estimate > time_left():
            result["accum_point"] = f"skipped: needs ~{estimate:.0f}s, {time_left():.0f}s left of --budget-s"  # fmt: skip
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


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(cfg: BenchConfig, arms: dict[str, Arm], result: dict, tokens_per_micro: int) -> None:
    """Medians, tokens/s and ratios into ``result``."""
    for arm in arms.values():
        one = arm.times["one_micro"]
        row = {
            "tokens_per_s_one_micro": tokens_per_micro / med(one["step"]),
            "step_ms": 1e3 * med(one["step"]),
            "fwd_bwd_ms": 1e3 * med(one["fwd_bwd"]),
            "optimizer_step_ms": 1e3 * med(one["opt"]),
            "timed_steps": len(one["step"]),
            "peak_memory_bytes": arm.memory["peak_bytes"],
            "resident_memory_bytes": arm.memory["resident_bytes"],
            "loss_before": arm.loss_before,
            "train_losses": arm.losses,
            "grad_norms": arm.grad_norms,
        }
        if cfg.accum:
            row["tokens_per_s_accum_composed"] = cfg.accum * tokens_per_micro / (cfg.accum * med(one["fwd_bwd"]) + med(one["opt"]))  # fmt: skip
        if "accum" in arm.times:
            row["tokens_per_s_accum_measured"] = cfg.accum * tokens_per_micro / med(arm.times["accum"]["step"])  # fmt: skip
        result["arms"].setdefault(arm.name, {}).update(row)
    base_name = ARMS[0] if ARMS[0] in arms else CPU_STANDIN
    base, ours = result["arms"][base_name], result["arms"]["muonscale"]
    result["baseline"] = base_name
    for key in ("one_micro", "accum_composed", "accum_measured"):
        if f"tokens_per_s_{key}" in ours and f"tokens_per_s_{key}" in base:
            result[f"throughput_ratio_{key}"] = ours[f"tokens_per_s_{key}"] / base[f"tokens_per_s_{key}"]  # fmt: skip
    if cfg.accum:
        result["accum_tokens_per_step"] = cfg.accum * tokens_per_micro
    result["optimizer_step_ratio"] = ours["optimizer_step_ms"] / base["optimizer_step_ms"]


def sanity(result: dict) -> dict:
    """Both arms: equal start (same weights), finite losses, loss on the fixed batch decreased,
    and equal first-step gradient norms (same weights, same batch, both clip the global norm)."""
    arms = result["arms"]
    out: dict[str, Any] = {}
    before = [a["loss_before"] for a in arms.values()]
    out["same_initial_loss"] = max(before) - min(before) <= 1e-3 * max(abs(b) for b in before)
    for name, a in arms.items():
        losses = a["train_losses"] + [a["loss_before"], a["loss_after"]]
        out[f"{name}_finite"] = all(math.isfinite(x) for x in losses)
        out[f"{name}_decreased"] = a["loss_after"] < a["loss_before"]
    first_norms = [a["grad_norms"][0] for a in arms.values() if a["grad_norms"] and a["grad_norms"][0] is not None]  # fmt: skip
    if len(first_norms) == len(arms):
        out["first_grad_norms"] = first_norms
        out["same_first_grad_norm"] = max(first_norms) - min(first_norms) <= 1e-2 * max(first_norms)
    out["ok"] = all(v for k, v in out.items() if isinstance(v, bool))
    return out


def print_table(result: dict) -> None:
    cols = [("arm", "{}"), ("tokens_per_s_one_micro", "{:,.0f}"), ("step_ms", "{:.1f}"),
            ("fwd_bwd_ms", "{:.1f}"), ("optimizer_step_ms", "{:.2f}"), ("peak_memory_bytes", "{:,}"),
            ("loss_before", "{:.3f}"), ("loss_after", "{:.3f}"),
            ("tokens_per_s_accum_composed", "{:,.0f}"), ("tokens_per_s_accum_measured", "{:,.0f}")]  # fmt: skip
    rows = [[name] + [fmt.format(a[c]) if c in a else "-" for c, fmt in cols[1:]] for name, a in result["arms"].items()]  # fmt: skip
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, (c, _) in enumerate(cols)]
    print("  ".join(c.ljust(w) for (c, _), w in zip(cols, widths)))
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
    for key in ("throughput_ratio_one_micro", "throughput_ratio_accum_composed", "throughput_ratio_accum_measured", "optimizer_step_ratio"):  # fmt: skip
        if key in result:
            print(f"{key} (muonscale / {result['baseline']}): {result[key]:.4f}")
    if "accum_point" in result:
        print(
            f"accumulation point ({result['accum_tokens_per_step']:,} tokens/step): {result['accum_point']}"
        )
    print(f"sanity: {result.get('sanity')}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_json(path: str, result: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> int:
    """0: measured and sane; 1: a sanity check failed; 3: megatron-core does not import."""
    cfg = parse_config(argv)
    if "WORLD_SIZE" not in os.environ:  # plain ``python megatron_gpu.py``: one process
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))  # fmt: skip
    rank0 = os.environ["RANK"] == "0"
    try:
        import megatron.core
        from megatron.core import optimizer as megatron_optimizer
        from megatron.core import parallel_state as ps
    except Exception as error:  # not installed, or built for another Python/torch
        message = f"import failed: {type(error).__name__}: {error}"
        if rank0 and cfg.out:
            write_json(cfg.out, {"import_error": message})
        print(f"megatron_gpu: {message}", file=sys.stderr)
        return 3
    if not cfg.smoke and not torch.cuda.is_available():
        sys.exit("megatron_gpu: no CUDA device; run with --smoke on CPU")
    device = Device(cfg.smoke)
    if device.cuda:
        torch.cuda.set_device(device.torch_device)
    dist.init_process_group("nccl" if device.cuda else "gloo")
    world = dist.get_world_size()
    if world % cfg.tp:
        sys.exit(f"megatron_gpu: --tp {cfg.tp} does not divide the {world} processes")
    ps.initialize_model_parallel(tensor_model_parallel_size=cfg.tp)
    result: dict[str, Any] = {
        "meta": {
            "device": device.name(), "world_size": world, "tp": cfg.tp, "torch": torch.__version__,
            "megatron_core": megatron.core.__version__,
            "megatron_core_path": os.path.dirname(megatron.core.__file__),
            "adam_impl": "torch.optim.AdamW" if megatron_optimizer.USING_PYTORCH_OPTIMIZER else "fused Adam (TE or apex)",  # fmt: skip
            "peak_metric": "torch.cuda.max_memory_allocated during the arm's build and warm-up, minus memory allocated before" if device.cuda else "process peak RSS (CPU smoke: not per arm)",  # fmt: skip
            "config": asdict(cfg),
        },
        "arms": {}, "phases_done": [],
    }  # fmt: skip

    def save() -> None:
        if rank0 and cfg.out:
            write_json(cfg.out, result)

    if rank0:
        print(f"megatron_gpu: {device.name()}, {world} processes, TP {cfg.tp}, "
              f"megatron-core {result['meta']['megatron_core']} ({result['meta']['megatron_core_path']})", flush=True)  # fmt: skip
    try:
        run(cfg, device, result, save)
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["traceback"] = traceback.format_exc()[-4000:]
        save()
        raise
    save()
    if rank0:
        print_table(result)
        if cfg.out:
            print(f"wrote {cfg.out}")
    ps.destroy_model_parallel()
    dist.barrier()
    dist.destroy_process_group()
    return 0 if result["sanity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
