"""One torchrun rank of test_torchtitan.py::test_pipeline_stages_on_their_process_groups.

pp=2 × dp=2 on a (pp, dp) gloo mesh of 4 ranks: each rank holds one stage of a 4-layer llama3
(split as torchtitan's pipeline splitting leaves it), FSDP2-sharded on its stage's ``dp`` axis;
``torch.distributed.pipelining`` (the runtime torchtitan uses) runs GPipe with 2 microbatches
over the ``pp`` axis. The MuonScale container builds one DTensorMuon for the stage, on the
stage's data-parallel group. Writes the stage's full parameters after ``STEPS`` steps (dp rank 0
of each stage, one file per stage).
"""

import sys

import torch
import torch.distributed as dist
from test_torchtitan import _pipeline_stages
from tiny_models import leave_process_group
from titan_models import batch, tiny_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from muonscale.distributed import DTensorMuon
from muonscale.integrations.torchtitan import muonscale_optimizers

steps, out = int(sys.argv[1]), sys.argv[2]
MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01}
PP, DP = 2, 2

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
stage_index, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
module = _pipeline_stages(tiny_model("llama3", n_layers=4))[stage_index]
for layer in module.layers.values():
    fully_shard(layer, mesh=mesh["dp"])
fully_shard(module, mesh=mesh["dp"])

optimizers = muonscale_optimizers(**MUON_KWARGS).build(model_parts=[module])
(optimizer,) = optimizers.optimizers
assert isinstance(optimizer, DTensorMuon), type(optimizer)
stage_group = dist.get_process_group_ranks(optimizer.process_group)
assert stage_group == mesh["dp"].mesh.tolist(), (stage_group, mesh["dp"].mesh)


def loss_fn(logits, targets):
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )


stage = PipelineStage(module, stage_index, PP, torch.device("cpu"), group=mesh["pp"].get_group())
# GPipe averages the microbatches' gradients (scale_grads); FSDP2 averages the dp ranks'
schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
for step in range(steps):
    tokens = batch(step).chunk(DP)[dp_rank]
    optimizers.zero_grad()
    if stage_index == 0:
        schedule.step(tokens[:, :-1])
    else:
        schedule.step(target=tokens[:, 1:])
    optimizers.step()

params = {n: p.detach().full_tensor() for n, p in module.named_parameters()}
if dp_rank == 0:
    torch.save(params, f"{out}.stage{stage_index}")
leave_process_group()
