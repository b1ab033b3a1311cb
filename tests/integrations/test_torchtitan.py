"""muonscale.integrations.torchtitan with torchtitan 0.3.0's OptimizersContainer, on tiny
llama3 and qwen3 (dense and MoE) models built from their model args.

Oracles: torchtitan's own module layout (routing, FusedQKVLinear's q/k/v split), muonscale's
matrix views, an uninterrupted run (DCP resume, bit-exact), the same model unsplit (pipeline
stages) and single-process muonscale.Muon (FSDP2 at 2 gloo ranks, torchtitan's llama3 TP plan at
dp × tp = 1 × 2 and 2 × 2, pp=2 × dp=2 pipeline stages, DCP onto 1 rank)."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from titan_models import batch, loss_of, tiny_model
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.models.common.attention import FusedQKVLinear

from muonscale import Muon, QKVLayout
from muonscale.integrations.torchtitan import (
    MuonScaleOptimizersContainer,
    fused_qkv_layouts,
    muonscale_optimizers,
)

HERE = os.path.dirname(os.path.abspath(__file__))
MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01}
KINDS = ["llama3", "qwen3", "qwen3_moe"]


def build(model_parts, **overrides):
    return muonscale_optimizers(**dict(MUON_KWARGS, **overrides)).build(model_parts=model_parts)


def train(model_parts, optimizers, first: int, count: int, forward=None) -> list[float]:
    forward = forward or (lambda tokens: loss_of(model_parts[0], tokens))
    losses = []
    for step in range(first, first + count):
        optimizers.zero_grad()
        loss = forward(batch(step))
        loss.backward()
        optimizers.step()
        losses.append(loss.item())
    return losses


def expected_algorithm(name: str, param: torch.Tensor) -> str:
    """torchtitan's names: embeddings, lm_head and every < 2-D tensor (norms) stay on AdamW."""
    if name in ("tok_embeddings.weight", "lm_head.weight") or param.ndim < 2:
        return "adamw"
    return "muon"


@pytest.mark.parametrize("kind", KINDS)
def test_routing_by_canonical_fqn_with_aligned_param_names(kind):
    model = tiny_model(kind)
    optimizers = build([model])
    assert isinstance(optimizers, MuonScaleOptimizersContainer) and len(optimizers) == 1
    (optimizer,) = optimizers.optimizers
    assert type(optimizer) is Muon
    named = dict(model.named_parameters())
    seen = []
    for group in optimizer.param_groups:
        # param_names aligned with params in every routed group
        assert [id(named[n]) for n in group["param_names"]] == [id(p) for p in group["params"]]
        for name in group["param_names"]:
            assert group["algorithm"] == expected_algorithm(name, named[name]), name
        seen += group["param_names"]
    assert sorted(seen) == sorted(named)
    experts = [n for n in named if named[n].ndim == 3]
    assert bool(experts) == (kind == "qwen3_moe")
    for name in experts:  # (E, F, D): E separate F×D matrices
        group = next(g for g in optimizer.param_groups if name in g.get("param_names", ()))
        view = optimizer.param_table.view(named[name], group["matrix_mode"])
        assert view.matrix_shapes == [tuple(named[name].shape[1:])] * named[name].shape[0]


@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
def test_fused_qkv_layout_matches_torchtitan_split(kind):
    """QKVLayout's q/k/v rows of wqkv give exactly the xq, xk, xv of FusedQKVLinear.forward."""
    model = tiny_model(kind)
    layouts = fused_qkv_layouts(model)
    modules = {n: m for n, m in model.named_modules() if isinstance(m, FusedQKVLinear)}
    assert sorted(layouts) == sorted(f"{n}.wqkv.weight" for n in modules)
    optimizer = build([model]).optimizers[0]
    named = dict(model.named_parameters())
    x = torch.randn(2, 5, model.config.dim)
    for module_name, module in modules.items():
        layout = layouts[f"{module_name}.wqkv.weight"]
        assert isinstance(layout, QKVLayout) and layout.q_per_group == module.heads_per_kv
        weight = module.wqkv.weight.detach()
        with torch.no_grad():
            xq, xk, xv = module(x)
        for rows, want in zip(layout.row_partition("qkv"), (xq, xk, xv)):
            got = (x @ weight[rows].T).unflatten(-1, (-1, module.head_dim))
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        rows = optimizer.split_rows[id(named[f"{module_name}.wqkv.weight"])]
        assert [r.tolist() for r in rows] == [r.tolist() for r in layout.row_partition("qkv")]


@pytest.mark.parametrize("kind", KINDS)
def test_loss_falls(kind):
    model = tiny_model(kind)
    losses = train([model], build([model]), 0, 12)
    # a learnable stream from ~ln(64) = 4.16: the last steps' mean is clearly lower
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses


