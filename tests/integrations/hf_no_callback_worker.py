"""One torchrun rank of test_hf.py::test_distributed_factory_without_callback_fails_fast.

``DistributedMuonFactory`` under the Trainer's DDP, saving every step, without
``DistributedCheckpointCallback`` and at the Trainer's default ``ddp_timeout``: each rank
records the error ``train()`` raised and how long it took to come."""

import json
import sys
import time

import torch.distributed as dist
from test_hf import MUON_KWARGS, SequentialTrainer, _args
from tiny_models import TokenData, leave_process_group, tiny_model

from muonscale.integrations.hf import DistributedMuonFactory

kind, tmp, out_dir = sys.argv[1:4]
args = _args(
    tmp,
    per_device_train_batch_size=2,
    max_steps=2,
    save_strategy="steps",
    save_steps=1,
    ddp_backend="gloo",
)
trainer = SequentialTrainer(
    model=tiny_model(kind),
    args=args,
    train_dataset=TokenData(),
    optimizer_cls_and_kwargs=(DistributedMuonFactory, dict(MUON_KWARGS)),
)
start = time.monotonic()
try:
    trainer.train()
    error = None
except Exception as e:  # the result under test: recorded, then compared by the test
    error = f"{type(e).__name__}: {e}"
record = {"error": error, "seconds": time.monotonic() - start, "ddp_timeout": args.ddp_timeout}
with open(f"{out_dir}/rank{dist.get_rank()}.json", "w") as f:
    json.dump(record, f)
leave_process_group()
