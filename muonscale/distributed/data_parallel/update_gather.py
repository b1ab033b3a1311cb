"""Gathering each owner's update instead of its updated parameter (``DistributedMuon``).

With Newton–Schulz in bfloat16 an owner's update of a Muon matrix (the matrix step's output,
:mod:`muonscale.matrix_step`) is bfloat16 already. The owner sends that update instead of the
fp32 parameter, and every rank applies it with the same rule
(:func:`muonscale.matrix_step.apply_updates_by_rule_`, one owned unit at a time: a parameter
owned whole, or one owner's range of a stack's experts) to its own copy, with the lr and weight
decay captured at ``step()``::

    W ← W · (1 − lr λ) + lr α U        (U: bfloat16 on the wire; α and the decay: the
                                        matrix's :func:`muonscale.matrix_step.apply_rule`)

The owner applies the update exactly as it sent it, so the replicas stay bitwise identical.
With fp32 Newton–Schulz this is an opt-in (``gather_updates=True``): the update is rounded to
bfloat16, and the owner applies the rounded update too. Matrices with main copies
(``main_params_dtype``) still gather their rounded parameters: non-owners hold no main copy.
The bytes are derived in *Across hosts* in the docs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...matrix_step import ApplyRule, ApplyUpdates, apply_rule, apply_updates_by_rule_
from ...newton_schulz import default_ns_dtype
from ...param_table import ParamTable
from ...settings import MuonSettings
from .buckets import ExpertRange, OwnedUnit, unit_param
from .layout import DataParallelLayout
from .reduction import BucketedReduction, StreamBuffers

UPDATE_DTYPE = torch.bfloat16
"""dtype of the updates on the wire."""


def check_gather_updates(value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(
            "gather_updates must be None (gather bfloat16 updates where Newton–Schulz runs in "
            f"bfloat16), True (also at other dtypes, rounding) or False, got {value!r}"
        )


def gathers_updates(
    option: bool | None,
    ns_dtype: torch.dtype,
    param_dtype: torch.dtype,
    main_dtype: torch.dtype | None,
) -> bool:
    """Whether a Muon matrix's owner sends its update: not with a main copy (non-owners hold
    none) or for a parameter no wider than the update (no byte to save); else where
    Newton–Schulz runs in bfloat16 (``option`` None) or whenever ``option`` is True."""
    if option is False or main_dtype is not None:
        return False
    if torch.finfo(param_dtype).bits <= torch.finfo(UPDATE_DTYPE).bits:
        return False
    return option is True or ns_dtype == UPDATE_DTYPE


def sends_update(
    p: torch.Tensor,
    group: dict[str, Any],
    option: bool | None,
    main_dtype: Callable[[torch.dtype], torch.dtype | None],
) -> bool:
    """Whether the owner of ``p`` (in ``group``) sends its update (:func:`gathers_updates`)."""
    if group["algorithm"] != "muon":
        return False
    ns_dtype = resolved_ns_dtype(group, p.device)
    return gathers_updates(option, ns_dtype, p.dtype, main_dtype(p.dtype))


def resolved_ns_dtype(group: dict[str, Any], device: torch.device) -> torch.dtype:
    """The dtype Newton–Schulz runs in for ``group`` on ``device``."""
    dtype = MuonSettings.from_group(group).ns.dtype
    return dtype if dtype is not None else default_ns_dtype(device)


@dataclass(frozen=True)
class UpdateRule:
    """How one matrix's gathered update is applied this step (captured at ``step()``)."""

    lr: float
    weight_decay: float
    apply: ApplyRule


