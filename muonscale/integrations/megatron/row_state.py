"""The matrices of a Megatron parameter in its TP group, and the replicated row states.

Each Muon matrix of a TP-sharded parameter is one exchange entry: its TP pieces (``"exact"``)
or, in ``"approximate_blockwise"`` mode and for matrices a rank holds whole, a matrix whole on
this rank. Its update is scaled by its *global* shape either way.

A row state (a state declared ``placement="replicated"``, such as NorMuon's row second moment)
holds the whole matrices' rows, a replica on every TP rank, stepped on every rank from the
statistics the owner computed. A checkpoint keeps each TP rank's own rows only (its pieces'
rows, as every other TP-sharded tensor of that rank's state), and loading all-gathers them
over the TP group back into the whole replica; a checkpoint of an earlier version, which held
those rows only, loads the same way. Every row state is handled alike, by its declaration.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from muonscale.declared_state import replicated_declarations
from muonscale.distributed.comm import Communicator, WireCounter
from muonscale.distributed.sharded import MatrixLayout
from muonscale.matrices import MatrixView

from .config import MegatronMuonConfig
from .plan import MegatronGroups, ParamPlan

RowStateEntry = tuple[dict, MatrixView, ParamPlan]
"""A parameter's state (holding row state), its matrix view and its plan."""


def held_row_state(state: Mapping[str, Any]) -> list[str]:
    """The keys of the row states (replicated states) ``state`` holds, in declaration order."""
    return [t.key for t in replicated_declarations() if t.key in state]


