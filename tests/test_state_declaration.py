"""The state declaration at ``load_state_dict``: a variant state tensor that does not fit its
parameter's matrix view is refused by name before anything changes; a state dict whose saved
options change the variant warns naming each option; a ``DistributedMuon`` DCP checkpoint of
NorMuon read into a plain-Muon optimizer fails at load, naming the missing tensor."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from compat_cases import BASE, DISTRIBUTED, Tiny, build_distributed
from distributed_harness import shared_pool

from muonscale import Muon
from muonscale.declared_state import MOMENTUM
from muonscale.distributed import DistributedMuon
from muonscale.variants import ROW_MOMENT

DCP_NORMUON = Path(__file__).parent / "assets" / "compat" / "dcp" / "distributed-normuon"
pytestmark = pytest.mark.timeout(120)


def _stepped(w: torch.nn.Parameter, **kw) -> Muon:
    opt = Muon([("h.weight", w)], lr=0.02, **kw)
    w.grad = torch.randn(w.shape, generator=torch.Generator().manual_seed(0))
    opt.step()
    return opt


def _unchanged(opt: Muon, before: dict) -> bool:
    state = opt.state_dict()
    return state["param_groups"] == before["param_groups"] and all(
        torch.equal(state["state"][i][k], v)
        for i, s in before["state"].items()
        for k, v in s.items()
    )


def test_row_moment_of_a_transposed_weight_is_refused_by_name():
    """Saved where the (8, 12) weight was stored (in, out) (12 matrix rows), loaded where it
    is not (8 rows): the moment no longer fits, and nothing is sliced from it."""
    saved = _stepped(
        torch.nn.Parameter(torch.randn(8, 12)), normalize="row", transposed={"h.weight"}
    )
    state_dict = saved.state_dict()
    assert state_dict["state"][0][ROW_MOMENT.key].shape == (12,)
    target = _stepped(torch.nn.Parameter(torch.randn(8, 12)), normalize="row")
    before = copy.deepcopy(target.state_dict())
    with pytest.raises(ValueError, match=rf"{ROW_MOMENT.key}.*'h.weight'.*\(12,\).*\(8,\)"):
        target.load_state_dict(state_dict)
    assert _unchanged(target, before)


@pytest.mark.parametrize(
    "key, bad",
    [
        (ROW_MOMENT.key, torch.zeros(1)),
        (ROW_MOMENT.key, torch.zeros(6, dtype=torch.int64)),
        (MOMENTUM.key, torch.zeros(6, 7)),
    ],
)
def test_state_that_does_not_fit_the_view_is_refused_by_name(key, bad):
    opt = _stepped(torch.nn.Parameter(torch.randn(6, 9)), normalize="row")
    state_dict = copy.deepcopy(opt.state_dict())
    state_dict["state"][0][key] = bad
    with pytest.raises(ValueError, match=rf"{key}.*'h.weight'"):
        opt.load_state_dict(state_dict)


def test_saved_variant_options_that_change_the_algorithm_warn_by_name():
    saved = _stepped(torch.nn.Parameter(torch.randn(6, 9)), normalize="row").state_dict()
    target = _stepped(torch.nn.Parameter(torch.randn(6, 9)), cautious_weight_decay=True)
    with pytest.warns(UserWarning, match=r"normalize: 'none' → 'row'.*cautious_weight_decay"):
        target.load_state_dict(saved)
    assert target.param_groups[0]["normalize"] == "row"  # torch's rule: the saved options
    same = _stepped(torch.nn.Parameter(torch.randn(6, 9)), normalize="row")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        same.load_state_dict(saved)  # nothing changes: no warning


def _load_normuon_dcp_into_plain(rank: int, world_size: int) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = build_distributed("distributed", "muon", seed=1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(DCP_NORMUON))
    try:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    except ValueError as err:
        return str(err)
    return "loaded"


@pytest.mark.parametrize("world_size", [1, 3])
def test_normuon_dcp_into_plain_distributed_muon_fails_at_load(world_size):
    assert "normalize" in DISTRIBUTED["normuon"] and not DISTRIBUTED["muon"]
    for message in shared_pool(world_size).run(_load_normuon_dcp_into_plain):
        assert ROW_MOMENT.key in message and "normalize='row'" in message, message


# the compat model's bare 3-D "experts" keep the flatten view, and its warning
@pytest.mark.filterwarnings("ignore::muonscale.optimizer_groups.UnknownLayoutWarning")
def test_normuon_state_dict_into_plain_distributed_muon_loads_correctly():
    """A full state dict carries the row moments: loading it into a DistributedMuon built
    with normalize='none' creates them and continues NorMuon exactly."""
    from compat_cases import train

    model = Tiny()
    opt = DistributedMuon(model, **BASE, **DISTRIBUTED["normuon"])
    train(model, opt, range(2))
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved = copy.deepcopy(opt.state_dict())
    train(model, opt, range(2, 3))
    resumed = Tiny(seed=1)
    resumed.load_state_dict(saved_params)
    plain = DistributedMuon(resumed, **BASE)
    with pytest.warns(UserWarning, match="normalize"):
        plain.load_state_dict(saved)
    train(resumed, plain, range(2, 3))
    for n, p in model.named_parameters():
        assert torch.equal(dict(resumed.named_parameters())[n], p), n
