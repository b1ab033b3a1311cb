"""Every collective muonscale issues, and the bytes each one puts on the wire.

All cross-rank traffic of the distributed optimizers goes through :class:`Communicator`, so the
byte accounting lives in one place. Bytes are counted **per rank** with the ring cost model
(S = bytes of the full tensor the collective is about, padding included, N = group size)::

    all_reduce       2 (N-1)/N * S      (reduce-scatter + all-gather)
    reduce_scatter     (N-1)/N * S      S = the full input (N shards)
    all_gather         (N-1)/N * S      S = the full output (N shards)
    all_to_all         (N-1)/N * S      S = this rank's input; with split sizes, exactly the
                                        bytes that leave (the input minus its own chunk)
    broadcast          (N-1)/N * S      pipelined ring broadcast

With N = 1, or when ``torch.distributed`` is not initialized, no collective is issued (the
operations copy or do nothing) and zero bytes are counted, so world size 1 runs the same code.

How the reduce-scatter is carried out depends on the backend. NCCL's native reduce-scatter
sends what the model says. gloo's (``reduce_scatter_tensor`` / ``reduce_scatter_single``) sends a
whole all-reduce (measured on veth: 1.02 / 1.51 tensor sizes per rank at 2 / 4 ranks, against
0.50 / 0.75), so on every other backend the reduce-scatter is an ``all_to_all_single`` (which
does send (N-1)/N * S) followed by a local sum over the received chunks in rank order 0..N-1
(deterministic; accumulated in float32 for 16-bit dtypes). ``reduce_scatter_impl`` picks it
explicitly. Given a :class:`~.hosts.HostMap` of H > 1 hosts with L > 1 ranks each, the
reduce-scatter and all-gather on those backends are two-level instead (:class:`~.hosts.TwoLevel`:
within the host, then across hosts between the ranks of one local rank), which cross each host
link with (H-1)/H * S per host instead of L times that.

Bytes are also counted per link class (:meth:`WireCounter.by_link`): ``"intra_host"`` (to a rank
of the same host) and ``"inter_host"``, for the algorithm that runs: an all-to-all by
destination, a ring collective (gloo's all-reduce and all-gather; NCCL's, modelled with ring
order = rank order) by this rank's ring successor ``rank + 1``. Without a host map every rank
counts as a host of its own.

Backend notes (torch 2.13 gloo, checked): ``reduce_scatter_single`` / ``all_gather_single``
(the replacements of the deprecated ``reduce_scatter_tensor`` / ``all_gather_into_tensor``) and
``all_to_all_single`` with split sizes work, async included, and bfloat16 sums too; gloo has
no ``ReduceOp.AVG`` (callers pre-divide by N); ``all_gather`` with tensors of different sizes
does not work (callers pad, and the padding is counted). torch 2.11 lacks the
``*_single`` names; :func:`_reduce_scatter_fn` / :func:`_all_gather_fn` pick whichever exists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist

from .handles import CompletedWork as _CompletedWork
from .handles import SumAfterWork as _SumAfterWork
from .handles import ThenWork as _ThenWork
from .handles import place_uneven
from .handles import sum_chunks as _sum_chunks
from .hosts import INTER, INTRA, HostGroups, HostMap, TwoLevel
from .wire import (  # noqa: F401 (re-exported: imported from here)
    RING_FACTORS,
    WireCounter,
    counting_torch_collectives,
    native_wire_bytes,
    ring_wire_bytes,
    tensor_bytes,
)

ReduceScatterImpl = Literal["auto", "native", "all_to_all", "two_level"]
"""How :meth:`Communicator.reduce_scatter` runs: ``"native"`` is the backend's reduce-scatter,
``"all_to_all"`` an all-to-all plus a local sum, ``"two_level"`` within hosts then across them
(the all-gather too), ``"auto"``: native on NCCL, else two-level where the host map allows it,
else the all-to-all."""
REDUCE_SCATTER_IMPLS = ("auto", "native", "all_to_all", "two_level")


class CollectiveError(RuntimeError):
    """A collective failed or timed out (usually: another rank raised or died)."""


# torch >= 2.13 names them *_single; older versions only have *_tensor. Resolved once, at
# import, so that counting_torch_collectives (which wraps torch's names) never counts these.
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return _REDUCE_SCATTER


def _all_gather_fn():
    return _ALL_GATHER


def _is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


class Communicator:
    """Collectives over one process group, each counted in a :class:`WireCounter`.

    ``group=None`` means the default group when ``torch.distributed`` is initialized, and a
    single-rank "group" (no collectives at all) when it is not. ``hosts``: the
    :class:`~.hosts.HostMap` of the group (:func:`~.hosts.discover_host_map`); None: every rank
    a host of its own. A two-level map makes the intra- and inter-host subgroups here.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        counter: WireCounter | None = None,
        *,
        reduce_scatter_impl: ReduceScatterImpl = "auto",
        hosts: HostMap | None = None,
    ):
        if reduce_scatter_impl not in REDUCE_SCATTER_IMPLS:
            raise ValueError(
                f"reduce_scatter_impl must be one of {REDUCE_SCATTER_IMPLS}, "
                f"got {reduce_scatter_impl!r}"
            )
        self.group = group
        self.two_level: TwoLevel | None = None
        self.counter = counter if counter is not None else WireCounter()
        if _is_initialized():
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            if group is not None:
                raise ValueError(
                    "a process_group was given but torch.distributed is not initialized"
                )
            self.world_size, self.rank = 1, 0
        if hosts is not None and len(hosts.host_of) != self.world_size:
            raise ValueError(
                f"hosts maps {len(hosts.host_of)} ranks, but the group has {self.world_size}"
            )
        self.hosts = hosts if hosts is not None else HostMap.unknown(self.world_size)
        if reduce_scatter_impl == "auto":
            nccl = self.active and dist.get_backend(group) == "nccl"
            two_level = self.active and self.hosts.two_level
            reduce_scatter_impl = "native" if nccl else "two_level" if two_level else "all_to_all"
        if reduce_scatter_impl == "two_level" and not (self.active and self.hosts.two_level):
            raise ValueError(
                "reduce_scatter_impl='two_level' needs a host map of more than one host with "
                f"the same number (> 1) of ranks each, got hosts {self.hosts.host_of}"
            )
        self.reduce_scatter_impl = reduce_scatter_impl
        if reduce_scatter_impl == "two_level":
            groups = HostGroups(group, self.hosts, self.rank)
            one_host = HostMap((0,) * groups.L, self.hosts.source)
            intra = Communicator(groups.intra, self.counter, hosts=one_host)
            inter = Communicator(groups.inter, self.counter, hosts=HostMap.unknown(groups.H))
            self.two_level = TwoLevel(groups, intra, inter)

    @property
    def counter(self) -> WireCounter:
        """Where this communicator's bytes are counted (its subgroups' too)."""
        return self._counter

    @counter.setter
    def counter(self, counter: WireCounter) -> None:
        self._counter = counter
        if self.two_level is not None:
            self.two_level.intra.counter = self.two_level.inter.counter = counter

    def _ring_link(self) -> str:
        """Link class of this rank's ring successor (where a ring collective sends)."""
        successor = (self.rank + 1) % self.world_size
        return INTRA if self.hosts.same_host(self.rank, successor) else INTER

    def _count_to_peers(self, op: str, chunk_bytes: Sequence[int], tag: str) -> None:
        """Count ``chunk_bytes[j]`` sent to rank ``j`` (not to itself), by link class."""
        by_link = {INTRA: 0, INTER: 0}
        for j, nbytes in enumerate(chunk_bytes):
            if j != self.rank:
                by_link[INTRA if self.hosts.same_host(self.rank, j) else INTER] += nbytes
        self.counter.add(op, by_link[INTER], tag, INTER)
        self.counter.add(op, by_link[INTRA], tag, INTRA, calls=0)

    @property
    def active(self) -> bool:
        """Whether collectives are actually issued (world size > 1)."""
        return self.world_size > 1

    @property
    def device(self) -> torch.device:
        """Device for small control tensors: CUDA for NCCL groups, CPU otherwise."""
        if self.active and dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    # ---- collectives -------------------------------------------------------------------
    def all_reduce(
        self,
        tensor: torch.Tensor,
        *,
        op=dist.ReduceOp.SUM,
        tag: str = "control",
        async_op: bool = False,
    ):
        self.counter.record(
            "all_reduce", tensor_bytes(tensor), self.world_size, tag, self._ring_link()
        )
        if not self.active:
            return _CompletedWork() if async_op else None
        return self._call(
            "all_reduce", dist.all_reduce, tensor, op=op, group=self.group, async_op=async_op
        )

    def reduce_scatter(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        op=dist.ReduceOp.SUM,
        tag: str = "other",
        async_op: bool = False,
        lengths: Sequence[int] | None = None,
    ):
        """``output`` (S/N) <- shard ``rank`` of the sum over ranks of ``input`` (S, contiguous).
        ``lengths``: the elements of each rank's shard that carry data (the rest is padding:
        neither sent nor written, except by the native reduce-scatter, which sends it)."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements, "
                f"expected {self.world_size} x {output.numel()}"
            )
        if not self.active:
            self.counter.record("reduce_scatter", 0, 1, tag)
            output.copy_(input)
            return _CompletedWork() if async_op else None
        if self.reduce_scatter_impl != "native" and op != dist.ReduceOp.SUM:
            raise ValueError(
                f"reduce_scatter: op must be ReduceOp.SUM with reduce_scatter_impl="
                f"{self.reduce_scatter_impl!r}, got {op}"
            )
        if lengths is not None and all(n == output.numel() for n in lengths):
            lengths = None  # no padding
        if self.two_level is not None:  # counted by the two subgroups' collectives
            if lengths is not None:
                return self.two_level.reduce_scatter_uneven(
                    output, input, lengths, tag=tag, async_op=async_op
                )
            return self.two_level.reduce_scatter(output, input, tag=tag, async_op=async_op)
        if self.reduce_scatter_impl == "all_to_all" and lengths is not None:
            return self._reduce_scatter_uneven(output, input, lengths, tag=tag, async_op=async_op)
        if self.reduce_scatter_impl == "all_to_all":
            chunk = tensor_bytes(input) // self.world_size
            self._count_to_peers("reduce_scatter", [chunk] * self.world_size, tag)
            return self._reduce_scatter_by_all_to_all(output, input, op=op, async_op=async_op)
        self.counter.record(
            "reduce_scatter", tensor_bytes(input), self.world_size, tag, self._ring_link()
        )
        return self._call(
            "reduce_scatter",
            _reduce_scatter_fn(),
            output,
            input,
            op=op,
            group=self.group,
            async_op=async_op,
        )

    def all_gather(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        *,
        tag: str = "other",
        async_op: bool = False,
        lengths: Sequence[int] | None = None,
    ):
        """``output`` (N*S) <- concatenation over ranks of ``input`` (S); equal sizes only.
        ``lengths``: the elements of each rank's ``input`` that carry data (the rest, padding,
        is neither sent nor written; on NCCL the native all-gather sends it)."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather: output has {output.numel()} elements, "
                f"expected {self.world_size} x {input.numel()}"
            )
        if not self.active:
            self.counter.record("all_gather", 0, 1, tag)
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _CompletedWork() if async_op else None
        if lengths is not None and all(n == input.numel() for n in lengths):
            lengths = None  # no padding
        nccl = dist.get_backend(self.group) == "nccl"
        if self.two_level is not None and lengths is not None:
            return self.two_level.all_gather_uneven(
                output, input, lengths, tag=tag, async_op=async_op
            )
        if self.two_level is not None:  # counted by the two subgroups' collectives
            return self.two_level.all_gather(output, input, tag=tag, async_op=async_op)
        if lengths is not None and not nccl:
            return self._all_gather_uneven(output, input, lengths, tag=tag, async_op=async_op)
        self.counter.record(
            "all_gather", tensor_bytes(output), self.world_size, tag, self._ring_link()
        )
        return self._call(
            "all_gather", _all_gather_fn(), output, input, group=self.group, async_op=async_op
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = None,
        input_split_sizes: Sequence[int] | None = None,
        *,
        tag: str = "other",
        count_as: str = "all_to_all",
        async_op: bool = False,
    ):
        """Chunk ``i`` of ``input`` (dim 0, ``input_split_sizes``) goes to rank ``i``; the
        bytes are counted under ``count_as`` (the collective this one is a phase of)."""
        n = self.world_size
        if n == 1:
            self.counter.record(count_as, 0, 1, tag)
        elif input_split_sizes is None:  # equal chunks: (N-1)/N of the input leaves
            self._count_to_peers(count_as, [tensor_bytes(input) // n] * n, tag)
        else:  # exact: everything but the chunk this rank keeps
            row_bytes = tensor_bytes(input) // max(1, input.shape[0]) if input.dim() else 0
            self._count_to_peers(count_as, [k * row_bytes for k in input_split_sizes], tag)
        if not self.active:
            output.copy_(input)
            return _CompletedWork() if async_op else None
        return self._call(
            "all_to_all_single",
            dist.all_to_all_single,
            output,
            input,
            list(output_split_sizes) if output_split_sizes is not None else None,
            list(input_split_sizes) if input_split_sizes is not None else None,
            group=self.group,
            async_op=async_op,
        )

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, tag: str = "other", async_op: bool = False
    ):
        """``src`` is a rank in this group."""
        self.counter.record(
            "broadcast", tensor_bytes(tensor), self.world_size, tag, self._ring_link()
        )
        if not self.active:
            return _CompletedWork() if async_op else None
        return self._call(
            "broadcast", dist.broadcast, tensor, group=self.group, group_src=src, async_op=async_op
        )

    def redistribute_like(self, tensor: torch.Tensor, param: torch.Tensor, *, tag: str):
        """``tensor`` (a DTensor gradient) redistributed to ``param``'s placements by DTensor's
        own collectives over ``param``'s mesh, counted per mesh axis with the ring model
        (Partial → Replicate: all-reduce; Partial → Shard: reduce-scatter; Shard → Replicate:
        all-gather; Shard → Shard: all-to-all; Replicate → anything: a local slice). Anything
        that is not a DTensor pair, or already placed alike, comes back as it is."""
        from torch.distributed.tensor import DTensor, Replicate

        if not (isinstance(tensor, DTensor) and isinstance(param, DTensor)):
            return tensor
        if tensor.placements == param.placements:
            return tensor
        mesh, local = param.device_mesh, tensor.to_local()
        for axis, (src, dst) in enumerate(zip(tensor.placements, param.placements)):
            if src == dst or isinstance(src, Replicate):
                continue
            if src.is_partial():
                op = "all_reduce" if isinstance(dst, Replicate) else "reduce_scatter"
            else:
                op = "all_gather" if isinstance(dst, Replicate) else "all_to_all"
            n = mesh.size(axis)
            full = tensor_bytes(local) * (n if op == "all_gather" else 1)
            self.counter.record(op, full, n, tag)
        return self._call("redistribute", tensor.redistribute, param.device_mesh, param.placements)

    def all_gather_object(self, obj: object, *, tag: str = "setup") -> list[object]:
        """Pickled objects from every rank (setup-time checks only; bytes are approximate)."""
        if not self.active:
            return [obj]
        out: list[object] = [None] * self.world_size
        self._call("all_gather_object", dist.all_gather_object, out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.active:
            self._call("barrier", dist.barrier, group=self.group)

    def wait(self, work, what: str = "collective") -> None:
        """Wait for an async handle; a failure or timeout becomes a :class:`CollectiveError`."""
        if work is None:
            return
        try:
            work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error(what, exc) from exc

    # ---- internals ---------------------------------------------------------------------
    def _reduce_scatter_uneven(self, output, input, lengths, *, tag: str, async_op: bool):
        """All-to-all of each shard's first ``lengths[j]`` elements, then the local sum."""
        n, size = self.world_size, output.numel()
        chunks = input.reshape(n, size)
        send = torch.cat([chunks[j, : lengths[j]] for j in range(n)])
        mine = lengths[self.rank]
        self._count_to_peers("reduce_scatter", [k * input.element_size() for k in lengths], tag)
        received = torch.empty(n * mine, dtype=input.dtype, device=input.device)
        work = self._call(
            "reduce_scatter",
            dist.all_to_all_single,
            received,
            send,
            [mine] * n,
            list(lengths),
            group=self.group,
            async_op=async_op,
        )
        target = output.view(-1)[:mine]
        if async_op:
            return _SumAfterWork(work, target, received, n)
        _sum_chunks(target, received, n)
        return None

    def _all_gather_uneven(self, output, input, lengths, *, tag: str, async_op: bool):
        """Each rank's first ``lengths[rank]`` elements to every rank (an all-to-all)."""
        n, size, mine = self.world_size, input.numel(), lengths[self.rank]
        self._count_to_peers("all_gather", [mine * input.element_size()] * n, tag)
        send = input.reshape(-1)[:mine].repeat(n)
        received = torch.empty(sum(lengths), dtype=input.dtype, device=input.device)
        work = self._call(
            "all_gather",
            dist.all_to_all_single,
            received,
            send,
            list(lengths),
            [mine] * n,
            group=self.group,
            async_op=async_op,
        )

        def finish():
            place_uneven(output.view(n, size), received, lengths)

        if async_op:
            return _ThenWork(work, finish)
        finish()
        return None

    def _reduce_scatter_by_all_to_all(self, output, input, *, op, async_op: bool):
        received = torch.empty(input.numel(), dtype=input.dtype, device=input.device)
        work = self._call(
            "reduce_scatter",
            dist.all_to_all_single,
            received,
            input.reshape(-1),
            group=self.group,
            async_op=async_op,
        )
        if async_op:
            return _SumAfterWork(work, output, received, self.world_size)
        _sum_chunks(output, received, self.world_size)
        return None

    def _call(self, what: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: BaseException) -> CollectiveError:
        return CollectiveError(
            f"{what} failed on rank {self.rank} of {self.world_size}: {exc}. "
            "If another rank raised or died (for example inside step()), the ranks waiting for "
            "it give up after at most the process-group timeout, set with "
            "init_process_group(timeout=...) (torch default: 30 min for gloo, 10 min for NCCL)."
        )


def gather_wire_stats(source, group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Mean, max and min over the ranks of ``group`` of this rank's bytes (collective; not
    counted itself). ``source``: a byte count, a :class:`WireCounter` (its total), or an
    optimizer with ``last_step_wire_bytes``."""
    if isinstance(source, WireCounter):
        nbytes = source.total
    elif hasattr(source, "last_step_wire_bytes"):
        nbytes = source.last_step_wire_bytes
    else:
        nbytes = int(source)
    comm = Communicator(group)
    values = torch.zeros(comm.world_size, dtype=torch.float64, device=comm.device)
    mine = torch.tensor([float(nbytes)], dtype=torch.float64, device=comm.device)
    comm.all_gather(values, mine, tag="stats")
    return {
        "mean": values.mean().item(),
        "max": values.max().item(),
        "min": values.min().item(),
        "world_size": comm.world_size,
    }


def combine_over_ranks(
    values: torch.Tensor, ops: Sequence[str], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """``values`` (K,) of every rank of ``group`` combined per entry by ``ops[k]``
    (``"sum"``, ``"max"`` or ``"min"``), in one all-gather (collective; not counted, like
    :func:`gather_wire_stats`): how the step metrics sum over ranks."""
    comm = Communicator(group)
    mine = values.to(device=comm.device, dtype=torch.float64).reshape(-1)
    every = torch.zeros(comm.world_size * mine.numel(), dtype=torch.float64, device=comm.device)
    comm.all_gather(every, mine, tag="stats")
    every = every.view(comm.world_size, -1)
    reduce = {"sum": lambda c: c.sum(), "max": lambda c: c.max(), "min": lambda c: c.min()}
    return torch.stack([reduce[op](every[:, k]) for k, op in enumerate(ops)]).cpu()
