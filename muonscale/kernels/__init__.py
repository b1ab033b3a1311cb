"""GPU fast paths for Newton–Schulz; :mod:`muonscale.newton_schulz` is their reference.

* :func:`newton_schulz_fast` — drop-in for ``newton_schulz`` on stacks of same-shape matrices:
  preallocated workspaces, Triton symmetric kernels on CUDA, optional Gram-matrix form.
* :func:`newton_schulz_batched_` — the in-place core on a normalized ``(k, m, n)`` stack.
* :mod:`muonscale.kernels.triton_symmetric` — the Triton kernels (imported lazily: the library
  imports and runs without ``triton``).
"""

from muonscale.kernels.newton_schulz_fast import (
    GRAM_POLICY,
    NSWorkspace,
    choose_method,
    clear_workspaces,
    gram_flops,
    newton_schulz_batched_,
    newton_schulz_fast,
    plain_flops,
    triton_available,
)

__all__ = [
    "GRAM_POLICY",
    "NSWorkspace",
    "choose_method",
    "clear_workspaces",
    "gram_flops",
    "newton_schulz_batched_",
    "newton_schulz_fast",
    "plain_flops",
    "triton_available",
]
