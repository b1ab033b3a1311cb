"""The Megatron NorMuon assets of ``tests/assets/compat/megatron/``: written once from an
earlier version of the code (``write``), loaded and continued by the current one (``resume``).
Cases (:data:`CASES`): ``"tp2"`` (TP 2, every replica steps: ``tp<r>.pt``) and ``"zero1"``
(TP 2 × DP 2, ZeRO-1: ``zero1-rank<r>.pt``). Write one from the repo root in the Megatron venv::

    PYTHONPATH=.:tests:tests/megatron .venv-megatron/bin/python tests/megatron/compat_asset.py CASE
"""

from __future__ import annotations

import copy
import io
import os
import sys

import megatron_workers as W
import torch

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "assets", "compat")
FOLDER = os.path.normpath(os.path.join(FOLDER, "megatron"))
SAVE_AT = 2
SHAPE = dict(W.TINY, num_layers=1, hidden_size=32, ffn_hidden_size=64, vocab_size=64)
CONFIG = dict(lr=0.02, weight_decay=0.1, adam_lr=0.01, ns_dtype=torch.float32, normalize="row")
CASES = {"tp2": 2, "zero1": 4}
"""Each case's world size (TP 2 in both: DP 1 replicated, DP 2 ZeRO-1)."""


def path(case: str, rank: int) -> str:
    """The asset file of ``rank`` (its TP rank for ``"tp2"``, its global rank for ``"zero1"``)."""
    if case == "tp2":
        from megatron.core import parallel_state as ps

        return os.path.join(FOLDER, f"tp{ps.get_tensor_model_parallel_rank()}.pt")
    return os.path.join(FOLDER, f"{case}-rank{rank}.pt")


def _build():
    from muonscale.integrations.megatron import MegatronMuonConfig, megatron_muon

    W.setup_parallel(2)
    model = W.build_gpt(SHAPE, seed=0)
    return model, megatron_muon([model], MegatronMuonConfig().replaced(**CONFIG))


def _train(model, opt, steps) -> None:
    for step in steps:
        W.inject_gradients(model, step)
        opt.step()
        opt.zero_grad(set_to_none=True)


def _local(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _platform() -> dict[str, str]:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def write(rank: int, world_size: int, case: str) -> None:
    from megatron.core import parallel_state as ps

    model, opt = _build()
    _train(model, opt, range(SAVE_AT))
    saved = io.BytesIO()  # written now: the next step changes the state in place
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, saved)
    saved.seek(0)
    record = dict(torch.load(saved, weights_only=False), params=_local(model))
    _train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    record.update(next_params=_local(model), platform=_platform())
    torch.save(record, path(case, rank))
    ps.destroy_model_parallel()


def resume(rank: int, world_size: int, case: str) -> dict:
    """A fresh model and optimizer loaded from the asset: (saved, loaded) state tensors of
    this rank, and (recorded, computed) next parameters."""
    from megatron.core import parallel_state as ps

    model, opt = _build()
    record = torch.load(path(case, rank), weights_only=False)
    saved = copy.deepcopy(record["optimizer"]["state"])  # loading may keep these tensors
    model.load_state_dict(record["model"])
    opt.load_state_dict(record["optimizer"])
    loaded = copy.deepcopy(opt.state_dict())  # the next step changes it in place
    replicas = {  # the row state in memory: (TP dim, TP size, rows of the local view, tensor)
        plan.name: (
            plan.partition_dim,
            plan.tp_size,
            sum(m for m, _ in view.matrix_shapes),
            state["row_second_moment"].clone(),
        )
        for state, view, plan in opt._row_state_entries()
    }
    _train(model, opt, range(SAVE_AT, SAVE_AT + 1))
    out = dict(
        saved=saved,
        loaded=loaded["state"],
        recorded=record["next_params"],
        computed=_local(model),
        platform=record["platform"],
        replicas=replicas,
        params=record["params"],
    )
    ps.destroy_model_parallel()
    return out


if __name__ == "__main__":
    from distributed_harness import WorkerPool

    case = sys.argv[1]
    os.makedirs(FOLDER, exist_ok=True)
    with WorkerPool(CASES[case], pg_timeout_s=180) as pool:
        pool.run(write, case)
    sys.exit(0)