def test_flat_state_dict_round_trip_and_torchtitan_keys():
    """torchtitan's flat FQN-keyed dict of the routed optimizer loads back (was KeyError
    'betas')."""
    model = tiny_model("qwen3")
    optimizers = build([model])
    train([model], optimizers, 0, 2)
    flat = optimizers.state_dict()
    assert flat["param_groups.lm_head.weight.betas"] == (0.9, 0.95)
    assert flat["param_groups.layers.0.attention.wo.weight.algorithm"] == "muon"
    assert "state.layers.0.attention.wo.weight.momentum_buffer" in flat
    other = build([copy.deepcopy(model)])
    other.load_state_dict(flat)
    again = other.state_dict()
    assert sorted(again) == sorted(flat)
    for key, value in flat.items():
        if torch.is_tensor(value):
            assert torch.equal(again[key], value), key
        else:
            assert again[key] == value, key


def test_mixed_with_torchtitan_adamw_and_unknown_names_rejected():
    model = tiny_model("llama3")
    config = MuonScaleOptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r"norm",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-3, "weight_decay": 0.0},
            ),
            ParamGroupConfig(
                pattern=".*", optimizer_name="MuonScale", optimizer_kwargs=MUON_KWARGS
            ),
        ],
        implementation="for-loop",
    )
    optimizers = config.build(model_parts=[model])
    kinds = sorted(type(o).__name__ for o in optimizers)
    assert kinds == ["AdamW", "Muon"]
    muon = next(o for o in optimizers if isinstance(o, Muon))
    assert not any("norm" in n for g in muon.param_groups for n in g["param_names"])
    train([model], optimizers, 0, 2)
    with pytest.raises(NotImplementedError):
        OptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="MuonScale")]
        ).build(model_parts=[tiny_model("llama3")])
    with pytest.raises(ValueError, match="same optimizer_kwargs"):
        MuonScaleOptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(
                    pattern="layers.0", optimizer_name="MuonScale", optimizer_kwargs={"lr": 0.02}
                ),
                ParamGroupConfig(
                    pattern=".*", optimizer_name="MuonScale", optimizer_kwargs={"lr": 0.01}
                ),
            ]
        ).build(model_parts=[tiny_model("llama3")])


@pytest.mark.parametrize("kind", ["llama3", "qwen3_moe"])
def test_dcp_resume_is_bit_exact(kind, tmp_path):
    model = tiny_model(kind)
    optimizers = build([model])
    train([model], optimizers, 0, 3)
    dcp.save(
        {"model": model.state_dict(), "optimizer": optimizers.state_dict()},
        checkpoint_id=str(tmp_path),
    )
    train([model], optimizers, 3, 3)

    resumed = tiny_model(kind, seed=1)  # other weights: everything must come from the checkpoint
    resumed_optimizers = build([resumed])
    state = {"model": resumed.state_dict(), "optimizer": resumed_optimizers.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path))
    resumed.load_state_dict(state["model"])
    resumed_optimizers.load_state_dict(state["optimizer"])
    train([resumed], resumed_optimizers, 3, 3)
    for (name, want), (_, got) in zip(model.named_parameters(), resumed.named_parameters()):
        assert torch.equal(got, want), name


