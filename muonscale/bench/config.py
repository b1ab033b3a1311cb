"""``BenchConfig``: everything that defines one ``muonscale bench`` run.

Keep this module free of heavy imports (no torch): ``muonscale bench --help`` reads it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

CONTENDERS = ("adamw", "muon")
"""Always run: the AdamW reference and muonscale's Muon."""
BASELINES = ("torch-muon", "torch-muon-bf16")
"""Optional extra contenders (``--baselines``): ``torch-muon`` = ``torch.optim.Muon`` for the
hidden matrices + AdamW for the rest (on CPU with its Newton-Schulz iteration run in float32,
see muonscale.bench.torch_muon); ``torch-muon-bf16``: the same, torch's own bfloat16 iteration
unchanged, run once (first seed, torch-muon's learning rate)."""
CORPORA = ("shakespeare", "web")
"""Corpora bundled in muonscale/data (``--corpus``): the Shakespeare plays and poems, and the
World English Bible (muonscale/data/PROVENANCE.md)."""
_VARIANT_NAME = re.compile(r"[a-z][a-z0-9_-]*")
DTYPES = ("float32", "bfloat16", "float16")
MLPS = ("gelu", "swiglu", "moe")
SCHEDULES = ("cosine", "wsd", "constant")
PARALLEL_MODES = ("dp", "fsdp", "tp", "fsdp+tp")  # --parallel; muonscale.bench.distributed reads it

# Default learning rates, tuned once on 2026-11-30 for the default bench (tiny preset: 4 layers,
# d_model 192, byte-level; 1024 tokens/step; cosine schedule, 10 warm-up steps; seed 0) on the
# 2-core CPU box, one single-threaded run per (optimizer, lr) at half the budget (200 steps),
# final validation loss (4 x 8 x 128 held-out tokens):
#   adamw  lr 1e-3: 2.589   2e-3: 2.582 (best)   4e-3: 2.610   8e-3: 2.701
#   muon   lr 2e-3: 2.515   4e-3: 2.470   8e-3: 2.428   1.6e-2: 2.371 (best)
# (equivalent to the sweep of `muonscale bench --steps 200 --eval-batches 4 --sweep
#  --sweep-fraction 1 --lr-adamw 2e-3 --lr-muon 4e-3 --sweep-factors 0.5 1 2 4`, which runs
#  them one after the other). Checked at the full 400 steps:
#   adamw  lr 1e-3: 2.475   2e-3: 2.477   4e-3: 2.565   (AdamW's optimum is 1e-3..2e-3)
#   muon   lr 1.6e-2: 1.929 (reaches AdamW's 2.477 at 0.40x the steps; 6 min 19 s in all)
# The default is 320 steps so that the whole run stays under 6 minutes on 2 cores: 4 min 39 s,
# adamw 2.507, muon 2.048, 0.45x the steps (*Default bench* in the docs).
# torch-muon starts from muon's learning rate: with adjust_lr_fn="match_rms_adamw" it is muon's
# update (on CPU, Newton-Schulz in float32 as muon's). --sweep tunes it like every contender.
DEFAULT_LR = {"adamw": 2e-3, "muon": 1.6e-2, "torch-muon": 1.6e-2}
# Inside the Muon contenders (muon, torch-muon, variants) the AdamW half (embeddings, head,
# norms, biases) trains at its own peak rate, searched at the full 320 steps on seed 0 for
# muon, torch-muon and NorMuon + cautious weight decay alike (5e-4 .. 1.6e-2 at momentum 0.85;
# *Tuning on the bench* in the docs): 1e-3 is the best for all three.
# Over seeds 0-2 muon then reaches AdamW's final loss in 88.5 steps at momentum 0.95 against
# 144.6 with the AdamW half at muon's own 1.6e-2 (the bench's earlier default); at 0.85 in 83.3
# against 134.9, in 270.8 against 311.6 at 1000 steps, and on the World English Bible in fewer
# steps as well.
DEFAULT_MUON_ADAMW_LR = 1e-3
# Below this many steps the report says the comparison means little. The learning rates and the
# 10 warm-up steps are tuned for the default 320, and AdamW leads early: on the default bench
# (2026-12-04, the 2-core CPU machine, `muonscale bench --steps N --memory-probe-steps 0`) Muon
# never reached AdamW's final loss at N = 10 (3.74 against 3.27) or 30 (2.85 against 2.80), and
# needed 0.80x AdamW's steps at 60, 0.64x at 100 (73 s) and 0.28x at 320.
SHORT_RUN_STEPS = 100
# Variants (--variants) start from muon's learning rate unless their spec sets lr.


