"""DistributedMuon checkpoints through torch.distributed.checkpoint, across world sizes.

Save at 4 ranks (3 Muon matrices: one rank owns nothing), load at 2 and at 1 (also into
single-process ``muonscale.Muon``), and save at 2 / load at 4; every resumed run must match
the uninterrupted one. Every rank sees the same batch, so all layouts compute the same update.
With fp32 main copies of a bf16 model (injected gradients whose bf16 mean is exact at any world
size), resuming is bit-identical, at the same and at another world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from distributed_harness import shared_pool
from test_distributed_dp import OPTS, bf16_models, main_copies, make_model, train, train_injected
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import muonscale
from muonscale.distributed import DistributedMuon

pytestmark = pytest.mark.timeout(180)

MODEL = dict(n_hidden=3, width=10)
SAVE_AT, TOTAL = 2, 4


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _save(rank, world_size, path):
    """Train SAVE_AT steps, checkpoint, train on to TOTAL: the uninterrupted reference."""
    model = make_model(**MODEL)
    opt = DistributedMuon(model, **OPTS)
    train(model, opt, SAVE_AT)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train(model, opt, TOTAL - SAVE_AT, first_step=SAVE_AT)
    owned = sum(1 for i, r in opt.owner_rank.items() if r == opt.rank)
    return _params(model), owned


def _resume(rank, world_size, path, plain_muon=False):
    """Fresh model (other seed) and optimizer, load the checkpoint, train to TOTAL."""
    model = make_model(seed=123, **MODEL)
    opt = muonscale.Muon(model, **OPTS) if plain_muon else DistributedMuon(model, **OPTS)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train(model, opt, TOTAL - SAVE_AT, first_step=SAVE_AT)
    return _params(model)


def _assert_close(got: dict, want: dict, what: str) -> float:
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    print(f"\n{what}: max |dW| vs uninterrupted = {diff:.3g}")
    assert diff <= 1e-6, what
    return diff


# the load into one process is on purpose; torch.distributed.checkpoint says it assumes so
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_save_4_load_2_and_1(tmp_path):
    path = str(tmp_path / "ckpt4")
    saved = shared_pool(4).run(_save, path)
    reference = saved[0][0]
    assert [s[1] for s in saved].count(0) >= 1  # a rank that owns nothing took part
    for got in shared_pool(2).run(_resume, path):
        _assert_close(got, reference, "saved at 4, resumed at 2")
    assert not dist.is_initialized()
    _assert_close(_resume(0, 1, path), reference, "saved at 4, resumed at 1 (DistributedMuon)")
    _assert_close(_resume(0, 1, path, True), reference, "saved at 4, resumed in muonscale.Muon")


def test_save_2_load_4(tmp_path):
    path = str(tmp_path / "ckpt2")
    reference = shared_pool(2).run(_save, path)[0][0]
    for got in shared_pool(4).run(_resume, path):
        _assert_close(got, reference, "saved at 2, resumed at 4")


def _save_main(rank, world_size, path):
    """bf16 model with fp32 main copies: SAVE_AT steps, checkpoint, on to TOTAL."""
    model, _ = bf16_models(**MODEL)
    opt = DistributedMuon(model, **OPTS, main_params_dtype=torch.float32, bucket_cap_mb=2e-4)
    train_injected(model, opt, SAVE_AT)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    train_injected(model, opt, TOTAL - SAVE_AT, first_step=SAVE_AT)
    return _params(model), main_copies(opt)


def _resume_main(rank, world_size, path):
    model, _ = bf16_models(seed=123, **MODEL)
    opt = DistributedMuon(model, **OPTS, main_params_dtype=torch.float32)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    train_injected(model, opt, TOTAL - SAVE_AT, first_step=SAVE_AT)
    return _params(model), main_copies(opt)


def _assert_identical(got, want, what: str) -> None:
    for name, kind in ((0, "parameters"), (1, "main copies")):
        diff = max((got[name][n] - want[name][n]).abs().max().item() for n in want[name])
        print(f"\n{what}: {kind} max |dW| vs uninterrupted = {diff:.3g}")
        assert all(torch.equal(got[name][n], want[name][n]) for n in want[name]), (what, kind)


def test_main_copies_resume_bit_identical_and_at_another_world_size(tmp_path):
    path2, path4 = str(tmp_path / "main2"), str(tmp_path / "main4")
    reference = shared_pool(2).run(_save_main, path2)[0]
    for got in shared_pool(2).run(_resume_main, path2):
        _assert_identical(got, reference, "main copies: saved at 2, resumed at 2")
    saved4 = shared_pool(4).run(_save_main, path4)[0]
    _assert_identical(saved4, reference, "main copies: 4 ranks vs 2 ranks, uninterrupted")
    for got in shared_pool(2).run(_resume_main, path4):
        _assert_identical(got, saved4, "main copies: saved at 4, resumed at 2")


def _fresh_state_dict(rank, world_size):
    torch.manual_seed(0)
    # two Muon matrices and no AdamW parameter: at 4 ranks, ranks 2 and 3 hold no tensor state
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 6, bias=False), torch.nn.Linear(6, 6, bias=False)
    )
    opt = DistributedMuon(model, **OPTS)
    non_empty = bool(opt.state)  # so DCP never runs its initialization step() on one rank alone
    _, optim_sd = get_state_dict(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():  # DCP's initialization step: zero gradients, lr 0
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    unchanged = all(torch.equal(p, q) for p, q in zip(before, model.parameters()))
    return non_empty, sorted(optim_sd["state"]), unchanged


def test_fresh_optimizer_state_dict_with_ranks_owning_nothing():
    for non_empty, keys, unchanged in shared_pool(4).run(_fresh_state_dict):
        assert non_empty and unchanged
        assert keys == ["0.weight", "1.weight"]


def _prepared(rank, world_size):
    """prepare_state_dict (collective), then state_dict() on rank 0 alone: the collective
    state_dict's contents; after a step, state_dict() gathers the new state again."""
    model = make_model(**MODEL)
    opt = DistributedMuon(model, **OPTS)
    train(model, opt, 1)
    collective = opt.state_dict()
    opt.prepare_state_dict()
    alone = opt.state_dict() if rank == 0 else None  # no collective: other ranks do not call
    dist.barrier()
    train(model, opt, 1, first_step=1)
    after = opt.state_dict()  # collective again, the state after the second step

    def equal(a, b):
        return a["state"].keys() == b["state"].keys() and all(
            torch.equal(v, b["state"][i][k]) for i, e in a["state"].items() for k, v in e.items()
        )

    same = rank != 0 or (
        equal(alone, collective) and alone["param_groups"] == collective["param_groups"]
    )
    return same, not equal(after, collective)


def test_prepared_state_dict_on_one_rank():
    for same, moved_on in shared_pool(2).run(_prepared):
        assert same and moved_on
