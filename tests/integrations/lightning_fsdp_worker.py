"""One torchrun rank of test_lightning.py::test_fsdp2_two_ranks_match_single_process.

Lightning's FSDP2 path: ``ModelParallelStrategy`` (data_parallel_size=2, tensor_parallel_size=1,
gloo on CPU), ``fully_shard`` per decoder layer and at the root in ``configure_model``;
``muonscale.integrations.lightning.configure_optimizers`` then sees DTensor parameters."""

import os
import sys

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from test_lightning import LM, _fit
from tiny_models import TokenData, leave_process_group
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from muonscale.distributed import DTensorMuon


class ShardedLM(LM):
    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def on_train_start(self):
        optimizer = self.trainer.optimizers[0]
        assert isinstance(optimizer, DTensorMuon), type(optimizer)
        assert all(isinstance(p, DTensor) for p in self.parameters())


kind, tmp, out = sys.argv[1:4]
module = ShardedLM(kind)
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
    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    sampler=sampler,
    use_distributed_sampler=False,
)
assert dist.get_world_size() == 2 and dist.get_backend() == "gloo"
full = {n: p.detach().full_tensor() for n, p in module.named_parameters()}
if dist.get_rank() == 0:
    torch.save(full, out)
leave_process_group()
