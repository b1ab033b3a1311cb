"""SHA-256 fingerprints of the weights a layout ends with, recorded once and compared bitwise.

A refactor that must move no bits is checked against the fingerprint of the code before it:
``assert_fingerprint(case, params)`` hashes the parameters (name, shape, dtype and bytes, in
name order) and compares with ``tests/assets/fingerprints/<case>.json``. The recording also
keeps the weights (``<case>.pt``), the CPU model and a signature of the host's BLAS (the bits
of a few one-thread float32 products): on a host whose CPU capability (``torch.backends.cpu``),
CPU model or BLAS signature differs from the recording's, the weights may round differently
(two hosts reporting the same capability do, and two CPU models with the same BLAS signature
moved the 2-rank layouts' weights by up to 1.6 float32 epsilons), and they are
compared within ``ulps`` float32 epsilons relative instead (as :mod:`test_compat_assets`
does). Workers run with one thread and matrices far
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


def _cpu_model() -> str:
    """The CPU's model name, family, model and stepping, and a digest of its feature flags
    (Linux: ``/proc/cpuinfo``; a virtual machine's name alone can be as vague as "AMD EPYC"),
    else the platform's processor."""
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model", "stepping", "flags"):
                    fields.setdefault(key, value.strip())
    except OSError:
        pass
    if not fields:
        return platform.processor()
    flags = hashlib.sha256(fields.pop("flags", "").encode()).hexdigest()[:12]
    name = fields.pop("model name", "?")
    return ", ".join([name, *(f"{k} {v}" for k, v in sorted(fields.items())), f"flags {flags}"])


def _blas_signature() -> str:
    """SHA-256 of one-thread float32 products of fixed inputs, at the tests' sizes: equal on
    hosts whose BLAS rounds these products alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        h = hashlib.sha256()
        for m, k, n in ((8, 64, 64), (64, 64, 256), (32, 96, 96), (7, 33, 65)):
            a, b = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
            c = torch.randn(m, n, generator=g)
            h.update((a @ b).numpy().tobytes())
            h.update(torch.baddbmm(c[None], a[None], b[None], beta=-0.5).numpy().tobytes())
        return h.hexdigest()[:16]
    finally:
        torch.set_num_threads(threads)


def assert_fingerprint(case: str, params: dict[str, torch.Tensor], ulps: int = 8) -> None:
    """Bitwise on a host like the recording's; elsewhere within ``ulps`` float32 epsilons of
    the recorded weights, relative to each tensor's largest entry."""
    params = {n: t.detach().cpu().clone() for n, t in params.items()}
    digest = fingerprint(params)
    meta_path, weights_path = ASSETS / f"{case}.json", ASSETS / f"{case}.pt"
    if RECORD:
        ASSETS.mkdir(parents=True, exist_ok=True)
        meta = {
            "sha256": digest,
            "cpu_capability": _capability(),
            "blas": _blas_signature(),
            "cpu_model": _cpu_model(),
            "torch": torch.__version__,
            "machine": platform.machine(),
        }
        meta_path.write_text(json.dumps(meta, indent=1) + "\n")
        torch.save(params, weights_path)
        return
    meta = json.loads(meta_path.read_text())
    if (
        meta["cpu_capability"] == _capability()
        and meta.get("blas") == _blas_signature()
        and meta.get("cpu_model") == _cpu_model()
    ):
        assert digest == meta["sha256"], f"{case}: the weights' SHA-256 changed (bitwise)"
        return
    recorded = torch.load(weights_path, weights_only=True)
    assert sorted(recorded) == sorted(params)
    for name, want in recorded.items():
        got = params[name]
        scale = want.abs().max().clamp_min(torch.finfo(want.dtype).tiny)
        limit = ulps * torch.finfo(torch.float32).eps
        assert float((got - want).abs().max() / scale) <= limit, f"{case}: {name} moved"
