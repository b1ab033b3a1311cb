"""A second replicated row state costs no layout code, through the Megatron adapter at TP 2: a
made-up variant's state beside NorMuon's row second moment (:mod:`made_up_row_state`,
registered by patching ``variants.VARIANT_STATE`` in the workers) is held whole on both TP
ranks and every rank's replica equals the owner's, bitwise, after each step; it is the
statistic of the whole matrix (single-process Muon's at TP 1, to float32 rounding, for row-
and column-split weights alike); it travels in the one row all-reduce per TP group and step;
and it moves no weight."""

from __future__ import annotations

import megatron_workers as W
import torch
import variant_workers as V
from made_up_row_state import ROW_PEAK, declared
from test_megatron_variants import tolerance

from muonscale.variants import ROW_MOMENT

STEPS = 3
NORMUON = dict(normalize="row")
ROW_STATES = (ROW_MOMENT.key, ROW_PEAK.key)


def _megatron(tp: int) -> dict:
    """NorMuon through the adapter at ``tp``: each Muon parameter's row states (by plan name)
    after each step, the last step's wire breakdown and the whole weights."""
    from megatron.core import parallel_state as ps

    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    W.setup_parallel(tp)
    model = W.build_gpt(W.TINY, seed=0)
    config = dict(
        lr=V.COMMON["lr"],
        weight_decay=V.COMMON["weight_decay"],
        muon_momentum=V.COMMON["momentum"],
        scale=V.COMMON["scale"],
        adam_lr=V.COMMON["adam_lr"],
        ns_dtype=torch.float32,
    )
    opt = megatron_muon([model], MegatronMuonConfig().replaced(**config, **NORMUON))
    states = []
    for step in range(STEPS):
        W.inject_gradients(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append(
            {
                plan.name: {k: state[k].clone() for k in ROW_STATES if k in state}
                for state, _, plan in opt._row_state_entries()
            }
        )
    out = dict(
        states=states,
        breakdown=opt.last_step_wire_breakdown,
        params={n: W.gather_full(p) for n, p in model.named_parameters()},
        split={pl.name: pl.partition_dim for pl in opt.plans if pl.algorithm == "muon"},
    )
    ps.destroy_model_parallel()
    return out


def _single_process() -> dict:
    """Single-process Muon on the TP 1 model: each parameter's row states after each step."""
    from megatron.core import parallel_state as ps

    W.setup_parallel(1)
    model = W.build_gpt(W.TINY, seed=0)
    opt = V._reference_muon(model, NORMUON)
    names = {
        id(p): n
        for group in opt.param_groups
        for n, p in zip(group["param_names"], group["params"])
    }
    states = []
    for step in range(STEPS):
        W.inject_gradients(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)
        states.append(
            {
                names[id(p)]: {k: s[k].clone() for k in ROW_STATES}
                for p, s in opt.state.items()
                if ROW_PEAK.key in s
            }
        )
    ps.destroy_model_parallel()
    return dict(states=states)


def run_replicated_state(rank: int, world_size: int) -> dict:
    torch.set_num_threads(1)
    normuon = _megatron(2)  # NorMuon's state alone
    with declared(ROW_PEAK):
        tp2 = _megatron(2)
        ref = _single_process()
    return dict(tp2=tp2, ref=ref, normuon=normuon)


def test_tp2_second_replicated_state_stays_equal_to_the_owners(pool2):
    per_rank = pool2.run(run_replicated_state, timeout=600)
    first = per_rank[0]["tp2"]
    for step in range(STEPS):
        states = first["states"][step]
        assert states and all(set(by_key) == set(ROW_STATES) for by_key in states.values())
        for name, by_key in states.items():
            peak = by_key[ROW_PEAK.key]
            assert peak.shape == by_key[ROW_MOMENT.key].shape, name  # the whole rows
            assert bool((peak > 0).all()), (step, name)
            if step:  # stepped again: β₂ v < max(β₂ v, ‖O_r‖₁) somewhere
                assert not torch.equal(peak, first["states"][step - 1][name][ROW_PEAK.key])
        for rank, res in enumerate(per_rank):  # two TP ranks, one of them the owner
            mine = res["tp2"]["states"][step]
            assert mine.keys() == states.keys(), (step, rank)
            for name, by_key in mine.items():
                for key, value in by_key.items():
                    assert torch.equal(value, states[name][key]), (step, rank, name, key)
    # the statistic of the whole matrix: single-process Muon's, for weights split by rows (0)
    # and by columns (1) alike, up to the order of the rows (a whole matrix at TP 2 stacks the
    # ranks' pieces: a gated fc1 or a QKV weight interleaves its blocks otherwise than at
    # TP 1; O's rows follow U's, so the statistics are the same values, permuted)
    ref = per_rank[0]["ref"]["states"]
    tol = tolerance(NORMUON)
    assert {0, 1} <= set(first["split"].values())
    for step in range(STEPS):
        assert ref[step].keys() == first["states"][step].keys()
        for name, by_key in first["states"][step].items():
            got = by_key[ROW_PEAK.key].sort().values
            want = ref[step][name][ROW_PEAK.key].sort().values
            worst = float((got - want).abs().max() / want.abs().max())
            assert worst <= tol, (step, name, worst, tol)
    for res in per_rank:
        normuon = res["normuon"]
        # both states' statistics in the one all-reduce: twice NorMuon's rows
        rows = normuon["breakdown"].get("muon_tp_rows/all_reduce", 0)
        assert rows > 0
        assert res["tp2"]["breakdown"]["muon_tp_rows/all_reduce"] == 2 * rows
        # and the made-up state moves no weight
        assert all(torch.equal(res["tp2"]["params"][n], w) for n, w in normuon["params"].items())
