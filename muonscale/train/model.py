"""nanoGPT-style decoder used by ``muonscale train`` and the benchmarks.

Pre-norm blocks (LayerNorm or RMSNorm), causal attention through
``F.scaled_dot_product_attention`` with optional grouped-query attention, GELU, SwiGLU or
mixture-of-experts MLP (:class:`MoE`), learned or rotary positions, optional tied embeddings.
GPT-2 initialization: normal(0, 0.02), residual output projections (and the experts'
``down_proj``) scaled by 1/sqrt(2 * n_layer).

The fused QKV weight ``blocks.{i}.attn.qkv.weight`` (``(rows, d_model)``) is laid out
interleaved by key/value group as described by :class:`muonscale.qkv.QKVLayout`, so that the
optimizer can orthogonalize Q, K and V (or each head) separately and a tensor-parallel row
shard holds whole heads::

    optimizer = muonscale.Muon(model.named_parameters(),
                               splits={name: model.qkv_layout for name in model.qkv_param_names()})

QK-clip (:mod:`muonscale.qk_clip`): ``model(idx, targets, probe_max_logits=True)`` also computes
every head's exact maximum attention logit (in chunks, outside the autograd graph; off by
default, since ``scaled_dot_product_attention`` never exposes logits), folded into a running
maximum over forwards (micro-batches) until :meth:`GPT.pop_max_attention_logits`; the time the
probe took is summed until :meth:`GPT.pop_probe_seconds` (wall time on CPU, CUDA events on a GPU,
so the forward is never synchronized for it)::

    clip = QKClip(model.qk_clip_targets(), tau=100.0)
    loss = model(x, y, probe_max_logits=True)[1]; loss.backward(); optimizer.step()
    clip(model.pop_max_attention_logits())

Parameter names make the roles recognisable: ``wte`` (token embedding), ``wpe`` (learned
positions), ``lm_head`` (output head), ``*norm*`` (norm weights).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from muonscale.qk_clip import FusedQKV, max_attention_logits
from muonscale.qkv import QKVLayout
from muonscale.train.config import ModelConfig


def _data(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.data


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def make_norm(config: ModelConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


def rotary_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (context_length, head_dim / 2), computed in float32."""
    half = config.head_dim // 2
    inv_freq = config.rope_base ** (-torch.arange(half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(config.context_length, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :half], x[..., half:]) of x: (B, heads, T, head_dim)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class ProbeClock:
    """Time spent in the max-logit probe, summed over forwards until :meth:`pop_seconds`: wall
    time on CPU; on CUDA a pair of events per probe, read at the pop (no synchronization
    inside the forward)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timing(self, device: torch.device):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            yield
            end.record()
            self.events.append((start, end))
            return
        begin = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - begin

    def pop_seconds(self) -> float:
        """Seconds summed since the last pop (waits for the recorded CUDA events), and reset."""
        total = self.seconds
        for start, end in self.events:
            end.synchronize()
            total += start.elapsed_time(end) / 1e3
        self.seconds, self.events = 0.0, []
        return total


class CausalSelfAttention(nn.Module):
    """Multi-head (or grouped-query) causal self-attention with one fused QKV projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.layout = QKVLayout(
            n_query_groups=config.kv_heads,
            q_per_group=config.n_head // config.kv_heads,
            head_dim=config.head_dim,
        )
        self.qkv = nn.Linear(config.d_model, self.layout.rows, bias=config.bias)  # (rows, d)
        self.proj = nn.Linear(config.n_head * config.head_dim, config.d_model, bias=config.bias)
        self.proj.is_residual_projection = True
        self.max_logits: torch.Tensor | None = None
        """(n_head,) running maximum logit of each head over probed forwards, or None."""
        self.probe_clock = ProbeClock()

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        probe_max_logits: bool = False,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape  # (B, T, d)
        q, k, v = self.layout.split_activations(self.qkv(x))  # (B, T, H, hd), (B, T, G, hd) x2
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hd)
        if rotary is not None:
            cos, sin = (table[:seq] for table in rotary)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if probe_max_logits:  # the logits SDPA computes below (its default scale 1/sqrt(hd))
            with self.probe_clock.timing(q.device):
                probed = max_attention_logits(q, k, causal=True)
            previous = self.max_logits
            self.max_logits = probed if previous is None else torch.maximum(previous, probed)
        if self.layout.q_per_group > 1:
            # query head h attends with key/value head h // q_per_group (matches the layout)
            k = k.repeat_interleave(self.layout.q_per_group, dim=1)
            v = v.repeat_interleave(self.layout.q_per_group, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    """GELU MLP (fc -> gelu -> proj) or SwiGLU (silu(gate) * up -> proj)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gated = config.mlp == "swiglu"
        hidden = config.hidden_dim
        self.fc = nn.Linear(config.d_model, hidden, bias=config.bias)
        if self.gated:
            self.gate = nn.Linear(config.d_model, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.d_model, bias=config.bias)
        self.proj.is_residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x)))


class Experts(nn.Module):
    """E SwiGLU experts stored as transformers stores routed experts: ``gate_up_proj``
    (E, 2F, D) and ``down_proj`` (E, D, F), each expert's matrix (out, in), gate and up the
    contiguous halves of its rows.

    The class attributes are the layout transformers' ``@use_experts_implementation`` records
    on its expert modules; :func:`muonscale.experts.find_experts` reads them, so Muon gives
    both weights the expert view (E matrices; gate and up apart)."""

    is_concatenated = True  # [gate; up]: contiguous halves (not interleaved)
    is_transposed = False  # each expert stored (out, in)
    has_gate = True
    has_bias = False

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    def forward(
        self, x: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x: (N, D); expert_index, weights: (N, K). Sum over k of weights[:, k] times expert
        expert_index[:, k] applied to x, each expert on its tokens in one matmul."""
        n, k = expert_index.shape
        flat = expert_index.reshape(-1)  # (N·K,) slot -> expert
        order = flat.argsort(stable=True)  # slots grouped by expert, tokens ascending
        token = torch.arange(n, device=x.device).repeat_interleave(k)[order]
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        outputs = []
        for e, rows in enumerate(x[token].split(counts)):  # (n_e, D)
            gate, up = F.linear(rows, self.gate_up_proj[e]).chunk(2, dim=-1)  # (n_e, F) x2
            outputs.append(F.linear(F.silu(gate) * up, self.down_proj[e]))  # (n_e, D)
        y = torch.cat(outputs) * weights.reshape(-1)[order, None].to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, y.to(x.dtype))


