"""Which rank orthogonalizes which Muon parameter.

Every Muon parameter is owned **whole** by one rank: the owner receives its reduced gradient,
keeps its momentum, runs Newton–Schulz on all of its matrices and sends the updated parameter
back. Because no matrix is ever split, the update is the same function as on one process.

Assignment (deterministic: depends only on the list of matrix shapes and the world size, so
every rank computes the same table without communicating):

* cost of a parameter = Σ over its matrices of ``newton_schulz_flops(m, n, steps)``
  = steps · (4m²n + 2m³) with m ≤ n (the NS FLOPs; ``steps`` only scales all costs alike);
* greedy longest-processing-time (LPT): parameters in decreasing cost, ties by parameter index,
  each to the rank with the least cost so far, ties by the lowest rank.

LPT is within 4/3 of the optimal makespan (Graham, 1969). Ranks may own nothing when there are
fewer Muon parameters than ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..newton_schulz import newton_schulz_flops

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


def assign_owners(shapes: Sequence, world_size: int, *, ns_steps: int = 5) -> list[int]:
    """Owner rank of each parameter; ``shapes[i]`` is ``(m, n)`` or a list of ``(m, n)``."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    costs = [parameter_cost(entry, ns_steps) for entry in shapes]
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in order:
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += costs[i]
    return owners


def rank_loads(
    shapes: Sequence, owners: Sequence[int], world_size: int, *, ns_steps: int = 5
) -> list[int]:
    """NS FLOPs per rank under ``owners``."""
    load = [0] * world_size
    for entry, rank in zip(shapes, owners):
        load[rank] += parameter_cost(entry, ns_steps)
    return load


def format_ownership_table(
    names: Sequence[str],
    shapes: Sequence,
    owners: Sequence[int],
    world_size: int,
    *,
    ns_steps: int = 5,
    numels: Sequence[int] | None = None,
) -> str:
    """Human-readable table: one line per parameter, then per-rank FLOP and element totals."""
    lines = [f"{'parameter':<40} {'matrices':<24} {'owner':>5} {'NS GFLOP':>9}"]
    for name, entry, rank in zip(names, shapes, owners):
        mats = _matrix_list(entry)
        desc = f"{len(mats)}x{mats[0][0]}x{mats[0][1]}" if len(set(mats)) == 1 else str(mats)
        lines.append(
            f"{name:<40} {desc:<24} {rank:>5} {parameter_cost(entry, ns_steps) / 1e9:>9.3f}"
        )
    loads = rank_loads(shapes, owners, world_size, ns_steps=ns_steps)
    elems = [0] * world_size
    if numels is not None:
        for n, rank in zip(numels, owners):
            elems[rank] += n
    for rank in range(world_size):
        count = sum(1 for o in owners if o == rank)
        extra = f", {elems[rank]} elements" if numels is not None else ""
        lines.append(f"rank {rank}: {count} parameters, {loads[rank] / 1e9:.3f} NS GFLOP{extra}")
    return "\n".join(lines)
