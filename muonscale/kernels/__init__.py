"""GPU fast paths for Newton–Schulz; :mod:`muonscale.newton_schulz` is their reference.

* :func:`newton_schulz_fast` — drop-in for ``newton_schulz`` on stacks of same-shape matrices:
  preallocated workspaces, Triton symmetric kernels on CUDA, optional Gram-matrix form.
* :func:`newton_schulz_batched_` — the in-place core on a normalized ``(k, m, n)`` stack.
* :mod:`muonscale.kernels.process_state` — the workspace cache and Triton availability, and
  :func:`clear_workspaces`, the one way to release the cached scratch.
* :mod:`muonscale.kernels.triton_symmetric` — the Triton kernels (imported lazily: the library
  imports and runs without ``triton``).
* :mod:`muonscale.kernels.triton_elementwise` — Muon's two elementwise passes as one Triton
  kernel per stack each; :func:`elementwise_kernels` says when they run (lazy import too),
  for the :data:`ElementwiseBackend` an optimizer read from :data:`ELEMENTWISE_ENV` when built
  (:func:`elementwise_backend_from_environment`).
"""

from muonscale.kernels.newton_schulz_fast import (
    GRAM_POLICY,
    NSBackend,
    NSMethodChoice,
    choose_method,
    newton_schulz_batched_,
    newton_schulz_fast,
)
from muonscale.kernels.process_state import (
    ELEMENTWISE_ENV,
    ElementwiseBackend,
    NSWorkspace,
    cached_workspace_bytes,
    clear_workspaces,
    elementwise_backend_from_environment,
    elementwise_kernels,
    triton_available,
)

__all__ = [
    "ELEMENTWISE_ENV",
    "ElementwiseBackend",
    "GRAM_POLICY",
    "NSBackend",
    "NSMethodChoice",
    "NSWorkspace",
    "cached_workspace_bytes",
    "choose_method",
    "clear_workspaces",
    "elementwise_backend_from_environment",
    "elementwise_kernels",
    "newton_schulz_batched_",
    "newton_schulz_fast",
    "triton_available",
]
