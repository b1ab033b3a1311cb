"""Configuration of the reference training stack, and CLI flags generated from dataclasses.

``ModelConfig`` and ``TrainConfig`` are keyword-only dataclasses with a docstring under every
field. :func:`add_dataclass_arguments` turns any such dataclass into ``argparse`` flags whose
help text is that docstring, and :func:`dataclass_from_args` reads them back, so a config
and its command line never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, fields, replace
from typing import Any, Literal

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "moe")
POSITIONS = ("learned", "rotary")
OPTIMIZERS = ("muon", "adamw", "torch-muon")
SCHEDULES = ("cosine", "wsd", "constant")
AUTOCAST_DTYPES = ("none", "bfloat16")
TENSOR_DTYPES = ("float32", "bfloat16", "float16")
TOKENIZERS = ("byte", "bpe")
PARALLEL_MODES = ("none", "dp", "fsdp")
MAX_SEED = 2**63 - 1
"""torch.manual_seed and numpy's generators take non-negative seeds below 2**64."""
MAX_BPE_VOCAB_SIZE = 2**18
"""262,144 tokens: above the largest published LLM vocabularies (Gemma's 256,000). Far larger
values (1e9) make the tokenizers library abort the process instead of raising."""
MAX_TOKENS_PER_STEP = 2**24
"""16,777,216 tokens: the largest published pre-training batch (Llama 3 405B, 16M tokens)."""


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the nanoGPT-style decoder (:class:`muonscale.train.model.GPT`)."""

    vocab_size: int = 256
    """Rows of the token embedding (and columns of the output head); >= the tokenizer's vocab."""
    context_length: int = 128
    """Maximum sequence length (tokens per training window)."""
    n_layer: int = 4
    """Number of transformer blocks."""
    d_model: int = 192
    """Width of the residual stream."""
    n_head: int = 6
    """Number of query heads; must divide d_model."""
    n_kv_head: int | None = None
    """Number of key/value heads (grouped-query attention); None means n_head (plain MHA)."""
    mlp: Literal["gelu", "swiglu", "moe"] = "gelu"
    """MLP type: GELU (4x expansion), SwiGLU (gated, ~8/3x expansion) or moe (routed SwiGLU
    experts, see muonscale.train.model.MoE)."""
    mlp_hidden_dim: int | None = None
    """Hidden width of the MLP (of each expert with moe); None: 4*d_model for gelu, 8/3*d_model
    rounded up to 64 for swiglu, swiglu's width / top_k for moe (a token's expert FLOPs equal
    the dense SwiGLU's)."""
    experts: int = 8
    """Routed experts per MoE block (mlp == 'moe')."""
    top_k: int = 2
    """Experts each token is routed to (mlp == 'moe')."""
    router_aux_loss_coef: float = 0.01
    """Weight of the router's load-balancing loss in the training loss (mlp == 'moe')."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    """Normalization layer used before attention, before the MLP and before the head."""
    norm_eps: float = 1e-5
    """Epsilon of the normalization layers."""
    position: Literal["learned", "rotary"] = "learned"
    """Position encoding: learned absolute embeddings (wpe) or rotary (RoPE) on q and k."""
    rope_base: float = 10000.0
    """Base of the rotary frequencies (used when position == 'rotary')."""
    tie_embeddings: bool = False
    """Share the token embedding (wte) with the output head (lm_head), as GPT-2 does."""
    bias: bool = False
    """Use biases in linear layers and LayerNorm."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "context_length", "n_layer", "d_model", "n_head")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"n_head={self.n_head} must divide d_model={self.d_model}")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        _check_choice("mlp", self.mlp, MLPS)
        if self.experts < 1:
            raise ValueError(f"ModelConfig.experts must be >= 1, got {self.experts}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(
                f"ModelConfig.top_k must be in [1, experts={self.experts}], got {self.top_k}"
            )
        if not 0 <= self.router_aux_loss_coef < float("inf"):
            raise ValueError(
                "ModelConfig.router_aux_loss_coef must be a finite number >= 0, got "
                f"{self.router_aux_loss_coef}"
            )
        _check_choice("norm", self.norm, NORMS)
        _check_choice("position", self.position, POSITIONS)
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(f"rotary positions need an even head_dim, got {self.head_dim}")

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def hidden_dim(self) -> int:
        if self.mlp_hidden_dim is not None:
            return self.mlp_hidden_dim
        if self.mlp == "gelu":
            return 4 * self.d_model
        swiglu = -(-8 * self.d_model // 3 // 64) * 64
        return swiglu if self.mlp == "swiglu" else max(1, swiglu // self.top_k)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


_PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized byte-level model (1.9M parameters, 6 heads of 32): a training step of 16 x 128
    # tokens costs ~25 GFLOP (flops_per_token), about a second on 2 idle CPU cores.
    "tiny": dict(vocab_size=256, context_length=128, n_layer=4, d_model=192, n_head=6),
    # GPT-2 shapes (Radford et al. 2019); vocab 50257 padded to 50304 (a multiple of 64).
    "gpt2-small": dict(vocab_size=50304, context_length=1024, n_layer=12, d_model=768, n_head=12),
    "gpt2-medium": dict(vocab_size=50304, context_length=1024, n_layer=24, d_model=1024, n_head=16),
    "gpt2-large": dict(vocab_size=50304, context_length=1024, n_layer=36, d_model=1280, n_head=20),
    "gpt2-xl": dict(vocab_size=50304, context_length=1024, n_layer=48, d_model=1600, n_head=25),
}
PRESET_NAMES = tuple(_PRESETS)


def model_preset(name: str, **overrides: Any) -> ModelConfig:
    """``ModelConfig`` of a named size ("tiny", "gpt2-small", "gpt2-medium", "gpt2-large",
    "gpt2-xl"), with keyword overrides applied."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose from {PRESET_NAMES}")
    return ModelConfig(**{**_PRESETS[name], **overrides})


@dataclass(kw_only=True)
class TrainConfig:
    """Everything one ``muonscale train`` run depends on (saved inside every checkpoint)."""

    model: Literal["tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"] = "tiny"
    """Model size preset: tiny, gpt2-small, gpt2-medium, gpt2-large or gpt2-xl."""
    n_layer: int | None = None
    """Override the preset's number of layers."""
    d_model: int | None = None
    """Override the preset's model width."""
    n_head: int | None = None
    """Override the preset's number of query heads."""
    n_kv_head: int | None = None
    """Override the preset's number of key/value heads (grouped-query attention)."""
    context_length: int | None = None
    """Override the preset's context length."""
    vocab_size: int | None = None
    """Override the preset's vocabulary size (must be >= the tokenizer's)."""
    mlp: Literal["gelu", "swiglu", "moe"] | None = None
    """Override the preset's MLP type (moe: routed experts, see --experts, --top-k)."""
    experts: int | None = None
    """Routed experts per MoE block with --mlp moe; None: 8."""
    top_k: int | None = None
    """Experts each token is routed to with --mlp moe; None: 2."""
    router_aux_loss_coef: float | None = None
    """Weight of the router's load-balancing loss with --mlp moe; None: 0.01."""
    norm: Literal["layernorm", "rmsnorm"] | None = None
    """Override the preset's normalization layer."""
    position: Literal["learned", "rotary"] | None = None
    """Override the preset's position encoding."""
    tie_embeddings: bool | None = None
    """Override whether the output head shares the token embedding."""
    data: str | None = None
    """UTF-8 text file or folder of .txt files; default: the bundled Shakespeare corpus."""
    tokenizer: Literal["byte", "bpe"] = "byte"
    """byte (UTF-8 bytes, vocab 256) or bpe (byte-level BPE trained on the corpus; needs
    tokenizers)."""
    bpe_vocab_size: int = 4096
    """Vocabulary size of the bpe tokenizer (the model's vocab grows to fit, rounded up to 64)."""
    val_fraction: float = 0.05
    """Fraction of the tokens (taken from the end) held out for validation."""
    optimizer: Literal["muon", "adamw", "torch-muon"] = "muon"
    """muon (muonscale.Muon), adamw (torch.optim.AdamW) or torch-muon (torch.optim.Muon + AdamW)."""
    lr: float = 3e-3
    """Peak learning rate (all parameter groups; Muon scales updates to match AdamW's RMS)."""
    adamw_lr: float | None = None
    """Peak learning rate of the AdamW groups inside muon / torch-muon; None: same as lr."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW: only parameters with >= 2 dims)."""
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2), also for the AdamW part of muon / torch-muon."""
    momentum: float = 0.95
    """Muon momentum (muon and torch-muon)."""
    ns_steps: int = 5
    """Newton-Schulz iterations per Muon update."""
    ns_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Newton-Schulz compute dtype for muon; None: bfloat16 on CUDA, float32 on CPU."""
    momentum_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of Muon momentum buffers; None: the parameter's dtype."""
    steps: int = 200
    """Number of optimizer steps."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass."""
    tokens_per_step: int | None = None
    """Tokens per optimizer step (a multiple of micro_batch_size * context); None: one
    micro-batch."""
    warmup_steps: int = 10
    """Linear warm-up steps (the learning rate rises from peak/warmup_steps to the peak)."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warm-up."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine and wsd)."""
    decay_fraction: float = 0.2
    """Fraction of the steps spent in the final linear decay of the wsd schedule."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm to this value; None or 0 disables clipping."""
    qk_clip: float | None = None
    """QK-clip threshold tau (MuonClip): after each step, shrink W_q/W_k of every head whose max
    attention logit exceeded tau; None: off."""
    eval_every: int = 50
    """Evaluate the validation loss every this many steps (and at the end); 0 disables."""
    eval_batches: int = 8
    """Micro-batches in the fixed validation set."""
    seed: int = 0
    """Seed of the model initialization and of the data order."""
    device: str = "auto"
    """Torch device (cpu, cuda, cuda:1, ...); auto: cuda when available, else cpu."""
    autocast: Literal["none", "bfloat16"] = "none"
    """Autocast dtype of the forward pass (parameters and optimizer state stay float32)."""
    checkpoint_every: int = 0
    """Save a checkpoint every this many steps (0: only at the end and on Ctrl-C)."""
    out_dir: str | None = "runs/train"
    """Folder for metrics.jsonl (appended) and checkpoint.pt (parallel: checkpoints/); none: no
    files."""
    resume: str | None = None
    """Checkpoint to resume from; 'auto': out_dir/checkpoint.pt when it exists."""
    overwrite: bool = False
    """Start a new run even though out_dir already holds a checkpoint (it is replaced)."""
    log_every: int = 10
    """Write a metrics.jsonl record (and refresh the progress bar) every this many steps."""
    parallel: Literal["none", "dp", "fsdp"] = "none"
    """Under torchrun: dp (DistributedMuon, or DDP for adamw) or fsdp (FSDP2 + DTensorMuon)."""
    pg_timeout_s: float = 60.0
    """Seconds a rank waits in a collective for a dead or stuck peer before failing (parallel)."""
    defer_gather: bool = True
    """--parallel dp with muon: leave step()'s parameter all-gathers in flight until the next
    forward needs them (the same parameters, bit for bit; hides the gather)."""

    def __post_init__(self) -> None:
        if self.model not in _PRESETS:
            raise ValueError(f"unknown model preset {self.model!r}; choose from {PRESET_NAMES}")
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice("schedule", self.schedule, SCHEDULES)
        _check_choice("autocast", self.autocast, AUTOCAST_DTYPES)
        _check_choice("tokenizer", self.tokenizer, TOKENIZERS)
        _check_choice("parallel", self.parallel, PARALLEL_MODES)
        if self.parallel != "none" and self.optimizer == "torch-muon":
            raise ValueError(
                f"optimizer 'torch-muon' runs in one process only; with --parallel "
                f"{self.parallel} choose muon or adamw"
            )
        if not (0 < self.pg_timeout_s < float("inf")):
            raise ValueError(f"pg_timeout_s must be a positive number, got {self.pg_timeout_s}")
        for name in ("steps", "micro_batch_size", "eval_batches", "ns_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup_steps", "eval_every", "checkpoint_every", "log_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.grad_clip is not None and not self.grad_clip >= 0:
            raise ValueError(
                f"grad_clip must be >= 0 (0 or none disables clipping), got {self.grad_clip}"
            )
        if self.qk_clip is not None and not 0 < self.qk_clip < float("inf"):
            raise ValueError(f"qk_clip must be a finite number > 0 (tau), got {self.qk_clip}")
        if self.momentum_dtype == "float16":
            raise ValueError(
                "momentum_dtype float16 is refused (muonscale.Muon): a finite gradient entry "
                "beyond 65504 would make the buffer inf and every weight NaN; use bfloat16"
            )
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, {MAX_SEED}], got {self.seed}")
        if not 256 <= self.bpe_vocab_size <= MAX_BPE_VOCAB_SIZE:
            raise ValueError(
                f"bpe_vocab_size must be in [256, {MAX_BPE_VOCAB_SIZE:,}] (256 byte tokens plus "
                f"merges), got {self.bpe_vocab_size:,}"
            )
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        self.adamw_betas = tuple(self.adamw_betas)
        self.model_config()  # validates the overrides
        self.gradient_accumulation_steps  # noqa: B018 (validates tokens_per_step)

    def model_config(self) -> ModelConfig:
        """The preset with every non-None override applied."""
        override_names = [f.name for f in fields(ModelConfig)]
        overrides = {
            name: getattr(self, name)
            for name in override_names
            if hasattr(self, name) and getattr(self, name) is not None
        }
        config = model_preset(self.model, **overrides)
        if self.tokenizer == "bpe" and self.vocab_size is None:
            padded = -(-self.bpe_vocab_size // 64) * 64
            config = replace(config, vocab_size=max(config.vocab_size, padded))
        return config

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.model_config().context_length

    @property
    def gradient_accumulation_steps(self) -> int:
        """tokens_per_step / (micro_batch_size * context_length)."""
        per_micro = self.tokens_per_micro_batch
        for name, value in (
            ("tokens_per_step", self.tokens_per_step),
            ("micro_batch_size * context_length", per_micro),
        ):
            if value is not None and value > MAX_TOKENS_PER_STEP:
                raise ValueError(
                    f"{name} = {value:,} exceeds the limit of {MAX_TOKENS_PER_STEP:,} tokens "
                    "per step"
                )
        if self.tokens_per_step is None:
            return 1
        if self.tokens_per_step < per_micro or self.tokens_per_step % per_micro:
            raise ValueError(
                f"tokens_per_step={self.tokens_per_step} must be a positive multiple of "
                f"micro_batch_size * context_length = {per_micro}"
            )
        return self.tokens_per_step // per_micro

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def replace(self, **changes: Any) -> TrainConfig:
        return replace(self, **changes)


# ----------------------------------------------------------------------------------------
# CLI flags from dataclasses


def field_docstrings(cls: type) -> dict[str, str]:
    """Map field name -> the string literal written under it in the class body (and bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body
        for statement, following in zip(body, body[1:]):
            if (
                isinstance(statement, ast.AnnAssign)
                and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                docs[statement.target.id] = " ".join(following.value.value.split())
    return docs


def _unwrap_optional(annotation: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(members) == 1 and len(typing.get_args(annotation)) == 2:
            return members[0], True
        raise TypeError(f"unsupported union annotation {annotation!r}")
    return annotation, False


def _scalar_parser(kind: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in error messages
    return parse


def _argument_spec(annotation: Any, optional: bool) -> dict[str, Any]:
    origin = typing.get_origin(annotation)
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if origin is Literal:
        options = list(typing.get_args(annotation))
        shown = options + (["none"] if optional else [])
        return {
            "type": _scalar_parser(type(options[0]), optional),
            "choices": options + ([None] if optional else []),
            "metavar": "{" + ",".join(map(str, shown)) + "}",
        }
    if annotation in (int, float, str):
        return {"type": _scalar_parser(annotation, optional)}
    if origin in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        kinds = set(args)
        if len(kinds) != 1 or next(iter(kinds)) not in (int, float, str):
            raise TypeError(f"unsupported sequence annotation {annotation!r}")
        variadic = origin is list or Ellipsis in typing.get_args(annotation)
        return {"type": next(iter(kinds)), "nargs": "+" if variadic else len(args)}
    raise TypeError(f"cannot make a CLI flag for annotation {annotation!r}")


def _default_of(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def add_dataclass_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, prefix: str = ""
) -> None:
    """Add one ``--flag`` per field of dataclass ``cls`` (``--{prefix}{name}``, underscores as
    dashes), typed from the annotation, with the field's docstring and default as help.

    Supported annotations: int, float, str, bool (``--x/--no-x``), Literal[...] (choices),
    ``X | None`` (pass ``none``), tuple[X, ...] / tuple[X, X] / list[X] of scalars.
    Fields without a default become required flags.
    """
    hints = typing.get_type_hints(cls)
    docs = field_docstrings(cls)
    for field in fields(cls):
        if not field.init:
            continue
        annotation, optional = _unwrap_optional(hints[field.name])
        spec = _argument_spec(annotation, optional)
        default = _default_of(field)
        help_text = docs.get(field.name, "")
        if default is dataclasses.MISSING:
            spec["required"] = True
        else:
            spec["default"] = default
            shown = " ".join(map(str, default)) if isinstance(default, tuple | list) else default
            help_text = f"{help_text} (default: {shown})".strip()
        flag = "--" + (prefix + field.name).replace("_", "-")
        parser.add_argument(flag, dest=_dest(prefix, field.name), help=help_text, **spec)


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


def dataclass_from_args(cls: type, args: argparse.Namespace, prefix: str = ""):
    """Build ``cls`` from a namespace filled by :func:`add_dataclass_arguments` (same prefix).
    Fields whose flag is absent from ``args`` keep their dataclass default."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in fields(cls):
        dest = _dest(prefix, field.name)
        if not field.init or not hasattr(args, dest):
            continue
        value = getattr(args, dest)
        annotation, _ = _unwrap_optional(hints[field.name])
        if typing.get_origin(annotation) is tuple and value is not None:
            value = tuple(value)
        values[field.name] = value
    return cls(**values)