class TensorParallelMatrices:
    """Where the matrices of each Megatron parameter live in its TP group (dense or expert)."""

    def __init__(self, groups: MegatronGroups, config: MegatronMuonConfig) -> None:
        self.groups, self.config = groups, config

    def tp_group(self, expert: bool) -> dist.ProcessGroup | None:
        return self.groups.expt_tp if expert else self.groups.tp

    def layouts(
        self, view: MatrixView, plan: ParamPlan
    ) -> tuple[list[MatrixLayout], list[tuple[int, int]]]:
        """Each matrix's layout in the exchange (its TP pieces in ``"exact"`` mode, else this
        rank's piece, whole here) and its global shape."""
        group_size = MegatronGroups.size(self.tp_group(plan.expert))
        # A head of a QKV split lies whole on one rank; Q, K, V blocks are dim-0 pieces.
        sharded = plan.partition_dim is not None and not (
            plan.qkv_layout is not None and self.config.qkv_split == "head"
        )
        exact = self.config.muon_tp_mode == "exact"
        layouts, shapes = [], []
        for m, n in view.matrix_shapes:
            full = (m, n)
            if sharded:
                full = (m * plan.tp_size, n) if plan.partition_dim == 0 else (m, n * plan.tp_size)
            if sharded and exact:
                sizes = [full[plan.partition_dim] // plan.tp_size] * plan.tp_size
                layouts.append(MatrixLayout.sharded(full, plan.partition_dim, sizes))
            else:
                layouts.append(MatrixLayout.replicated((m, n), group_size))
            shapes.append(full)
        return layouts, shapes

    # ---------------------------------------------------------------- row state
    def row_state_zeros(
        self, view: MatrixView, plan: ParamPlan, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """A zero row state of the whole matrices' rows."""
        rows = sum(lay.shape[0] for lay in self.layouts(view, plan)[0])
        return torch.zeros(rows, dtype=dtype, device=device)

    @staticmethod
    def entries(
        param_groups: Sequence[Mapping[str, Any]],
        states: Mapping[torch.Tensor, dict],
        view_of: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
        plan_of: Callable[[torch.Tensor], ParamPlan],
    ) -> list[RowStateEntry]:
        """(state, matrix view, plan) of every Muon parameter whose state holds row state."""
        out = []
        for group in param_groups:
            for p in group["params"] if group["algorithm"] == "muon" else ():
                state = states.get(p, {})
                if held_row_state(state):
                    out.append((state, view_of(p, group), plan_of(p)))
        return out

    def saved_state_(
        self,
        packed: dict[str, Any],
        param_groups: Sequence[Mapping[str, Any]],
        view_of: Callable[[torch.Tensor, Mapping[str, Any]], MatrixView],
        plan_of: Callable[[torch.Tensor], ParamPlan],
    ) -> None:
        """In a ``state_dict()`` of torch's form: each row state replaced by this rank's rows
        (in a new entry: torch's entries are the live state's dicts)."""
        for saved, group in zip(packed["param_groups"], param_groups):
            for index, p in zip(saved["params"], group["params"]):
                entry = packed["state"].get(index, {})
                keys = held_row_state(entry) if group["algorithm"] == "muon" else []
                if keys:
                    view, plan = view_of(p, group), plan_of(p)
                    rows = {key: self.rank_rows(entry[key], view, plan) for key in keys}
                    packed["state"][index] = {**entry, **rows}

    @staticmethod
    def restore_(entries: Sequence[RowStateEntry], wholes: Sequence[dict]) -> None:
        """Put back the whole row states :meth:`to_rank_rows_` returned."""
        for (state, _, _), whole in zip(entries, wholes):
            state.update(whole)

    def _rank(self, plan: ParamPlan) -> int:
        group = self.tp_group(plan.expert)
        return dist.get_rank(group) if group is not None else 0

    def rank_rows(self, whole: torch.Tensor, view: MatrixView, plan: ParamPlan) -> torch.Tensor:
        """This TP rank's rows of a whole row state (what a checkpoint keeps)."""
        rank, parts, start = self._rank(plan), [], 0
        for lay in self.layouts(view, plan)[0]:
            rows = torch.arange(start, start + lay.shape[0])[lay.pieces[rank][0]]
            parts.append(whole[rows])
            start += lay.shape[0]
        return torch.cat(parts)

    def to_rank_rows_(self, entries: Sequence[RowStateEntry]) -> list[dict]:
        """Replace each whole row state by this rank's rows; returns the whole ones (by key)."""
        wholes = []
        for state, view, plan in entries:
            wholes.append({key: state[key] for key in held_row_state(state)})
            for key, whole in wholes[-1].items():
                state[key] = self.rank_rows(whole, view, plan)
        return wholes

    @torch.no_grad()
    def to_whole_(self, entries: Sequence[RowStateEntry], counter: WireCounter) -> None:
        """Replace each rank's rows of a row state by the whole replica: one flat all-gather
        per TP group (collective over each TP group; tag ``"checkpoint"``)."""
        by_group: dict[bool, list[RowStateEntry]] = {False: [], True: []}
        for entry in entries:
            by_group[entry[2].expert].append(entry)
        for expert, items in by_group.items():
            if not items:
                continue
            comm = Communicator(self.tp_group(expert), counter=counter)
            rows = [(state, key) for state, _, _ in items for key in held_row_state(state)]
            flat = torch.cat([state[key].float() for state, key in rows])
            gathered = flat.new_empty(comm.world_size * flat.numel())
            comm.all_gather(gathered, flat, tag="checkpoint")
            gathered = gathered.view(comm.world_size, flat.numel())
            offset = 0
            for state, view, plan in items:
                layouts = self.layouts(view, plan)[0]
                for key in held_row_state(state):
                    mine = state[key]
                    whole = torch.zeros(
                        sum(lay.shape[0] for lay in layouts), dtype=mine.dtype, device=mine.device
                    )
                    start = 0
                    for lay in layouts:
                        held = lay.piece_shape(0)[0]  # every rank holds as many rows
                        target = whole[start : start + lay.shape[0]]
                        for rank in range(comm.world_size):
                            target[lay.pieces[rank][0]] = gathered[rank, offset : offset + held]
                        start, offset = start + lay.shape[0], offset + held
                    state[key] = whole
