"""One torchrun rank of test_lightning.py::test_ddp_two_ranks_match_single_process."""

import os
import sys

import lightning as L
import torch
import torch.distributed as dist
from test_lightning import LM, _fit
from tiny_models import TokenData, leave_process_group

kind, tmp, out = sys.argv[1:4]
module = LM(kind)
# Lightning's automatic DistributedSampler did not deal samples in plain round-robin order
# here; the oracle (samples 4k..4k+3 at step k) needs it, so the worker passes its own.
sampler = torch.utils.data.DistributedSampler(
    TokenData(), num_replicas=2, rank=int(os.environ["RANK"]), shuffle=False
)
trainer = _fit(
    module,
    tmp,
    batch=2,
    max_steps=3,
    gradient_clip_val=0.05,
    devices=2,
    strategy="ddp",
    sampler=sampler,
    use_distributed_sampler=False,
)
assert isinstance(trainer.strategy, L.pytorch.strategies.DDPStrategy)
assert dist.get_world_size() == 2 and dist.get_backend() == "gloo"
if dist.get_rank() == 0:
    torch.save({n: p.detach().clone() for n, p in module.named_parameters()}, out)
leave_process_group()
