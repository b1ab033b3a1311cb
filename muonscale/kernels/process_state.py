"""Process-wide state of the Newton–Schulz kernels, kept apart from the iterations.

Three things outlive one call: the workspace cache (preallocated buffers per stack shape, so
the hot path allocates nothing per step), whether the Triton kernels load and run (imported
lazily, so ``import muonscale`` never needs triton; a failing kernel disables them for the rest
of the process), and the ``torch.compile``-d iteration. :func:`clear_workspaces` is the one way
to release the cached memory; the optimizers call it at the end of every step, so scratch is
reused across the chunks and shapes of one step but not held through the next forward and
backward. Not thread-safe, and not for concurrent use on several CUDA streams.
"""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

NSMethod = Literal["plain", "gram"]
"""A Newton–Schulz formulation: the reference iteration or the Gram-matrix form."""

__all__ = [
    "DEFAULT_ELEMENTWISE_BACKEND",
    "ELEMENTWISE_BACKENDS",
    "ELEMENTWISE_ENV",
    "ElementwiseBackend",
    "NSMethod",
    "NSWorkspace",
    "cached_workspace_bytes",
    "check_elementwise_backend",
    "clear_workspaces",
    "compiled",
    "disable_triton",
    "disable_triton_elementwise",
    "elementwise_backend_from_environment",
    "elementwise_kernels",
    "get_workspace",
    "triton_available",
    "triton_module",
    "workspace_bytes",
]

MAX_CACHED_WORKSPACES = 64
"""At most this many workspaces are cached, whatever their bytes."""


