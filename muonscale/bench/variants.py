"""``--variants``: extra muonscale Muon contenders, each with a few extra ``Muon`` options.

A variant is written ``NAME=OPTION:VALUE[,OPTION:VALUE...]`` (parsed by
:func:`muonscale.bench.config.parse_variant`) and trains exactly like the ``muon`` contender
(same parameters, routing, splits, learning rate schedule) with its options added to the
``muonscale.Muon(...)`` call. Option names are checked against ``muonscale.Muon``'s signature
at run time, and values by building a ``Muon`` on a small matrix, before any training. Two
options configure the training instead (:data:`muonscale.bench.config.TRAINING_OPTIONS`):
``lr:VALUE`` (the starting learning rate) and ``qk_clip:TAU`` (QK-clip, passed as
``TrainConfig.qk_clip``, so it is part of the run's key in the run store).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Mapping
from typing import Any

RESERVED = {
    "params": "the bench passes the model's parameters",
    "lr": "write lr:VALUE in the variant itself; it is the starting point of --sweep",
    "splits": "the bench splits the fused QKV weight like the muon contender",
    "rules": "routing rules are not a scalar option",
}
"""``muonscale.Muon`` arguments a variant may not set, and why."""

_DTYPE_NAMES = ("float32", "bfloat16", "float16", "float64")


def muon_option_names() -> list[str]:
    """Keyword arguments of ``muonscale.Muon`` (read from its signature and its
    ``**variant_options``, so options added to ``Muon`` become available to ``--variants``
    without a change here)."""
    from muonscale import Muon
    from muonscale.settings import VARIANT_KEYWORDS

    parameters = inspect.signature(Muon).parameters.values()
    names = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind == p.VAR_KEYWORD for p in parameters):
        names += VARIANT_KEYWORDS
    return names


def to_muon_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
    """Variant options as ``Muon`` keyword arguments: ``*_dtype`` names become torch dtypes."""
    import torch

    kwargs = dict(options)
    for name, value in options.items():
        if name.endswith("_dtype") and isinstance(value, str):
            if value not in _DTYPE_NAMES:
                raise ValueError(
                    f"variant option {name}: expected one of {_DTYPE_NAMES}, got {value!r}"
                )
            kwargs[name] = getattr(torch, value)
    return kwargs


def check_options(contender: str, options: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming the variant and option unless every option is a
    ``muonscale.Muon`` keyword with a value ``Muon`` accepts."""
    known = muon_option_names()
    for name in options:
        if name in RESERVED:
            raise ValueError(
                f"--variants {contender}: option {name!r} is not allowed: {RESERVED[name]}"
            )
        if name not in known:
            choices = ", ".join(n for n in known if n not in RESERVED)
            raise ValueError(
                f"--variants {contender}: unknown option {name!r}; "
                f"muonscale.Muon accepts: {choices}"
            )
    import torch

    from muonscale import Muon
    from muonscale.matrices import IdleOptionWarning

    probe = torch.nn.Parameter(torch.zeros(4, 3))
    try:
        kwargs = to_muon_kwargs(options)
        with warnings.catch_warnings():  # the probe's matrices have no Q/K blocks
            warnings.filterwarnings("ignore", category=IdleOptionWarning)
            Muon([("probe.weight", probe)], **kwargs)
    except (ValueError, TypeError) as error:
        raise ValueError(f"--variants {contender}: {error}") from error


def build_variant_optimizer(model, config, options: Mapping[str, Any]):
    """``muonscale.Muon`` exactly as ``muonscale.train`` builds it for ``config`` (a
    ``TrainConfig`` with ``optimizer="muon"``), with ``options`` added."""
    from muonscale import Muon
    from muonscale.train.optimizers import muon_options, muon_params

    return Muon(muon_params(model), **{**muon_options(model, config), **to_muon_kwargs(options)})
