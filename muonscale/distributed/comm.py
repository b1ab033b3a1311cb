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
explicitly.

Backend notes (torch 2.13 gloo, checked): ``reduce_scatter_single`` / ``all_gather_single``
(the replacements of the deprecated ``reduce_scatter_tensor`` / ``all_gather_into_tensor``) and
``all_to_all_single`` with split sizes work, async included, and bfloat16 sums too; gloo has
no ``ReduceOp.AVG`` (callers pre-divide by N); ``all_gather`` with tensors of different sizes
does not work (callers pad, and the padding is counted). torch 2.11 lacks the
``*_single`` names; :func:`_reduce_scatter_fn` / :func:`_all_gather_fn` pick whichever exists.
"""

from __future__ import annotations

import contextlib
import datetime
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

RING_FACTORS = {
    # op -> (numerator multiplier k) in k * (N-1)/N * S
    "all_reduce": 2,
    "reduce_scatter": 1,
    "all_gather": 1,
    "all_to_all": 1,
    "broadcast": 1,
}


def ring_wire_bytes(op: str, full_bytes: int, world_size: int) -> int:
    """Bytes one rank sends for collective ``op`` on a full tensor of ``full_bytes`` bytes."""
    if op not in RING_FACTORS:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(RING_FACTORS)}")
    if world_size <= 1:
        return 0
    return RING_FACTORS[op] * (world_size - 1) * int(full_bytes) // world_size


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass
class WireCounter:
    """Bytes on the wire sent by this rank, broken down by ``"<tag>/<op>"``.

    ``tag`` says what the traffic is for (``"muon"``, ``"adamw"``, ``"control"``, ...), ``op``
    is the collective. :meth:`take` returns the totals since the last ``take`` and resets them,
    which is how the optimizer reports bytes per step.
    """

    bytes_by_key: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls_by_key: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, op: str, full_bytes: int, world_size: int, tag: str = "other") -> int:
        """Count ``op`` on a full tensor of ``full_bytes`` with the ring model."""
        return self.add(op, ring_wire_bytes(op, full_bytes, world_size), tag)

    def add(self, op: str, nbytes: int, tag: str = "other") -> int:
        """Count ``nbytes`` sent by this rank (already computed)."""
        key = f"{tag}/{op}"
        self.bytes_by_key[key] += nbytes
        self.calls_by_key[key] += 1
        return nbytes

    @property
    def total(self) -> int:
        return sum(self.bytes_by_key.values())

    def breakdown(self) -> dict[str, int]:
        return dict(sorted(self.bytes_by_key.items()))

    def by_op(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for key, nbytes in self.bytes_by_key.items():
            out[key.split("/", 1)[1]] += nbytes
        return dict(sorted(out.items()))

    def reset(self) -> None:
        self.bytes_by_key = defaultdict(int)
        self.calls_by_key = defaultdict(int)

    def take(self) -> tuple[int, dict[str, int]]:
        """(total, breakdown) since the last call; resets the counter."""
        total, breakdown = self.total, self.breakdown()
        self.reset()
        return total, breakdown


ReduceScatterImpl = Literal["auto", "native", "all_to_all"]
"""How :meth:`Communicator.reduce_scatter` runs: ``"native"`` is the backend's reduce-scatter,
``"all_to_all"`` an all-to-all plus a local sum, ``"auto"`` native on NCCL only."""


class CollectiveError(RuntimeError):
    """A collective failed or timed out (usually: another rank raised or died)."""


class _CompletedWork:
    """Stands in for a ``Work`` handle when no collective was issued (world size 1)."""

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _sum_chunks(output: torch.Tensor, received: torch.Tensor, world_size: int) -> None:
    """``output`` <- sum of the ``world_size`` equal chunks of ``received``, in rank order."""
    chunks = received.view(world_size, -1)
    low_precision = received.dtype in (torch.float16, torch.bfloat16)
    acc = chunks[0].float() if low_precision else chunks[0].clone()
    for r in range(1, world_size):
        acc.add_(chunks[r])
    output.copy_(acc.view(output.shape))


class _SumAfterWork:
    """The async handle of an all-to-all reduce-scatter: waiting also does the local sum."""

    def __init__(self, work, output: torch.Tensor, received: torch.Tensor, world_size: int):
        self._work, self._output, self._received = work, output, received
        self._world_size = world_size

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        if self._received is not None:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
            _sum_chunks(self._output, self._received, self._world_size)
            self._received = None
        return True

    def is_completed(self) -> bool:
        return self._received is None


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
    single-rank "group" (no collectives at all) when it is not.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        counter: WireCounter | None = None,
        *,
        reduce_scatter_impl: ReduceScatterImpl = "auto",
    ):
        if reduce_scatter_impl not in ("auto", "native", "all_to_all"):
            raise ValueError(
                "reduce_scatter_impl must be 'auto', 'native' or 'all_to_all', "
                f"got {reduce_scatter_impl!r}"
            )
        self.group = group
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
        if reduce_scatter_impl == "auto":
            nccl = self.active and dist.get_backend(group) == "nccl"
            reduce_scatter_impl = "native" if nccl else "all_to_all"
        self.reduce_scatter_impl = reduce_scatter_impl

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
        self.counter.record("all_reduce", tensor_bytes(tensor), self.world_size, tag)
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
    ):
        """``output`` (S/N) <- shard ``rank`` of the sum over ranks of ``input`` (S, contiguous)."""
        if input.numel() != output.numel() * self.world_size:
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements, "
                f"expected {self.world_size} x {output.numel()}"
            )
        self.counter.record("reduce_scatter", tensor_bytes(input), self.world_size, tag)
        if not self.active:
            output.copy_(input)
            return _CompletedWork() if async_op else None
        if self.reduce_scatter_impl == "all_to_all":
            return self._reduce_scatter_by_all_to_all(output, input, op=op, async_op=async_op)
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
    ):
        """``output`` (N*S) <- concatenation over ranks of ``input`` (S); equal sizes only."""
        if output.numel() != input.numel() * self.world_size:
            raise ValueError(
                f"all_gather: output has {output.numel()} elements, "
                f"expected {self.world_size} x {input.numel()}"
            )
        self.counter.record("all_gather", tensor_bytes(output), self.world_size, tag)
        if not self.active:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return _CompletedWork() if async_op else None
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
        async_op: bool = False,
    ):
        """Chunk ``i`` of ``input`` (dim 0, ``input_split_sizes``) goes to rank ``i``."""
        if input_split_sizes is None or self.world_size == 1:
            self.counter.record("all_to_all", tensor_bytes(input), self.world_size, tag)
        else:  # exact: everything but the chunk this rank keeps
            row_bytes = tensor_bytes(input) // max(1, input.shape[0]) if input.dim() else 0
            self.counter.add(
                "all_to_all", tensor_bytes(input) - input_split_sizes[self.rank] * row_bytes, tag
            )
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
        self.counter.record("broadcast", tensor_bytes(tensor), self.world_size, tag)
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
    def _reduce_scatter_by_all_to_all(self, output, input, *, op, async_op: bool):
        if op != dist.ReduceOp.SUM:
            raise ValueError(
                f"reduce_scatter: op must be ReduceOp.SUM with reduce_scatter_impl='all_to_all', "
                f"got {op}"
            )
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


def native_wire_bytes(op: str, full_bytes: int, world_size: int, backend: str) -> int:
    """Bytes one rank sends for torch's own collective ``op`` on ``backend`` (for traffic that
    does not go through :class:`Communicator`, such as FSDP2's): the ring model, except gloo's
    native reduce-scatter, which sends a whole all-reduce (see the module docstring)."""
    if op == "reduce_scatter" and backend == "gloo":
        return ring_wire_bytes("all_reduce", full_bytes, world_size)
    return ring_wire_bytes(op, full_bytes, world_size)


@contextlib.contextmanager
def counting_torch_collectives(counter: WireCounter, *, tag: str = "torch"):
    """Count, with :func:`native_wire_bytes`, the all-gathers and reduce-scatters that torch
    itself issues (FSDP2 looks ``torch.distributed.<name>`` up at call time) while inside."""
    wrapped = {
        "all_gather_single": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "reduce_scatter_single": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
    }
    originals = {name: getattr(dist, name) for name in wrapped if hasattr(dist, name)}

    def counted(name, fn):
        op = wrapped[name]

        def call(output, input, *args, group=None, **kwargs):
            full = output if op == "all_gather" else input
            n = dist.get_world_size(group)
            counter.add(
                op, native_wire_bytes(op, tensor_bytes(full), n, dist.get_backend(group)), tag
            )
            return fn(output, input, *args, group=group, **kwargs)

        return call

    try:
        for name, fn in originals.items():
            setattr(dist, name, counted(name, fn))
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


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
