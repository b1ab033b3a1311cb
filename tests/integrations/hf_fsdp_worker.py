"""One torchrun rank of test_hf.py::test_fsdp2_two_ranks_match_single_process.

The Trainer's FSDP2 path with accelerate's own preparation: the optimizer is built on the
whole model (``MuonFactory``), then ``Accelerator._prepare_fsdp2`` runs ``fully_shard`` per
decoder layer and at the root and swaps the DTensor shards into the optimizer's groups.

accelerate 1.15 enables FSDP only on accelerator devices (``AcceleratorState`` keeps the plugin
for MULTI_GPU/NPU/XPU/... only): on CPU it drops the plugin silently and the Trainer runs DDP.
:class:`CpuFsdp2Trainer` sets the state accelerate would have set on a GPU machine (FSDP with
the plugin built from the same ``TrainingArguments``); everything after is unpatched."""

import sys

import torch
import torch.distributed as dist
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from test_hf import MUON_KWARGS, SequentialTrainer, _args
from tiny_models import TokenData, algorithm_of, leave_process_group, tiny_model
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from muonscale.distributed import DTensorMuon
from muonscale.integrations.hf import MuonFactory, accelerate_fsdp_version


class CpuFsdp2Trainer(SequentialTrainer):
    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        state = self.accelerator.state
        assert state.distributed_type == DistributedType.MULTI_CPU, state.distributed_type
        assert not self.is_fsdp_enabled  # the gate lifted here: on CPU accelerate dropped FSDP
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


kind, tmp, out, max_grad_norm = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
args = _args(
    tmp,
    per_device_train_batch_size=1,  # 2 ranks x 1 x 2 micro-batches = the oracle's batch of 4
    gradient_accumulation_steps=2,
    max_steps=3,
    max_grad_norm=max_grad_norm,
    ddp_backend="gloo",
    fsdp=True,
    fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
)
trainer = CpuFsdp2Trainer(
    model=tiny_model(kind),
    args=args,
    train_dataset=TokenData(),
    optimizer_cls_and_kwargs=(MuonFactory, dict(MUON_KWARGS)),
)
assert accelerate_fsdp_version() == 2
trainer.train()
optimizer = trainer.optimizer.optimizer  # inside accelerate's AcceleratedOptimizer
assert isinstance(optimizer, DTensorMuon), type(optimizer)
assert isinstance(trainer.model, FSDPModule)
params = dict(trainer.model.named_parameters())
assert all(isinstance(p, DTensor) for p in params.values())
bound = {id(p) for g in optimizer.param_groups for p in g["params"]}
assert bound == {id(p) for p in params.values()}  # the optimizer steps the shards
assert algorithm_of(optimizer)["lm_head.weight"] == "adamw"
assert algorithm_of(optimizer)["model.layers.0.mlp.up_proj.weight"] == "muon"
assert dist.get_world_size() == 2 and dist.get_backend() == "gloo"
full = {n: p.detach().full_tensor() for n, p in params.items()}
norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
if dist.get_rank() == 0:
    torch.save({"params": full, "grad_norms": norms}, out)
leave_process_group()
