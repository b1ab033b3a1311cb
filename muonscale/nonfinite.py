"""What :class:`muonscale.Muon` does with a non-finite gradient (``nonfinite="raise" | "skip" |
"ignore"``): the error, the first bad gradient of a step, and the skipped steps counted on the
host or, in a capturable step, on the device (:mod:`muonscale.capturable`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .capturable import DeviceNonFiniteGuard, NonFinitePolicy


class NonFiniteGradientError(FloatingPointError):
    """A gradient held NaN or ±inf; nothing was changed."""


def checked_params(
    param_groups: Sequence[Mapping[str, Any]], grads: Mapping[int, torch.Tensor]
) -> list[torch.Tensor]:
    """The parameters whose gradients the non-finite check reads: those in ``grads`` (by
    ``id``) with elements (an empty tensor has no max norm, and nothing to check)."""
    return [
        p
        for group in param_groups
        for p in group["params"]
        if id(p) in grads and grads[id(p)].numel()
    ]


def first_nonfinite(grads: Sequence[torch.Tensor]) -> int | None:
    """The index of the first of ``grads`` (each with elements) holding NaN or ±inf, if any
    (one host sync)."""
    max_abs = torch._foreach_norm(list(grads), float("inf"))  # NaN propagates through the max
    finite = torch.stack([m.to(max_abs[0].device) for m in max_abs]).isfinite()
    if bool(finite.all()):
        return None
    return int((~finite).nonzero()[0])


class NonFiniteSteps:
    """The steps a non-finite gradient stopped, owned by the optimizer: a host count of the
    skipped ones and, once a capturable step has checked its gradients, the device record
    (:class:`~muonscale.capturable.DeviceNonFiniteGuard`) that counts and remembers on the
    device. ``policy`` is the optimizer's ``nonfinite``, passed where it decides."""

    def __init__(self, skipped: int = 0) -> None:
        self.skipped_on_host = int(skipped)
        self.device_guard: DeviceNonFiniteGuard | None = None

    @property
    def skipped(self) -> int:
        """Steps skipped under ``"skip"`` (reading the device's count waits for it)."""
        guard = self.device_guard
        on_device = guard.read()[2] if guard is not None and guard.policy == "skip" else 0
        return self.skipped_on_host + on_device

    def reset_skipped(self, value: int) -> None:
        """Set the count to ``value``: on the host, the device's count cleared."""
        self.skipped_on_host = int(value)
        if self.device_guard is not None:
            self.device_guard.clear(skipped=True)

    def stop(self, bad: str, policy: NonFinitePolicy) -> None:
        """A host-checked step found gradient ``bad`` non-finite: raise, or count a skip."""
        if policy == "raise":
            raise NonFiniteGradientError(
                f"non-finite gradient (NaN or inf) in parameter '{bad}'; parameters and optimizer "
                "state were left unchanged. Pass nonfinite='skip' to skip such steps instead."
            )
        self.reset_skipped(self.skipped + 1)

    def gate(
        self,
        param_groups: Sequence[Mapping[str, Any]],
        grads: Mapping[int, torch.Tensor],
        name: Callable[[torch.Tensor], str],
        policy: NonFinitePolicy,
    ) -> torch.Tensor | None:
        """A capturable step's device flag, False when one of ``grads`` (by ``id`` of the
        parameters of ``param_groups``, named by ``name``) is not finite, recorded on the
        device (the record is made at the first call); None when nothing is checked."""
        owners = checked_params(param_groups, grads)
        if policy == "ignore" or not owners:
            return None
        checked = [grads[id(p)] for p in owners]
        if self.device_guard is None:
            self.device_guard = DeviceNonFiniteGuard(policy, checked[0].device)
        return self.device_guard.gate(checked, [name(p) for p in owners])

    def publish(self) -> None:
        """Start the copy of the device record to the host (see :meth:`gate`)."""
        if self.device_guard is not None:
            self.device_guard.publish()

    def raise_recorded(self, policy: NonFinitePolicy, *, wait: bool) -> None:
        """Raise :class:`NonFiniteGradientError` for a non-finite gradient the device
        recorded (``"raise"``): waiting for the device, or (``wait=False``) only from a
        record already on the host."""
        guard = self.device_guard
        if guard is None:
            return
        record = guard.read() if wait else guard.poll()
        if record is None or not record[0] or policy != "raise":
            return
        name = guard.bad_name(record[1])
        guard.clear()
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or inf) in parameter '{name}' in a capturable step; "
            "that step and every step after it until now were no-ops on the device, so "
            "parameters and optimizer state are as they were before it. Pass "
            "nonfinite='skip' to skip such steps instead."
        )