CountReduction = Callable[[torch.Tensor], None]
"""Sums an (E,) tensor of routed-token counts over the data-parallel ranks, in place."""


class MoE(nn.Module):
    """Top-k softmax router over :class:`Experts`, with the Switch Transformer load-balancing
    loss (*Train* in the docs gives the choice and its sources).

    A token's router probabilities are ``softmax(router(x))`` (in at least float32); it goes to its
    ``top_k`` most probable experts, weighted by their probabilities renormalized to sum 1.
    In training forwards the block records :attr:`balance_loss` ``E · Σ_i f_i · P_i`` (f_i:
    share of the routed token slots that expert i took; P_i: mean probability of expert i)
    and adds each expert's token count to :attr:`expert_tokens`. With
    :attr:`count_reduction` set (data-parallel runs) f comes from the counts of the global
    batch, so the ranks' mean of their losses is the single-process loss."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.router = nn.Linear(config.d_model, config.experts, bias=False)  # (E, D)
        self.experts = Experts(config.experts, config.d_model, config.hidden_dim)
        self.count_reduction: CountReduction | None = None
        self.balance_loss: torch.Tensor | None = None
        self.register_buffer(
            "expert_tokens", torch.zeros(config.experts, dtype=torch.int64), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        logits = self.router(flat)  # (N, E); softmax in at least float32
        probs = logits.to(torch.promote_types(logits.dtype, torch.float32)).softmax(dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # (N, K)
        out = self.experts(flat, top_i, top_p / top_p.sum(dim=-1, keepdim=True))
        if self.training:
            with torch.no_grad():
                counts = torch.bincount(top_i.reshape(-1), minlength=probs.shape[1])
                if self.count_reduction is not None:
                    self.count_reduction(counts)
                self.expert_tokens += counts
            share = counts.to(probs.dtype) / counts.sum()  # f: (E,), sums to 1
            self.balance_loss = probs.shape[1] * (share * probs.mean(dim=0)).sum()
        return out.reshape(x.shape)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = CausalSelfAttention(config)
        self.mlp_norm = make_norm(config)
        self.mlp = MoE(config) if config.mlp == "moe" else MLP(config)

    def forward(self, x: torch.Tensor, rotary=None, *, probe_max_logits: bool = False):
        x = x + self.attn(self.attn_norm(x), rotary, probe_max_logits=probe_max_logits)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only transformer. ``forward(idx, targets=None) -> (logits, loss | None)``.

    The loss is the cross-entropy; in training mode with ``mlp="moe"`` it adds
    ``router_aux_loss_coef`` times the MoE blocks' mean load-balancing loss (evaluation in
    ``eval()`` mode gives the cross-entropy alone)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = (
            nn.Embedding(config.context_length, config.d_model)
            if config.position == "learned"
            else None
        )
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.position == "rotary":
            cos, sin = rotary_tables(config)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "is_residual_projection", False):
                std = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Experts):  # down_proj: a residual output projection
            nn.init.normal_(module.gate_up_proj, mean=0.0, std=0.02)
            residual = 0.02 / math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.down_proj, mean=0.0, std=residual)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def qkv_layout(self) -> QKVLayout:
        """Layout of every fused QKV weight (all blocks share it)."""
        return self.blocks[0].attn.layout

    def qkv_param_names(self) -> list[str]:
        """Names (as in ``named_parameters()``) of the fused QKV weights."""
        return [f"blocks.{i}.attn.qkv.weight" for i in range(len(self.blocks))]

    def qk_clip_targets(self) -> list[FusedQKV]:
        """The fused QKV projections (weight and bias) for :class:`muonscale.qk_clip.QKClip`,
        in block order."""
        return [
            FusedQKV(block.attn.qkv.weight.data, block.attn.layout, _data(block.attn.qkv.bias))
            for block in self.blocks
        ]

    def pop_max_attention_logits(self) -> list[torch.Tensor]:
        """Each block's (n_head,) maximum logit over the forwards probed since the last call,
        and reset them. Raises if a block was not probed."""
        if any(block.attn.max_logits is None for block in self.blocks):
            raise RuntimeError(
                "no attention logits probed: call forward(..., probe_max_logits=True) first"
            )
        maxima = [block.attn.max_logits for block in self.blocks]
        for block in self.blocks:
            block.attn.max_logits = None
        return maxima

    def moe_blocks(self) -> list[MoE]:
        """The MoE blocks, in block order (empty unless ``mlp == "moe"``)."""
        return [block.mlp for block in self.blocks if isinstance(block.mlp, MoE)]

    def set_expert_count_reduction(self, reduction: CountReduction | None) -> None:
        """Every MoE block sums its routed-token counts with ``reduction`` (over the
        data-parallel ranks) before the load-balancing loss and :meth:`pop_expert_tokens`."""
        for moe in self.moe_blocks():
            moe.count_reduction = reduction

    def pop_expert_tokens(self) -> torch.Tensor:
        """(n_layer, E) tokens routed to each expert of each MoE block by the training forwards
        since the last call (summed over ranks with a count reduction), and reset."""
        counts = torch.stack([moe.expert_tokens.clone() for moe in self.moe_blocks()])
        for moe in self.moe_blocks():
            moe.expert_tokens.zero_()
        return counts

    def pop_probe_seconds(self) -> float:
        """Seconds the max-logit probe took in all blocks since the last call, and reset."""
        return math.fsum(block.attn.probe_clock.pop_seconds() for block in self.blocks)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        probe_max_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        seq = idx.shape[1]  # idx: (B, T) int64
        if seq > self.config.context_length:
            raise ValueError(f"sequence length {seq} > context_length {self.config.context_length}")
        x = self.wte(idx)  # (B, T, d)
        rotary = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(seq, device=idx.device))
        else:
            rotary = (self.rope_cos, self.rope_sin)
        for block in self.blocks:
            x = block(x, rotary, probe_max_logits=probe_max_logits)
        logits = self.lm_head(self.final_norm(x))  # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            moe = self.moe_blocks()
            if moe and self.training and self.config.router_aux_loss_coef:
                balance = torch.stack([m.balance_loss for m in moe]).mean()
                loss = loss + self.config.router_aux_loss_coef * balance
        return logits, loss

    def num_parameters(self, *, exclude_embeddings: bool = False) -> int:
        """Unique parameters; ``exclude_embeddings`` drops wte and wpe (not a tied head)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.wte.weight.numel() + (
                self.wpe.weight.numel() if self.wpe is not None else 0
            )
            if self.config.tie_embeddings:
                total += self.lm_head.weight.numel()
        return total

    def flops_per_token(self, *, training: bool = True) -> int:
        """Matmul FLOPs per token (PaLM appendix B convention, as in nanoGPT).

        forward = 2 * (matmul weights, incl. lm_head) + 4 * n_layer * context * d_model
        (attention scores and values at full context, causal masking not discounted);
        training = 3 * forward (backward costs twice the forward).
        """
        matmul_weights = sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))
        cfg = self.config
        for experts in self.modules():  # a token runs through top_k of the E experts
            if isinstance(experts, Experts):
                total = experts.gate_up_proj.numel() + experts.down_proj.numel()
                matmul_weights += total * cfg.top_k // cfg.experts
        forward = 2 * matmul_weights + 4 * cfg.n_layer * cfg.context_length * cfg.d_model
        return 3 * forward if training else forward
