"""Construction-time check that every rank built the same optimizer: one all-gather of a digest,
and, only when digests differ, an exchange of the per-parameter records to name the first
difference (instead of a hang or an abort inside a later collective)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .comm import Communicator

__all__ = ["check_same_on_every_rank", "digests_agree", "require_same_options"]


def digests_agree(comm: Communicator, value: object) -> bool:
    """Whether every rank holds the same ``value`` (compared by its ``repr``): one all-gather of
    a 56-bit digest (collective)."""
    digest = hashlib.sha256(repr(value).encode()).digest()
    mine = torch.tensor(
        [int.from_bytes(digest[:7], "little")], dtype=torch.int64, device=comm.device
    )
    every = torch.empty(comm.world_size, dtype=torch.int64, device=comm.device)
    comm.all_gather(every, mine, tag="setup")
    return bool((every == every[0]).all())


def require_same_options(comm: Communicator, options: dict[str, object], who: str) -> None:
    """Raise naming the first option whose value differs between ranks (``options``: the
    constructor's options that every rank's collectives depend on; compared by ``repr``)."""
    mine = {name: repr(value) for name, value in options.items()}
    if digests_agree(comm, sorted(mine.items())):
        return
    per_rank = comm.all_gather_object(mine)
    for name in mine:
        values = [r.get(name) for r in per_rank]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"{v} on rank {rank}" for rank, v in enumerate(values))
            raise ValueError(
                f"{who}: option {name!r} differs between ranks ({shown}); every rank must "
                "build the optimizer with the same options"
            )
    raise ValueError(f"{who}: the options differ between ranks")


def check_same_on_every_rank(
    comm: Communicator,
    records: Sequence[tuple[str, tuple]],
    *,
    who: str,
    fields: str,
) -> None:
    """``records``: one ``(parameter name, decision)`` per parameter, in order. Raise a
    ``ValueError`` naming the first parameter whose decision differs between ranks, and what
    each rank decided (``fields`` says what a decision holds). Not on torch's fake process
    group (one process alone: nothing to compare with)."""
    if not comm.active or dist.get_backend(comm.group) == "fake":
        return
    records = [(str(name), tuple(decision)) for name, decision in records]
    if digests_agree(comm, records):
        return
    per_rank = comm.all_gather_object(records)
    longest = max(len(r) for r in per_rank)
    for i in range(longest):
        seen = [r[i] if i < len(r) else None for r in per_rank]
        if all(s == seen[0] for s in seen):
            continue
        name = next(s[0] for s in seen if s is not None)
        decisions = "; ".join(
            f"rank {rank}: " + ("no such parameter" if s is None else f"'{s[0]}' {s[1]}")
            for rank, s in enumerate(seen)
        )
        raise ValueError(
            f"{who}: parameter #{i} '{name}' is set up differently on different ranks "
            f"({fields}) — {decisions}. Every rank must pass the same parameters, names, "
            "rules and options."
        )
    raise ValueError(f"{who}: the optimizer differs between ranks (same records, other order)")
