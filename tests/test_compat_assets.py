"""Saved state keeps loading: the assets of ``tests/assets/compat/`` (written by an earlier
version, see ``make_assets.py`` there) load into today's optimizers. Every loaded state tensor
equals the saved one bitwise; one continued step equals the recorded one bitwise on the
recording's torch and CPU kernels, and within 1e-6 relative elsewhere."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest
import torch
from compat_cases import (
    BASE,
    DISTRIBUTED,
    PICKLED_BY_0_1,
    SAVE_AT,
    SINGLE_PROCESS,
    Tiny,
    build_distributed,
    gradients,
    local_state,
    params_of,
    train,
)
from distributed_harness import shared_pool

import muonscale

ASSETS = Path(__file__).parent / "assets" / "compat"
pytestmark = [
    pytest.mark.timeout(120),
    # the cases' bare 3-D "experts" keep 0.5.0's flatten view, and so its warning
    # (tests/test_experts.py asserts that warning)
    pytest.mark.filterwarnings("ignore::muonscale.optimizer_groups.UnknownLayoutWarning"),
]


def state_mismatches(saved: dict, loaded: dict) -> list[str]:
    """What differs between two ``state_dict()["state"]`` (keys, dtypes, shapes or bits)."""
    if saved.keys() != loaded.keys():
        return [f"parameter indices {sorted(saved)} != {sorted(loaded)}"]
    out = []
    for i in saved:
        if saved[i].keys() != loaded[i].keys():
            out.append(f"state {i}: keys {sorted(saved[i])} != {sorted(loaded[i])}")
            continue
        for key, want in saved[i].items():
            got = loaded[i][key]
            if not torch.is_tensor(want):
                if got != want:
                    out.append(f"state {i}[{key!r}]: {got!r} != {want!r}")
            elif got.dtype != want.dtype or not torch.equal(got, want):
                out.append(f"state {i}[{key!r}]: {got.dtype} {tuple(got.shape)} != saved")
    return out


def step_mismatches(recorded: dict, computed: dict) -> list[str]:
    """Parameters of the continued step that differ from the recording by more than 1e-6
    relative (to the tensor's max). The step is recomputed here, and a CPU's BLAS rounds by
    its own blocking: the same torch and CPU capability differed by up to 1.5e-8 between two
    Xeon VMs of this project's machine kind (the recording's ``platform`` says where it was
    made)."""
    out = []
    for name, want in recorded.items():
        got = computed[name]
        scale = want.abs().max().clamp_min(torch.finfo(want.dtype).tiny)
        if not bool(((got - want).abs().max() / scale) <= 1e-6):
            out.append(f"{name}: max |dW| {(got - want).abs().max().item():.3g}")
    return out


def _record(case: str) -> dict:
    return torch.load(ASSETS / "single" / f"{case}.pt", weights_only=False)


@pytest.mark.parametrize("case", sorted(SINGLE_PROCESS))
def test_single_process_state_dict_loads_and_continues(case):
    record = _record(case)
    saved = copy.deepcopy(record["state_dict"])
    model = Tiny(seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(record["params"][n])
    opt = muonscale.Muon(model, **BASE, **SINGLE_PROCESS[case])
    opt.load_state_dict(record["state_dict"])
    assert state_mismatches(saved["state"], opt.state_dict()["state"]) == []
    train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    assert step_mismatches(record["next_params"], params_of(model)) == []


@pytest.mark.parametrize("case", sorted(SINGLE_PROCESS))
def test_single_process_pickle_loads_and_continues(case):
    record = _record(case)
    saved = copy.deepcopy(record["state_dict"]["state"])
    opt = record["optimizer"]
    assert type(opt) is muonscale.Muon
    assert state_mismatches(saved, opt.state_dict()["state"]) == []
    params = {opt.param_names[id(p)]: p for g in opt.param_groups for p in g["params"]}
    for name, grad in gradients(Tiny(), SAVE_AT).items():
        params[name].grad = grad
    opt.step()
    computed = {n: p.detach() for n, p in params.items()}
    assert step_mismatches(record["next_params"], computed) == []


def _resume_dcp(rank: int, world_size: int, kind: str, case: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = ASSETS / "dcp" / f"{kind}-{case}"
    record = torch.load(folder / f"rank{rank}.pt", weights_only=False)
    model, opt = build_distributed(kind, case, seed=1)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = state_mismatches(record["state"], local_state(opt))
    train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    stepped = step_mismatches(record["next_params"], params_of(model))
    return {"state": loaded, "step": stepped}


@pytest.mark.parametrize("kind", ["distributed", "dtensor"])
@pytest.mark.parametrize("case", sorted(DISTRIBUTED))
def test_dcp_checkpoint_at_2_ranks_loads_and_continues(kind, case):
    for rank, result in enumerate(shared_pool(2).run(_resume_dcp, kind, case)):
        assert result == {"state": [], "step": []}, (kind, case, rank)


def _pickled_0_1(case: str) -> dict:
    return torch.load(ASSETS / "pickled-0.1" / f"{case}.pt", weights_only=False)


def _step_unpickled(opt: muonscale.Muon, order: list[list[str]], step: int) -> dict:
    """One step of ``opt`` with the gradients of ``step``; its parameters by name (``order``:
    the model's name of each param-group slot)."""
    params = {n: p for g, names in zip(opt.param_groups, order) for n, p in zip(names, g["params"])}
    for name, grad in gradients(Tiny(), step).items():
        params[name].grad = grad
    opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


@pytest.mark.parametrize("case", sorted(PICKLED_BY_0_1))
def test_pickle_of_0_1_steps_as_a_fresh_optimizer(case):
    """A ``Muon`` pickled by muonscale 0.1.0 (torch's state only) continues the run: its step
    equals the one 0.1.0 recorded and, bitwise, a fresh ``Muon`` of today's loaded with the
    same state."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        record = _pickled_0_1(case)
    opt = record["optimizer"]
    state_dict = copy.deepcopy(record["state_dict"])  # AdamW's state tensors are shared
    assert type(opt) is muonscale.Muon
    stepped = _step_unpickled(opt, record["param_order"], SAVE_AT)
    assert step_mismatches(record["next_params"], stepped) == []
    assert opt.nonfinite == "raise"  # not in the pickle: the default, and a warning says so
    said = [str(w.message) for w in caught if "muonscale 0.1" in str(w.message)]
    assert len(said) == 1 and "nonfinite='raise'" in said[0] and "splits" in said[0], said

    model = Tiny(seed=1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(record["params"][n])
    fresh = muonscale.Muon(model, **BASE, **dict(PICKLED_BY_0_1[case], nonfinite="raise"))
    fresh.load_state_dict(state_dict)
    train(model, fresh, range(SAVE_AT, SAVE_AT + 1))
    assert all(torch.equal(stepped[n], p) for n, p in params_of(model).items())
    assert state_mismatches(fresh.state_dict()["state"], opt.state_dict()["state"]) == []


def test_pickle_of_0_1_raises_at_a_nonfinite_gradient():
    """0.1.0 did not pickle ``nonfinite``: the copy takes the default, ``"raise"`` (a NaN
    gradient raises naming the parameter and changes nothing), and says so when unpickled."""
    with pytest.warns(UserWarning, match="nonfinite"):
        record = _pickled_0_1("nonfinite_skip")
    opt = record["optimizer"]
    slots = zip(opt.param_groups, record["param_order"])
    params = {n: p for g, names in slots for n, p in zip(names, g["params"])}
    before = {n: p.detach().clone() for n, p in params.items()}
    for name, grad in gradients(Tiny(), SAVE_AT).items():
        params[name].grad = grad
    params["fc.weight"].grad[0, 0] = float("nan")
    group, index = next(
        (g, names.index("fc.weight"))
        for g, names in enumerate(record["param_order"])
        if "fc.weight" in names
    )
    slot = f"param_groups[{group}]['params'][{index}]"  # 0.1 did not pickle names
    with pytest.raises(muonscale.NonFiniteGradientError, match=re.escape(slot)):
        opt.step()
    assert all(torch.equal(before[n], p) for n, p in params.items())
