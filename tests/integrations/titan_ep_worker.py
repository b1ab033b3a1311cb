"""One torchrun rank of test_titan_expert_parallel.py: torchtitan's own qwen3_moe parallelization
(``Module.parallelize`` for TP and EP, then FSDP2 on ``fsdp`` for dense weights and on ``efsdp``
for routed experts) on a gloo mesh, set up for CPU as torchtitan 0.3.0 needs it:
``spmd_backend="partial_dtensor"`` and ``set_spmd_backend`` (as its Trainer does), the CPU device
type, and FSDP's gradient reduction forced to a plain sum (gloo has no PREMUL_SUM).

The single argument is a JSON spec: ``dp_shard``, ``tp``, ``ep``, ``experts``, ``mode``
(``"inject"``: identical full gradients distributed with each parameter's own placements, then
``steps`` steps; ``"train"``: ``steps`` steps of torchtitan's token dispatch end to end),
``optimizers`` (each of ``"muon"`` and torchtitan's
``"adamw"`` on a model of its own), ``initial`` (the full initial weights), ``out``; optional
``load`` / ``save`` (a DCP checkpoint read before / written after the steps), ``first`` (the first
step's index), ``uninterrupted`` (also run steps 0.. on a fresh model), ``wire`` and
``refuse`` (also build the optimizer on expert placements it must refuse). Rank 0
writes the full parameters per optimizer, the routed experts' placements and, with ``wire``,
every rank's optimizer bytes of one step with gradients on the routed experts only and of one
on the dense matrices only.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchtitan.distributed.parallel_dims as titan_parallel_dims
from tiny_models import leave_process_group
from titan_models import batch, injected_gradients, loss_of, tiny_config
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import set_spmd_backend
from torchtitan.models.qwen3.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

from muonscale.distributed import DTensorMuon
from muonscale.integrations.torchtitan import muonscale_optimizers

spec = json.loads(sys.argv[1])
MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01, "weight_decay": 0.1}
ADAMW_KWARGS = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}

titan_parallel_dims.device_type = "cpu"  # torchtitan 0.3.0 falls back to "cuda" without a GPU
dist.init_process_group("gloo")
parallelism = ParallelismConfig(
    data_parallel_shard_degree=spec["dp_shard"],
    tensor_parallel_degree=spec["tp"],
    expert_parallel_degree=spec["ep"],
    spmd_backend="partial_dtensor",
)
set_spmd_backend("partial_dtensor")
parallel_dims = ParallelDims.from_config(parallelism, dist.get_world_size())
parallel_dims.build_mesh()
# the initial weights of the single-process reference (tiny_model in the test's process), placed
# as the parallelized model holds them: under TP, this process's routers initialize otherwise
initial = torch.load(spec["initial"])


def parallelized_model() -> torch.nn.Module:
    config = tiny_config("qwen3_moe", num_experts=spec["experts"])
    set_qwen3_sharding_config(
        config, enable_sp=parallelism.enable_sequence_parallel, enable_ep=parallel_dims.ep_enabled
    )
    model = config.build()
    model.init_states()
    parallelize_qwen3(
        model,
        parallel_dims=parallel_dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder=spec["out"] + ".dump",
    )
    assert all(isinstance(p, DTensor) for p in model.parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = distribute_tensor(initial[name], p.device_mesh, p.placements)
            p.to_local().copy_(full.to_local())
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)  # PREMUL_SUM(1) is a SUM; gloo lacks it
    return model


def build_optimizers(model: torch.nn.Module, name: str) -> OptimizersContainer:
    if name == "muon":
        optimizers = muonscale_optimizers(**MUON_KWARGS).build(model_parts=[model])
        assert isinstance(optimizers.optimizers[0], DTensorMuon), type(optimizers.optimizers[0])
        return optimizers
    return OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=ADAMW_KWARGS)
        ],
        implementation="for-loop",
    ).build(model_parts=[model])


def inject(model: torch.nn.Module, step: int, only=None) -> None:
    named = dict(model.named_parameters())
    for name, grad in injected_gradients(model, step).items():
        p = named[name]
        p.grad = None
        if only is None or name in only:
            p.grad = distribute_tensor(grad, p.device_mesh, p.placements)


# the batch rows of this rank: every rank of one (dense) data-parallel group reads the same ones
dp = parallel_dims.dp_shard
dp_rank = parallel_dims.get_mesh("fsdp").get_local_rank() if dp > 1 else 0


def run(model, optimizers, first: int, count: int) -> None:
    for step in range(first, first + count):
        optimizers.zero_grad()
        if spec["mode"] == "inject":
            inject(model, step)
        else:
            with loss_parallel():  # the summed local mean losses / dp (FSDP sums over ranks)
                (loss_of(model, batch(step).chunk(dp)[dp_rank]) / dp).backward()
        optimizers.step()


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor().clone() for n, p in model.named_parameters()}  # no views


def refusals() -> list[str | None]:
    """A routed-expert stack given placements the layout cannot read exactly (unreduced values;
    a Shard subclass, whose elements may not be Shard's): building the optimizer refuses it by
    name."""

    class _OtherShard(Shard):
        pass

    model = parallelized_model()
    experts_module = model.layers["0"].moe.routed_experts.inner_experts
    w1 = experts_module.w1_EFD
    messages = []
    for bad in (Partial(), _OtherShard(0)):
        placements = (bad, *w1.placements[1:])
        experts_module.w1_EFD = torch.nn.Parameter(
            DTensor.from_local(w1.to_local(), w1.device_mesh, placements, run_check=False)
        )
        try:
            build_optimizers(model, "muon")
            messages.append(None)
        except ValueError as error:
            messages.append(str(error))
    return messages


def wire_bytes(model, optimizers, step: int) -> dict[str, dict[str, int]]:
    """The optimizer bytes of one step with gradients on the routed experts only, and of one
    with gradients on the dense Muon matrices only (this rank's, by collective)."""
    optimizer = optimizers.optimizers[0]
    experts = {n for n, p in model.named_parameters() if p.ndim == 3}
    muon = {n for g in optimizer.param_groups if g["algorithm"] == "muon" for n in g["param_names"]}
    wire = {}
    for label, only in (("experts", experts), ("dense", muon - experts)):
        optimizers.zero_grad()
        inject(model, step, only)
        optimizers.step()
        wire[label] = {k: v for k, v in optimizer.last_step_wire_breakdown.items() if "muon" in k}
    return wire


out: dict = {}
first = spec.get("first", 0)
for name in spec["optimizers"]:
    model = parallelized_model()
    optimizers = build_optimizers(model, name)
    if spec.get("load"):
        state = {"model": model.state_dict(), "optimizer": optimizers.state_dict()}
        dcp.load(state, checkpoint_id=spec["load"])
        model.load_state_dict(state["model"])
        optimizers.load_state_dict(state["optimizer"])
    run(model, optimizers, first, spec["steps"])
    if spec.get("save"):
        state = {"model": model.state_dict(), "optimizer": optimizers.state_dict()}
        dcp.save(state, checkpoint_id=spec["save"])
    out[name] = full_params(model)
    out["placements"] = {n: repr(p.placements) for n, p in model.named_parameters() if p.ndim == 3}
    if spec.get("uninterrupted"):  # the same steps from step 0 at this layout, in one run
        model = parallelized_model()
        optimizers = build_optimizers(model, name)
        run(model, optimizers, 0, first + spec["steps"])
        out[f"{name}_uninterrupted"] = full_params(model)
    if spec.get("wire"):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, wire_bytes(model, optimizers, first + spec["steps"]))
        out["wire"] = gathered
if spec.get("refuse"):
    out["messages"] = refusals()
if dist.get_rank() == 0:
    torch.save(out, spec["out"])
leave_process_group()
