"""``DistributedMuon``'s wing: data-parallel Muon with whole-matrix owners and ZeRO-1 AdamW.

One module per idea: :mod:`.optimizer` (the class and its step phases), :mod:`.layout` (who
holds what: :class:`DataParallelLayout`), :mod:`.reduction` and :mod:`.buckets` (the bucketed
reduce-scatter and its plans), :mod:`.step` (the phases after the reduction),
:mod:`.quantized_shards` (8-bit AdamW moments of the ZeRO-1 segments), :mod:`.gathers`
and :mod:`.update_gather` (the all-gathers back), :mod:`.deferred_gather` (gathers landed in the
next forward), :mod:`.grad_clip` and :mod:`.checkpoint`.
"""

from __future__ import annotations

from .layout import DataParallelLayout
from .optimizer import AgreedGradients, DistributedMuon
from .reduction import BucketedReduction, ReductionOptions

__all__ = [
    "AgreedGradients",
    "BucketedReduction",
    "DataParallelLayout",
    "DistributedMuon",
    "ReductionOptions",
]
