"""Small stand-ins for the names a documented Python block leaves to the reader (their model,
data, loss), for the main suite's environment (``tests/docs_blocks.py``).

``STAND_INS[document][name]`` builds the object from the names built before it, in the order
the block's ``stand-ins:`` marker lists them; ``COMMON`` holds those shared by every document.
Everything is seeded, and ``batch`` differs by rank (``RANK``, as torchrun sets it).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ = 64, 16


class TinyTransformer(nn.Module):
    """A reader's model in miniature: embedding, two hidden matrices, norm, output head;
    ``model(tokens).loss`` is the next-token loss, as a Hugging Face model returns it."""

    def __init__(self, vocab: int = VOCAB, width: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> SimpleNamespace:
        h = self.embed(tokens[:, :-1])
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        return SimpleNamespace(loss=loss, logits=logits)


def _tokens(seed: int, n: int = 4) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))


def _reference_gpt(ns):
    from muonscale.train.config import ModelConfig
    from muonscale.train.model import GPT

    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=VOCAB, context_length=SEQ, n_layer=1, d_model=32, n_head=4))


def _gpt(ns):
    """The reference GPT the document's other stand-ins belong to (hidden from the block unless
    it declares ``model``)."""
    if "_gpt" not in ns:
        ns["_gpt"] = _reference_gpt(ns)
    return ns["_gpt"]


def _reference_muon(ns):
    import muonscale

    model = _gpt(ns)
    splits = {name: model.qkv_layout for name in model.qkv_param_names()}
    return muonscale.Muon(model.named_parameters(), lr=0.02, adamw_lr=3e-3, splits=splits)


def _probed_maxima(ns):
    tokens = _tokens(1)
    _gpt(ns)(tokens[:, :-1], tokens[:, 1:], probe_max_logits=True)
    return _gpt(ns).pop_max_attention_logits()


_RANK = int(os.environ.get("RANK", "0"))

COMMON = {
    "MyTransformer": lambda ns: TinyTransformer,
    "loader": lambda ns: [_tokens(seed) for seed in range(3)],
}

STAND_INS = {
    "README.md": {
        "model": lambda ns: TinyTransformer(),  # the same weights on every rank
        "accum": lambda ns: 2,
        "batch": lambda ns: [_tokens(100 + 10 * _RANK + i) for i in range(ns["accum"])],
    },
    "docs/qk_clip.md": {
        "model": _gpt,  # muonscale's reference GPT, one layer
        "x": lambda ns: _tokens(2)[:, :-1],
        "y": lambda ns: _tokens(2)[:, 1:],
        "optimizer": _reference_muon,
        "dp_group": lambda ns: None,  # one process: no data-parallel peers
        "targets": lambda ns: _gpt(ns).qk_clip_targets(),
        "group_spanning_tp_and_dp_ranks": lambda ns: None,
        "local_maxima": _probed_maxima,
    },
    "docs/hosts.md": {
        "model": lambda ns: TinyTransformer(),
        "batches": lambda ns: [_tokens(20 + i) for i in range(2)],
        "loss_fn": lambda ns: lambda model, batch: model(batch).loss,
    },
    "docs/cuda_graphs.md": {
        "build_model": lambda ns: TinyTransformer,
        "warmup_then_cosine": lambda ns: lambda step: min(1.0, (step + 1) / 10),
        "loss_fn": lambda ns: lambda out: out.loss,
        "x0": lambda ns: _tokens(3).cuda(),
        "batches": lambda ns: [_tokens(4 + i).cuda() for i in range(4)],
    },
}


def build(document: str, names: tuple[str, ...], stand_ins: dict | None = None) -> dict:
    """The namespace a block of ``document`` runs in: its declared stand-ins, built in order
    (from ``stand_ins``, ``{document: {name: factory}}``, where a suite brings its own)."""
    tables = STAND_INS if stand_ins is None else stand_ins
    table = {**COMMON, **tables.get(document, {})}
    unknown = [n for n in names if n not in table]
    if unknown:
        raise KeyError(f"{document}: no stand-in for {unknown}")
    ns: dict = {"__name__": "__main__"}
    for name in names:
        ns[name] = table[name](ns)
    return ns
