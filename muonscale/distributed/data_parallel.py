"""``DistributedMuon``: data-parallel Muon with whole-matrix owners and ZeRO-1 AdamW."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import functional
from ..optimizer import Muon
from . import full_state
from .buckets import FlatBucket, OwnerBucket, OwnerStreams, plan_flat_buckets, plan_owner_streams
from .comm import Communicator, WireCounter
from .ownership import assign_owners, format_ownership_table


@dataclass
class _Stream:
    """Runtime buffers of the owner streams of one (dtype, device) of Muon parameters."""

    layout: OwnerStreams
    recv: torch.Tensor  # (T,) reduce dtype: this rank's reduced gradients
    send: list[torch.Tensor]  # per bucket (N·L_b,) reduce dtype
    gather_in: torch.Tensor  # (T,) param dtype: this rank's updated parameters
    gather_out: list[torch.Tensor]  # per bucket (N·L_b,) param dtype


@dataclass
class _Shards:
    """Runtime buffers of one AdamW flat bucket (ZeRO-1)."""

    layout: FlatBucket
    full: torch.Tensor  # (padded,) local gradients in, gathered parameters out
    shard: torch.Tensor  # (padded/N,) reduced gradient shard, then updated parameter shard
    exp_avg: torch.Tensor  # (padded/N,) state of this shard only
    exp_avg_sq: torch.Tensor


class _Bucket:
    """One reduction unit in launch order: an owner bucket of a stream or a flat bucket."""

    def __init__(self, kind: str, params: frozenset[int], stream=None, index: int = 0, shards=None):
        self.kind, self.params, self.stream, self.index, self.shards = (
            kind,
            params,
            stream,
            index,
            shards,
        )
        self.pending = len(params)
        self.work = None
        self.launched = False


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _holds_dtensor(params: Any) -> bool:
    """Whether any parameter in a ``params`` argument (module, tensors, (name, tensor) pairs or
    param groups) is a DTensor."""
    if isinstance(params, torch.nn.Module):
        return any(_is_dtensor(p) for p in params.parameters())
    for entry in params:
        if isinstance(entry, Mapping):
            inner = entry["params"]
            if _holds_dtensor([inner] if isinstance(inner, torch.Tensor) else list(inner)):
                return True
        elif isinstance(entry, tuple) and len(entry) == 2:
            if _is_dtensor(entry[1]):
                return True
        elif _is_dtensor(entry):
            return True
    return False


def _on_grad_ready(optimizer_ref: weakref.ref, param: torch.Tensor) -> None:
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._grad_ready(param)


class DistributedMuon(Muon):
    r"""Data-parallel Muon: each Muon matrix is orthogonalized whole by one owner rank; AdamW
    parameters are sharded ZeRO-1 style. Do **not** wrap the model in DDP: this optimizer
    averages the gradients itself (``p.grad`` keeps the local gradient).

    Communication of one step (N ranks; every arrow goes through :mod:`.comm`)::

        backward ──hook per parameter──▶ bucket full? ──▶ reduce-scatter (async)
          Muon:  bucket = every rank's owner-stream slice; rank r receives Σ grads of the
                 matrices it owns                     (N−1)/N · S_muon
          AdamW: bucket = flat parameters, padded to a multiple of N; rank r receives
                 shard r                              (N−1)/N · S_adamw
        step():
          1. launch buckets backward did not, wait for every reduction
          2. all-reduce (max) of [has-gradient, non-finite] flags: all ranks agree to
             raise / skip / go on                      2(N−1)/N · 8·P bytes
          3. AdamW on the local shard (state for the shard only) ──▶ all-gather (async)
          4. Muon on owned matrices: momentum, batched Newton–Schulz, update
             ──▶ all-gather of the owner streams (async)        (N−1)/N · S
          5. wait, copy gathered parameters back

    Total ≈ reduce-scatter + all-gather of every parameter = the volume of ZeRO-1 AdamW
    (DDP's all-reduce costs the same; all-reduce + broadcast/all-gather costs 1.5×).
    ``reduce_dtype=torch.bfloat16`` halves the Muon reduce-scatter bytes (opt-in: the sum of
    the ranks' gradients is then rounded to bfloat16).

    With world size 1 (or without an initialized process group) the same code runs with no
    collectives and gives bitwise :class:`muonscale.Muon`'s result.

    Usage (under ``torchrun``; the model is not wrapped in DDP)::

        opt = DistributedMuon(model, lr=0.02, weight_decay=0.1)
        for micro_batch in batches[:-1]:
            with opt.no_sync():                  # accumulate locally
                loss_fn(model, micro_batch).backward()
        loss_fn(model, batches[-1]).backward()   # reductions start here, bucket by bucket
        opt.clip_grad_norm_(1.0)                 # global norm of the averaged gradient
        opt.step()                               # collective: every rank calls it
        opt.zero_grad()

    Args:
        params: as for :class:`muonscale.Muon`: the model itself (routes embeddings by module
            type), ``model.named_parameters()``, or param groups.
        process_group: the data-parallel group (None: the default group).
        reduce_dtype: dtype of the Muon gradient reduction (None: the parameter's dtype).
        bucket_cap_mb: approximate size of one bucket (as DDP's ``bucket_cap_mb``).
        **muon_options: every :class:`muonscale.Muon` option.

    ``state_dict()`` is collective and returns the **full** state keyed exactly like
    :class:`muonscale.Muon`'s (momentum gathered from the owners, AdamW shards gathered), so
    ``torch.distributed.checkpoint`` sees replicated tensors and a checkpoint loads at any world
    size, even into single-process ``Muon``. ``load_state_dict()`` takes full state and keeps
    the local part (no collectives); see :mod:`.full_state`.

    A rank that fails inside ``step()`` makes the others fail in their next collective after
    at most the process-group timeout (``init_process_group(timeout=...)``), with a
    :class:`~muonscale.distributed.CollectiveError` that says so.
    """

    def __new__(cls, *args: Any, **kwargs: Any):
        """Parameters that are DTensors (FSDP2 ``fully_shard``, tensor parallel) are handled by
        :class:`muonscale.DTensorMuon` (the sharding framework reduces their gradients; whole
        matrices go to owners by all-to-all): ``DistributedMuon(...)`` returns one.
        Subclasses are constructed as usual."""
        params = args[0] if args else kwargs.get("params")
        if cls is not DistributedMuon or params is None:
            return super().__new__(cls)
        materialized = params if isinstance(params, torch.nn.Module) else list(params)
        if not _holds_dtensor(materialized):
            instance = super().__new__(cls)
            instance._materialized_params = materialized  # __init__ reads it (params may be a generator)
            return instance
        from .dtensor import DTensorMuon

        kwargs.pop("params", None)
        process_group = args[1] if len(args) > 1 else kwargs.pop("process_group", None)
        if kwargs.pop("reduce_dtype", None) is not None:
            raise ValueError(
                "reduce_dtype does not apply to DTensor parameters: their gradients are reduced "
                "by FSDP2 (set its MixedPrecisionPolicy(reduce_dtype=...) instead)"
            )
        kwargs.pop("bucket_cap_mb", None)
        return DTensorMuon(materialized, process_group=process_group, **kwargs)

    def __init__(
        self,
        params: Any,
        process_group: dist.ProcessGroup | None = None,
        *,
        reduce_dtype: torch.dtype | None = None,
        bucket_cap_mb: float = 25.0,
        **muon_options: Any,
    ) -> None:
        params = self.__dict__.pop("_materialized_params", params)
        super().__init__(params, **muon_options)
        if reduce_dtype is not None and not (
            isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
        ):
            raise ValueError(
                f"reduce_dtype must be None or a floating torch.dtype, got {reduce_dtype!r}"
            )
        if not (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        self.comm = Communicator(process_group, WireCounter())
        self.world_size, self.rank = self.comm.world_size, self.comm.rank
        self.reduce_dtype = reduce_dtype
        self._params = [p for g in self.param_groups for p in g["params"]]
        self._group_of = [g for g in self.param_groups for _ in g["params"]]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        for p in self._params:
            if not p.is_contiguous():
                raise ValueError(
                    f"DistributedMuon needs contiguous parameters; '{self._name(p)}' is not"
                )
        self._check_same_parameters()
        self._assign_owners()
        self._build_buckets(int(bucket_cap_mb * 2**20))
        self._init_local_state()
        self._sync = True
        self._start_cycle()
        ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(lambda param, ref=ref: _on_grad_ready(ref, param))
            for p in self._params
            if p.requires_grad
        ]
        self.last_step_wire_bytes = 0
        self.last_step_wire_breakdown: dict[str, int] = {}

    # ================================================================ construction
    def _signature(self) -> list[tuple]:
        return [
            (self._name(p), tuple(p.shape), str(p.dtype), g["algorithm"])
            for p, g in zip(self._params, self._group_of)
        ]

    def _check_same_parameters(self) -> None:
        """All ranks must hold the same parameter list; raise naming the first difference."""
        if not self.comm.active:
            return
        signature = self._signature()
        digest = hashlib.sha256(repr(signature).encode()).digest()
        mine = torch.tensor(
            [int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=self.comm.device
        )
        every = torch.empty(self.world_size, dtype=torch.int64, device=self.comm.device)
        self.comm.all_gather(every, mine, tag="setup")
        if bool((every == every[0]).all()):
            return
        signatures = self.comm.all_gather_object(signature)
        reference = signatures[0]
        for rank, other in enumerate(signatures):
            for i in range(max(len(reference), len(other))):
                a = reference[i] if i < len(reference) else None
                b = other[i] if i < len(other) else None
                if a != b:
                    raise ValueError(
                        f"DistributedMuon: the parameter lists differ between ranks: parameter #{i} "
                        f"is {a} on rank 0 but {b} on rank {rank} (name, shape, dtype, algorithm). "
                        "Every rank must build the same model and optimizer."
                    )
        raise ValueError("DistributedMuon: the parameter lists differ between ranks")

    def _assign_owners(self) -> None:
        self._muon = [i for i, g in enumerate(self._group_of) if g["algorithm"] == "muon"]
        self._adamw = [i for i, g in enumerate(self._group_of) if g["algorithm"] == "adamw"]
        shapes = [
            self.matrix_view(self._params[i], self._group_of[i]).matrix_shapes for i in self._muon
        ]
        owners = assign_owners(shapes, self.world_size)
        self.owner_rank: dict[int, int] = dict(zip(self._muon, owners))
        self._matrix_shapes = dict(zip(self._muon, shapes))

    def _by_dtype_and_device(self, indices: list[int]) -> dict[tuple, list[int]]:
        """``indices`` in readiness order (reverse registration: backward's order), grouped by
        (dtype, device): one owner stream or set of flat buckets per group."""
        groups: dict[tuple, list[int]] = {}
        for i in sorted(indices, reverse=True):
            p = self._params[i]
            groups.setdefault((p.dtype, p.device), []).append(i)
        return groups

    def _build_buckets(self, cap_bytes: int) -> None:
        """Owner streams (Muon), flat buckets (AdamW), and one launch order for both."""
        numels = {i: p.numel() for i, p in enumerate(self._params)}
        N = self.world_size
        self._streams: list[_Stream] = []
        buckets: list[_Bucket] = []
        for (dtype, device), members in self._by_dtype_and_device(self._muon).items():
            rdtype = self.reduce_dtype or dtype
            cap = cap_bytes * 8 // torch.finfo(rdtype).bits
            layout = plan_owner_streams(members, numels, self.owner_rank, N, cap)
            recv = torch.zeros(layout.length, dtype=rdtype, device=device)  # (T,)
            send = [torch.zeros(b.numel, dtype=rdtype, device=device) for b in layout.buckets]
            if rdtype == dtype:  # reuse: gradients are consumed before parameters are sent
                gather_in, gather_out = recv, send
            else:
                gather_in = torch.zeros(layout.length, dtype=dtype, device=device)
                gather_out = [
                    torch.zeros(b.numel, dtype=dtype, device=device) for b in layout.buckets
                ]
            stream = _Stream(layout, recv, send, gather_in, gather_out)
            self._streams.append(stream)
            buckets += [
                _Bucket("muon", b.params, stream=stream, index=k)
                for k, b in enumerate(layout.buckets)
            ]
        self._shards: list[_Shards] = []
        for (dtype, device), members in self._by_dtype_and_device(self._adamw).items():
            cap = cap_bytes * 8 // torch.finfo(dtype).bits
            for layout in plan_flat_buckets(members, numels, N, cap):
                full = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
                shard, exp_avg, exp_avg_sq = (
                    torch.zeros(layout.shard_numel, dtype=dtype, device=device) for _ in range(3)
                )
                shards = _Shards(layout, full, shard, exp_avg, exp_avg_sq)
                self._shards.append(shards)
                buckets.append(_Bucket("adamw", frozenset(layout.params), shards=shards))
        # Launch order: by the last gradient a bucket waits for (backward runs in reverse).
        position = {i: len(self._params) - 1 - i for i in range(len(self._params))}
        buckets.sort(key=lambda b: max((position[p] for p in b.params), default=-1))
        self._buckets = buckets
        self._buckets_of: dict[int, list[_Bucket]] = {i: [] for i in range(len(self._params))}
        for b in buckets:
            for p in b.params:
                self._buckets_of[p].append(b)
        self._segments = {}  # AdamW parameter -> (its flat bucket, its segment in this shard)
        for shards in self._shards:
            for seg in shards.layout.segments(self.rank):
                self._segments[seg.param] = (shards, seg)

    def _init_local_state(self) -> None:
        """Create this rank's state now (owned momentum, AdamW shard views, every step counter),
        so that no rank's state is empty (DCP's ``get_state_dict`` would otherwise call
        ``step()`` on that rank alone)."""
        for i in self._muon:
            p, group = self._params[i], self._group_of[i]
            state = self.state[p]
            state["owner_rank"] = self.owner_rank[i]
            if self.owner_rank[i] == self.rank:
                dtype = group["momentum_dtype"] or p.dtype
                state["momentum_buffer"] = torch.zeros_like(
                    p, dtype=dtype, memory_format=torch.preserve_format
                )
        for i in self._adamw:
            state = self.state[self._params[i]]
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            if i in self._segments:
                shards, seg = self._segments[i]
                window = slice(seg.buffer_start, seg.buffer_start + seg.length)
                state["exp_avg"] = shards.exp_avg[window]
                state["exp_avg_sq"] = shards.exp_avg_sq[window]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if hasattr(self, "_buckets"):
            raise NotImplementedError(
                "DistributedMuon: parameters are fixed at construction (owners and buckets are "
                "planned once, on every rank); build a new optimizer instead"
            )
        super().add_param_group(param_group)

    def init_state(self, p: torch.Tensor, group: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """State is created at construction (owned Muon matrices, local AdamW shards)."""
        return self.state[p]

    # ================================================================ public helpers
    def ownership_table(self) -> str:
        """Which rank owns which Muon parameter, with NS FLOPs and elements per rank."""
        names = [self._name(self._params[i]) for i in self._muon]
        shapes = [self._matrix_shapes[i] for i in self._muon]
        owners = [self.owner_rank[i] for i in self._muon]
        numels = [self._params[i].numel() for i in self._muon]
        return format_ownership_table(names, shapes, owners, self.world_size, numels=numels)

    def communication_buffer_bytes(self) -> int:
        """Bytes of the persistent reduction/gather buffers (not optimizer state)."""
        tensors = [t for s in self._streams for t in [s.recv, *s.send]]
        tensors += [
            t
            for s in self._streams
            if s.gather_in is not s.recv
            for t in [s.gather_in, *s.gather_out]
        ]
        tensors += [t for s in self._shards for t in (s.full, s.shard)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (the optimizer no longer reduces during backward)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles = []

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduction) for all but the last micro-batch."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # ================================================================ reductions
    def _start_cycle(self) -> None:
        for b in self._buckets:
            b.pending, b.work, b.launched = len(b.params), None, False
        self._ready: set[int] = set()
        self._next_launch = 0
        self._reduced = False

    def _grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: count the parameter in its buckets; launch full ones."""
        if not self._sync:
            return
        i = self._index[id(param)]
        if i in self._ready:
            if any(b.launched for b in self._buckets_of[i]):
                raise RuntimeError(
                    f"gradient of '{self._name(param)}' accumulated again after its reduction was "
                    "launched: use `with opt.no_sync():` for all but the last backward before step()"
                )
            return
        self._ready.add(i)
        for b in self._buckets_of[i]:
            b.pending -= 1
        # Launch strictly in bucket order so that every rank issues the same collectives.
        while (
            self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0
        ):
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _local_grad(self, i: int) -> torch.Tensor | None:
        grad = self._params[i].grad
        if grad is None:
            return None
        if grad.is_sparse:
            raise ValueError(
                f"parameter '{self._name(self._params[i])}' has a sparse gradient; DistributedMuon needs dense gradients"
            )
        return grad.reshape(-1)

    def _launch(self, bucket: _Bucket) -> None:
        """Copy local gradients into the bucket (pre-divided by N) and reduce-scatter it."""
        if bucket.kind == "muon":
            stream, layout = bucket.stream, bucket.stream.layout.buckets[bucket.index]
            buf = stream.send[bucket.index]  # (N·L_b,)
            for piece in layout.pieces:
                dst = buf[piece.buffer_start : piece.buffer_start + piece.length]
                grad = self._local_grad(piece.param)
                if grad is None:
                    dst.zero_()
                else:
                    dst.copy_(grad[piece.param_start : piece.param_start + piece.length])
            out = stream.recv[layout.stream_start : layout.stream_start + layout.length]
            tag = "muon"
        else:
            shards = bucket.shards
            buf, out, tag = shards.full, shards.shard, "adamw"
            for p, off, n in zip(shards.layout.params, shards.layout.offsets, shards.layout.numels):
                grad = self._local_grad(p)
                if grad is None:
                    buf[off : off + n].zero_()
                else:
                    buf[off : off + n].copy_(grad)
        if self.world_size > 1:
            buf.div_(self.world_size)
        bucket.work = self.comm.reduce_scatter(out, buf, tag=tag, async_op=True)
        bucket.launched = True

    def _finish_reductions(self) -> None:
        """Launch every bucket backward did not (in order), then wait for all of them."""
        if self._reduced:
            return
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
        self._next_launch = len(self._buckets)
        for bucket in self._buckets:
            self.comm.wait(bucket.work, f"gradient reduce-scatter ({bucket.kind})")
            bucket.work = None
        self._reduced = True

    def _reduced_grad(self, i: int) -> torch.Tensor:
        """Averaged gradient of an owned Muon parameter (a view into the receive stream)."""
        p = self._params[i]
        stream = self._stream_of(i)
        off = stream.layout.offsets[i]
        grad = stream.recv[off : off + p.numel()].view(p.shape)
        return grad if grad.dtype == p.dtype else grad.to(p.dtype)

    def _stream_of(self, i: int) -> _Stream:
        for stream in self._streams:
            if i in stream.layout.offsets:
                return stream
        raise KeyError(i)

    def _reduced_shard_grad(self, i: int) -> torch.Tensor:
        shards, seg = self._segments[i]
        return shards.shard[seg.buffer_start : seg.buffer_start + seg.length]

    def _local_reduced_grads(self) -> dict[int, torch.Tensor]:
        """Every reduced gradient this rank holds: owned matrices and AdamW segments."""
        out = {i: self._reduced_grad(i) for i in self._muon if self.owner_rank[i] == self.rank}
        out.update({i: self._reduced_shard_grad(i) for i in self._segments})
        return out

    # ================================================================ global operations
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
        for stream in self._streams:
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

    # ================================================================ step
    @torch.no_grad()
    def step(self, closure=None):
        """Reduce (if backward did not finish it), agree on non-finite gradients, update owned
        matrices and AdamW shards, gather the updated parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self._finish_reductions()
            present, bad = self._agree_on_gradients()
            if bad is not None:
                self._handle_nonfinite(bad)  # raises on every rank, or counts a skip
                return loss
            self._update_adamw_shards(present)
            adamw_gathers = self._launch_adamw_gathers()
            self._update_owned_matrices(present)
            muon_gathers = self._launch_muon_gathers()
            self._wait_and_copy_back(adamw_gathers + muon_gathers)
        finally:
            self._start_cycle()
            self.last_step_wire_bytes, self.last_step_wire_breakdown = self.comm.counter.take()
        return loss

    def _update_owned_matrices(self, present: list[bool]) -> None:
        for group in self.param_groups:
            if group["algorithm"] != "muon":
                continue
            indices = [self._index[id(p)] for p in group["params"]]
            mine = [i for i in indices if present[i] and self.owner_rank[i] == self.rank]
            self.update_group(
                group, [self._params[i] for i in mine], [self._reduced_grad(i) for i in mine]
            )

    def _update_adamw_shards(self, present: list[bool]) -> None:
        for group in self.param_groups:
            if group["algorithm"] != "adamw":
                continue
            indices = [self._index[id(p)] for p in group["params"] if present[self._index[id(p)]]]
            local = [i for i in indices if i in self._segments]
            for i in indices:
                if i not in self._segments:  # no local shard: only the step counter moves
                    self.state[self._params[i]]["step"] += 1
            if not local:
                continue
            params, states = [], []
            for i in local:
                seg = self._segments[i][1]
                params.append(
                    self._params[i].view(-1)[seg.param_start : seg.param_start + seg.length]
                )
                states.append(self.state[self._params[i]])
            beta1, beta2 = group["betas"]
            functional.adamw(
                params, [self._reduced_shard_grad(i) for i in local],
                [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                [s["step"] for s in states], lr=float(group["lr"]), beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"],
            )  # fmt: skip

    def _launch_adamw_gathers(self) -> list[tuple[Any, Callable[[], None]]]:
        """All-gather every flat bucket's updated shard; returns (work, copy back) pairs."""
        pending = []
        for shards in self._shards:
            for seg in shards.layout.segments(self.rank):
                flat = self._params[seg.param].view(-1)
                shards.shard[seg.buffer_start : seg.buffer_start + seg.length].copy_(
                    flat[seg.param_start : seg.param_start + seg.length]
                )
            work = self.comm.all_gather(shards.full, shards.shard, tag="adamw", async_op=True)
            pending.append((work, functools.partial(self._copy_back_flat, shards)))
        return pending

    def _launch_muon_gathers(self) -> list[tuple[Any, Callable[[], None]]]:
        """All-gather the owner streams of updated matrices, bucket by bucket."""
        pending = []
        for stream in self._streams:
            for i in stream.layout.owned[self.rank]:
                off, p = stream.layout.offsets[i], self._params[i]
                stream.gather_in[off : off + p.numel()].copy_(p.view(-1))
            for k, bucket in enumerate(stream.layout.buckets):
                mine = stream.gather_in[bucket.stream_start : bucket.stream_start + bucket.length]
                work = self.comm.all_gather(stream.gather_out[k], mine, tag="muon", async_op=True)
                pending.append(
                    (work, functools.partial(self._copy_back_owned, bucket, stream.gather_out[k]))
                )
        return pending

    def _wait_and_copy_back(self, pending: list[tuple[Any, Callable[[], None]]]) -> None:
        for work, copy_back in pending:
            self.comm.wait(work, "parameter all-gather")
            copy_back()

    def _copy_back_flat(self, shards: _Shards) -> None:
        layout = shards.layout
        for p, off, n in zip(layout.params, layout.offsets, layout.numels):
            self._params[p].view(-1).copy_(shards.full[off : off + n])

    def _copy_back_owned(self, bucket: OwnerBucket, gathered: torch.Tensor) -> None:
        for piece in bucket.pieces:
            if self.owner_rank[piece.param] == self.rank:
                continue  # updated in place already
            flat = self._params[piece.param].view(-1)
            flat[piece.param_start : piece.param_start + piece.length].copy_(
                gathered[piece.buffer_start : piece.buffer_start + piece.length]
            )

    # ================================================================ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Full state, keyed like :class:`muonscale.Muon`'s. Collective: call on every rank."""
        packed = super().state_dict()  # param_groups with indices; its "state" is replaced
        step_counter, self.comm.counter = self.comm.counter, WireCounter()  # not a step's traffic
        try:
            packed["state"] = full_state.gather(self)
        finally:
            self.comm.counter = step_counter
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load full state (from this class, :class:`muonscale.Muon`, or DCP's
        ``set_state_dict``); every rank keeps its part. No collectives."""
        full_state.load(self, state_dict)
