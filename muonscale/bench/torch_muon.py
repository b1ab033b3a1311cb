"""The ``torch.optim.Muon`` baseline with its Newton-Schulz iteration in float32.

``torch.optim.Muon`` orthogonalizes in bfloat16: its ``_zeropower_via_newtonschulz`` starts
with ``grad.bfloat16()``. CPUs emulate bfloat16 matrix products (about 30x slower than float32
on the bench machine), and muonscale runs the iteration in float32 on CPU, so comparing the two
there would compare precisions. On CPU the bench therefore runs torch's own function with one
change: its input's ``.bfloat16()`` returns a float32 copy instead. Everything else (the
coefficients, the normalization, the iteration, momentum, Nesterov, the learning-rate
adjustment, weight decay) is torch's code, unchanged.

How: :func:`float32_newton_schulz` swaps ``torch.optim._muon._zeropower_via_newtonschulz``
for a wrapper that calls the original with its input viewed as :class:`_BFloat16AsFloat32`
(a tensor subclass whose ``bfloat16()`` is a float32 copy), and restores it on exit. It is
entered around each training step of the ``torch-muon`` contender only, so the
``torch-muon-bf16`` contender, interleaved in the same process, runs torch's bfloat16
iteration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.optim import _muon


class _BFloat16AsFloat32(torch.Tensor):
    """A view whose ``.bfloat16()`` gives a float32 copy; every other op sees a plain tensor."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            if func is torch.Tensor.bfloat16:
                # bfloat16() of a float32 tensor is a new tensor, which torch then divides in
                # place: a copy keeps the caller's momentum/update tensor untouched likewise.
                return args[0].to(torch.float32, copy=True)
            return func(*args, **kwargs)


def _float32_zeropower(grad, *args, **kwargs):
    return _TORCH_ZEROPOWER(grad.as_subclass(_BFloat16AsFloat32), *args, **kwargs)


_TORCH_ZEROPOWER = _muon._zeropower_via_newtonschulz


@contextlib.contextmanager
def float32_newton_schulz() -> Iterator[None]:
    """Inside the block, ``torch.optim.Muon`` runs its Newton-Schulz iteration in float32."""
    before = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = _float32_zeropower
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = before


class Float32NewtonSchulzRun:
    """A training run whose every ``step()`` happens under :func:`float32_newton_schulz`;
    everything else is the wrapped run's."""

    newton_schulz_dtype = "float32"

    def __init__(self, run) -> None:
        self._run = run

    def step(self):
        with float32_newton_schulz():
            return self._run.step()

    def __getattr__(self, name: str):
        return getattr(self._run, name)
