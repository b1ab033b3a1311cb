"""Distributed Muon: every collective in :mod:`.comm` (with bytes-on-the-wire accounting),
whole-matrix owners in :mod:`.ownership` and bucket layouts in :mod:`.buckets`; data
parallelism in :mod:`.data_parallel` (the optimizer), which owns a :mod:`.dp_reduction`
(buffers, gradient hooks, reduce-scatter / all-gather), with :mod:`.dp_grad_clip` and
:mod:`.dp_checkpoint`; DTensor (FSDP2 / TP) in :mod:`.dtensor` over :mod:`.sharded`;
:func:`distributed_muon` (:mod:`.factory`) picks the class for the parameters."""

from .comm import CollectiveError, Communicator, WireCounter, gather_wire_stats, ring_wire_bytes
from .data_parallel import DistributedMuon
from .dtensor import DTensorMuon
from .factory import distributed_muon
from .ownership import assign_owners, format_ownership_table

__all__ = [
    "CollectiveError",
    "Communicator",
    "DTensorMuon",
    "DistributedMuon",
    "WireCounter",
    "assign_owners",
    "distributed_muon",
    "format_ownership_table",
    "gather_wire_stats",
    "ring_wire_bytes",
]
