"""SHA-256 fingerprints of the weights a layout ends with, recorded once and compared bitwise.

A refactor that must move no bits is checked against the fingerprint of the code before it:
``assert_fingerprint(case, params)`` hashes the parameters (name, shape, dtype and bytes, in
name order) and compares with ``tests/assets/fingerprints/<case>.json``. The recording also
keeps the weights (``<case>.pt``): on a CPU whose capability (``torch.backends.cpu``) differs
from the recording's, BLAS rounds differently, and the weights are compared to 1e-6 relative
instead (as :mod:`test_compat_assets` does). Workers run with one thread and matrices far
below BLAS's blocking sizes, so the summation order is the micro-kernel's alone.

``MUONSCALE_RECORD_FINGERPRINTS=1`` (re)writes the recordings instead of comparing.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

ASSETS = Path(__file__).parent / "assets" / "fingerprints"
RECORD = os.environ.get("MUONSCALE_RECORD_FINGERPRINTS") == "1"


def fingerprint(params: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _capability() -> str:
    return torch.backends.cpu.get_cpu_capability()


def assert_fingerprint(case: str, params: dict[str, torch.Tensor]) -> None:
    params = {n: t.detach().cpu().clone() for n, t in params.items()}
    digest = fingerprint(params)
    meta_path, weights_path = ASSETS / f"{case}.json", ASSETS / f"{case}.pt"
    if RECORD:
        ASSETS.mkdir(parents=True, exist_ok=True)
        meta = {
            "sha256": digest,
            "cpu_capability": _capability(),
            "torch": torch.__version__,
            "machine": platform.machine(),
        }
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        torch.save(params, weights_path)
        return
    meta = json.loads(meta_path.read_text())
    if meta["cpu_capability"] == _capability():
        assert digest == meta["sha256"], f"{case}: the weights' SHA-256 changed (bitwise)"
        return
    recorded = torch.load(weights_path, weights_only=True)
    assert sorted(recorded) == sorted(params)
    for name, want in recorded.items():
        got = params[name]
        scale = want.abs().max().clamp_min(torch.finfo(want.dtype).tiny)
        assert float((got - want).abs().max() / scale) <= 1e-6, f"{case}: {name} moved"
