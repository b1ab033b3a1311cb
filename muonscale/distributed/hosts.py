"""Which host each rank of a process group runs on, the subgroups derived from that, and the
two-level collectives that cross each host boundary as few times as possible.

A rank's host label comes, in this order, from an explicit ``host_map`` (one label per rank of
the group, the same list on every rank), from torchrun's ``GROUP_RANK`` (the node rank), or
from the hostname; every rank contributes its label through one ``all_gather_object`` over the
group. Hosts are numbered in order of first appearance in rank order; a rank's *local rank* is
its position among its host's ranks (in rank order).

With H > 1 hosts of L > 1 ranks each, :class:`HostGroups` makes two subgroups per rank with
``new_group(..., use_local_synchronization=True)`` (only their members take part, so
optimizers over different groups, built at different times, cannot deadlock): the ranks of
this host ("intra"), and the ranks with this local rank on every host ("inter").

Two-level reduce-scatter of N = H·L chunks (chunk j is rank j's):
  1. within the host, an all-to-all: local rank l receives the H chunks of the ranks with
     local rank l from each of its host's ranks, and sums them over the host's ranks in
     ascending rank order (16-bit dtypes accumulate in float32, then round to the wire dtype);
  2. across hosts, an all-to-all between the ranks of one local rank: each receives its own
     chunk's H host sums, and adds them in ascending rank order of the inter group.
Per rank (S = the full input): (L−1)/L·S within the host, (H−1)/N·S across hosts, so a host
sends (H−1)/H·S over its link, against L·(H−1)/H·S for a flat all-to-all.

Two-level all-gather: first across hosts (the ranks of one local rank gather their chunks),
then within the host (each rank gathers its host's H-chunk blocks): (H−1)/H·S per host link.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

INTRA, INTER = "intra_host", "inter_host"
"""Link classes of :class:`~.comm.WireCounter`: bytes that stay on a host, bytes that leave it."""


class Communicator(Protocol):
    """What this module calls on a :class:`~.comm.Communicator` (which builds on this module,
    so it is named here by the methods used, not imported)."""

    rank: int
    world_size: int

    @property
    def active(self) -> bool: ...

    def all_gather_object(self, obj: object, *, tag: str = ...) -> list[object]: ...

    def all_gather(
        self, output: torch.Tensor, input: torch.Tensor, *, tag: str = ..., async_op: bool = ...
    ) -> Any: ...

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int] | None = ...,
        input_split_sizes: Sequence[int] | None = ...,
        *,
        tag: str = ...,
        count_as: str = ...,
        async_op: bool = ...,
    ) -> Any: ...

    def wait(self, work: Any, what: str = ...) -> None: ...


@dataclass(frozen=True)
class HostMap:
    """Host index of every rank of a group (hosts numbered by first appearance)."""

    host_of: tuple[int, ...]
    source: str = "none"  # "host_map", "GROUP_RANK", "hostname" or "none" (unknown)

    @classmethod
    def from_labels(cls, labels: Sequence[Hashable], source: str = "host_map") -> HostMap:
        index: dict[Hashable, int] = {}
        return cls(tuple(index.setdefault(x, len(index)) for x in labels), source)

    @classmethod
    def unknown(cls, world_size: int) -> HostMap:
        """Hosts not known: every rank counted as a host of its own."""
        return cls(tuple(range(world_size)), "none")

    @property
    def hosts(self) -> int:
        return len(set(self.host_of))

    def members(self, host: int) -> list[int]:
        """Ranks of ``host``, ascending."""
        return [r for r, h in enumerate(self.host_of) if h == host]

    def local_rank(self, rank: int) -> int:
        return self.members(self.host_of[rank]).index(rank)

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of[a] == self.host_of[b]

    @property
    def ranks_per_host(self) -> int | None:
        """L when every host has the same number of ranks, else None."""
        counts = {len(self.members(h)) for h in range(self.hosts)}
        return counts.pop() if len(counts) == 1 else None

    @property
    def two_level(self) -> bool:
        """Whether the two-level collectives apply: H > 1 hosts of L > 1 ranks each."""
        per_host = self.ranks_per_host
        return self.hosts > 1 and per_host is not None and per_host > 1

    def peers(self, rank: int) -> list[int]:
        """Ranks with ``rank``'s local rank, one per host, ascending (the inter group)."""
        local = self.local_rank(rank)
        return sorted(self.members(h)[local] for h in range(self.hosts))


