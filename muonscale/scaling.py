"""Update scale rules: the factor s(m, n) in W ← W − lr · s(m, n) · NS(U).

An orthogonalized m×n update O has every singular value ≈ 1, so its RMS is ≈ 1/√max(m, n).
The rules below turn that into an update of a chosen size. m = rows = fan-out, n = columns =
fan-in (``nn.Linear.weight`` is (out_features, in_features)).

| muonscale          | s(m, n)            | elsewhere                                             |
|--------------------|--------------------|-------------------------------------------------------|
| ``shape``          | √max(1, m/n)       | Keller Jordan's Muon; torch.optim.Muon ``"original"`` |
| ``match_rms_adamw``| 0.2 · √max(m, n)   | Moonlight; torch.optim.Muon ``"match_rms_adamw"``     |
| ``unit_rms``       | √max(m, n)         | Megatron-Core ``muon_scale_mode="spectral"``          |
| ``spectral``       | √(m/n)             | √(fan_out/fan_in); Megatron ``"unit_rms_norm"``       |
| ``none``           | 1                  |                                                       |

``match_rms_adamw`` (the default) gives the update an RMS of ≈ 0.2, the typical RMS of an AdamW
update, so the learning rate and weight decay tuned for AdamW carry over (Liu et al., 2025,
"Muon is Scalable for LLM Training", arXiv:2502.16982).
"""

from __future__ import annotations

import math

SCALE_RULES = ("shape", "match_rms_adamw", "unit_rms", "spectral", "none")

ADJUST_LR_FNS = {"original": "shape", "match_rms_adamw": "match_rms_adamw"}
"""torch.optim.Muon's ``adjust_lr_fn`` values and the scale rule each one is."""


def update_scale(rule: str, rows: int, cols: int) -> float:
    """s(rows, cols) for ``rule`` (one of :data:`SCALE_RULES`)."""
    if rule == "shape":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "unit_rms":
        return math.sqrt(max(rows, cols))
    if rule == "spectral":
        return math.sqrt(rows / cols)
    if rule == "none":
        return 1.0
    raise ValueError(f"scale must be one of {SCALE_RULES}, got {rule!r}")