def _pipeline_stages(model):
    """Two stages as torchtitan's pipeline splitting leaves them: stage 0 keeps the embeddings
    and the first half of the blocks, stage 1 the rest, the final norm and the head."""
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    n = len(model.layers)
    for i in range(n // 2, n):
        del first.layers[str(i)]
    for i in range(n // 2):
        del second.layers[str(i)]
    first.norm = first.lm_head = None
    second.tok_embeddings = None
    return [first, second]


def test_one_optimizer_per_pipeline_stage():
    model = tiny_model("llama3", n_layers=4)
    stages = _pipeline_stages(model)
    optimizers = build(stages)
    assert len(optimizers) == 2
    for stage, optimizer in zip(stages, optimizers):
        names = {n for g in optimizer.param_groups for n in g["param_names"]}
        assert names == {n for n, _ in stage.named_parameters()}

    def staged_loss(tokens):
        logits = stages[1](stages[0](tokens[:, :-1]))
        return torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )

    train(stages, optimizers, 0, 3, forward=staged_loss)
    whole = build([model])
    train([model], whole, 0, 3)
    assert sorted(optimizers.state_dict()) == sorted(whole.state_dict())  # one flat FQN space
    staged = {n: p for s in stages for n, p in s.named_parameters()}
    # Same losses and gradients; Muon batches same-shape matrices per optimizer, so the two runs
    # batch different sets: float32 rounding (eps 1.2e-7) amplified ≲ 10^2 by Newton–Schulz, on
    # 3 updates of size lr·0.2·sqrt(max dim) ≲ 0.03 → atol 1e-5.
    for name, want in model.named_parameters():
        torch.testing.assert_close(staged[name], want, rtol=0, atol=1e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_two_ranks_and_dcp_onto_one_rank(tmp_path):
    """FSDP2 at 2 gloo ranks (DTensorMuon on the mesh's group) against single-process Muon; its
    DCP checkpoint (sharded DTensor state) loads exactly onto 1 rank and training continues."""
    steps, more = 3, 2
    ckpt, out = tmp_path / "ckpt", tmp_path / "out.pt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), HERE]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={_free_port()}",
        os.path.join(HERE, "titan_fsdp_worker.py"),
        "llama3",
        str(ckpt),
        str(out),
        str(steps),
        str(more),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    fsdp = torch.load(out)

    reference = tiny_model("llama3")
    reference_optimizers = build([reference])
    train([reference], reference_optimizers, 0, steps)
    flat = reference_optimizers.state_dict()
    # Two summation orders (per-rank mean losses averaged vs one mean; gather/scatter of whole
    # matrices): float32 gradients agree to ~1e-6 relative, Newton–Schulz amplifies ≲ 10^2,
    # 5 updates of size ≲ 0.03 → atol 1e-4 on parameters and state.
    for key, value in fsdp["state"].items():
        torch.testing.assert_close(value, flat[key], rtol=0, atol=1e-4, msg=key)

    resumed = tiny_model("llama3", seed=1)
    resumed_optimizers = build([resumed])
    state = {"model": resumed.state_dict(), "optimizer": resumed_optimizers.state_dict()}
    dcp.load(state, checkpoint_id=str(ckpt))  # 2 shards → 1 rank
    resumed.load_state_dict(state["model"])
    resumed_optimizers.load_state_dict(state["optimizer"])
    loaded = resumed_optimizers.state_dict()
    for key, value in fsdp["state"].items():  # the mesh change itself loses nothing
        assert torch.equal(loaded[key], value), key
    train([resumed], resumed_optimizers, steps, more)
    train([reference], reference_optimizers, steps, more)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(fsdp["params"][name], p.detach(), rtol=0, atol=1e-4, msg=name)
        torch.testing.assert_close(
            dict(resumed.named_parameters())[name].detach(), p.detach(), rtol=0, atol=1e-4, msg=name
        )


def _torchrun(nproc: int, worker: str, *args) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), HERE]), OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        os.path.join(HERE, worker),
        *map(str, args),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _single_process_params(steps: int) -> dict[str, torch.Tensor]:
    reference = tiny_model("llama3")
    train([reference], build([reference]), 0, steps)
    return {n: p.detach() for n, p in reference.named_parameters()}


# Distributed vs single-process: float32 with other summation orders (TP's sharded matmuls and
# all-reduces, FSDP's reduce-scatter, sharded softmax of loss_parallel): gradients agree to
# ~n·eps (n ≲ 10^2 terms, eps 1.2e-7); Newton–Schulz amplifies ≲ 10^2; 3 updates of size
# ≲ lr·0.2·sqrt(max dim) ≈ 0.03 → |Δparam| ≲ 3 · 0.03 · 10^4 · eps ≈ 1e-4.
DISTRIBUTED_ATOL = 1e-4


@pytest.mark.timeout(400)
@pytest.mark.parametrize("dp,tp", [(1, 2), (2, 2)])
def test_tensor_parallel_plan_matches_single_process(dp, tp, tmp_path):
    """torchtitan's own llama3 TP plan and parallelize_llama (FSDP2 on the dp axis) at
    dp × tp gloo ranks: DTensorMuon on the (fsdp, tp) mesh gives single-process Muon's weights
    (the TP plan at dp=1 used to crash: Partial / Replicate gradients on other placements)."""
    steps, out = 3, tmp_path / "out.pt"
    _torchrun(dp * tp, "titan_tp_worker.py", dp, tp, steps, tmp_path, out)
    got = torch.load(out)
    want = _single_process_params(steps)
    initial = dict(tiny_model("llama3").named_parameters())
    assert max((want[n] - initial[n]).abs().max().item() for n in want) > 100 * DISTRIBUTED_ATOL
    for name, p in want.items():
        torch.testing.assert_close(got[name], p, rtol=0, atol=DISTRIBUTED_ATOL, msg=name)


