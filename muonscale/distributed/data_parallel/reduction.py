"""The bucketed gradient reduction that :class:`~muonscale.distributed.DistributedMuon` owns:
the buffers laid out by :mod:`.buckets` (owner streams with their AdamW fill, flat ZeRO-1
buckets), the gradient hooks that launch each bucket's reduce-scatter during backward, and the
all-gathers that bring updated parameters (or owners' updates) back. Every collective goes
through :mod:`.comm`.

The AdamW state of this rank's shards lives beside the buffers it updates (``exp_avg``,
``exp_avg_sq`` and, with ``main_params_dtype``, ``main_param`` in the main dtype); gradient and
gather buffers keep the parameters' dtype (the Muon reduction: ``reduce_dtype``; the gather of a
stream that carries the owners' updates: the update dtype).

When the reduction reads ``p.grad`` (``reduce_at``): ``"backward"`` launches each bucket from a
gradient hook as soon as it is full, overlapping backward; a gradient changed after its bucket
was launched (clipping, masking, zeroing, or another backward accumulating into it) is noticed
at ``step()`` (by the tensor's identity and version counter;
:meth:`BucketedReduction.grads_changed`) and every bucket is reduced again from ``p.grad``.
``"step"`` reduces everything at ``step()``. ``"never"``: ``p.grad`` already holds the average
over the group (a model wrapped in DDP), so nothing is reduced: each rank copies its own slices
at ``step()``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ...quantized_state import ADAMW_MOMENTS
from ...settings import check_dtype
from ..comm import Communicator
from .buckets import (
    ExpertRange,
    FlatBucket,
    OwnedUnit,
    OwnerStreams,
    StreamFill,
    plan_flat_buckets,
    plan_owner_streams,
    unit_param,
)
from .quantized_shards import zero_code


@dataclass
class FillShard:
    """This rank's range of a stream's AdamW fill: a ZeRO-1 shard that rides in the stream."""

    layout: StreamFill
    grad: torch.Tensor  # (fill_r,) view of the stream's recv: reduced gradients, then updated
    #                     parameters (the stream's gather_in is its recv when there is a fill)
    exp_avg: torch.Tensor | None  # (fill_r,) state of this range only (main dtype with main
    exp_avg_sq: torch.Tensor | None  # copies; None: every parameter's moments are 8-bit)
    main_param: torch.Tensor | None = None  # (fill_r,) main copies of this range, or None
    exp_avg_codes: torch.Tensor | None = None  # (fill_r,) uint8: 8-bit moments, or None
    exp_avg_sq_codes: torch.Tensor | None = None


@dataclass
class StreamBuffers:
    """Runtime buffers of the owner streams of one (dtype, device) of Muon parameters."""

    layout: OwnerStreams
    recv: torch.Tensor  # (T,) reduce dtype: this rank's reduced gradients
    send: list[torch.Tensor]  # per bucket (N·L_b,) reduce dtype
    gather_in: torch.Tensor  # (T,) param dtype: this rank's updated parameters (or updates)
    gather_out: list[torch.Tensor]  # per bucket (N·L_b,) param dtype (or update dtype)
    fill: FillShard | None
    carries_updates: bool = False  # the gather sends the owners' updates (update dtype), not
    #                                the parameters: every rank applies them (.update_gather)


@dataclass
class FlatShard:
    """Runtime buffers of one AdamW flat bucket (ZeRO-1)."""

    layout: FlatBucket
    full: torch.Tensor  # (padded,) local gradients in, gathered parameters out
    shard: torch.Tensor  # (padded/N,) reduced gradient shard, then updated parameter shard
    exp_avg: torch.Tensor | None  # (padded/N,) state of this shard only (main dtype with main
    exp_avg_sq: torch.Tensor | None  # copies; None: every parameter's moments are 8-bit)
    main_param: torch.Tensor | None = None  # (padded/N,) main copies of this shard, or None
    exp_avg_codes: torch.Tensor | None = None  # (padded/N,) uint8: 8-bit moments, or None
    exp_avg_sq_codes: torch.Tensor | None = None

    @property
    def grad(self) -> torch.Tensor:
        return self.shard


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


def _on_grad_ready(reduction_ref: weakref.ref, param: torch.Tensor) -> None:
    reduction = reduction_ref()
    if reduction is not None:
        reduction.grad_ready(param)


ReduceAt = Literal["backward", "step", "never"]
REDUCE_AT: tuple[ReduceAt, ...] = ("backward", "step", "never")


@dataclass(frozen=True)
class ReductionOptions:
    """Options of :class:`BucketedReduction` (validated here, read only there)."""

    reduce_dtype: torch.dtype | None = None
    """dtype of the Muon gradient reduction (None: the parameter's dtype)."""
    main_params_dtype: torch.dtype | None = None
    """dtype of main copies of parameters with fewer bits (None: no main copies)."""
    bucket_cap_mb: float = 25.0
    """Approximate size of one bucket (as DDP's ``bucket_cap_mb``)."""
    reduce_at: ReduceAt = "backward"
    """When ``p.grad`` is read and reduced: ``"backward"`` (hooks), ``"step"``, or ``"never"``
    (gradients arrive averaged, e.g. by DDP)."""

    def main_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """dtype of the main copies of parameters of ``dtype`` (None: updated in their own)."""
        main = self.main_params_dtype
        if main is None or not dtype.is_floating_point:
            return None
        return main if torch.finfo(dtype).bits < torch.finfo(main).bits else None

    def __post_init__(self) -> None:
        if self.reduce_at not in REDUCE_AT:
            raise ValueError(f"reduce_at must be one of {REDUCE_AT}, got {self.reduce_at!r}")
        check_dtype("reduce_dtype", self.reduce_dtype)
        check_dtype("main_params_dtype", self.main_params_dtype)
        cap = self.bucket_cap_mb
        if isinstance(cap, bool) or not (isinstance(cap, (int, float)) and cap > 0):
            raise ValueError(f"bucket_cap_mb must be a positive number, got {cap!r}")


class BucketedReduction:
    """Buckets, gradient hooks, reduce-scatter and all-gather of data-parallel Muon.

    Args:
        params: every parameter, in the optimizer's order (indices below refer to it).
        options: :class:`ReductionOptions`.
        muon, adamw: indices of the Muon and AdamW parameters.
        owner_rank: owner rank of each Muon index owned whole (not the stacks spread over
            several owners: ``expert_ranges``).
        expert_ranges: the :class:`~.buckets.ExpertRange` s of each expert stack spread over
            several owners (each range rides in its owner's stream).
        comm: the data-parallel :class:`~muonscale.distributed.comm.Communicator`.
        name_of: a parameter's name, for error messages.
        update_params: Muon indices whose owner's update may be gathered instead of the
            parameter; a stream whose every matrix is one gathers updates in ``update_dtype``
            and carries no AdamW fill (:mod:`.update_gather`).
        quantized_adamw: AdamW indices whose moments are 8-bit (``state_precision="int8"``):
            their segments' codes live in the stores' ``exp_avg_codes`` and
            ``exp_avg_sq_codes`` (:mod:`.quantized_shards`).
        readiness: every index, in the order backward is expected to make the gradients
            ready (None: the reverse of ``params``); streams and buckets follow it.

    Attributes:
        streams: one :class:`StreamBuffers` per (dtype, device) of Muon parameters.
        flat_shards: one :class:`FlatShard` per flat ZeRO-1 bucket of the other AdamW
            parameters.
        segments: AdamW parameter index -> (its :class:`FlatShard` or :class:`FillShard`, its
            segment on this rank).
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        options: ReductionOptions,
        *,
        muon: list[int],
        adamw: list[int],
        owner_rank: dict[int, int],
        expert_ranges: Mapping[int, Sequence[ExpertRange]] | None = None,
        comm: Communicator,
        name_of: Callable[[torch.Tensor], str] = lambda p: "<parameter>",
        update_params: frozenset[int] = frozenset(),
        update_dtype: torch.dtype = torch.bfloat16,
        readiness: list[int] | None = None,
        quantized_adamw: frozenset[int] = frozenset(),
    ) -> None:
        self.quantized_adamw = quantized_adamw
        self.params, self.options, self.comm, self.owner_rank = params, options, comm, owner_rank
        self.expert_ranges = dict(expert_ranges or {})
        order = readiness if readiness is not None else list(range(len(params)))[::-1]
        self._position = {i: k for k, i in enumerate(order)}  # index -> expected readiness
        self._update_params, self._update_dtype = update_params, update_dtype
        self.rank, self.world_size = comm.rank, comm.world_size
        self.muon, self.adamw = muon, adamw
        self._name_of = name_of
        self._index = {id(p): i for i, p in enumerate(params)}
        self._build_buckets(int(options.bucket_cap_mb * 2**20))
        self._sync = True
        self._warned_rereduce = False
        self.start_cycle()
        self._hook_handles: list[Any] = []
        self._register_hooks()
        self.before_reduce: Callable[[], None] | None = None
        """Called before each bucket's reduction (a deferred gather lands first: the buffers
        are shared)."""

    def _register_hooks(self) -> None:
        """Gradient hooks that launch buckets during backward (``reduce_at="backward"`` only)."""
        self.remove_hooks()
        if self.options.reduce_at != "backward":
            return
        ref = weakref.ref(self)
        self._hook_handles = [
            p.register_post_accumulate_grad_hook(lambda param, ref=ref: _on_grad_ready(ref, param))
            for p in self.params
            if p.requires_grad
        ]

    def rebind(self, params: list[torch.Tensor]) -> None:
        """Follow new parameter objects (same order, shapes and dtypes as before)."""
        self.params = params
        self._index = {id(p): i for i, p in enumerate(params)}
        self._register_hooks()

    # ================================================================ construction
    def main_dtype(self, dtype: torch.dtype) -> torch.dtype | None:
        """dtype of the main copies of parameters of ``dtype`` (None: updated in their own)."""
        return self.options.main_dtype(dtype)

    def _by_dtype_and_device(self, indices: list[int]) -> dict[tuple, list[int]]:
        """``indices`` in expected readiness order (backward's), grouped by (dtype, device):
        one owner stream or set of flat buckets per group."""
        groups: dict[tuple, list[int]] = {}
        for i in sorted(indices, key=self._position.__getitem__):
            p = self.params[i]
            groups.setdefault((p.dtype, p.device), []).append(i)
        return groups

    def _build_buckets(self, cap_bytes: int) -> None:
        """Owner streams (Muon, levelled with AdamW fill), flat buckets (the other AdamW
        parameters), and one launch order for both."""
        numels = {i: p.numel() for i, p in enumerate(self.params)}
        N = self.world_size
        adamw_groups = self._by_dtype_and_device(self.adamw)
        filled: set[int] = set()
        self.streams: list[StreamBuffers] = []
        buckets: list[_Bucket] = []
        for (dtype, device), members in self._by_dtype_and_device(self.muon).items():
            rdtype = self.options.reduce_dtype or dtype
            cap = cap_bytes * 8 // torch.finfo(rdtype).bits
            updates = all(i in self._update_params for i in members)
            gdtype = self._update_dtype if updates else dtype  # what the gather sends
            # Fill candidates: AdamW parameters of the stream's dtype, the last ready in
            # backward first (they pair with the stream ends, which wait for the first layers).
            # None in a stream of updates: AdamW parameters keep their own dtype on the wire.
            same = rdtype == dtype and not updates
            last_first = sorted(adamw_groups.get((dtype, device), []), key=self._position.get)
            fillers = last_first[::-1] if same else []
            units = [u for i in members for u in self.expert_ranges.get(i, [i])]
            layout = plan_owner_streams(units, numels, self.owner_rank, N, cap, fillers)
            filled.update(layout.fill.params)
            recv = torch.zeros(layout.length, dtype=rdtype, device=device)  # (T,)
            send = [torch.zeros(b.numel, dtype=rdtype, device=device) for b in layout.buckets]
            if rdtype == gdtype:  # reuse: gradients are consumed before parameters are sent
                gather_in, gather_out = recv, send
            else:
                gather_in = torch.zeros(layout.length, dtype=gdtype, device=device)
                gather_out = [
                    torch.zeros(b.numel, dtype=gdtype, device=device) for b in layout.buckets
                ]
            fill = None
            if layout.fill.params:
                start, n = layout.fill.stream_starts[self.rank], layout.fill.lengths[self.rank]
                main_dtype = self.main_dtype(dtype)
                moments = self._moments(layout.fill.params, n, main_dtype or dtype, device)
                main = (
                    None if main_dtype is None else torch.zeros(n, dtype=main_dtype, device=device)
                )
                fill = FillShard(layout.fill, recv[start : start + n], moments[0], moments[1], main)
                fill.exp_avg_codes, fill.exp_avg_sq_codes = moments[2:]
            stream = StreamBuffers(layout, recv, send, gather_in, gather_out, fill, updates)
            self.streams.append(stream)
            buckets += [
                _Bucket("muon", b.params, stream=stream, index=k)
                for k, b in enumerate(layout.buckets)
            ]
        self.flat_shards: list[FlatShard] = []
        for (dtype, device), members in adamw_groups.items():
            cap = cap_bytes * 8 // torch.finfo(dtype).bits
            members = [i for i in members if i not in filled]
            main_dtype = self.main_dtype(dtype)
            for layout in plan_flat_buckets(members, numels, N, cap):
                full = torch.zeros(layout.padded_numel, dtype=dtype, device=device)
                shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
                moments = self._moments(
                    layout.params, layout.shard_numel, main_dtype or dtype, device
                )
                main = None
                if main_dtype is not None:
                    main = torch.zeros(layout.shard_numel, dtype=main_dtype, device=device)
                shards = FlatShard(layout, full, shard, moments[0], moments[1], main)
                shards.exp_avg_codes, shards.exp_avg_sq_codes = moments[2:]
                self.flat_shards.append(shards)
                buckets.append(_Bucket("adamw", frozenset(layout.params), shards=shards))
        # Launch order: by the last gradient a bucket waits for.
        buckets.sort(key=lambda b: max((self._position[p] for p in b.params), default=-1))
        self._buckets = buckets
        self._buckets_of: dict[int, list[_Bucket]] = {i: [] for i in range(len(self.params))}
        for b in buckets:
            for p in b.params:
                self._buckets_of[p].append(b)
        self.segments: dict[int, tuple[FlatShard | FillShard, Any]] = {}
        for shards in self.flat_shards:
            for seg in shards.layout.segments(self.rank):
                self.segments[seg.param] = (shards, seg)
        for stream in self.streams:
            if stream.fill is not None:
                for seg in stream.fill.layout.segments(self.rank):
                    self.segments[seg.param] = (stream.fill, seg)

    def _moments(
        self, params: Sequence[int], n: int, dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor | None]:
        """A store's AdamW moments for ``n`` elements holding ``params``: floating
        ``exp_avg``, ``exp_avg_sq`` (None when every parameter's are 8-bit), then uint8
        codes of each (every one the code of 0; None when no parameter's are 8-bit)."""
        quantized = [i in self.quantized_adamw for i in params]
        floating = [torch.zeros(n, dtype=dtype, device=device) for _ in range(2)]
        if all(quantized):
            floating = [None, None]
        codes = [None, None]
        if any(quantized):
            codes = [
                torch.full((n,), zero_code(signed), dtype=torch.uint8, device=device)
                for _, _, signed in ADAMW_MOMENTS
            ]
        return floating + codes

    def segment_starts(self) -> dict[int, list[int]]:
        """Every sharded AdamW parameter -> the starts (in the flattened parameter) of its
        segments on every rank."""
        layouts = [s.layout for s in self.flat_shards]
        layouts += [s.fill.layout for s in self.streams if s.fill is not None]
        out: dict[int, list[int]] = {}
        for layout in layouts:
            for r in range(self.world_size):
                for seg in layout.segments(r):
                    out.setdefault(seg.param, []).append(seg.param_start)
        return out

    # ================================================================ public helpers
    def communication_buffer_bytes(self) -> int:
        """Bytes of the persistent reduction/gather buffers (not optimizer state)."""
        tensors = [t for s in self.streams for t in [s.recv, *s.send]]
        tensors += [
            t
            for s in self.streams
            if s.gather_in is not s.recv
            for t in [s.gather_in, *s.gather_out]
        ]
        tensors += [t for s in self.flat_shards for t in (s.full, s.shard)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (no reduction starts during backward any more)."""
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

    @property
    def bucket_count(self) -> int:
        """Reduction units (owner buckets and flat buckets) per step."""
        return len(self._buckets)

    def unlaunched_buckets(self) -> int:
        """How many buckets of this cycle have not started their reduction yet."""
        return len(self._buckets) - self._next_launch

    # ================================================================ reductions
    def start_cycle(self) -> None:
        """Forget this step's reductions: the next backward starts a new cycle."""
        for b in self._buckets:
            b.pending, b.work, b.launched = len(b.params), None, False
        self._ready: set[int] = set()
        self._next_launch = 0
        self._reduced = False
        self._launched_grads: dict[int, tuple[Any, int] | None] = {}  # i -> (grad ref, version)
        self._accumulations: dict[int, int] = {}  # i -> gradient hooks fired since the step

    def grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: count the parameter in its buckets; launch full ones."""
        if not self._sync:
            return
        i = self._index[id(param)]
        self._accumulations[i] = self._accumulations.get(i, 0) + 1
        if i in self._ready:  # accumulated again: finish() sees the changed p.grad
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
        grad = self.params[i].grad
        if grad is None:
            return None
        if grad.is_sparse:
            raise ValueError(
                f"parameter '{self._name_of(self.params[i])}' has a sparse gradient; "
                "DistributedMuon needs dense gradients"
            )
        return grad.reshape(-1)

    def _launch(self, bucket: _Bucket) -> None:
        """Copy local gradients into the bucket (pre-divided by N) and reduce-scatter it; with
        ``reduce_at="never"``, keep this rank's slice of the (already averaged) gradients."""
        if self.before_reduce is not None:
            self.before_reduce()
        for i in bucket.params:
            grad = self.params[i].grad
            self._launched_grads[i] = None if grad is None else (weakref.ref(grad), grad._version)
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
            tag = "muon"  # owner-stream traffic, the AdamW fill included
        else:
            shards = bucket.shards
            buf, out, tag = shards.full, shards.shard, "adamw"
            for p, off, n in zip(shards.layout.params, shards.layout.offsets, shards.layout.numels):
                grad = self._local_grad(p)
                if grad is None:
                    buf[off : off + n].zero_()
                else:
                    buf[off : off + n].copy_(grad)
        if self.options.reduce_at == "never":
            out.copy_(buf.view(self.world_size, -1)[self.rank])
            bucket.work = None
        else:
            if self.world_size > 1:
                buf.div_(self.world_size)
            lengths = None  # padding of the owner streams stays off the wire
            if bucket.kind == "muon":
                lengths = bucket.stream.layout.data_lengths(bucket.index)
            bucket.work = self.comm.reduce_scatter(
                out, buf, tag=tag, async_op=True, lengths=lengths
            )
        bucket.launched = True

    def backward_passes(self) -> int:
        """How many backward passes (outside ``no_sync``) reached the gradient hooks since the
        last step: every rank must have run the same number (0 without hooks)."""
        return max(self._accumulations.values(), default=0)

    def grads_changed(self) -> list[int]:
        """Parameters whose ``p.grad`` is not the tensor (or version) their reduction read."""
        changed = []
        for i, seen in self._launched_grads.items():
            grad = self.params[i].grad
            if seen is None:
                if grad is not None:
                    changed.append(i)
            elif grad is None or seen[0]() is not grad or grad._version != seen[1]:
                changed.append(i)
        return changed

    def finish(self) -> None:
        """Launch every bucket backward did not (in order), then wait for all of them."""
        if self._reduced:
            return
        for bucket in self._buckets[self._next_launch :]:
            self._launch(bucket)
        self._next_launch = len(self._buckets)
        self._wait_all()
        self._reduced = True

    def reduce_again(self) -> None:
        """Reduce every bucket again from ``p.grad`` (collective: every rank calls it)."""
        for bucket in self._buckets:
            self._launch(bucket)
        self._wait_all()
        self._reduced = True

    def _wait_all(self) -> None:
        for bucket in self._buckets:
            self.comm.wait(bucket.work, f"gradient reduce-scatter ({bucket.kind})")
            bucket.work = None

    def owned_slice(self, unit: OwnedUnit) -> torch.Tensor:
        """The elements of an owned unit: the parameter itself, or its range of experts (a
        view of the parameter, shaped as the sub-stack)."""
        if not isinstance(unit, ExpertRange):
            return self.params[unit]
        flat = self.params[unit.param].view(-1)
        return flat[unit.start : unit.start + unit.numel].view(unit.shape)

    def reduced_grad(self, unit: OwnedUnit, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Averaged gradient of an owned unit (a Muon parameter, or a range of its experts) in
        ``dtype`` (None: the parameter's); a view into the receive stream when that is its
        dtype."""
        shape = unit.shape if isinstance(unit, ExpertRange) else self.params[unit].shape
        stream = self._stream_of(unit)
        off = stream.layout.offsets[unit]
        grad = stream.recv[off : off + stream.layout.numels[unit]].view(shape)
        dtype = dtype or self.params[unit_param(unit)].dtype
        return grad if grad.dtype == dtype else grad.to(dtype)

    def _stream_of(self, unit: OwnedUnit) -> StreamBuffers:
        for stream in self.streams:
            if unit in stream.layout.offsets:
                return stream
        raise KeyError(unit)

    def reduced_shard_grad(self, i: int) -> torch.Tensor:
        """Averaged gradient of this rank's segment of AdamW parameter ``i`` (a view)."""
        store, seg = self.segments[i]
        return store.grad[seg.buffer_start : seg.buffer_start + seg.length]

    def local_reduced_grads(self) -> dict[int, torch.Tensor]:
        """Every reduced gradient this rank holds, by parameter index: owned matrices (a
        parameter whole, or this rank's range of a stack's experts) and AdamW segments."""
        out = {i: self.reduced_grad(i) for i in self.muon if self.owner_rank.get(i) == self.rank}
        for ranges in self.expert_ranges.values():
            out.update({r.param: self.reduced_grad(r) for r in ranges if r.owner == self.rank})
        out.update({i: self.reduced_shard_grad(i) for i in self.segments})
        return out

    def scale_reduced_grads_(self, coef: torch.Tensor) -> None:
        """Multiply every reduced gradient this rank holds by ``coef`` (a scalar tensor)."""
        for stream in self.streams:  # owned matrices and the AdamW fill
            stream.recv.mul_(coef.to(stream.recv.device))
        for shards in self.flat_shards:
            shards.shard.mul_(coef.to(shards.shard.device))
