"""One torchrun rank of test_hf.py::test_ddp_two_ranks_match_single_process."""

import json
import sys

import torch
from test_hf import SequentialTrainer, _args
from tiny_models import TokenData, algorithm_of, leave_process_group, tiny_model

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
leave_process_group()
