"""GPT-2 shapes, fp32 parameter sets with random gradients, a model (the library GPT or a
fallback), the Muon/AdamW split and the optimizers the sections compare."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import muonscale

GPT2 = {  # name: (n_layer, d_model, n_head)
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
    "gpt2-xl": (48, 1600, 25),
}
VOCAB, CONTEXT = 50304, 1024


def gpt2_shapes(n_layer: int, d: int) -> list[tuple[int, int, int]]:
    """(count, rows, cols) of the Muon matrices: qkv (3d, d), attn proj (d, d), mlp fc (4d, d),
    mlp proj (d, 4d), one each per layer."""
    return [(n_layer, 3 * d, d), (n_layer, d, d), (n_layer, 4 * d, d), (n_layer, d, 4 * d)]


def param_set(n_layer: int, d: int, device, vocab: int = VOCAB, context: int = CONTEXT):
    """Named fp32 parameters of GPT-2 shapes with random gradients:
    (muon list, adamw list) of (name, Parameter)."""
    torch.manual_seed(0)
    muon, adamw = [], []

    def make(name, shape, bucket):
        p = nn.Parameter(torch.empty(shape, device=device).normal_(0, 0.02))
        p.grad = torch.randn(shape, device=device) * 1e-3
        bucket.append((name, p))

    make("wte.weight", (vocab, d), adamw)
    make("wpe.weight", (context, d), adamw)
    for i in range(n_layer):
        make(f"blocks.{i}.attn.qkv.weight", (3 * d, d), muon)
        make(f"blocks.{i}.attn.proj.weight", (d, d), muon)
        make(f"blocks.{i}.mlp.fc.weight", (4 * d, d), muon)
        make(f"blocks.{i}.mlp.proj.weight", (d, 4 * d), muon)
        for norm in ("attn_norm", "mlp_norm"):
            make(f"blocks.{i}.{norm}.weight", (d,), adamw)
            make(f"blocks.{i}.{norm}.bias", (d,), adamw)
    make("final_norm.weight", (d,), adamw)
    make("lm_head.weight", (vocab, d), adamw)
    return muon, adamw


class _Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.attn_norm, self.mlp_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.fc, self.fc_proj = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.n_head, -1).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_proj(F.gelu(self.fc(self.mlp_norm(x))))


class MiniGPT(nn.Module):
    """Fallback GPT-2 (used only when muonscale.train.model does not import)."""

    def __init__(self, n_layer: int, d: int, n_head: int, vocab: int, context: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(_Block(d, n_head) for _ in range(n_layer))
        self.final_norm = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0, 0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.final_norm(x))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def build_model(preset: str, dims: tuple[int, int, int], device, vocab: int, context: int):
    """(model, source): the library GPT when it imports, else the fallback."""
    n_layer, d, n_head = dims
    with torch.device(device):
        try:
            from muonscale.train.config import model_preset
            from muonscale.train.model import GPT

            cfg = model_preset(
                preset,
                n_layer=n_layer,
                d_model=d,
                n_head=n_head,
                vocab_size=vocab,
                context_length=context,
            )
            return GPT(cfg), "muonscale.train.model.GPT"
        except Exception as exc:  # missing module or changed API: fall back, say so
            return MiniGPT(n_layer, d, n_head, vocab, context), f"MiniGPT (fallback: {exc!r})"


def split_hidden(named) -> tuple[list, list]:
    """Muon (hidden 2-D matrices) vs AdamW (embeddings, head, norms, biases) by name/shape."""
    muon, adamw = [], []
    for name, p in named:
        embed = name.startswith(("wte", "wpe", "lm_head"))
        (muon if p.dim() == 2 and not embed else adamw).append((name, p))
    return muon, adamw


def make_optimizer(kind: str, muon_named, adamw_named, lr: float = 1e-3):
    """One object with .step() / .zero_grad(): "adamw", "torch_muon", "muonscale",
    "muonscale_bf16mom"."""
    if kind == "adamw":
        params = [p for _, p in muon_named + adamw_named]
        return torch.optim.AdamW(params, lr=lr, fused=params[0].is_cuda)
    if kind == "torch_muon":
        fused = adamw_named[0][1].is_cuda
        return _Pair(
            torch.optim.Muon([p for _, p in muon_named], lr=lr, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW([p for _, p in adamw_named], lr=lr, fused=fused),
        )
    mom = torch.bfloat16 if kind == "muonscale_bf16mom" else None
    groups = [
        {"params": [p for _, p in muon_named], "algorithm": "muon"},
        {"params": [p for _, p in adamw_named], "algorithm": "adamw"},
    ]
    ns_dtype = torch.bfloat16 if muon_named[0][1].is_cuda else torch.float32
    return muonscale.Muon(groups, lr=lr, ns_dtype=ns_dtype, momentum_dtype=mom, nonfinite="ignore")


class _Pair:
    def __init__(self, *opts) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)


def state_bytes(opt) -> int:
    if hasattr(opt, "optimizer_state_bytes"):
        return int(opt.optimizer_state_bytes())
    opts = opt.opts if isinstance(opt, _Pair) else (opt,)
    return sum(
        t.numel() * t.element_size()
        for o in opts
        for st in o.state.values()
        for t in st.values()
        if torch.is_tensor(t) and t.dim() > 0
    )
