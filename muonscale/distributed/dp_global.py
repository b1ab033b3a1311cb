"""Operations of :class:`~muonscale.distributed.DistributedMuon` over the whole model's state:
the global gradient norm (``clip_grad_norm_``), the agreement on missing / non-finite gradients
that every ``step()`` starts with, and the full ``state_dict`` (see :mod:`.full_state` for the
checkpoint format). Each is one or a few collectives over the data-parallel group.

:class:`GlobalOperations` is a mixin of ``DistributedMuon``; it uses the buffers of
:class:`~muonscale.distributed.dp_streams.BucketedReduction`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from . import full_state
from .comm import WireCounter


class GlobalOperations:
    """``clip_grad_norm_``, the non-finite agreement, ``state_dict`` / ``load_state_dict``."""

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient by its global norm (collective); returns the norm.

        Same result as ``torch.nn.utils.clip_grad_norm_`` on the averaged gradients of every
        parameter in one process. ``p.grad`` (local) is not touched: the reduced gradients that
        ``step()`` uses are scaled.
        """
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type!r}")
        self._finish_reductions()
        grads = [g for g in self._local_reduced_grads().values() if g.numel()]
        device = self.comm.device
        if norm_type == 2.0:
            local = torch.zeros((), dtype=torch.float64, device=device)
            for n in torch._foreach_norm(grads, 2.0) if grads else []:
                local += n.to(device, torch.float64) ** 2
            self.comm.all_reduce(local.view(1), tag="clip")
            total = local.sqrt().float()
        else:
            local = torch.zeros((), dtype=torch.float32, device=device)
            for n in torch._foreach_norm(grads, float("inf")) if grads else []:
                local = torch.maximum(local, n.to(device, torch.float32))
            self.comm.all_reduce(local.view(1), op=dist.ReduceOp.MAX, tag="clip")
            total = local
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for stream in self._streams:  # owned matrices and the AdamW fill
            stream.recv.mul_(coef.to(stream.recv.device))
        for shards in self._shards:
            shards.shard.mul_(coef.to(shards.shard.device))
        return total

    def _agree_on_gradients(self) -> tuple[list[bool], str | None]:
        """One all-reduce (max) of per-parameter flags [has a gradient on some rank,
        non-finite reduced gradient]; returns (present, first non-finite name)."""
        P, device = len(self._params), self.comm.device
        has_grad = [p.grad is not None for p in self._params]
        flags = torch.zeros(2 * P, dtype=torch.int32)  # built on the host, one copy to device
        flags[:P] = torch.tensor(has_grad, dtype=torch.int32)
        flags = flags.to(device)
        if self.nonfinite != "ignore":
            local = {i: g for i, g in self._local_reduced_grads().items() if g.numel()}
            if local:
                max_abs = torch._foreach_norm(list(local.values()), float("inf"))  # NaN propagates
                finite = torch.stack([m.to(device) for m in max_abs]).isfinite()
                index = torch.tensor([P + i for i in local], device=device)
                flags.index_copy_(0, index, (~finite).to(torch.int32))
        self.comm.all_reduce(flags, op=dist.ReduceOp.MAX, tag="control")
        present = [bool(f) for f in flags[:P].tolist()]
        bad = flags[P:].nonzero()
        return present, (self._name(self._params[int(bad[0])]) if bad.numel() else None)

    # ================================================================ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Full state, keyed like :class:`muonscale.Muon`'s. Collective: call on every rank."""
        packed = super().state_dict()  # param_groups with indices; its "state" is replaced
        step_counter, self.comm.counter = self.comm.counter, WireCounter()  # not a step's traffic
        try:
            state = full_state.gather(self)  # momentum, flat-bucket AdamW state
            state.update(self._gather_fill_state())  # AdamW state held in stream fills
            packed["state"] = {i: state[i] for i in sorted(state)}
        finally:
            self.comm.counter = step_counter
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load full state (from this class, :class:`muonscale.Muon`, or DCP's
        ``set_state_dict``); every rank keeps its part. No collectives."""
        full_state.load(self, state_dict)

    @torch.no_grad()
    def _gather_fill_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """Full AdamW state (and main copies) of the parameters in stream fills (collective: one
        all-gather per moment and stream, each rank's range padded to the longest)."""
        full: dict[int, dict[str, torch.Tensor]] = {}
        for stream in self._streams:
            fill = stream.fill
            if fill is None:
                continue
            layout, width = fill.layout, max(fill.layout.lengths)
            names = full_state.sharded_names(fill)
            gathered = {}
            for name in names:
                mine = getattr(fill, name)
                padded = torch.zeros(width, dtype=mine.dtype, device=mine.device)
                padded[: mine.numel()].copy_(mine)
                gathered[name] = torch.empty(
                    self.world_size * width, dtype=mine.dtype, device=mine.device
                )
                self.comm.all_gather(gathered[name], padded, tag="checkpoint")
            for i in layout.params:
                p = self._params[i]
                full[i] = {"step": self.state[p]["step"].clone()}
                for name in names:
                    full[i][name] = torch.empty_like(p, dtype=gathered[name].dtype)
            for rank in range(self.world_size):
                for seg in layout.segments(rank):
                    src = rank * width + seg.buffer_start
                    for name in names:
                        full[seg.param][name].view(-1)[
                            seg.param_start : seg.param_start + seg.length
                        ] = gathered[name][src : src + seg.length]
        return full
