"""The device-side non-finite record of a capturable step (``Muon(capturable=True)``).

A capturable step never reads a tensor on the host, so it cannot decide in Python whether a
gradient is finite. :class:`DeviceNonFiniteGuard` decides on the device instead: it returns a
0-dim boolean ``ok`` that the update math folds into its scalars (``torch.where``), so a step
with a NaN/inf gradient changes nothing, and it keeps a sticky device flag, the index of the
first bad gradient and a skip count. The host learns about them only at sync points it chooses:
:meth:`DeviceNonFiniteGuard.poll` (no wait: reads a copy that has already arrived) and
:meth:`DeviceNonFiniteGuard.read` (waits). See *CUDA graphs* in the docs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

NonFinitePolicy = Literal["raise", "skip", "ignore"]


def is_capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is being captured into a graph (False off CUDA)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def device_lr(group: dict) -> torch.Tensor:
    """``group["lr"]`` as a 0-dim tensor on the group's device (capturable steps). A float or
    a tensor elsewhere is replaced once, in the group, by a float64 tensor there, so a
    scheduler's in-place writes reach every later (and every captured) step."""
    lr = group["lr"]
    device = group["params"][0].device if group["params"] else torch.device("cpu")
    if isinstance(lr, torch.Tensor) and lr.device == device:
        return lr
    if isinstance(lr, torch.Tensor):
        lr = lr.to(device=device, dtype=torch.float64)  # device copy: no host read
    else:
        lr = torch.full((), lr, dtype=torch.float64, device=device)
    group["lr"] = lr
    return lr


def step_lr(group: dict, step_ok: torch.Tensor | None) -> torch.Tensor:
    """The lr of this capturable step: 0 on the device when the step must be a no-op
    (``step_ok``: :meth:`DeviceNonFiniteGuard.gate`'s flag, None without a check)."""
    lr = device_lr(group)
    return lr if step_ok is None else torch.where(step_ok, lr, 0.0)


class DeviceNonFiniteGuard:
    """Non-finite gradients recorded on ``device`` for the policy ``"raise"`` or ``"skip"``.

    ``flag`` (bool): a non-finite gradient was seen since the last :meth:`clear`; with
    ``"raise"`` every later step is a no-op until then, so parameters and state stay as they
    were before the bad step. ``first_bad`` (int64): its index in the names given to
    :meth:`gate` at that step. ``skipped`` (int64): steps made no-ops.
    """

    def __init__(self, policy: NonFinitePolicy, device: torch.device) -> None:
        if policy not in ("raise", "skip"):
            raise ValueError(f"DeviceNonFiniteGuard needs 'raise' or 'skip', got {policy!r}")
        self.policy = policy
        self.device = device
        self.record = torch.zeros(3, dtype=torch.int64, device=device)  # [flag, first_bad, skipped]
        self.names: list[str] = []
        self._host: torch.Tensor | None = None
        self._arrived: torch.cuda.Event | None = None

    def gate(self, grads: Sequence[torch.Tensor], names: Sequence[str]) -> torch.Tensor:
        """Record this step's gradients; return ``ok``, a 0-dim bool on the device: True when
        the step may change parameters and state. ``names[i]`` names ``grads[i]``."""
        self.names = list(names)
        max_abs = torch._foreach_norm(list(grads), float("inf"))  # NaN propagates through max
        finite = torch.stack([m.to(self.device, torch.float32) for m in max_abs]).isfinite()
        step_finite = finite.all()
        flag, first_bad, skipped = self.record.unbind(0)
        newly_bad = ~step_finite & (flag == 0)
        first = torch.argmin(finite.to(torch.int32))  # the first False (argmin takes the first)
        first_bad.copy_(torch.where(newly_bad, first, first_bad))
        ok = step_finite & (flag == 0) if self.policy == "raise" else step_finite
        skipped.add_((~ok).to(torch.int64))
        flag.copy_(flag | (~step_finite).to(torch.int64))
        return ok

    def publish(self) -> None:
        """Start a copy of the record to the host, without waiting (not while capturing)."""
        if self.device.type != "cuda":
            self._host = self.record  # host memory already: nothing to copy or wait for
            return
        if is_capturing(self.device):
            return
        if self._host is None:
            self._host = torch.empty(3, dtype=torch.int64, pin_memory=True)
            self._arrived = torch.cuda.Event()
        self._host.copy_(self.record, non_blocking=True)
        self._arrived.record()

    def poll(self) -> tuple[int, int, int] | None:
        """The record as of the last :meth:`publish`, if its copy has arrived (no wait)."""
        if self._host is None or is_capturing(self.device):
            return None
        if self._arrived is not None and not self._arrived.query():
            return None
        return self._read_host(self._host)

    def read(self) -> tuple[int, int, int]:
        """The current record (waits for the device)."""
        if self.device.type == "cuda":
            return self._read_host(self.record.cpu())
        return self._read_host(self.record)

    @staticmethod
    def _read_host(host: torch.Tensor) -> tuple[int, int, int]:
        # A host tensor's memory read directly: no device, nothing to synchronize with.
        flag, first_bad, skipped = (int(v) for v in host.numpy())
        return flag, first_bad, skipped

    def bad_name(self, first_bad: int) -> str:
        if 0 <= first_bad < len(self.names):
            return self.names[first_bad]
        return "<unknown parameter>"

    def clear(self, *, skipped: bool = False) -> None:
        """Forget the flag (and the skip count when ``skipped``); a device write, no sync."""
        self.record[0].zero_()
        if skipped:
            self.record[2].zero_()
        if self._host is not None and self._host is not self.record:
            self._host.zero_()
