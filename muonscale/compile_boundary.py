"""Where ``torch.compile`` stops: the optimizer's ``step()`` runs eagerly inside a compiled
region (a graph break), so ``torch.compile(opt.step)`` or a compiled training step that calls
it gives eager's results bit for bit.

Why not trace it: AdamW param groups are a ``dict`` subclass (their ``"momentum"`` is an alias
of ``betas[0]``, so momentum-cycling schedulers reach AdamW's β₁), which TorchDynamo's optimizer
tracing does not handle; the distributed steps drive collectives and their work handles; and
the Newton–Schulz iteration already compiles its own kernel where that pays (see
:mod:`muonscale.kernels`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager_under_compile(fn: F) -> F:
    """``fn`` as ``torch.compiler.disable(fn)``, built at its first call (TorchDynamo is
    imported then, not when muonscale is)."""

    @functools.wraps(fn)
    def eager(*args: Any, **kwargs: Any) -> Any:
        disabled = getattr(fn, "_muonscale_disabled", None)
        if disabled is None:
            disabled = torch.compiler.disable(fn)
            fn._muonscale_disabled = disabled  # type: ignore[attr-defined]
        return disabled(*args, **kwargs)

    return eager  # type: ignore[return-value]
