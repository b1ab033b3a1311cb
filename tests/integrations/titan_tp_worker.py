"""One torchrun rank of test_torchtitan.py::test_tensor_parallel_plan_matches_single_process.

torchtitan's own parallelization of llama3: the model config's TP plan
(``set_llama3_sharding_config``, sequence parallel on, as torchtitan's default) and
``parallelize_llama`` (TP via ``Module.parallelize``, then FSDP2 on the ``fsdp`` axis, applied
even at degree 1) on a (fsdp=DP, tp=TP) gloo mesh, ``spmd_backend="partial_dtensor"``
(DTensors for the model-parallel axes). The MuonScale container builds a DTensorMuon; the loss
is computed under ``loss_parallel`` (vocab-sharded logits), as torchtitan's trainer does. Writes
the full parameters after ``STEPS`` steps (rank 0).
"""

import sys

import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from tiny_models import leave_process_group
from titan_models import batch, loss_of, tiny_config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.models.llama3.parallelize import parallelize_llama
from torchtitan.models.llama3.sharding import set_llama3_sharding_config

from muonscale.distributed import DTensorMuon
from muonscale.integrations.torchtitan import muonscale_optimizers

dp, tp, steps, tmp, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:6]
MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01}

# torchtitan 0.3.0 builds its meshes on tools.utils.device_type, which is "cuda" when no
# accelerator is found; this CPU run needs "cpu" there.
titan_parallel_dims.device_type = "cpu"
dist.init_process_group("gloo")
parallelism = ParallelismConfig(
    data_parallel_shard_degree=dp, tensor_parallel_degree=tp, spmd_backend="partial_dtensor"
)
parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
parallel_dims.build_mesh()
config = tiny_config("llama3")
set_llama3_sharding_config(config, enable_sp=parallelism.enable_sequence_parallel)
torch.manual_seed(0)  # the same initial weights as titan_models.tiny_model("llama3")
model = config.build()
model.init_states()
parallelize_llama(
    model,
    parallel_dims=parallel_dims,
    training=TrainingConfig(mixed_precision_param="float32"),
    parallelism=parallelism,
    compile_config=CompileConfig(),
    ac_config=None,
    dump_folder=tmp,
)
assert all(isinstance(p, DTensor) for p in model.parameters())
# parallelize_llama turns FSDP's gradient division off (factor 1: the trainer divides the summed
# loss by the global token count); FSDP then reduce-scatters with PREMUL_SUM(1), which gloo
# lacks. A plain SUM is the same reduction.
for module in model.modules():
    if isinstance(module, FSDPModule):
        module.set_force_sum_reduction_for_comms(True)
optimizers = muonscale_optimizers(**MUON_KWARGS).build(model_parts=[model])
assert isinstance(optimizers.optimizers[0], DTensorMuon), type(optimizers.optimizers[0])

dp_rank = parallel_dims.get_mesh("fsdp").get_local_rank() if dp > 1 else 0
for step in range(steps):
    tokens = batch(step).chunk(dp)[dp_rank]  # every TP rank of a DP group reads the same rows
    optimizers.zero_grad()
    with loss_parallel():
        # torchtitan's loss: local token sum / global token count (FSDP sums over DP ranks);
        # every DP rank has the same number of tokens, so that is the local mean / dp
        (loss_of(model, tokens) / dp).backward()
    optimizers.step()

params = {n: p.detach().full_tensor() for n, p in model.named_parameters()}
if dist.get_rank() == 0:
    torch.save(params, out)
leave_process_group()