def _check_host_map(host_map, world_size: int) -> tuple:
    if isinstance(host_map, (str, bytes)) or not isinstance(host_map, Sequence):
        raise ValueError(
            f"host_map must be a sequence with one host label per rank of the group, got "
            f"{host_map!r}"
        )
    if len(host_map) != world_size:
        raise ValueError(
            f"host_map has {len(host_map)} entries, expected one per rank of the group "
            f"({world_size})"
        )
    for label in host_map:
        if not isinstance(label, (int, str)) or isinstance(label, bool):
            raise ValueError(f"host_map labels must be ints or strings, got {label!r}")
    return tuple(host_map)


def discover_host_map(comm: Communicator, host_map: Sequence[Hashable] | None = None) -> HostMap:
    """The :class:`HostMap` of ``comm``'s group (collective: one ``all_gather_object``)."""
    world_size = comm.world_size
    given = None if host_map is None else _check_host_map(host_map, world_size)
    if given is not None:
        source, label = "host_map", given[comm.rank]
    elif os.environ.get("GROUP_RANK", "").isdigit():
        source, label = "GROUP_RANK", int(os.environ["GROUP_RANK"])
    else:
        source, label = "hostname", socket.gethostname()
    if not comm.active:
        return HostMap((0,), source)
    everyone = comm.all_gather_object((source, label, given), tag="setup")
    sources = {s for s, _, _ in everyone}
    if len(sources) > 1:
        by_rank = ", ".join(f"rank {r}: {s}" for r, (s, _, _) in enumerate(everyone))
        raise ValueError(
            f"ranks disagree on where their host label comes from ({by_rank}): pass the same "
            "host_map= on every rank, or launch every rank with torchrun"
        )
    maps = {m for _, _, m in everyone}
    if len(maps) > 1:
        raise ValueError(f"host_map differs between ranks: {sorted(maps, key=repr)}")
    return HostMap.from_labels([x for _, x, _ in everyone], source)


_GROUP_CACHE: dict[tuple, tuple] = {}


def _subgroups(key: tuple, intra_ranks: list[int], inter_ranks: list[int]) -> tuple:
    """(intra, inter) subgroups of global ranks, made once per (group, host map) ``key`` and
    reused. Every rank of the group hits or misses the cache together and a miss makes exactly
    two groups on each, so the members of a new subgroup agree on its (hashed) name."""
    alive = dist.distributed_c10d._world.pg_map
    pair = _GROUP_CACHE.get(key)
    if pair is None or any(g not in alive for g in pair):
        intra = dist.new_group(intra_ranks, use_local_synchronization=True)
        inter = dist.new_group(inter_ranks, use_local_synchronization=True)
        pair = _GROUP_CACHE[key] = (intra, inter)
    return pair


class HostGroups:
    """The intra-host and inter-host subgroups of one rank and the chunk order of the two-level
    collectives (see the module docstring). Subgroup positions follow global ranks."""

    def __init__(self, group, hosts: HostMap, rank: int) -> None:
        n = len(hosts.host_of)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))

        def by_global(members):
            return sorted(members, key=lambda r: ranks[r])

        self.hosts, self.rank = hosts, rank
        self.intra_ranks = by_global(hosts.members(hosts.host_of[rank]))  # group ranks
        self.inter_ranks = by_global(hosts.peers(rank))
        self.intra, self.inter = _subgroups(
            (tuple(ranks), hosts.host_of),
            sorted(ranks[r] for r in self.intra_ranks),
            sorted(ranks[r] for r in self.inter_ranks),
        )
        self.H, self.L = hosts.hosts, len(self.intra_ranks)
        # Chunk order of the reduce-scatter's first send buffer, and of the all-gather's last
        # receive buffer: block p of H chunks is for (from) intra peer p, in p's inter order.
        self.order = [j for q in self.intra_ranks for j in by_global(hosts.peers(q))]

    def index(self, device) -> torch.Tensor:
        return torch.tensor(self.order, dtype=torch.long, device=device)


