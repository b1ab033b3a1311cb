"""Whole-matrix work on sharded matrices: shards → owners (all-to-all) → work → shards.

The generic, framework-agnostic primitive behind DTensor (FSDP2 / tensor parallel) and
Megatron support. Each matrix lives across the ranks of one process group as *pieces*: rank r
holds ``full[rows_r][:, cols_r]`` for index sets ``rows_r``, ``cols_r`` (a dim-0 or dim-1 shard,
possibly uneven or empty, a 2-D block on an FSDP × TP mesh, a strided FSDP2+TP shard, or a
replica). Newton–Schulz needs the whole matrix, so::

    rank 0   [A0 B0 C0]   ──┐                      ┌─▶ [A0' B0' C0']
    rank 1   [A1 B1 C1]   ──┼─ all_to_all_single ─▶ owner(A): A = [A0; A1; A2] ─ fn ─▶ A'  ─┼─▶ ...
    rank 2   [A2 B2 C2]   ──┘   (split sizes)      owner(B): B …           second all_to_all
                                                   owner(C): C …

1. every matrix gets one owner rank (FLOP-balanced, deterministic: the same on every rank);
2. ONE batched ``all_to_all_single`` with split sizes sends each piece to its matrix's owner;
3. the owner assembles whole matrices and runs ``fn`` on plain local tensors;
4. a second ``all_to_all_single`` sends every rank its piece of each result.

Split sizes follow from the layouts alone, so no metadata is exchanged at step time.

Cost (ring model, S = bytes of all matrices, N ranks, evenly sharded): each rank sends the
(N−1)/N of its S/N that others own and receives as much back, so per rank per call
``2 · (N−1)/N · S/N`` bytes, and each rank runs Newton–Schulz on ≈ S/N of the matrices.
"Duplicated" mode — all-gather every full matrix on every rank and let every rank run
Newton–Schulz on all of them — costs ``(N−1)/N · S`` bytes per rank and N× the FLOPs:
the all-to-all moves 2/N of that (equal at N = 2, half at N = 4, an eighth at N = 16).
:func:`duplicated_wire_bytes` gives the duplicated figure by the same cost model.

A matrix that every rank holds whole (``Replicate`` on every mesh axis) is computed by every
rank locally: zero bytes, duplicated FLOPs (sending results from one owner would cost
(N−1)·S instead).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .comm import Communicator, WireCounter, tensor_bytes
from .hosts import HostMap
from .ownership import assign_owners

__all__ = [
    "MatrixLayout",
    "ShardedMatrices",
    "all_to_all_wire_bytes",
    "chunk_bounds",
    "default_owners",
    "duplicated_wire_bytes",
]

Index = torch.Tensor | slice
"""Indices of one tensor dim held by a rank: a ``slice`` when contiguous, else a LongTensor."""

WholeMatrixFn = Callable[[list[int], list[torch.Tensor]], list[torch.Tensor]]
"""``fn(indices, matrices) -> results``: indices into the layout list, whole (m, n) matrices
this rank owns, and results of the same shapes (batch same-shape matrices inside ``fn``).
``fn`` must not modify its inputs in place (for whole-everywhere matrices they are the
caller's own tensors)."""


def chunk_bounds(size: int, chunks: int, index: int) -> tuple[int, int]:
    """(start, length) of chunk ``index`` of ``size`` elements split like ``torch.chunk``
    (ceil-sized chunks, trailing ones short or empty), as DTensor ``Shard`` and FSDP2 do."""
    step = -(-size // chunks) if size else 0
    start = min(step * index, size)
    return start, min(step, size - start)


def _as_index(idx: torch.Tensor) -> Index:
    if idx.numel() == 0:
        return slice(0, 0)
    start = int(idx[0])
    if torch.equal(idx, torch.arange(start, start + idx.numel())):
        return slice(start, start + idx.numel())
    return idx


def _index_len(idx: Index) -> int:
    return idx.stop - idx.start if isinstance(idx, slice) else int(idx.numel())


def _index_key(idx: Index) -> tuple:
    return ("s", idx.start, idx.stop) if isinstance(idx, slice) else ("t", *idx.tolist())


@dataclass(frozen=True)
class MatrixLayout:
    """Where the pieces of one (m, n) matrix live: ``pieces[r] = (rows, cols)`` is what group
    rank r holds, ``full[rows][:, cols]`` in that order. Pieces are disjoint or identical
    (replicas); together they cover the matrix."""

    shape: tuple[int, int]
    pieces: tuple[tuple[Index, Index], ...]

    @staticmethod
    def from_indices(
        shape: Sequence[int], pieces: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> MatrixLayout:
        """From per-rank (row indices, column indices); checks the pieces tile the matrix."""
        m, n = (int(s) for s in shape)
        normal = tuple(
            (_as_index(torch.as_tensor(r).long()), _as_index(torch.as_tensor(c).long()))
            for r, c in pieces
        )
        layout = MatrixLayout((m, n), normal)
        distinct = {}
        for rows, cols in normal:
            distinct[(_index_key(rows), _index_key(cols))] = _index_len(rows) * _index_len(cols)
        if sum(distinct.values()) != m * n:
            raise ValueError(
                f"pieces of a ({m}, {n}) matrix must be disjoint or identical and cover it; "
                f"distinct pieces hold {sum(distinct.values())} elements"
            )
        return layout

    @staticmethod
    def sharded(shape: Sequence[int], shard_dim: int, shard_sizes: Sequence[int]) -> MatrixLayout:
        """Contiguous shards along ``shard_dim`` (0 = rows, 1 = columns) in rank order; sizes
        may be uneven or zero (Megatron, FSDP2: see :func:`chunk_bounds`)."""
        if shard_dim not in (0, 1):
            raise ValueError(f"shard_dim must be 0 or 1, got {shard_dim}")
        m, n = (int(s) for s in shape)
        if sum(shard_sizes) != (m, n)[shard_dim]:
            raise ValueError(
                f"shard sizes {list(shard_sizes)} do not add up to dim {shard_dim} of ({m}, {n})"
            )
        pieces, start = [], 0
        for size in shard_sizes:
            part = slice(start, start + int(size))
            pieces.append((part, slice(0, n)) if shard_dim == 0 else (slice(0, m), part))
            start += int(size)
        return MatrixLayout((m, n), tuple(pieces))

    @staticmethod
    def replicated(shape: Sequence[int], group_size: int) -> MatrixLayout:
        m, n = (int(s) for s in shape)
        return MatrixLayout((m, n), ((slice(0, m), slice(0, n)),) * group_size)

    def piece_shape(self, rank: int) -> tuple[int, int]:
        rows, cols = self.pieces[rank]
        return _index_len(rows), _index_len(cols)

    @property
    def whole_everywhere(self) -> bool:
        return all(self.piece_shape(r) == self.shape for r in range(len(self.pieces)))


def _read(full: torch.Tensor, rows: Index, cols: Index) -> torch.Tensor:
    out = full[rows] if isinstance(rows, slice) else full.index_select(0, rows.to(full.device))
    return out[:, cols] if isinstance(cols, slice) else out.index_select(1, cols.to(full.device))


def _write(full: torch.Tensor, rows: Index, cols: Index, piece: torch.Tensor) -> None:
    if isinstance(rows, slice) and isinstance(cols, slice):
        full[rows, cols] = piece
        return
    r = torch.arange(rows.start, rows.stop) if isinstance(rows, slice) else rows
    c = torch.arange(cols.start, cols.stop) if isinstance(cols, slice) else cols
    full[r.to(full.device).unsqueeze(1), c.to(full.device)] = piece


def default_owners(
    layouts: Sequence[MatrixLayout],
    world_size: int,
    *,
    ns_steps: int = 5,
    matrix_shapes: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> list[int]:
    """FLOP-balanced deterministic owners (``ownership.assign_owners``) of the matrices that
    need one; whole-everywhere matrices are computed by every rank (owner entry 0, unused).
    ``matrix_shapes[i]``: the matrices Newton–Schulz really sees for layout i (QKV blocks), for
    the cost; default: the layout's full shape."""
    todo = [i for i, lay in enumerate(layouts) if not lay.whole_everywhere]
    costs = [
        list(matrix_shapes[i]) if matrix_shapes is not None else [layouts[i].shape] for i in todo
    ]
    picked = assign_owners(costs, world_size, ns_steps=ns_steps)
    owners = [0] * len(layouts)
    for i, owner in zip(todo, picked):
        owners[i] = int(owner)
    return owners


def _all_to_all(
    comm: Communicator,
    counter: WireCounter,
    tag: str,
    output: torch.Tensor,
    input: torch.Tensor,
    output_split_sizes: list[int],
    input_split_sizes: list[int],
) -> None:
    """``all_to_all_single`` with split sizes through comm.py, counting the bytes this rank
    actually sends. Our inputs carry no chunk for the rank itself (kept local), so comm's
    (N−1)/N · input model would under-count; ``comm`` records into a scratch counter (whose
    split by link class is kept) and the exact figure goes to ``counter``."""
    comm.counter.reset()
    comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes, tag=tag)
    inter = min(tensor_bytes(input), comm.counter.by_link()["inter_host"])
    counter.add("all_to_all", inter, tag, "inter_host")
    counter.add("all_to_all", tensor_bytes(input) - inter, tag, "intra_host", calls=0)


class ShardedMatrices:
    """A fixed list of sharded matrices and their owners; :meth:`apply` runs ``fn`` on whole
    matrices at their owners and returns each rank's pieces of the results.

    Build once (the send/receive plan is precomputed from the layouts) and call every step.
    ``layouts[i].pieces`` is indexed by rank in ``group``; every rank passes the same layouts
    and owners (``owners=None``: :func:`default_owners`).
    """

    def __init__(
        self,
        layouts: Sequence[MatrixLayout],
        *,
        group: dist.ProcessGroup | None = None,
        owners: Sequence[int] | None = None,
        counter: WireCounter | None = None,
        tag: str = "muon",
        hosts: HostMap | None = None,
    ) -> None:
        # scratch counter: see _all_to_all; ``hosts`` classifies the bytes by link
        self.comm = Communicator(
            group, counter=WireCounter(), hosts=hosts, reduce_scatter_impl="all_to_all"
        )
        self.counter = counter if counter is not None else WireCounter()
        self.tag = tag
        self._setup(layouts, owners, self.comm.rank, self.comm.world_size)

    @classmethod
    def plan_only(
        cls,
        layouts: Sequence[MatrixLayout],
        owners: Sequence[int] | None,
        rank: int,
        world_size: int,
    ) -> ShardedMatrices:
        """The plan rank ``rank`` of ``world_size`` would use, without a process group (for the
        cost model: :meth:`wire_elements`); :meth:`apply` is not available on it."""
        plan = cls.__new__(cls)
        plan.comm, plan.counter, plan.tag = None, WireCounter(), "muon"
        plan._setup(layouts, owners, rank, world_size)
        return plan

    def _setup(self, layouts, owners, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.layouts = list(layouts)
        for i, lay in enumerate(self.layouts):
            if len(lay.pieces) != self.world_size:
                raise ValueError(
                    f"layout {i} has {len(lay.pieces)} pieces "
                    f"for a group of {self.world_size} ranks"
                )
        self.owners = (
            list(owners) if owners is not None else default_owners(self.layouts, self.world_size)
        )
        if len(self.owners) != len(self.layouts) or not all(
            0 <= o < self.world_size for o in self.owners
        ):
            raise ValueError(
                f"need one owner rank in [0, {self.world_size}) per matrix, got {self.owners}"
            )
        self._plan()

    def _sources(self, i: int) -> list[int]:
        """Per rank r: the rank that sends r's piece of matrix i to its owner — the owner itself
        when it holds an identical piece (a replica), else the lowest rank holding it."""
        lay, owner = self.layouts[i], self.owners[i]
        keys = [tuple(_index_key(x) for x in piece) for piece in lay.pieces]
        first: dict[tuple, int] = {}
        for r, key in enumerate(keys):
            first.setdefault(key, r)
        first[keys[owner]] = owner
        return [first[key] for key in keys]

    def _plan(self) -> None:
        me, n_ranks = self.rank, self.world_size
        self.local = [i for i, lay in enumerate(self.layouts) if lay.whole_everywhere]
        self.owned = [i for i, o in enumerate(self.owners) if o == me and i not in set(self.local)]
        # send[d]: matrices whose piece I ship to owner d; recv[s]: (matrix, piece rank) from s
        self.send: list[list[int]] = [[] for _ in range(n_ranks)]
        self.recv: list[list[tuple[int, int]]] = [[] for _ in range(n_ranks)]
        self.self_pieces: dict[int, list[int]] = {}  # owned matrix -> piece ranks I hold myself
        for i, lay in enumerate(self.layouts):
            if lay.whole_everywhere:
                continue
            owner, seen, sources = self.owners[i], set(), self._sources(i)
            for r in range(n_ranks):
                src = sources[r]
                if src in seen or lay.piece_shape(r)[0] * lay.piece_shape(r)[1] == 0:
                    continue
                seen.add(src)
                if src == me and owner != me:
                    self.send[owner].append(i)
                if owner == me:
                    if src == me:
                        self.self_pieces.setdefault(i, []).append(src)
                    else:
                        self.recv[src].append((i, src))
        # results: owner o sends every other rank r its piece (empty pieces skipped)
        self.result_send: list[list[int]] = [[] for _ in range(n_ranks)]
        self.result_recv: list[list[int]] = [[] for _ in range(n_ranks)]
        for i, lay in enumerate(self.layouts):
            if lay.whole_everywhere:
                continue
            owner = self.owners[i]
            for r in range(n_ranks):
                if r == owner or lay.piece_shape(r)[0] * lay.piece_shape(r)[1] == 0:
                    continue
                if owner == me:
                    self.result_send[r].append(i)
                if r == me:
                    self.result_recv[owner].append(i)

    def _numel(self, i: int, rank: int) -> int:
        m, n = self.layouts[i].piece_shape(rank)
        return m * n

    def wire_elements(self) -> tuple[int, int]:
        """Elements this rank sends in (to owners, back to shards) per :meth:`apply`."""
        to_owners = sum(
            self._numel(i, self.rank) for d in range(self.world_size) for i in self.send[d]
        )
        back = sum(self._numel(i, r) for r in range(self.world_size) for i in self.result_send[r])
        return to_owners, back

    def piece_buffer(
        self, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One flat buffer for this rank's pieces, laid out as :meth:`apply` sends them (the
        pieces for owner 0, 1, … first, then those that stay here), and the pieces as views
        into it. Pieces written there and passed with ``packed=`` the buffer are sent from it
        as they are: :meth:`apply` skips packing them into a send buffer."""
        me = self.rank
        sent = [i for d in range(self.world_size) for i in self.send[d]]
        order = sent + sorted(set(range(len(self.layouts))) - set(sent))
        numels = [self._numel(i, me) for i in order]
        buffer = torch.empty(sum(numels), dtype=dtype, device=device)
        pieces: list[torch.Tensor | None] = [None] * len(self.layouts)
        for i, flat in zip(order, buffer.split(numels)):
            pieces[i] = flat.view(self.layouts[i].piece_shape(me))
        return buffer, pieces  # type: ignore[return-value]

    def apply(
        self,
        pieces: Sequence[torch.Tensor],
        fn: WholeMatrixFn,
        *,
        result_dtype: torch.dtype | None = None,
        packed: torch.Tensor | None = None,
    ) -> list[torch.Tensor]:
        """``pieces[i]``: this rank's piece of matrix i (shape ``layouts[i].piece_shape(rank)``,
        one dtype for all). Returns this rank's pieces of ``fn``'s results (new tensors, or for
        whole-everywhere matrices ``fn``'s own output), in ``result_dtype`` (default: the
        pieces' dtype; every rank must pass the same, as it sizes the receive buffer).
        ``packed``: the buffer of :meth:`piece_buffer` that ``pieces`` are views into."""
        if self.comm is None:
            raise RuntimeError("a plan_only() plan cannot apply(); build ShardedMatrices(...)")
        me, n_ranks = self.rank, self.world_size
        if len(pieces) != len(self.layouts):
            raise ValueError(f"expected {len(self.layouts)} pieces, got {len(pieces)}")
        for i, p in enumerate(pieces):
            if tuple(p.shape) != self.layouts[i].piece_shape(me):
                raise ValueError(
                    f"piece {i} has shape {tuple(p.shape)}, "
                    f"layout says {self.layouts[i].piece_shape(me)}"
                )
        dtypes = {p.dtype for p in pieces}
        if len(dtypes) > 1:
            raise ValueError(f"all pieces must share one dtype, got {sorted(map(str, dtypes))}")
        ref = pieces[0] if pieces else torch.empty(0)

        # phase 1: pieces → owners (one all-to-all)
        send_sizes = [sum(self._numel(i, me) for i in self.send[d]) for d in range(n_ranks)]
        recv_sizes = [sum(self._numel(i, r) for i, r in self.recv[s]) for s in range(n_ranks)]
        if packed is not None:
            send_buf = packed[: sum(send_sizes)]
            offset = 0
            for i in (i for d in range(n_ranks) for i in self.send[d]):
                if pieces[i].data_ptr() != send_buf[offset:].data_ptr():
                    raise ValueError(f"piece {i} is not where piece_buffer() put it in packed=")
                offset += self._numel(i, me)
        else:
            send_buf = torch.cat(
                [pieces[i].reshape(-1) for d in range(n_ranks) for i in self.send[d]]
                + [ref.new_empty(0)]
            )
        recv_buf = ref.new_empty(sum(recv_sizes))
        if n_ranks > 1 and self._any_traffic:
            _all_to_all(
                self.comm, self.counter, self.tag, recv_buf, send_buf, recv_sizes, send_sizes
            )

        # phase 2: assemble whole matrices at the owner, run fn
        whole: dict[int, torch.Tensor] = {i: pieces[i] for i in self.local}
        for i in self.owned:
            whole[i] = ref.new_empty(self.layouts[i].shape)
            for r in self.self_pieces.get(i, []):
                _write(whole[i], *self.layouts[i].pieces[r], pieces[i])
        offset = 0
        for s in range(n_ranks):
            for i, r in self.recv[s]:
                rows, cols = self.layouts[i].pieces[r]
                numel = self._numel(i, r)
                _write(
                    whole[i],
                    rows,
                    cols,
                    recv_buf[offset : offset + numel].view(self.layouts[i].piece_shape(r)),
                )
                offset += numel
        order = sorted(whole)
        out_dtype = result_dtype or ref.dtype
        results = dict(zip(order, fn(order, [whole[i] for i in order]))) if order else {}
        for i in order:
            if results[i].shape != whole[i].shape:
                raise ValueError(
                    f"fn returned shape {tuple(results[i].shape)} "
                    f"for matrix {i} of {tuple(whole[i].shape)}"
                )
            results[i] = results[i].to(out_dtype)

        # phase 3: results → shards (second all-to-all)
        out: list[torch.Tensor | None] = [None] * len(self.layouts)
        for i in self.local:
            out[i] = results[i]
        for i in self.owned:
            out[i] = _read(results[i], *self.layouts[i].pieces[me]).contiguous()
        back_send = [sum(self._numel(i, r) for i in self.result_send[r]) for r in range(n_ranks)]
        back_recv = [sum(self._numel(i, me) for i in self.result_recv[o]) for o in range(n_ranks)]
        chunks = [
            _read(results[i], *self.layouts[i].pieces[r]).reshape(-1)
            for r in range(n_ranks)
            for i in self.result_send[r]
        ]
        back_buf = torch.cat(chunks + [ref.new_empty(0, dtype=out_dtype)])
        got = ref.new_empty(sum(back_recv), dtype=out_dtype)
        if n_ranks > 1 and self._any_traffic:
            _all_to_all(self.comm, self.counter, self.tag, got, back_buf, back_recv, back_send)
        offset = 0
        for o in range(n_ranks):
            for i in self.result_recv[o]:
                numel = self._numel(i, me)
                out[i] = got[offset : offset + numel].view(self.layouts[i].piece_shape(me))
                offset += numel
        for i, lay in enumerate(self.layouts):  # empty pieces
            if out[i] is None:
                out[i] = ref.new_empty(lay.piece_shape(me), dtype=out_dtype)
        return out  # type: ignore[return-value]

    @property
    def _any_traffic(self) -> bool:
        """Whether any rank sends anything (the same on every rank, so all call or none do)."""
        return any(not lay.whole_everywhere for lay in self.layouts)


def all_to_all_wire_bytes(
    layouts: Sequence[MatrixLayout],
    owners: Sequence[int] | None,
    element_size: int,
    world_size: int,
) -> list[int]:
    """Bytes each rank sends per :meth:`ShardedMatrices.apply` (both all-to-alls), exact."""
    out = []
    for rank in range(world_size):
        to_owners, back = ShardedMatrices.plan_only(
            layouts, owners, rank, world_size
        ).wire_elements()
        out.append((to_owners + back) * element_size)
    return out


def duplicated_wire_bytes(
    layouts: Sequence[MatrixLayout], element_size: int, world_size: int
) -> int:
    """Bytes per rank, ring model, of "duplicated" mode: all-gather every sharded matrix to every
    rank, (N−1)/N · S (S = bytes of the matrices; whole-everywhere matrices cost nothing)."""
    total = sum(lay.shape[0] * lay.shape[1] for lay in layouts if not lay.whole_everywhere)
    return (world_size - 1) * total * element_size // world_size
