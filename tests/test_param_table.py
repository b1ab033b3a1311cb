"""``ParamTable``: the per-parameter facts of one optimizer, re-keyed when parameter objects
change (rebind, pickling) and read by every layout."""

from __future__ import annotations

import copy

import torch

from muonscale.matrices import row_blocks
from muonscale.param_table import ParamTable
from muonscale.params import RouteDecision


def _table_and_groups():
    a, b, c = torch.zeros(6, 4), torch.zeros(4, 6), torch.zeros(3)
    table = ParamTable(transposed=["b"])
    table.names = {id(a): "a", id(b): "b"}
    table.routing = {"a": RouteDecision("muon", "hidden"), "b": RouteDecision("muon", "hidden")}
    table.split_rows = {id(a): row_blocks([2, 2, 2])}
    table.split_roles = {id(a): ("q", "k", "v")}
    groups = [{"params": [a, b], "algorithm": "muon"}, {"params": [c], "algorithm": "adamw"}]
    return table, groups, (a, b, c)


def test_rebind_keys_every_fact_by_the_new_parameter():
    table, _, (a, b, _) = _table_and_groups()
    old_view = table.view(a, "flatten")
    a2 = torch.zeros(6, 4)
    table.rebind([(a, a2, "a"), (b, b, "b")])
    assert table.names == {id(a2): "a", id(b): "b"}
    assert list(table.split_rows) == [id(a2)] and table.split_roles == {id(a2): ("q", "k", "v")}
    view = table.view(a2, "flatten")
    assert view is not old_view and view.matrix_shapes == old_view.matrix_shapes
    assert table.is_transposed(b) and not table.is_transposed(a2)


def test_pickled_table_follows_parameters_by_position():
    table, groups, _ = _table_and_groups()
    copied = copy.deepcopy(groups)  # new tensors: every id changes
    restored = ParamTable.unpickled(copied, table.pickled(groups))
    a, b, c = (p for g in copied for p in g["params"])
    assert restored.names == {id(a): "a", id(b): "b"}
    assert restored.split_roles == {id(a): ("q", "k", "v")}
    assert [t.tolist() for t in restored.split_rows[id(a)]] == [
        t.tolist() for t in table.split_rows[id(groups[0]["params"][0])]
    ]
    assert restored.routing == table.routing and restored.transposed == {"b"}
    assert restored.label(c, copied) == "param_groups[1]['params'][0]"  # unnamed: its place


def test_view_follows_matrix_mode_and_splits():
    table, _, (a, b, _) = _table_and_groups()
    assert table.view(a, "flatten").matrix_shapes == [(2, 4)] * 3  # row blocks of splits
    assert table.view(b, "flatten").matrix_shapes == [(6, 4)]  # stored (in, out): b.T
    w = torch.zeros(2, 3, 5)
    assert table.view(w, "flatten").matrix_shapes == [(2, 15)]
    assert table.view(w, "batch").matrix_shapes == [(3, 5), (3, 5)]  # mode change: rebuilt