class UpdateGather:
    """Where each matrix's update lands in the gathered buckets of the streams that carry
    updates, the owner's apply (which writes the update into the gather buffer), and every
    other rank's apply once a matrix's last bucket arrived.

    Args:
        reduction: the :class:`~.reduction.BucketedReduction` (its streams and parameters).
        option: ``gather_updates`` as given (None, True or False).
    """

    def __init__(
        self,
        reduction: BucketedReduction,
        option: bool | None,
        name_of: Callable[[torch.Tensor], str] = lambda p: "<parameter>",
    ) -> None:
        self.reduction, self.option, self._name_of = reduction, option, name_of
        self.rank = reduction.rank
        self._offset: dict[OwnedUnit, tuple[StreamBuffers, int]] = {}  # unit -> (stream, offset)
        self._pieces: dict[OwnedUnit, list[tuple[int, int, int]]] = {}  # [(k, start, length)]
        self._in_bucket: dict[tuple[int, int], list[OwnedUnit]] = {}  # (id(stream), k) -> units
        for stream in reduction.streams:
            if not stream.carries_updates:
                continue
            for u, off in stream.layout.offsets.items():
                self._offset[u], self._pieces[u] = (stream, off), []
            for k, bucket in enumerate(stream.layout.buckets):
                for piece in sorted(bucket.pieces, key=lambda q: q.param_start):
                    u = piece.unit  # a stream carrying updates has no AdamW fill
                    self._pieces[u].append((k, piece.buffer_start, piece.length))
                    self._in_bucket.setdefault((id(stream), k), []).append(u)
        self._rules: dict[OwnedUnit, UpdateRule] = {}
        self._missing: dict[OwnedUnit, int] = {}  # unit -> its buckets not arrived this step

    @property
    def gathered_units(self) -> frozenset[OwnedUnit]:
        """Owned units (Muon indices, ranges of experts) whose update is gathered."""
        return frozenset(self._offset)

    def capture(
        self, layout: DataParallelLayout, param_table: ParamTable, present: list[bool]
    ) -> None:
        """The lr, weight decay and update rule of every gathered unit (a matrix, or a range
        of a stack's experts) with a gradient this step (the same on every rank). Raises on
        every rank if a group's Newton–Schulz dtype left bfloat16 after construction without
        ``gather_updates=True``."""
        self._rules = {}
        self._missing = {u: len(pieces) for u, pieces in self._pieces.items()}
        for u in self._offset:
            i = unit_param(u)
            p, group = layout.params[i], layout.group_of[i]
            if self.option is None and resolved_ns_dtype(group, p.device) != UPDATE_DTYPE:
                raise ValueError(
                    f"parameter '{self._name_of(p)}': its group's ns_dtype is no longer bfloat16, "
                    "but DistributedMuon chose at construction to gather its bfloat16 update: "
                    "pass gather_updates=True (rounds each update to bfloat16) or False"
                )
            if not present[i] or p.numel() == 0:
                continue
            settings = MuonSettings.from_group(group)
            if isinstance(u, ExpertRange):  # the sub-stack its owner steps
                view = layout.range_view(u)
            else:
                view = param_table.view(p, group["matrix_mode"])
            lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
            self._rules[u] = UpdateRule(lr, weight_decay, apply_rule(view, settings))

    def owner_apply(self, unit_of: Callable[[torch.Tensor], OwnedUnit | None]) -> ApplyUpdates:
        """Muon's last pass on the owner: each gathered unit's update (``unit_of``: the unit a
        stepped tensor is) goes into the gather buffer (rounded to :data:`UPDATE_DTYPE`), then
        is applied from there as every other rank applies it; other matrices are applied as
        usual."""

        def apply(params, updates, rules, *, lr, weight_decay):
            columns: list[list] = [[], [], []]  # (params, updates, rules): one elementwise pass
            for p, u, rule in zip(params, updates, rules):
                unit = unit_of(p)
                if unit in self._offset:
                    stream, off = self._offset[unit]
                    wire = stream.gather_in[off : off + p.numel()]
                    wire.copy_(u.reshape(-1))
                    u = wire.view(p.shape)  # applied from the rounded copy, as elsewhere
                for column, x in zip(columns, (p, u, rule)):
                    column.append(x)
            apply_updates_by_rule_(*columns, lr=lr, weight_decay=weight_decay)

        return apply

    def apply_gathered(self, stream: StreamBuffers, k: int) -> None:
        """Bucket ``k`` of ``stream`` arrived: apply the update of every unit this rank does
        not own whose buckets have all arrived (the whole unit at once, as its owner did; the
        buckets may arrive in any order)."""
        for u in self._in_bucket.get((id(stream), k), []):
            self._missing[u] -= 1
            if self._missing[u]:
                continue
            rule = self._rules.get(u)
            owner = u.owner if isinstance(u, ExpertRange) else self.reduction.owner_rank[u]
            if rule is None or owner == self.rank:
                continue  # no gradient this step, or applied by the owner already
            pieces = [stream.gather_out[kk][s : s + n] for kk, s, n in self._pieces[u]]
            update = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            target = self.reduction.owned_slice(u)  # the parameter, or its range of experts
            apply_updates_by_rule_(
                [target],
                [update.view(target.shape)],
                [rule.apply],
                lr=rule.lr,
                weight_decay=rule.weight_decay,
            )