@dataclass
class NSWorkspace:
    """Buffers for Newton–Schulz on one (k, rows, cols) stack, allocated on first use and reused.

    ``x`` is the iterate (the caller fills it); every other buffer is scratch.
    """

    shape: tuple[int, int, int]
    dtype: torch.dtype
    device: torch.device
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.shape != torch.Size(shape):
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            self.buffers[name] = buf
        return buf

    @property
    def x(self) -> torch.Tensor:
        return self.get("x", self.shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def workspace_bytes(k: int, m: int, n: int, itemsize: int, method: NSMethod) -> int:
    """Bytes of a workspace for a (k, m, n) stack of either orientation (x and scratch)."""
    m, n = min(m, n), max(m, n)
    if method == "gram":
        return k * itemsize * (2 * m * n + 5 * m * m + 1)
    return k * itemsize * (2 * m * n + 2 * m * m + 1)


_workspaces: OrderedDict[tuple, NSWorkspace] = OrderedDict()


def get_workspace(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: torch.device,
    method: NSMethod,
    *,
    max_cached_bytes: int,
) -> NSWorkspace:
    """The cached workspace for (shape, dtype, device, method). Least recently used ones are
    dropped while the cache would hold more than :data:`MAX_CACHED_WORKSPACES` entries or more
    than ``max_cached_bytes`` with this one, so the memory kept does not grow with the number
    of matrix shapes."""
    key = (tuple(shape), dtype, str(device), method)
    ws = _workspaces.get(key)
    if ws is not None:
        _workspaces.move_to_end(key)
        return ws
    itemsize = torch.empty((), dtype=dtype).element_size()
    needed = workspace_bytes(*shape, itemsize, method)
    while _workspaces and (
        len(_workspaces) >= MAX_CACHED_WORKSPACES
        or cached_workspace_bytes() + needed > max_cached_bytes
    ):
        _workspaces.popitem(last=False)
    ws = NSWorkspace(tuple(shape), dtype, torch.device(device))
    _workspaces[key] = ws
    return ws


def cached_workspace_bytes() -> int:
    """Bytes held by the workspace cache now."""
    return sum(ws.nbytes() for ws in _workspaces.values())


def clear_workspaces() -> None:
    """Drop every cached workspace (frees their memory)."""
    _workspaces.clear()


# Triton availability: lazy, so importing muonscale never imports triton.
_triton: dict[str, object] = {}


def triton_available() -> bool:
    """True when ``triton`` imports and the symmetric kernels module loads (and no kernel
    failed since; see :func:`disable_triton`)."""
    if "ok" not in _triton:
        try:
            from muonscale.kernels import triton_symmetric

            _triton["module"] = triton_symmetric
            _triton["ok"] = True
        except Exception as exc:  # ImportError, or a broken triton install
            _triton["ok"] = False
            _triton["error"] = repr(exc)
    return bool(_triton["ok"])


def triton_module():
    """:mod:`muonscale.kernels.triton_symmetric`; raises when it is unavailable."""
    if not triton_available():
        raise RuntimeError(f"triton backend unavailable: {_triton.get('error')}")
    return _triton["module"]


def disable_triton(exc: BaseException) -> None:
    """``backend="auto"`` falls back to torch for the rest of the process, once, loudly."""
    _triton["ok"] = False
    _triton["error"] = repr(exc)
    warnings.warn(
        f"muonscale: Triton Newton–Schulz kernels failed ({exc!r}); using torch.bmm from now on",
        RuntimeWarning,
        stacklevel=3,
    )


ElementwiseBackend = Literal["auto", "foreach", "triton"]
"""How Muon's two elementwise passes run: ``"foreach"`` (``torch._foreach_*``, the default
until the kernels are timed on a GPU), ``"auto"`` (Triton kernels for CUDA tensors when triton
loads, else foreach), or ``"triton"`` forced (on CPU tensors it runs the Triton interpreter:
tests)."""

ELEMENTWISE_BACKENDS: tuple[ElementwiseBackend, ...] = ("auto", "foreach", "triton")
"""Every :data:`ElementwiseBackend`."""

DEFAULT_ELEMENTWISE_BACKEND: ElementwiseBackend = "foreach"
"""The :data:`ElementwiseBackend` when :data:`ELEMENTWISE_ENV` is unset."""

ELEMENTWISE_ENV = "MUONSCALE_ELEMENTWISE"
"""Environment variable naming the :data:`ElementwiseBackend` (unset: ``"foreach"``); read
once, by :func:`elementwise_backend_from_environment` when an optimizer is built."""


def check_elementwise_backend(
    backend: object, name: str = "elementwise_backend"
) -> ElementwiseBackend:
    """``backend`` when it is an :data:`ElementwiseBackend`; else ValueError naming ``name``
    (the argument or environment variable it came from) and the allowed values."""
    if not isinstance(backend, str) or backend not in ELEMENTWISE_BACKENDS:
        raise ValueError(f"{name} must be 'auto', 'foreach' or 'triton', got {backend!r}")
    return backend


def elementwise_backend_from_environment(
    environ: Mapping[str, str] | None = None,
) -> ElementwiseBackend:
    """The :data:`ElementwiseBackend` named by :data:`ELEMENTWISE_ENV` (unset:
    :data:`DEFAULT_ELEMENTWISE_BACKEND`), validated; ``environ`` defaults to ``os.environ``.
    The optimizers call this once, at construction, and pass the result to every step."""
    environ = os.environ if environ is None else environ
    return check_elementwise_backend(
        environ.get(ELEMENTWISE_ENV, DEFAULT_ELEMENTWISE_BACKEND), ELEMENTWISE_ENV
    )


_triton_elementwise: dict[str, object] = {}


def elementwise_kernels(device: torch.device, backend: ElementwiseBackend):
    """:mod:`muonscale.kernels.triton_elementwise` when Muon's elementwise passes on ``device``
    should use it under ``backend`` (see :data:`ElementwiseBackend`), else None (the foreach
    path). Triton is imported on the first call that may use it. Forcing ``"triton"`` without
    triton raises."""
    check_elementwise_backend(backend)
    if backend == "foreach" or (backend == "auto" and device.type != "cuda"):
        return None
    if "ok" not in _triton_elementwise:
        try:
            from muonscale.kernels import triton_elementwise

            _triton_elementwise["module"] = triton_elementwise
            _triton_elementwise["ok"] = True
        except Exception as exc:  # ImportError, or a broken triton install
            _triton_elementwise["ok"] = False
            _triton_elementwise["error"] = repr(exc)
    if not _triton_elementwise["ok"]:
        if backend == "triton":
            raise RuntimeError(
                f"elementwise backend 'triton' ({ELEMENTWISE_ENV}=triton when an optimizer was "
                f"built): kernels unavailable: {_triton_elementwise['error']}"
            )
        return None
    return _triton_elementwise["module"]


def disable_triton_elementwise(exc: BaseException, backend: ElementwiseBackend) -> None:
    """Under ``"auto"``, the elementwise passes fall back to foreach for the rest of the
    process, once, loudly (a kernel that does not compile on this GPU fails before writing
    anything); when ``backend`` is ``"triton"`` (forced), ``exc`` is raised instead."""
    if backend == "triton":
        raise exc
    _triton_elementwise["ok"] = False
    _triton_elementwise["error"] = repr(exc)
    warnings.warn(
        f"muonscale: Triton elementwise kernels failed ({exc!r}); "
        "using torch._foreach_* from now on",
        RuntimeWarning,
        stacklevel=3,
    )


_compiled: dict[str, Callable] = {}


def compiled(name: str, fn: Callable) -> Callable:
    """``torch.compile(fn)``, compiled once per process under ``name``."""
    if name not in _compiled:
        _compiled[name] = torch.compile(fn, fullgraph=True, dynamic=False)
    return _compiled[name]
