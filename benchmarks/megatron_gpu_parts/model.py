"""The model both arms train (Megatron's ``GPTModel``, seeded identically) and its batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .device import Device, cpu_shims

if TYPE_CHECKING:  # the config lives in the entry script, benchmarks/megatron_gpu.py
    from megatron_gpu import BenchConfig


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
            raise ValueError(
                f"--seq {cfg.seq} is longer than the corpus ({self.tokens.numel()} tokens)"
            )
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.device = device.torch_device
        self.positions = (
            torch.arange(cfg.seq, device=self.device).unsqueeze(0).expand(cfg.micro_batch, -1)
        )
        self.mask = torch.triu(
            torch.ones(cfg.seq, cfg.seq, dtype=torch.bool, device=self.device), 1
        )[None, None]

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