@dataclass(kw_only=True)
class BenchConfig:
    """One side-by-side benchmark: same model, data, seed, schedule and tokens per contender.

    ``parsed_variants`` (set on construction, not a field): ``{NAME: {OPTION: VALUE}}`` of
    ``variants``, parsed once by :func:`parse_variant`, in the order given.
    """

    steps: int = 320
    """Optimizer steps per contender (token budget: steps x tokens per step, same for all)."""
    model: str = "tiny"
    """Model preset (tiny, gpt2-small, ...; see muonscale.train.config.model_preset)."""
    n_layer: int | None = None
    """Override the preset's number of layers."""
    d_model: int | None = None
    """Override the preset's model width."""
    n_head: int | None = None
    """Override the preset's number of attention heads."""
    mlp: Literal["gelu", "swiglu", "moe"] | None = None
    """Override the preset's MLP: gelu, swiglu or moe (routed SwiGLU experts stored as
    transformers stores them; see --experts, --top-k, --router-aux-loss-coef)."""
    experts: int = 8
    """Routed experts per MoE block (--mlp moe)."""
    top_k: int = 2
    """Experts each token is routed to (--mlp moe)."""
    router_aux_loss_coef: float = 0.01
    """Weight of the Switch Transformer load-balancing loss in the training loss (--mlp moe)."""
    tokens_per_step: int = 1024
    """Tokens per optimizer step; a multiple of the preset's context length (128 for tiny)."""
    data: str | None = None
    """UTF-8 text file or folder of .txt files to train on; default: the bundled Shakespeare
    corpus (the same reader as muonscale train --data)."""
    corpus: Literal["shakespeare", "web"] | None = None
    """A bundled corpus instead of --data: shakespeare (the default) or web (World English
    Bible); see muonscale/data/PROVENANCE.md."""
    tokenizer: Literal["byte", "bpe"] = "byte"
    """byte (UTF-8 bytes, vocab 256) or bpe (byte-level BPE trained on the corpus)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the bpe tokenizer (the model's vocab grows to fit)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward; None: the whole step in one micro-batch."""
    lr_adamw: float = DEFAULT_LR["adamw"]
    """Peak learning rate of the AdamW contender."""
    lr_muon: float = DEFAULT_LR["muon"]
    """Peak learning rate of muonscale Muon (scale=match_rms_adamw: AdamW-like values)."""
    lr_torch_muon: float = DEFAULT_LR["torch-muon"]
    """Peak learning rate of the torch.optim.Muon baseline (adjust_lr_fn=match_rms_adamw)."""
    baselines: list[str] = field(default_factory=list)
    """Extra contenders besides adamw and muon: torch-muon (torch.optim.Muon + AdamW; on CPU its
    Newton-Schulz in float32) and torch-muon-bf16 (torch's bfloat16 iteration, first seed only)."""
    variants: list[str] = field(default_factory=list)
    """Extra muonscale Muon contenders, each NAME=OPTION:VALUE[,OPTION:VALUE...] with options
    of muonscale.Muon (e.g. pe=coefficients:polar_express normuon=normalize:row); lr:VALUE sets
    the variant's starting learning rate (default: --lr-muon); qk_clip:TAU trains it with
    QK-clip at threshold TAU (as muonscale train --qk-clip; e.g. clip=qk_clip:100)."""
    track_max_logit: bool = False
    """Also measure the exact maximum attention logit of contenders without QK-clip (one extra
    QK^T per layer per forward, no rescale) and report it beside the clipped ones'. A
    qk_clip contender always measures it."""
    seeds: int = 1
    """Seeds per contender (--seed, --seed + 1, ...); > 1 adds the mean and spread of final loss
    and of steps to AdamW's final loss (each seed against AdamW's run of that seed)."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warm-up, shared by every contender."""
    lr_warmup_steps: int = 10
    """Linear learning-rate warm-up steps, shared by every contender."""
    weight_decay: float = 0.1
    """Decoupled weight decay, shared by every contender (see --muon-weight-decay)."""
    muon_weight_decay: float | None = None
    """Decoupled weight decay of muon, torch-muon and the variants alike (their Muon half and
    their AdamW half's >= 2-D tensors; a variant's weight_decay:VALUE overrides it); the AdamW
    contender keeps --weight-decay. None: --weight-decay."""
    momentum: float = 0.95
    """Muon momentum, shared by muon, torch-muon and the variants (a variant's momentum:VALUE
    overrides it); AdamW's betas are unchanged."""
    muon_adamw_lr: float | None = DEFAULT_MUON_ADAMW_LR
    """Peak learning rate of the AdamW half (embeddings, head, norms, biases) inside muon,
    torch-muon and the variants alike (a variant's adamw_lr:VALUE overrides it; --sweep scales
    the Muon half's rate only); none: each contender's own learning rate for both halves."""
    sweep: bool = False
    """First sweep learning rates per contender on a shorter budget; run with the best of each."""
    sweep_factors: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0, 4.0])
    """Learning rates tried by --sweep, as multiples of each contender's --lr-* value."""
    sweep_fraction: float = 0.25
    """Steps of each sweep run as a fraction of --steps."""
    ns_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Newton-Schulz dtype of muon; None: bfloat16 on CUDA, float32 on CPU."""
    momentum_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Momentum buffer dtype of muon; None: the parameter dtype."""
    device: str = "cpu"
    """Torch device: cpu, cuda, cuda:N, or auto (cuda when available)."""
    seed: int = 0
    """Seed of model init and data order, shared by every contender."""
    threads: int | None = 1
    """torch CPU threads; None: torch's default. 1 keeps CPU timings clean: on 2 shared cores
    two threads ran 4x slower than one whenever another process was busy."""
    workers: int | None = None
    """Processes that train the contenders at once, steps in lockstep (muonscale.bench.lockstep):
    the same losses bitwise in less wall time, but timings taken while the other workers compute
    (for evidence runs over seeds and variants). None: 1 (steps interleaved in one process) for
    the training runs; the sweep's runs, which are not timed, as many at once as the cores hold."""
    eval_interval: float = 0.025
    """Evaluate at least every this fraction of the steps (0.025: >= 40 evaluations)."""
    eval_batches: int = 3
    """Micro-batches in the fixed validation set."""
    timing_warmup_steps: int = 10
    """Steps left out of the timing medians."""
    memory_probe_steps: int = 3
    """Steps each contender runs alone in a child process to measure peak memory; 0 skips."""
    out: str | None = None
    """Output folder; None: runs/bench-<UTC timestamp>/. Every finished run is saved in its
    runs/ subfolder, keyed by its full configuration; the same command again reuses them."""
    tensorboard: str | None = None
    """Also write the curves as TensorBoard event files into this folder (needs tensorboard)."""
    plots: bool = True
    """Write PNG plots (--no-plots skips them)."""
    progress: bool = True
    """Show a progress bar on stderr."""
    nproc: int = 1
    """Processes (gloo ranks) to run on. > 1 runs the distributed side-by-side bench
    (muonscale.bench.distributed): the same contenders, model, data and flags in distributed
    form (a few flags that mean nothing there are refused, see REFUSED_WITH_NPROC), plus bytes
    on the wire per step; on 2 CPU cores use a small model, e.g. --n-layer 2 --d-model 128
    --steps 30."""
    parallel: str = "dp"
    """With --nproc > 1: dp (DistributedMuon vs ZeRO-1 AdamW vs DDP AdamW), fsdp, tp or
    fsdp+tp (DTensorMuon vs AdamW on the same FSDP2 / tensor-parallel model; fsdp+tp: --nproc 4)."""

    def __post_init__(self) -> None:
        positive = ("steps", "tokens_per_step", "eval_batches", "nproc", "seeds", "experts")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("lr_adamw", "lr_muon", "lr_torch_muon"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{_flag(name)} must be > 0, got {getattr(self, name)}")
        for name in ("micro_batch_size", "threads", "workers"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {value}")
        for name in self.baselines:
            if name not in BASELINES:
                raise ValueError(f"unknown baseline {name!r}; choose from {', '.join(BASELINES)}")
        if len(set(self.baselines)) != len(self.baselines):
            raise ValueError(f"--baselines lists a contender twice: {self.baselines}")
        parsed = [parse_variant(spec) for spec in self.variants]
        names = [name for name, _ in parsed]
        for name in names:
            if name in (*CONTENDERS, *BASELINES):
                raise ValueError(f"--variants: name {name!r} is taken by a built-in contender")
        if len(set(names)) != len(names):
            raise ValueError(f"--variants names a contender twice: {names}")
        self.parsed_variants: dict[str, dict[str, Any]] = dict(parsed)
        if self.corpus is not None and self.corpus not in CORPORA:
            raise ValueError(f"--corpus must be one of {CORPORA}, got {self.corpus!r}")
        if self.corpus is not None and self.data is not None:
            raise ValueError("--corpus and --data both choose the text: pass one of them")
        if self.tensorboard is not None and importlib.util.find_spec("tensorboard") is None:
            raise ValueError(
                "--tensorboard needs the tensorboard package, which is not installed: "
                "pip install 'muonscale[bench]' (or pip install tensorboard)"
            )
        if not 0 < self.eval_interval <= 1:
            raise ValueError(f"--eval-interval must be in (0, 1], got {self.eval_interval}")
        if not 0 < self.sweep_fraction <= 1:
            raise ValueError(f"--sweep-fraction must be in (0, 1], got {self.sweep_fraction}")
        if self.sweep and not self.sweep_factors:
            raise ValueError("--sweep needs at least one --sweep-factors value")
        if any(f <= 0 for f in self.sweep_factors):
            raise ValueError(f"--sweep-factors must be > 0, got {self.sweep_factors}")
        if self.muon_adamw_lr is not None and not self.muon_adamw_lr > 0:
            raise ValueError(f"--muon-adamw-lr must be > 0, got {self.muon_adamw_lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        for name in ("weight_decay", "muon_weight_decay"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < float("inf"):
                raise ValueError(f"--{_flag(name)} must be a finite number >= 0, got {value}")
        for name in ("lr_warmup_steps", "timing_warmup_steps", "memory_probe_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        for name in ("ns_dtype", "momentum_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise ValueError(f"--{_flag(name)} must be one of {DTYPES}, got {value!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"--parallel must be one of {PARALLEL_MODES}, got {self.parallel!r}")
        if self.mlp is not None and self.mlp not in MLPS:
            raise ValueError(f"--mlp must be one of {MLPS}, got {self.mlp!r}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"--top-k must be in [1, --experts={self.experts}], got {self.top_k}")
        if not 0 <= self.router_aux_loss_coef < float("inf"):
            raise ValueError(
                f"--router-aux-loss-coef must be a finite number >= 0, got "
                f"{self.router_aux_loss_coef}"
            )
        if self.mlp == "moe" and self.parallel in ("tp", "fsdp+tp"):
            raise ValueError(
                f"--mlp moe does not apply with --parallel {self.parallel}: the tensor-parallel "
                "plan shards the dense MLP's fc and proj, which an MoE block does not have "
                "(use --parallel dp or fsdp)"
            )
        if self.tokenizer not in ("byte", "bpe"):
            raise ValueError(f"--tokenizer must be byte or bpe, got {self.tokenizer!r}")
        if self.nproc > 1:
            self._check_nproc_flags()
        if self.nproc == 1 and self.parallel != "dp":
            raise ValueError(f"--parallel {self.parallel} needs --nproc >= 2")

    def _check_nproc_flags(self) -> None:
        """Refuse the flags that have no meaning in the distributed bench, naming why."""
        defaults = {f.name: f for f in dataclasses.fields(BenchConfig)}
        for name, why in REFUSED_WITH_NPROC.items():
            f = defaults[name]
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            if getattr(self, name) != default:
                raise ValueError(
                    f"--{_flag(name)} {getattr(self, name)!r} does not apply with --nproc > 1: "
                    f"{why}; leave it at its default ({default!r}) or use --nproc 1"
                )
        if self.parallel in ("tp", "fsdp+tp"):
            clipped = [n for n, o in self.parsed_variants.items() if o.get("qk_clip") is not None]
            named = f"--variants {', '.join(clipped)}: qk_clip"
            for flag, used in (("--track-max-logit", self.track_max_logit), (named, clipped)):
                if used:
                    raise ValueError(
                        f"{flag} does not apply with --parallel {self.parallel}: {TP_MAX_LOGIT}"
                    )

    @property
    def contenders(self) -> list[str]:
        """Contender names in execution order (adamw first: it is the reference)."""
        return [*CONTENDERS, *self.baselines, *self.parsed_variants]

    def variant_options(self, contender: str) -> dict[str, Any] | None:
        """The muonscale.Muon options of a --variants contender (without the bench's own
        :data:`TRAINING_OPTIONS`); None otherwise."""
        options = self.parsed_variants.get(contender)
        if options is None:
            return None
        return {k: v for k, v in options.items() if k not in TRAINING_OPTIONS}

    def qk_clip_for(self, contender: str) -> float | None:
        """The QK-clip threshold tau of a contender (``qk_clip:TAU`` of a variant); None: off."""
        tau = self.parsed_variants.get(contender, {}).get("qk_clip")
        return None if tau is None else float(tau)

    def tracks_max_logit(self, contender: str) -> bool:
        """Whether a contender's runs measure the maximum attention logit (QK-clip on, or
        --track-max-logit)."""
        return self.track_max_logit or self.qk_clip_for(contender) is not None

    def lr_for(self, contender: str) -> float:
        """The starting (unswept) peak learning rate of a contender."""
        if contender in self.parsed_variants:
            return float(self.parsed_variants[contender].get("lr", self.lr_muon))
        if contender == "torch-muon-bf16":
            return self.lr_torch_muon
        return getattr(self, "lr_" + contender.replace("-", "_"))

    def model_overrides(self) -> dict:
        """The non-None --n-layer / --d-model / --n-head / --mlp overrides of the preset, and
        with --mlp moe its --experts, --top-k and --router-aux-loss-coef."""
        names = ("n_layer", "d_model", "n_head", "mlp")
        if self.mlp == "moe":
            names += ("experts", "top_k", "router_aux_loss_coef")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BenchConfig:
        return cls(**json.loads(text))


REFUSED_WITH_NPROC = {
    "baselines": "torch.optim.Muon has no distributed form (muonscale train refuses torch-muon "
    "with --parallel for the same reason); the distributed Muon contenders are DistributedMuon "
    "and DTensorMuon",
    "lr_torch_muon": "it is the learning rate of the torch-muon baselines, which the "
    "distributed bench does not train (see --baselines)",
    "workers": "it spreads the contenders over single-process worker processes; with --nproc "
    "every rank trains every contender, steps interleaved",
    "device": "the distributed bench's ranks are gloo processes on the CPU",
    "memory_probe_steps": "the memory probes train each contender alone in one process; the "
    "distributed report gives each rank's optimizer-state bytes instead",
}
"""Flags that mean nothing in the distributed bench (``--nproc > 1``), and why: refused unless
at their default. Every other flag means there what it means in the single-process bench."""

TP_MAX_LOGIT = (
    "each tensor-parallel rank's attention computes only its own heads, and the per-head "
    "maxima that QK-clip and --track-max-logit read are not gathered across the TP ranks "
    "(use --parallel dp or fsdp)"
)
"""Why QK-clip and the max-logit probe are refused under ``--parallel tp`` / ``fsdp+tp``."""


TRAINING_OPTIONS = {
    "lr": "the variant's starting learning rate (swept by --sweep)",
    "qk_clip": "QK-clip threshold tau (TrainConfig.qk_clip)",
}
"""Variant options that configure training rather than ``muonscale.Muon``."""


def parse_variant(spec: str) -> tuple[str, dict[str, Any]]:
    """``"NAME=OPTION:VALUE[,OPTION:VALUE...]"`` -> ``(NAME, {OPTION: VALUE})``.

    Values: ``true``/``false`` -> bool, ``none`` -> None, integers and floats -> numbers,
    anything else a string (dtype names stay strings here). Option names are checked against
    ``muonscale.Muon``'s signature later (:func:`muonscale.bench.variants.check_options`).
    """
    usage = "expected NAME=OPTION:VALUE[,OPTION:VALUE...], e.g. pe=coefficients:polar_express"
    name, sep, body = spec.partition("=")
    if not sep or not body:
        raise ValueError(f"--variants {spec!r}: {usage}")
    if not _VARIANT_NAME.fullmatch(name):
        raise ValueError(
            f"--variants {spec!r}: name {name!r} must be lowercase letters, digits, - or _ "
            "(starting with a letter)"
        )
    options: dict[str, Any] = {}
    for item in body.split(","):
        option, sep, value = item.partition(":")
        if not sep or not option or not value:
            raise ValueError(f"--variants {spec!r}: bad item {item!r}; {usage}")
        if option in options:
            raise ValueError(f"--variants {spec!r}: option {option!r} given twice")
        options[option] = _parse_value(value)
    if "lr" in options and not (
        isinstance(options["lr"], int | float)
        and not isinstance(options["lr"], bool)
        and 0 < options["lr"] < math.inf
    ):
        raise ValueError(
            f"--variants {spec!r}: lr must be a finite number > 0, got {options['lr']!r}"
        )
    tau = options.get("qk_clip")
    if (
        "qk_clip" in options
        and tau is not None
        and not (isinstance(tau, int | float) and not isinstance(tau, bool) and 0 < tau < math.inf)
    ):
        raise ValueError(
            f"--variants {spec!r}: qk_clip must be a finite number > 0 (tau) or none, got {tau!r}"
        )
    return name, options


def _parse_value(text: str) -> Any:
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _flag(name: str) -> str:
    return name.replace("_", "-")


def report_key(contender: str) -> str:
    """Key of a contender in report.json (``torch-muon`` -> ``torch_muon``)."""
    return contender.replace("-", "_")
