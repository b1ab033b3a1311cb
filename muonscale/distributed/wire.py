"""Bytes on the wire: the ring cost model, :class:`WireCounter` (bytes by ``"<tag>/<op>"`` and
by link class), and the count of the collectives torch itself issues (FSDP2's). The model and
the backends' algorithms are described in :mod:`.comm`, which counts every collective of its
own here."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .hosts import INTER, INTRA

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
    bytes_by_link: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def record(
        self, op: str, full_bytes: int, world_size: int, tag: str = "other", link: str = INTER
    ) -> int:
        """Count ``op`` on a full tensor of ``full_bytes`` with the ring model."""
        return self.add(op, ring_wire_bytes(op, full_bytes, world_size), tag, link)

    def add(
        self, op: str, nbytes: int, tag: str = "other", link: str = INTER, *, calls: int = 1
    ) -> int:
        """Count ``nbytes`` sent by this rank (already computed) over a ``link`` class."""
        if link not in (INTRA, INTER):
            raise ValueError(f"link must be {INTRA!r} or {INTER!r}, got {link!r}")
        key = f"{tag}/{op}"
        self.bytes_by_key[key] += nbytes
        self.calls_by_key[key] += calls
        self.bytes_by_link[link] += nbytes
        return nbytes

    def by_link(self) -> dict[str, int]:
        """Bytes by link class: ``{"intra_host": ..., "inter_host": ...}``."""
        return {INTRA: self.bytes_by_link.get(INTRA, 0), INTER: self.bytes_by_link.get(INTER, 0)}

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
        self.bytes_by_link = defaultdict(int)

    def take(self) -> tuple[int, dict[str, int]]:
        """(total, breakdown) since the last call; resets the counter."""
        total, breakdown = self.total, self.breakdown()
        self.reset()
        return total, breakdown


def native_wire_bytes(op: str, full_bytes: int, world_size: int, backend: str) -> int:
    """Bytes one rank sends for torch's own collective ``op`` on ``backend`` (for traffic that
    does not go through :class:`Communicator`, such as FSDP2's): the ring model, except gloo's
    native reduce-scatter, which sends a whole all-reduce (see the module docstring)."""
    if op == "reduce_scatter" and backend == "gloo":
        return ring_wire_bytes("all_reduce", full_bytes, world_size)
    return ring_wire_bytes(op, full_bytes, world_size)


def _successor_link(group, host_of: Sequence[Hashable] | None) -> str:
    """Link class from this rank to its ring successor in ``group`` (``host_of``: the host
    label of every global rank; None: every rank a host of its own)."""
    if host_of is None:
        return INTER
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    me = dist.get_rank(group)
    successor = ranks[(me + 1) % len(ranks)]
    return INTRA if host_of[ranks[me]] == host_of[successor] else INTER


@contextlib.contextmanager
def counting_torch_collectives(
    counter: WireCounter, *, tag: str = "torch", host_of: Sequence[Hashable] | None = None
):
    """Count, with :func:`native_wire_bytes`, the all-gathers and reduce-scatters that torch
    itself issues (FSDP2 looks ``torch.distributed.<name>`` up at call time) while inside, by
    link class of the ring successor (``host_of``: host label of each global rank)."""
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
            nbytes = native_wire_bytes(op, tensor_bytes(full), n, dist.get_backend(group))
            counter.add(op, nbytes, tag, _successor_link(group, host_of))
            return fn(output, input, *args, group=group, **kwargs)

        return call

    try:
        for name, fn in originals.items():
            setattr(dist, name, counted(name, fn))
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
