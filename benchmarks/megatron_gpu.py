"""Megatron-Core GPT under Megatron's own DDP: tokens/s of muonscale vs Megatron's Adam and Muon.

GPU (NCCL), from the repository root, with megatron-core 0.19.2 installed or carried as the
wheels of ``bash .ci/megatron_site.sh`` (``.megatron-site/``)::

    PYTHONPATH=.:.megatron-site torchrun --nproc-per-node 1 benchmarks/megatron_gpu.py \\
        --out runs/megatron_gpu.json                  # one GPU, GPT-2-medium shapes, ~1 minute
    PYTHONPATH=.:.megatron-site torchrun --nproc-per-node 8 benchmarks/megatron_gpu.py --tp 2

``benchmarks/gpu.py`` runs the first line as its Megatron leg. CPU smoke (gloo, tiny model)::

    PYTHONPATH=. .venv-megatron/bin/torchrun --nproc-per-node 2 benchmarks/megatron_gpu.py --smoke
    PYTHONPATH=. .venv-megatron/bin/python benchmarks/megatron_gpu.py --smoke   # one process

Three arms on three identically built models (same seeds, hence the same initial weights; the
JSON checks it with the loss of each on one fixed batch), fed the same batches. Both Muon arms
and Megatron's Adam are built from ONE Megatron ``OptimizerConfig(optimizer="muon", bf16=True,
muon_*=...)`` (``arms.muon_optimizer_config``; every ``muon_*`` field is a ``--muon-*`` flag;
defaults: momentum 0.95, Nesterov, ``simple`` coefficients = muonscale's ``keller``, 5 steps,
``spectral`` × 0.2 = muonscale's ``match_rms_adamw``, ``medium`` = bf16 Newton–Schulz, QKV
split, ``duplicated`` = exact TP). The JSON's ``muon_config`` records that config, the
``TensorParallelMuon`` arguments Megatron derives from it, what ``from_megatron`` made of it, and
the settings read back from both built optimizers (``same_settings``, checked in ``sanity``):

* ``megatron_adam``: ``get_megatron_optimizer`` of that config with ``optimizer="adam"``:
  Megatron's ``Float16OptimizerWithFloat16Params`` (fp32 main parameters,
  global gradient-norm clipping) around Adam (TE or apex ``FusedAdam`` when installed, else
  ``torch.optim.AdamW``; ``meta.adam_impl`` says which);
* ``muonscale``: ``megatron_muon([model], MegatronMuonConfig.from_megatron(config, ...))``, which
  reads Megatron DDP's ``main_grad`` (``dp_mode="replicated"``), keeps fp32 main copies of the
  bf16 parameters and clips the global gradient norm the same way;
* ``megatron_muon``: ``get_megatron_optimizer(config, [model])``: a ``ChainedOptimizer`` of
  ``Float16OptimizerWithFloat16Params`` around Megatron-Core's ``TensorParallelMuon`` (on
  emerging-optimizers) for the 2-D weights and around Adam for the rest.

Both Megatron arms get Megatron's ``OptimizerParamScheduler`` at constant lr (as
megatron.training): it sets each group's weight decay × ``wd_mult`` (none on biases and norms).

The model is Megatron's ``GPTModel`` (local layer spec; Transformer Engine's with ``--spec te``,
or ``auto`` when ``transformer_engine`` imports), bf16 parameters in ``Float16Module``, wrapped in
Megatron's ``DistributedDataParallel`` (fp32 gradient buffers, no overlap, no distributed
optimizer), as ``megatron.training`` builds it. One step, as Megatron's training loop runs it:
``zero_grad_buffer()`` and ``optimizer.zero_grad()``; forward/backward of each micro-batch (loss
mean ÷ micro-batches); ``finalize_model_grads([model])``; ``optimizer.step()``.

Measured (docs/metrics.md): each arm first runs its warm-up steps alone, which also
gives its peak memory (``torch.cuda.max_memory_allocated`` minus what was allocated before the
arm was built, i.e. its model, gradient buffers, optimizer state and activations); then timed
rounds interleave the arms (A B, B A, ...), ``torch.cuda.synchronize()`` around each step and
between backward and optimizer step; medians of step time, forward+backward time and optimizer
step time. Reported: tokens/s of each arm at one micro-batch per step and, with ``--accum K``,
at K micro-batches per step (measured when it fits ``--budget-s``, and composed from the
one-micro-batch medians: K·t_fwd_bwd + t_opt, which counts the per-step buffer zeroing and
gradient reduction K times, slightly against both arms); ``throughput_ratio`` = muonscale ÷
megatron_adam; the loss on a fixed batch before and after, each step's training loss and
gradient norm (sanity: same start, finite, decreasing, same first-step gradient norm); the same
ratios against ``megatron_muon`` (``*_vs_megatron_muon_*``) and peak memory ratios.

What the CPU smoke covers, and what only a GPU run does. Megatron's DDP allocates its gradient
buffers on ``torch.cuda.current_device()`` (distributed/param_and_grad_buffer.py L1184) and
``Float16OptimizerWithFloat16Params`` accepts only ``torch.cuda.*Tensor`` parameters and makes
CUDA tensors (optimizer/optimizer.py L1009, L690), so neither runs on CPU. ``--smoke`` therefore
runs the same harness (flags, Megatron ``GPTModel`` + ``Float16Module`` in bf16 built twice with
equal weights, corpus batches split over DP, interleaved rounds, accumulation, table, JSON,
loss checks) with: ``muonscale`` = ``megatron_muon`` on the unwrapped bf16 model (no
``main_grad``: the optimizer averages ``.grad`` over DP itself; fp32 main params and clipping as
on GPU); in place of ``megatron_muon``, ``megatron_muon_unwrapped_cpu`` = the same
``get_megatron_optimizer(config, [model])`` call with ``FP32Optimizer``,
``Float16OptimizerWithFloat16Params`` and ``ChainedOptimizer`` replaced by pass-throughs (so
Megatron's own parameter tagging, param groups and config → ``TensorParallelMuon`` arguments
run), stepped by ``arms.MainParamsChain`` (fp32 main copies with Megatron's attributes, one
clip, the two torch optimizers); and, in place of ``megatron_adam``, ``adamw_cpu_standin`` =
``torch.optim.AdamW`` with
the same hyper-parameters directly on the bf16 parameters (no weight decay for 1-D tensors, as
Megatron's default groups), DP mean and ``clip_grad_norm_`` by hand (exact at the smoke's TP 1).
The JSON says ``"not measured: <reason>"`` for the Megatron arms (``not_measured``) and for
peak memory. Only a GPU run covers Megatron's DDP (``main_grad`` buffers,
``finalize_model_grads``), ``get_megatron_optimizer`` and muonscale reading ``main_grad``, NCCL,
CUDA timing and memory. Nothing of torch.cuda is replaced on the GPU path.

Code: this file holds the config (every field a flag) and ``main``; the model, data, arms,
timing and report live in ``benchmarks/megatron_gpu_parts/`` (one module each).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import traceback
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.megatron_gpu_parts.arms import (
    ARMS,
    CPU_STANDIN,
    CPU_STANDINS,
    Arm,
    MainParamsChain,
    StandinAdamW,
    build_arm,
    muon_optimizer_config,
    muon_settings,
    muonscale_config,
    standin_mean_over_dp,
    unwrapped_megatron_optimizers,
)
from benchmarks.megatron_gpu_parts.device import Device, cpu_shims
from benchmarks.megatron_gpu_parts.measure import eval_loss, run, train_step
from benchmarks.megatron_gpu_parts.model import Batches, build_gpt, resolve_spec, seed_weights
from benchmarks.megatron_gpu_parts.report import med, print_table, sanity, summarize, write_json

__all__ = [  # the parts, re-exported: everything the script defined before it was split
    "ARMS",
    "CPU_STANDIN",
    "CPU_STANDINS",
    "MainParamsChain",
    "muon_optimizer_config",
    "muon_settings",
    "muonscale_config",
    "unwrapped_megatron_optimizers",
    "SPECS",
    "SMOKE_DEFAULTS",
    "Arm",
    "Batches",
    "BenchConfig",
    "Device",
    "StandinAdamW",
    "build_arm",
    "build_gpt",
    "build_parser",
    "cpu_shims",
    "eval_loss",
    "free_port",
    "main",
    "med",
    "parse_config",
    "print_table",
    "resolve_spec",
    "run",
    "sanity",
    "seed_weights",
    "standin_mean_over_dp",
    "summarize",
    "train_step",
    "write_json",
]

SPECS = ("auto", "local", "te")
MUON_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high", "highest")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")


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
    spec: str = _option(
        "auto",
        str,
        "layer spec: local, te (Transformer Engine), auto = te if it imports",
        choices=SPECS,
    )
    lr: float = _option(3e-4, float, "learning rate of both arms (muonscale's AdamW half too)")
    weight_decay: float = _option(0.1, float, "decoupled weight decay of both arms")
    clip_grad: float = _option(1.0, float, "global gradient-norm clip of both arms (0 = off)")
    warmup: int = _option(2, int, "untimed steps per arm before the timed rounds")
    rounds: int = _option(3, int, "timed rounds; each runs every arm for --steps-per-round steps")
    steps_per_round: int = _option(4, int, "timed steps per arm per round")
    accum: int = _option(
        64,
        int,
        "micro-batches per step of the accumulation point (64 x 8 x 1024 = 0.5M tokens); 0 = skip",
    )
    accum_rounds: int = _option(1, int, "timed accumulation steps per arm (interleaved)")
    budget_s: float = _option(
        0.0,
        float,
        "wall-clock budget in seconds: the accumulation point is measured only if it fits "
        "(0 = no limit)",
    )
    muon_momentum: float = _option(0.95, float, "OptimizerConfig.muon_momentum (both Muon arms)")
    muon_nesterov: bool = _option(True, bool, "OptimizerConfig.muon_nesterov (both Muon arms)")
    muon_split_qkv: bool = _option(True, bool, "OptimizerConfig.muon_split_qkv (both Muon arms)")
    muon_coefficient_type: str = _option(
        "simple",
        str,
        "OptimizerConfig.muon_coefficient_type (simple = muonscale's keller)",
        choices=MUON_COEFFICIENT_TYPES,
    )
    muon_num_ns_steps: int = _option(5, int, "OptimizerConfig.muon_num_ns_steps")
    muon_scale_mode: str = _option(
        "spectral",
        str,
        "OptimizerConfig.muon_scale_mode (Megatron's names)",
        choices=MUON_SCALE_MODES,
    )
    muon_extra_scale_factor: float = _option(
        0.2,
        float,
        "OptimizerConfig.muon_extra_scale_factor "
        "(spectral x 0.2 = muonscale's default match_rms_adamw)",
    )
    muon_fp32_matmul_prec: str = _option(
        "medium",
        str,
        "OptimizerConfig.muon_fp32_matmul_prec (medium = bf16 Newton-Schulz)",
        choices=MUON_MATMUL_PRECISIONS,
    )
    muon_tp_mode: str = _option(
        "duplicated",
        str,
        "OptimizerConfig.muon_tp_mode of Megatron's Muon (muonscale is exact whatever it says)",
        choices=MUON_TP_MODES,
    )
    seed: int = _option(0, int, "seed of the weights (every arm) and of the batches")
    out: str = _option("", str, "write the JSON result to this path (rank 0)")
    smoke: bool = _option(
        False, bool, "tiny model on CPU with gloo (see the module docstring for what it covers)"
    )

    def __post_init__(self) -> None:
        positive = (
            "layers",
            "hidden",
            "heads",
            "seq",
            "micro_batch",
            "tp",
            "rounds",
            "steps_per_round",
            "accum_rounds",
            "muon_num_ns_steps",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        for name in (
            "query_groups",
            "ffn_hidden",
            "warmup",
            "accum",
            "budget_s",
            "clip_grad",
            "weight_decay",
        ):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}"
                )
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
        if not self.muon_extra_scale_factor > 0:
            raise ValueError(
                f"--muon-extra-scale-factor must be > 0, got {self.muon_extra_scale_factor}"
            )
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads {self.heads}")
        groups = self.query_groups or self.heads
        if self.heads % groups:
            raise ValueError(f"--heads {self.heads} is not a multiple of --query-groups {groups}")
        if self.heads % self.tp or groups % self.tp:
            raise ValueError(
                f"--tp {self.tp} must divide --heads {self.heads} and the query groups {groups}"
            )
        if self.vocab < 256 or self.vocab % self.tp:
            raise ValueError(
                f"--vocab must be >= 256 (byte tokens) and a multiple of --tp, got {self.vocab}"
            )
        if self.seq < 2:
            raise ValueError(f"--seq must be >= 2, got {self.seq}")

    @property
    def num_query_groups(self) -> int:
        return self.query_groups or self.heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.ffn_hidden or 4 * self.hidden


SMOKE_DEFAULTS = dict(
    layers=2,
    hidden=64,
    heads=4,
    query_groups=2,
    seq=32,
    vocab=256,
    micro_batch=2,
    warmup=1,
    rounds=2,
    steps_per_round=3,
    accum=2,
    lr=3e-3,
)
"""--smoke replaces these defaults (flags given explicitly still win)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Defaults: one H200, GPT-2-medium shapes; --smoke: "
        + ", ".join(f"{k}={v}" for k, v in SMOKE_DEFAULTS.items()),
    )
    for f in fields(BenchConfig):
        flag = "--" + f.name.replace("_", "-")
        meta = dict(f.metadata)
        kind, help_text = meta.pop("kind"), meta.pop("help")
        default = f.default if f.default is not MISSING else None
        if kind is bool and default:  # on by default: --x / --no-x
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=True, help=help_text
            )
        elif kind is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
        else:
            parser.add_argument(
                flag,
                type=kind,
                default=default,
                help=f"{help_text} (default {default if default != '' else 'none'})",
                **meta,
            )
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """0: measured and sane; 1: a sanity check failed; 3: megatron-core does not import."""
    cfg = parse_config(argv)
    if "WORLD_SIZE" not in os.environ:  # plain ``python megatron_gpu.py``: one process
        os.environ.update(
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
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
            "device": device.name(),
            "world_size": world,
            "tp": cfg.tp,
            "torch": torch.__version__,
            "megatron_core": megatron.core.__version__,
            "megatron_core_path": os.path.dirname(megatron.core.__file__),
            "adam_impl": "torch.optim.AdamW"
            if megatron_optimizer.USING_PYTORCH_OPTIMIZER
            else "fused Adam (TE or apex)",
            "peak_metric": (
                "torch.cuda.max_memory_allocated during the arm's build and warm-up, "
                "minus memory allocated before"
            )
            if device.cuda
            else "process peak RSS (CPU smoke: not per arm)",
            "config": asdict(cfg),
        },
        "arms": {},
        "phases_done": [],
    }

    def save() -> None:
        if rank0 and cfg.out:
            write_json(cfg.out, result)

    if rank0:
        print(
            f"megatron_gpu: {device.name()}, {world} processes, TP {cfg.tp}, "
            f"megatron-core {result['meta']['megatron_core']} "
            f"({result['meta']['megatron_core_path']})",
            flush=True,
        )
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
