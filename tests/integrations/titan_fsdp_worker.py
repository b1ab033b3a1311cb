"""One torchrun rank of test_torchtitan.py::test_fsdp_two_ranks_and_dcp_onto_one_rank.

A tiny llama3 under FSDP2 (``fully_shard`` per block and at the root) on a 1-D gloo mesh; the
MuonScale container builds a DTensorMuon on the mesh's group. Trains ``STEPS`` steps on the
global batch split across ranks, saves model + optimizer with DCP, trains ``MORE`` steps, and
writes the full parameters and the full optimizer state at the save point (rank 0).
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from tiny_models import leave_process_group
from titan_models import batch, loss_of, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from muonscale.distributed import DTensorMuon
from muonscale.integrations.torchtitan import muonscale_optimizers

kind, ckpt, out, steps, more = (
    sys.argv[1],
    sys.argv[2],
    sys.argv[3],
    int(sys.argv[4]),
    int(sys.argv[5]),
)
MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01}

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
model = tiny_model(kind)
for layer in model.layers.values():
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
optimizers = muonscale_optimizers(**MUON_KWARGS).build(model_parts=[model])
assert isinstance(optimizers.optimizers[0], DTensorMuon), type(optimizers.optimizers[0])


def train(first: int, count: int) -> None:
    for step in range(first, first + count):
        tokens = batch(step)
        local = tokens.chunk(world)[rank]
        optimizers.zero_grad()
        # FSDP2 averages gradients over ranks: the mean of per-rank mean losses is the mean loss
        loss_of(model, local).backward()
        optimizers.step()


def full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value.clone()


train(0, steps)
dcp.save({"model": model.state_dict(), "optimizer": optimizers.state_dict()}, checkpoint_id=ckpt)
saved_state = {k: full(v) for k, v in optimizers.state_dict().items() if torch.is_tensor(v)}
train(steps, more)
params = {n: full(p.detach()) for n, p in model.named_parameters()}
if rank == 0:
    torch.save({"params": params, "state": saved_state}, out)
leave_process_group()
