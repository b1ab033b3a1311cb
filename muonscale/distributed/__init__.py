"""Distributed Muon: every collective in :mod:`.comm` (with bytes-on-the-wire accounting),
whole-matrix owners in :mod:`.ownership` and bucket layouts in :mod:`.buckets`; data
parallelism in :mod:`.data_parallel` (the optimizer), :mod:`.dp_streams` (owner-stream buffers,
gradient hooks, reduce-scatter / all-gather) and :mod:`.dp_global` (clipping, non-finite
agreement, checkpoints); DTensor (FSDP2 / TP) in :mod:`.dtensor` over :mod:`.sharded`."""

from .comm import CollectiveError, Communicator, WireCounter, gather_wire_stats, ring_wire_bytes
from .data_parallel import DistributedMuon
from .dtensor import DTensorMuon
from .ownership import assign_owners, format_ownership_table

__all__ = [
    "CollectiveError",
    "Communicator",
    "DTensorMuon",
    "DistributedMuon",
    "WireCounter",
    "assign_owners",
    "format_ownership_table",
    "gather_wire_stats",
    "ring_wire_bytes",
]