@pytest.mark.timeout(400)
def test_pipeline_stages_on_their_process_groups(tmp_path):
    """pp=2 × dp=2 at 4 gloo ranks: torch.distributed.pipelining (GPipe, 2 microbatches) over
    FSDP2-sharded stages; each stage's DTensorMuon runs on that stage's dp group (the worker
    asserts it). Together the stages' weights are single-process Muon's on the whole model."""
    steps, out = 3, tmp_path / "out.pt"
    _torchrun(4, "titan_pipeline_worker.py", steps, out)
    got = {**torch.load(f"{out}.stage0"), **torch.load(f"{out}.stage1")}
    reference = tiny_model("llama3", n_layers=4)
    train([reference], build([reference]), 0, steps)
    assert sorted(got) == sorted(n for n, _ in reference.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=0, atol=DISTRIBUTED_ATOL, msg=name)


def test_spmd_types_local_shards_refused():
    """torchtitan's spmd_backend="spmd_types" keeps TP parameters as plain local shards with a
    PartitionSpec attribute (as measured: wqkv (32, 32) of (64, 32) at tp=2); orthogonalizing a
    shard would silently not be Muon, so the factory refuses it by name."""
    from spmd_types import PartitionSpec
    from spmd_types.runtime import _set_partition_spec

    model = tiny_model("llama3")
    wqkv = model.layers["0"].attention.qkv_linear.wqkv.weight
    _set_partition_spec(wqkv, PartitionSpec("tp", None))
    with pytest.raises(ValueError, match="layers.0.attention.qkv_linear.wqkv.weight.*spmd_backend"):
        build([model])
    _set_partition_spec(wqkv, PartitionSpec(None, None))  # a replicated spec is a whole tensor
    build([model])


def test_moe_router_on_muon_with_its_reason_and_experts_as_views():
    """The router decision (docs/moe.md): torchtitan's ``moe.router.gate.weight`` (E, D) stays
    on Muon and the summary says why; ``GroupedExperts`` stacks show their expert view."""
    model = tiny_model("qwen3_moe")
    optimizer = build([model]).optimizers[0]
    named = dict(model.named_parameters())
    routers = [n for n in named if n.endswith("router.gate.weight")]
    assert routers
    for name in routers:
        decision = optimizer.routing[name]
        assert decision.algorithm == "muon" and decision.reason.startswith("router (E="), name
    summary = optimizer.summary()
    assert "router (E=" in summary and "(E=" in summary and "× (" in summary
    for name, p in named.items():
        if p.ndim == 3:
            assert optimizer.param_table.expert_layout(p) is not None, name


class _CPUMemoryMonitor:
    """torchtitan's device memory monitor reads CUDA; on CPU, a stand-in with no figures."""

    device_name = "cpu"

    def reset_peak_stats(self) -> None:
        pass

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        return DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)


def test_step_metrics_in_the_metrics_processors_output(tmp_path, monkeypatch):
    """MuonScaleMetricsProcessor: Muon's step metrics in what torchtitan's processor writes
    (its TensorBoard logger, read back), at every logging step."""
    import torchtitan.components.metrics as titan_metrics
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torchtitan.distributed.parallel_dims import ParallelDims

    monkeypatch.setattr(titan_metrics, "build_device_memory_monitor", _CPUMemoryMonitor)

    from muonscale.integrations.torchtitan import MuonScaleMetricsProcessor

    model = tiny_model("llama3")
    optimizers = build([model])
    config = MuonScaleMetricsProcessor.Config(
        enable_tensorboard=True, save_for_all_ranks=True, log_freq=1
    )
    # torchtitan's processor reads the rank: a one-rank process group, as its trainer has
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )
    try:
        processor = config.build(
            parallel_dims=ParallelDims(1, 1, 1, 1, 1, 1, world_size=1), dump_folder=str(tmp_path)
        )
        processor.num_flops_per_token = 1  # set by the trainer from the model
        processor.optimizers = optimizers  # as the trainer does: the metrics are enabled here
        for step in (1, 2):
            (loss,) = train([model], optimizers, step - 1, 1)
            processor.ntokens_since_last_log = 1
            processor.data_loading_times.append(0.0)
            processor.log(step, loss, loss, 1.0)
        processor.logger.close()
    finally:
        torch.distributed.destroy_process_group()
    muon = optimizers.optimizers[0]
    ns_elements = sum(
        p.numel() for g in muon.param_groups if g["algorithm"] == "muon" for p in g["params"]
    )
    (event_file,) = tmp_path.glob("tb/**/events.out.tfevents.*")
    events = EventAccumulator(str(event_file)).Reload()
    logged = events.Scalars("muon/ns_elements")
    assert [(e.step, e.value) for e in logged] == [(1, ns_elements), (2, ns_elements)]
    assert all(e.value > 0 for e in events.Scalars("muon/update_rms/group0_muon"))
