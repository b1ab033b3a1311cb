"""Main (fp32) copies of low-precision model parameters, as Megatron's
``Float16OptimizerWithFloat16Params`` keeps them: the optimizer updates the copies and writes
them back into the bf16 model after every step, so small updates are not rounded away."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from .plan import ParamPlan


class MainParams:
    """``plans`` with ``param`` replaced by a main copy wherever the model's parameter has fewer
    bits than ``dtype`` (``dtype=None``: no copies, parameters are updated in place).

    Attributes:
        plans: the plans the optimizer runs on (``param`` = main copy or the model's tensor).
        model_params: the model's tensor for each plan, in the same order.
    """

    def __init__(self, plans: Sequence[ParamPlan], dtype: torch.dtype | None) -> None:
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"main_params_dtype must be None or a floating torch.dtype, got {dtype!r}"
            )
        for pl in plans:
            if pl.param.dtype == torch.float16:
                raise NotImplementedError(
                    f"{pl.name}: float16 parameters need a loss scaler (Megatron's --fp16 path), "
                    "which this adapter does not implement; train in bfloat16 (--bf16)"
                )
        self.model_params = [pl.param for pl in plans]
        self.plans: list[ParamPlan] = []
        self.copied: list[int] = []
        """Indices of the plans whose ``param`` is a main copy."""
        for index, pl in enumerate(plans):
            if (
                dtype is not None
                and pl.param.is_floating_point()
                and _bits(pl.param.dtype) < _bits(dtype)
            ):
                main = pl.param.detach().to(dtype).clone()
                self.plans.append(replace(pl, param=main))
                self.copied.append(index)
            else:
                self.plans.append(pl)

    def load_grads(self) -> None:
        """Point each optimizer tensor's ``.grad`` at the model's gradient: Megatron DDP's
        ``main_grad`` when present (as Megatron's optimizers read it), else ``.grad``, cast to
        the optimizer tensor's dtype (no copy when it already matches)."""
        for pl, model_param in zip(self.plans, self.model_params):
            source = getattr(model_param, "main_grad", None)
            if source is None:
                source = model_param.grad
            if source is None:
                pl.param.grad = None
            elif source is not pl.param.grad:
                pl.param.grad = (
                    source if source.dtype == pl.param.dtype else source.to(pl.param.dtype)
                )

    @torch.no_grad()
    def write_back(self) -> None:
        """Model parameter ← its main copy (rounded to the model's dtype)."""
        for index in self.copied:
            self.model_params[index].copy_(self.plans[index].param)

    def zero_model_grads(self, set_to_none: bool) -> None:
        for index in self.copied:
            p = self.model_params[index]
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {
            "names": [self.plans[i].name for i in self.copied],
            "values": [self.plans[i].param.detach().clone() for i in self.copied],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        names = [self.plans[i].name for i in self.copied]
        saved = list(state["names"])
        if saved != names:
            diff = next(
                (f"{a!r} saved, {b!r} here" for a, b in zip(saved, names) if a != b),
                f"{len(saved)} saved, {len(names)} here",
            )
            raise ValueError(f"main_params in the checkpoint do not match this model ({diff})")
        for index, value in zip(self.copied, state["values"]):
            main = self.plans[index].param
            if tuple(value.shape) != tuple(main.shape):
                raise ValueError(
                    f"main_params[{self.plans[index].name!r}]: shape {tuple(value.shape)} in the "
                    f"checkpoint, {tuple(main.shape)} here (saved at another TP size?)"
                )
            main.copy_(value)
        self.write_back()


def _bits(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits
