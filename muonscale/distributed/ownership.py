"""Which rank orthogonalizes which Muon parameter.

Every Muon matrix is owned **whole** by one rank: the owner receives its reduced gradient,
keeps its momentum, runs Newton–Schulz on it and sends the updated values back. Because no
matrix is ever split, the update is the same function as on one process. A parameter is owned
whole, except an expert stack (:func:`assign_expert_ranges`): its experts are independent
matrices, so each expert is a unit of the assignment, and each owner receives a contiguous
range of the stack's experts.

Assignment (deterministic: depends only on the list of matrix shapes, the optional sizes and
the world size, so every rank computes the same table without communicating):

* cost of a parameter = Σ over its matrices of ``newton_schulz_flops(m, n, steps)``
  = steps · (4m²n + 2m³) with m ≤ n (the NS FLOPs; ``steps`` only scales all costs alike);
* **FLOPs first** — greedy longest-processing-time (LPT): parameters in decreasing cost, ties
  by parameter index, each to the rank with the least cost so far, ties by the lowest rank.
  LPT is within 4/3 − 1/(3N) of the optimal makespan (Graham, "Bounds on multiprocessing
  timing anomalies", SIAM J. Appl. Math. 17(2), 1969).
* **then bytes** (only when ``sizes`` is given: the bytes each parameter puts in its owner's
  stream) — local search by moves and pairwise swaps, the classic improvement step for
  makespan scheduling (e.g. Finn & Horowitz, "A linear time approximation algorithm for
  multiprocessor scheduling", BIT 19, 1979): while the rank h with the most bytes can hand a
  parameter to another rank r, or swap one of its parameters for a smaller one of r, so that
  both h and r end **below** h's current bytes and **no rank's FLOPs exceed the LPT makespan**,
  apply the best such change (lowest resulting max(bytes_h, bytes_r); ties by the lowest
  parameter index, then rank). Each change strictly lowers Σ_r bytes_r², so the search ends.

Guarantees: the FLOP makespan is at most LPT's (Graham's bound holds); the byte makespan is at
most LPT's; at the end no single move or swap from the most-loaded rank lowers its bytes under
that FLOP cap. Why bytes matter: :class:`~muonscale.distributed.DistributedMuon` sends every
owner stream at the length of the longest one (see :mod:`.buckets`); what the owners leave
uneven is filled with AdamW elements, or else padded, so a smaller byte imbalance needs less
fill (and, without fill, less padding). Cost: parameters of equal (size, cost) are tried once
per rank, so a pass is cheap for transformer-like parameter lists.
Ranks may own nothing when there are fewer Muon parameters than ranks.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ..flops import newton_schulz_flops

Shape = tuple[int, int]


def _matrix_list(entry) -> list[Shape]:
    """An entry is one (m, n) matrix shape or a sequence of them (one parameter's matrices)."""
    if len(entry) == 2 and all(isinstance(x, int) for x in entry):
        return [(int(entry[0]), int(entry[1]))]
    return [(int(m), int(n)) for m, n in entry]


def parameter_cost(entry, ns_steps: int = 5) -> int:
    """NS FLOPs of one parameter (sum over its matrices)."""
    total = 0
    for m, n in _matrix_list(entry):
        short, long = min(m, n), max(m, n)
        total += newton_schulz_flops(short, long, ns_steps)
    return total


def parameter_elements(entry) -> int:
    """Elements of one parameter (sum over its matrices)."""
    return sum(m * n for m, n in _matrix_list(entry))


def assign_owners(
    shapes: Sequence,
    world_size: int,
    *,
    ns_steps: int = 5,
    sizes: Sequence[int] | None = None,
) -> list[int]:
    """Owner rank of each parameter; ``shapes[i]`` is ``(m, n)`` or a list of ``(m, n)``.

    ``sizes[i]``: what parameter i weighs in its owner's stream (bytes or elements); when
    given, bytes are balanced under the LPT FLOP makespan (module docstring). None: FLOPs only.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = [parameter_cost(entry, ns_steps) for entry in shapes]
    if sizes is not None and len(sizes) != len(costs):
        raise ValueError(f"sizes has {len(sizes)} entries, shapes {len(costs)}")
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    if sizes is not None and world_size > 1:
        _balance_sizes(owners, costs, [int(s) for s in sizes], world_size)
    return owners


def assign_expert_ranges(
    shapes: Sequence,
    experts: Sequence[int],
    world_size: int,
    *,
    ns_steps: int = 5,
    sizes: Sequence[int] | None = None,
) -> list[list[tuple[int, int, int]]]:
    """Owners of each parameter's experts: parameter i is ``experts[i]`` experts of equal
    matrices (1: a parameter owned whole), ``shapes[i]`` the matrices of all of them in expert
    order, ``sizes[i]`` its weight in the owners' streams (split evenly over its experts).

    Every expert is one unit of :func:`assign_owners` (FLOPs first, then bytes); the experts
    of one parameter are interchangeable (same cost and size), so only how many each rank
    received counts, and they are laid out in rank order: rank r's experts of a parameter are
    one contiguous range. Returns per parameter its ``(rank, first, stop)`` ranges, in expert
    order. Parameters of one expert are assigned exactly as :func:`assign_owners` assigns
    them (the same units in the same order)."""
    if len(experts) != len(shapes):
        raise ValueError(f"experts has {len(experts)} entries, shapes {len(shapes)}")
    if sizes is not None and len(sizes) != len(shapes):
        raise ValueError(f"sizes has {len(sizes)} entries, shapes {len(shapes)}")
    units, unit_sizes, first_unit = [], [], []
    for i, (entry, count) in enumerate(zip(shapes, experts, strict=True)):
        mats = _matrix_list(entry)
        if count < 1 or len(mats) % count:
            raise ValueError(
                f"parameter {i}: {len(mats)} matrices do not split into {count} experts"
            )
        per = len(mats) // count
        first_unit.append(len(units))
        units += [mats[e * per : (e + 1) * per] for e in range(count)]
        if sizes is not None:
            unit_sizes += [int(sizes[i]) // count] * count
    owners = assign_owners(
        units, world_size, ns_steps=ns_steps, sizes=unit_sizes if sizes is not None else None
    )
    out = []
    for start, count in zip(first_unit, experts, strict=True):
        counts = [0] * world_size
        for rank in owners[start : start + count]:
            counts[rank] += 1
        ranges, first = [], 0
        for rank, n in enumerate(counts):
            if n:
                ranges.append((rank, first, first + n))
                first += n
        out.append(ranges)
    return out


def _balance_sizes(owners: list[int], costs: list[int], sizes: list[int], world_size: int) -> None:
    """Moves and swaps that lower the largest rank's ``sizes`` total, each rank's cost staying
    at most the current cost makespan (in place; see the module docstring)."""
    state = _Loads(owners, costs, sizes, world_size)
    cap = max(state.flops)
    for _ in range(4 * len(costs) + 1):  # Σ weight² strictly falls: a bound for safety only
        weight, flops = state.weight, state.flops
        h = max(range(world_size), key=lambda r: (weight[r], -r))
        best = None  # (resulting pair max, parameter, rank, swapped parameter or -1)
        for s_p, c_p in state.keys[h]:
            p = state.members[h][s_p, c_p][0]
            for r in range(world_size):
                if r == h:
                    continue
                # a swap takes back q with W_r + s_p − W_h < s_q < s_p (both ranks end below
                # W_h); a move takes nothing back and needs W_r + s_p < W_h
                keys = state.keys[r]
                lo = bisect.bisect_right(keys, (weight[r] + s_p - weight[h], float("inf")))
                hi = bisect.bisect_left(keys, (s_p, -1))
                candidates = [(s, c, state.members[r][s, c][0]) for s, c in keys[lo:hi]]
                if 0 < s_p and weight[r] + s_p < weight[h]:
                    candidates.append((0, 0, -1))
                for s_q, c_q, q in candidates:
                    if flops[r] + c_p - c_q > cap or flops[h] - c_p + c_q > cap:
                        continue
                    new_h, new_r = weight[h] - s_p + s_q, weight[r] + s_p - s_q
                    key = (max(new_h, new_r), p, r, q)
                    if best is None or key < best:
                        best = key
        if best is None:
            return
        _, p, r, q = best
        state.transfer(p, h, r)
        if q >= 0:
            state.transfer(q, r, h)


class _Loads:
    """Per-rank cost and size totals, and each rank's parameters grouped by (size, cost):
    parameters of one class are interchangeable, so only the lowest index of each is tried."""

    def __init__(self, owners: list[int], costs: list[int], sizes: list[int], world_size: int):
        self.owners, self.costs, self.sizes = owners, costs, sizes
        self.flops = rank_totals(costs, owners, world_size)
        self.weight = rank_totals(sizes, owners, world_size)
        self.members: list[dict[tuple[int, int], list[int]]] = [{} for _ in range(world_size)]
        for i in range(len(costs)):  # ascending index: every list starts sorted
            self.members[owners[i]].setdefault((sizes[i], costs[i]), []).append(i)
        self.keys = [sorted(m) for m in self.members]  # per rank, by size then cost

    def transfer(self, i: int, src: int, dst: int) -> None:
        cls = (self.sizes[i], self.costs[i])
        self.members[src][cls].remove(i)
        if not self.members[src][cls]:
            del self.members[src][cls]
            self.keys[src].remove(cls)
        if cls not in self.members[dst]:
            self.members[dst][cls] = []
            bisect.insort(self.keys[dst], cls)
        bisect.insort(self.members[dst][cls], i)
        self.owners[i] = dst
        self.flops[src] -= self.costs[i]
        self.flops[dst] += self.costs[i]
        self.weight[src] -= self.sizes[i]
        self.weight[dst] += self.sizes[i]


def rank_totals(values: Sequence[int], owners: Sequence[int], world_size: int) -> list[int]:
    """Σ of ``values`` per rank under ``owners``."""
    total = [0] * world_size
    for value, rank in zip(values, owners):
        total[rank] += value
    return total


def rank_loads(
    shapes: Sequence, owners: Sequence[int], world_size: int, *, ns_steps: int = 5
) -> list[int]:
    """NS FLOPs per rank under ``owners``."""
    return rank_totals([parameter_cost(e, ns_steps) for e in shapes], owners, world_size)


def format_ownership_table(
    names: Sequence[str],
    shapes: Sequence,
    owners: Sequence[int],
    world_size: int,
    *,
    ns_steps: int = 5,
    numels: Sequence[int] | None = None,
) -> str:
    """Human-readable table: one line per parameter (or range of a stack's experts), then
    per-rank FLOP and element totals."""
    width = max([40, *(len(name) for name in names)])
    lines = [f"{'parameter':<{width}} {'matrices':<24} {'owner':>5} {'NS GFLOP':>9}"]
    for name, entry, rank in zip(names, shapes, owners):
        mats = _matrix_list(entry)
        desc = f"{len(mats)}x{mats[0][0]}x{mats[0][1]}" if len(set(mats)) == 1 else str(mats)
        cost = parameter_cost(entry, ns_steps) / 1e9
        lines.append(f"{name:<{width}} {desc:<24} {rank:>5} {cost:>9.3f}")
    loads = rank_loads(shapes, owners, world_size, ns_steps=ns_steps)
    elems = rank_totals(numels, owners, world_size) if numels is not None else None
    for rank in range(world_size):
        count = sum(1 for o in owners if o == rank)
        extra = f", {elems[rank]} elements" if elems is not None else ""
        lines.append(f"rank {rank}: {count} parameters, {loads[rank] / 1e9:.3f} NS GFLOP{extra}")
    return "\n".join(lines)
