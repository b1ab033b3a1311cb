"""Write the saved-state assets of ``tests/test_compat_assets.py`` (run from the repo root):

    PYTHONPATH=.:tests python tests/assets/compat/make_assets.py [single|dcp|all]

except the pickles of muonscale 0.1.0, written by that version's code (its checkout first on
the path; this file and ``compat_cases.py`` from today's):

    git worktree add /tmp/muonscale-0.1 2c7e802
    PYTHONPATH=/tmp/muonscale-0.1:tests python tests/assets/compat/make_assets.py pickled-0.1

Each asset holds what a run saved after ``SAVE_AT`` steps and the parameters after one more
step, so that a later version of the code can check that it loads and continues the run:

* ``single/<case>.pt``: single-process ``Muon``'s ``state_dict()``, a pickle of the optimizer
  (``torch.save(opt)``), the parameters, and the next step's parameters.
* ``pickled-0.1/<case>.pt``: the same for muonscale 0.1.0's ``Muon``, whose pickle holds
  torch's state only (no parameter names), with ``param_order``: the model's name of every
  param-group slot.
* ``dcp/<kind>-<case>/``: a ``torch.distributed.checkpoint`` of ``DistributedMuon`` or
  ``DTensorMuon`` (FSDP2) at 2 gloo ranks, with ``rank<r>.pt``: that rank's local state, its
  parameters and its next step's parameters.

The Megatron assets (TP 2, and ZeRO-1 at TP 2 × DP 2) are written by
``tests/megatron/compat_asset.py`` in the Megatron venv.
"""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import torch
from compat_cases import (
    BASE,
    DISTRIBUTED,
    PICKLED_BY_0_1,
    SAVE_AT,
    SINGLE_PROCESS,
    Tiny,
    build_distributed,
    local_state,
    params_of,
    recorded_platform,
    train,
)

import muonscale

HERE = Path(__file__).resolve().parent


def write_single(case: str) -> None:
    model = Tiny()
    opt = muonscale.Muon(model, **BASE, **SINGLE_PROCESS[case])
    train(model, opt, range(SAVE_AT))
    saved = io.BytesIO()  # written now: the next step changes the state in place
    torch.save({"state_dict": opt.state_dict(), "optimizer": opt}, saved)
    saved.seek(0)
    record = torch.load(saved, weights_only=False)
    record.update(params=params_of(model), platform=recorded_platform())
    train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    record["next_params"] = params_of(model)
    (HERE / "single").mkdir(exist_ok=True)
    torch.save(record, HERE / "single" / f"{case}.pt")


def write_pickled_0_1(case: str) -> None:
    assert muonscale.__version__ == "0.1.0", "run with muonscale 0.1.0 first on PYTHONPATH"
    model = Tiny()
    opt = muonscale.Muon(model, **BASE, **PICKLED_BY_0_1[case])
    name_of = {id(p): n for n, p in model.named_parameters()}
    train(model, opt, range(SAVE_AT))
    saved = io.BytesIO()
    torch.save({"state_dict": opt.state_dict(), "optimizer": opt}, saved)
    saved.seek(0)
    record = torch.load(saved, weights_only=False)
    record.update(
        params=params_of(model),
        platform=recorded_platform(),
        param_order=[[name_of[id(p)] for p in g["params"]] for g in opt.param_groups],
        written_by=f"muonscale {muonscale.__version__}",
    )
    train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    record["next_params"] = params_of(model)
    (HERE / "pickled-0.1").mkdir(exist_ok=True)
    torch.save(record, HERE / "pickled-0.1" / f"{case}.pt")


def dcp_worker(rank: int, world_size: int, kind: str, case: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = build_distributed(kind, case)
    train(model, opt, range(SAVE_AT))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    record = {"state": local_state(opt), "params": params_of(model)}
    train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    record["next_params"] = params_of(model)
    record["platform"] = recorded_platform()
    torch.save(record, Path(path) / f"rank{rank}.pt")


def write_dcp() -> None:
    from distributed_harness import WorkerPool

    root = HERE / "dcp"
    with WorkerPool(2) as pool:
        for kind in ("distributed", "dtensor"):
            for case in DISTRIBUTED:
                path = root / f"{kind}-{case}"
                shutil.rmtree(path, ignore_errors=True)
                pool.run(dcp_worker, kind, case, str(path))


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("single", "all"):
        for name in SINGLE_PROCESS:
            write_single(name)
    if what in ("dcp", "all"):
        write_dcp()
    if what == "pickled-0.1":
        for name in PICKLED_BY_0_1:
            write_pickled_0_1(name)