def sum_blocks(received: torch.Tensor, blocks: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Sum of the ``blocks`` equal blocks of ``received`` in block order (float32 accumulation
    for 16-bit dtypes), in ``out_dtype``."""
    chunks = received.view(blocks, -1)
    low = received.dtype in (torch.float16, torch.bfloat16)
    acc = chunks[0].float() if low else chunks[0].clone()
    for b in range(1, blocks):
        acc.add_(chunks[b])
    return acc if acc.dtype == out_dtype else acc.to(out_dtype)


class _TwoPhase:
    """Async handle of a two-level collective: phase 1 in flight, phase 2 launched by
    :meth:`TwoLevel.drive` (in call order on every rank), the result written at :meth:`wait`."""

    def __init__(self, owner: TwoLevel, first, what: str, second, phase2_on: str):
        self.owner, self.first, self.what, self.second = owner, first, what, second
        self.phase2_on = phase2_on
        self.second_work = self.finish = None
        self.done = False

    def launch_second(self) -> None:
        self.owner.comm_on(self.phase2_on, other=True).wait(self.first, self.what)
        self.second_work, self.finish = self.second()
        self.second = None

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.owner.drive(until=self)
            self.owner.comm_on(self.phase2_on).wait(self.second_work, self.what)
            self.finish()
            self.done, self.finish = True, None
        return True

    def is_completed(self) -> bool:
        return self.done


class TwoLevel:
    """Two-level reduce-scatter and all-gather over ``intra`` and ``inter``
    :class:`~.comm.Communicator` s (module docstring). Phase 2 of a collective starts when its
    phase 1 is seen complete at the next call, or at its ``wait``; on each subgroup every rank
    issues the same collectives in the same order."""

    def __init__(self, groups: HostGroups, intra: Communicator, inter: Communicator) -> None:
        self.groups, self.intra, self.inter = groups, intra, inter
        self.H, self.L = groups.H, groups.L
        self.N = self.H * self.L
        self._index: dict[torch.device, torch.Tensor] = {}
        self._pending: list[_TwoPhase] = []

    def comm_on(self, which: str, other: bool = False) -> Communicator:
        intra = (which == "intra") != other
        return self.intra if intra else self.inter

    def index(self, device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._index:
            self._index[device] = self.groups.index(device)
        return self._index[device]

    def drive(self, until: _TwoPhase | None = None, blocking_on: str | None = None) -> None:
        """Launch phase 2 of pending collectives in call order: every one up to ``until``, and
        up to the last one whose phase 2 runs on ``blocking_on``, waiting for their phase 1;
        then those whose phase 1 has completed, stopping at the first that has not."""
        last = -1
        for k, item in enumerate(self._pending):
            if item is until or item.phase2_on == blocking_on:
                last = k
        k = 0
        while k < len(self._pending):
            item = self._pending[k]
            if k > last and not item.first.is_completed():
                break
            item.launch_second()
            k += 1
        del self._pending[:k]

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, tag: str, async_op):
        """``output`` (S/N) <- this rank's chunk of the sum over ranks of ``input`` (S)."""
        self.drive(blocking_on="intra")  # earlier all-gathers' intra phases go first
        H, L, c = self.H, self.L, output.numel()
        send = input.reshape(self.N, c).index_select(0, self.index(input.device))  # (L·H, c)
        recv = torch.empty_like(send)
        first = self.intra.all_to_all_single(
            recv, send, tag=tag, count_as="reduce_scatter", async_op=True
        )

        def second():
            partial = sum_blocks(recv, L, input.dtype)  # (H·c,) host sums, inter order
            got = torch.empty_like(partial)
            work = self.inter.all_to_all_single(
                got, partial, tag=tag, count_as="reduce_scatter", async_op=True
            )
            return work, lambda: output.copy_(sum_blocks(got, H, output.dtype).view(output.shape))

        return self._start(first, "gradient reduce-scatter", second, "inter", async_op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, *, tag: str, async_op):
        """``output`` (N·S) <- the concatenation over ranks of ``input`` (S)."""
        self.drive(blocking_on="inter")  # earlier reduce-scatters' inter phases go first
        c = input.numel()
        mid = torch.empty(self.H * c, dtype=input.dtype, device=input.device)
        first = self.inter.all_gather(mid, input.reshape(-1), tag=tag, async_op=True)

        def second():
            full = torch.empty(self.N * c, dtype=input.dtype, device=input.device)
            work = self.intra.all_gather(full, mid, tag=tag, async_op=True)
            index = self.index(input.device)
            return work, lambda: output.view(self.N, c).index_copy_(0, index, full.view(-1, c))

        return self._start(first, "parameter all-gather", second, "intra", async_op)

    def _start(self, first, what: str, second, phase2_on: str, async_op: bool):
        item = _TwoPhase(self, first, what, second, phase2_on)
        self._pending.append(item)
        if async_op:
            return item
        item.wait()
        return None

    # ---- with padding: only each chunk's first lengths[j] elements travel ----------------
    def reduce_scatter_uneven(self, output, input, lengths, *, tag: str, async_op):
        """As :meth:`reduce_scatter`, sending only the first ``lengths[j]`` elements of chunk
        ``j`` and writing only the first ``lengths[rank]`` of ``output``."""
        self.drive(blocking_on="intra")
        H, L, c, order = self.H, self.L, output.numel(), self.groups.order
        chunks = input.reshape(self.N, c)
        send = torch.cat([chunks[j, : lengths[j]] for j in order])  # by intra peer, inter order
        per_peer = [sum(lengths[j] for j in order[q * H : (q + 1) * H]) for q in range(L)]
        mine = self.groups.intra_ranks.index(self.groups.rank)
        recv = torch.empty(L * per_peer[mine], dtype=input.dtype, device=input.device)
        first = self.intra.all_to_all_single(
            recv,
            send,
            [per_peer[mine]] * L,
            per_peer,
            tag=tag,
            count_as="reduce_scatter",
            async_op=True,
        )
        inter_lengths = [lengths[j] for j in order[mine * H : (mine + 1) * H]]
        own = lengths[self.groups.rank]

        def second():
            partial = sum_blocks(recv, L, input.dtype)  # host sums of my inter peers' chunks
            got = torch.empty(H * own, dtype=input.dtype, device=input.device)
            work = self.inter.all_to_all_single(
                got,
                partial,
                [own] * H,
                inter_lengths,
                tag=tag,
                count_as="reduce_scatter",
                async_op=True,
            )
            target = output.view(-1)[:own]
            return work, lambda: target.copy_(sum_blocks(got, H, output.dtype))

        return self._start(first, "gradient reduce-scatter", second, "inter", async_op)

    def all_gather_uneven(self, output, input, lengths, *, tag: str, async_op):
        """As :meth:`all_gather`, sending only each rank's first ``lengths[rank]`` elements
        and writing only the first ``lengths[j]`` of each chunk of ``output``."""
        self.drive(blocking_on="inter")
        H, L, c, order = self.H, self.L, input.numel(), self.groups.order
        own = lengths[self.groups.rank]
        mine = self.groups.intra_ranks.index(self.groups.rank)
        inter_lengths = [lengths[j] for j in order[mine * H : (mine + 1) * H]]
        mid = torch.empty(sum(inter_lengths), dtype=input.dtype, device=input.device)
        send = input.reshape(-1)[:own].repeat(H)
        first = self.inter.all_to_all_single(
            mid, send, inter_lengths, [own] * H, tag=tag, count_as="all_gather", async_op=True
        )
        per_peer = [sum(lengths[j] for j in order[q * H : (q + 1) * H]) for q in range(L)]

        def second():
            full = torch.empty(sum(per_peer), dtype=input.dtype, device=input.device)
            work = self.intra.all_to_all_single(
                full,
                mid.repeat(L),
                per_peer,
                [mid.numel()] * L,
                tag=tag,
                count_as="all_gather",
                async_op=True,
            )

            def finish():
                rows, start = output.view(self.N, c), 0
                for j in order:  # ``full`` holds the chunks in send order
                    rows[j, : lengths[j]].copy_(full[start : start + lengths[j]])
                    start += lengths[j]

            return work, finish

        return self._start(first, "parameter all-gather", second, "intra", async_op)
