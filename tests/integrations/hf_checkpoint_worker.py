"""One torchrun rank of test_hf.py::test_distributed_muon_checkpoint_resume_two_ranks.

Three Trainer runs in one process group, each with ``DistributedMuonFactory`` and
``DistributedCheckpointCallback``: uninterrupted (no saves), saving every 2 steps, and resumed
from the first checkpoint into a differently initialized model."""

import sys

import torch
import torch.distributed as dist
from test_hf import MUON_KWARGS, SequentialTrainer, _args
from tiny_models import TokenData, leave_process_group, tiny_model

from muonscale.distributed import DistributedMuon
from muonscale.integrations.hf import DistributedCheckpointCallback, DistributedMuonFactory

kind, tmp, out = sys.argv[1:4]
STEPS = 4


def run(sub: str, seed: int = 0, resume: str | None = None, **overrides) -> dict:
    args = _args(
        f"{tmp}/{sub}",
        per_device_train_batch_size=2,
        max_steps=STEPS,
        max_grad_norm=1.0,
        ddp_backend="gloo",
        **overrides,
    )
    trainer = SequentialTrainer(
        model=tiny_model(kind, seed),
        args=args,
        train_dataset=TokenData(),
        optimizer_cls_and_kwargs=(DistributedMuonFactory, dict(MUON_KWARGS)),
        callbacks=[DistributedCheckpointCallback()],
    )
    trainer.train(resume_from_checkpoint=resume)
    opt = trainer.optimizer.optimizer  # inside accelerate's AcceleratedOptimizer
    assert isinstance(opt, DistributedMuon) and opt.reduction.options.reduce_at == "never"
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    assert set(opt.owner_rank[i] for i in opt.muon_indices) == {0, 1}, "matrices on both ranks"
    state = opt.state_dict()  # collective, every rank
    return {
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "state": state["state"],
        "names": [opt.param_names[id(p)] for p in opt.params],
    }


full = run("full")
saved = run("saved", save_strategy="steps", save_steps=2)
resumed = run("saved", seed=1, resume=f"{tmp}/saved/checkpoint-2")
assert dist.get_world_size() == 2
if dist.get_rank() == 0:
    torch.save({"full": full, "saved": saved, "resumed": resumed}, out)
leave_process_group()
