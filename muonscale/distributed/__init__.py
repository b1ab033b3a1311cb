"""Distributed Muon: every collective in :mod:`.comm` (with bytes-on-the-wire accounting) and
whole-matrix owners in :mod:`.ownership`, shared by the layouts; data parallelism in the
:mod:`.data_parallel` package (``DistributedMuon``, its layout, bucketed reduction, gathers and
checkpoints); DTensor (FSDP2 / TP) in :mod:`.dtensor` over :mod:`.sharded` and
:mod:`.exchange`; :func:`distributed_muon` (:mod:`.factory`) picks the class for the
parameters."""

from ..lazy_names import lazy_names
from .comm import CollectiveError, Communicator, WireCounter, gather_wire_stats, ring_wire_bytes
from .ownership import assign_owners, format_ownership_table

_LAZY = {  # the optimizers import muonscale.Muon, whose modules import helpers from here
    "DistributedMuon": "data_parallel",
    "DTensorMuon": "dtensor",
    "distributed_muon": "factory",
}
__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY)

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
