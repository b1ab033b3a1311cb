"""One torchrun rank of test_hf.py::test_distributed_muon_checkpoint_resume_two_ranks.

Three Trainer runs in one process group, each with ``DistributedMuonFactory`` and
``DistributedCheckpointCallback``: uninterrupted (no saves), saving every 2 steps, and resumed
from the first checkpoint into a differently initialized model. Expert stacks (Qwen3-MoE) are
spread over both ranks, a range of experts each."""

import sys

import torch
import torch.distributed as dist
from test_hf import MUON_KWARGS, ConvertingResumeTrainer, SequentialTrainer, _args
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
    cls = ConvertingResumeTrainer if kind == "qwen3_moe" else SequentialTrainer
    trainer = cls(
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
    assert set(opt.owner_rank.values()) == {0, 1}, "matrices on both ranks"
    stacks = [p for p in trainer.model.parameters() if p.ndim == 3]
    # an expert stack's experts on both ranks, a range each
    assert len(opt.expert_ranges) == len(stacks), (len(opt.expert_ranges), len(stacks))
    assert all(len(ranges) == 2 for ranges in opt.expert_ranges.values())
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
