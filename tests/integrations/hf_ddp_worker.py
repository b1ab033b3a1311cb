"""One torchrun rank of test_hf.py::test_ddp_two_ranks_match_single_process."""

import json
import os
import sys

import torch
from test_hf import SequentialTrainer, _args
from tiny_models import TokenData, algorithm_of, tiny_model

from muonscale.integrations.hf import MuonFactory

kind, tmp, out = sys.argv[1:4]
args = _args(tmp, per_device_train_batch_size=2, max_steps=3, max_grad_norm=1.0, ddp_backend="gloo")
from test_hf import MUON_KWARGS  # noqa: E402

trainer = SequentialTrainer(
    model=tiny_model(kind),
    args=args,
    train_dataset=TokenData(),
    optimizer_cls_and_kwargs=(MuonFactory, dict(MUON_KWARGS)),
)
trainer.train()
assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
assert torch.distributed.get_world_size() == 2
algorithms = algorithm_of(trainer.optimizer)
assert algorithms["lm_head.weight"] == "adamw"
if torch.distributed.get_rank() == 0:
    with open(out, "w") as f:
        json.dump({n: p.detach().tolist() for n, p in trainer.model.named_parameters()}, f)
# Both ranks leave together and shut the group down, then exit without the interpreter's
# teardown: a rank whose gloo threads were destroyed there aborted at exit now and then
# ("terminate called without an active exception"), after its results were written.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
