"""muonscale.integrations.hf under a real Hugging Face Trainer, on tiny GPT-2 and Llama models.

Oracles: a plain torch loop with the same muonscale.Muon (clipping, accumulation, DDP, FSDP2),
an uninterrupted Trainer run (resume), and the same optimizer without the parameter swap (FSDP2
swap emulation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from tiny_models import EMBEDDING_AND_HEAD, TokenData, algorithm_of, free_port, tiny_model
from transformers import Trainer, TrainingArguments

from muonscale.integrations.hf import DistributedMuonFactory, MuonFactory, create_optimizer

HERE = os.path.dirname(os.path.abspath(__file__))


MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01, "scale": "match_rms_adamw"}
# float32 steps through two summation orders (micro-batches vs one batch, DDP's all-reduce vs
# one process): gradients agree to ~n·eps relative (n ≲ 100 terms per entry), and Newton–Schulz
# (5 steps, coefficients up to 3.4·(1+4.8+2.0) per step) amplifies a relative error by ≲ 10^2.
# 3 steps of lr ≤ 0.02 updates: |Δparam| ≲ 3 · 0.02 · 100 · 100 · eps ≈ 7e-5; we allow 1e-4.
PARAM_ATOL = 1e-4


class SequentialTrainer(Trainer):
    """The Trainer with the data in order, so a plain loop can replay the same batches."""

    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)


def _args(tmp_path, **overrides) -> TrainingArguments:
    kwargs = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        lr_scheduler_type="constant",
        warmup_steps=0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kwargs.update(overrides)
    return TrainingArguments(**kwargs)


def _trainer(model, tmp_path, **overrides) -> SequentialTrainer:
    return SequentialTrainer(
        model=model,
        args=_args(tmp_path, **overrides),
        train_dataset=TokenData(),
        optimizer_cls_and_kwargs=(MuonFactory, dict(MUON_KWARGS)),
    )


def plain_loop(model, steps: int, batch: int, max_grad_norm: float | None):
    """The oracle: muonscale.Muon in a hand-written torch loop on the same batches."""
    optimizer = create_optimizer(model, **MUON_KWARGS)
    data = TokenData()
    for step in range(steps):
        ids = torch.stack([data[i]["input_ids"] for i in range(step * batch, (step + 1) * batch)])
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
    return model


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_factory_routes_embeddings_and_head_to_adamw(kind, tmp_path):
    trainer = _trainer(tiny_model(kind), tmp_path)
    trainer.create_optimizer()
    algorithms = algorithm_of(trainer.optimizer)
    for name in EMBEDDING_AND_HEAD[kind]:
        assert algorithms[name] == "adamw", name
    hidden = [n for n in algorithms if ".layers.0." in n or ".h.0." in n]
    matrices = [n for n in hidden if dict(trainer.model.named_parameters())[n].ndim == 2]
    assert matrices and all(algorithms[n] == "muon" for n in matrices)
    assert len(algorithms) == len(list(trainer.model.parameters()))


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_loss_falls(kind, tmp_path):
    trainer = _trainer(tiny_model(kind), tmp_path, max_steps=30, per_device_train_batch_size=8)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_clipping_and_accumulation_match_plain_loop(kind, tmp_path):
    max_grad_norm = 0.05
    trainer = _trainer(
        tiny_model(kind),
        tmp_path,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=max_grad_norm,
    )
    trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert min(norms) > 2 * max_grad_norm, "clipping must be active for this test to mean anything"
    reference = plain_loop(tiny_model(kind), steps=3, batch=4, max_grad_norm=max_grad_norm)
    unclipped = plain_loop(tiny_model(kind), steps=3, batch=4, max_grad_norm=None)
    got = dict(trainer.model.named_parameters())
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got[name].detach(), want.detach(), rtol=0, atol=PARAM_ATOL)
    far = max((got[n] - p).abs().max().item() for n, p in unclipped.named_parameters())
    assert far > 10 * PARAM_ATOL, "the unclipped run must differ, or the comparison proves nothing"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_resume_is_bit_exact(kind, tmp_path):
    full = _trainer(tiny_model(kind), tmp_path / "full", max_steps=6)
    full.train()
    first = _trainer(
        tiny_model(kind), tmp_path / "resumed", max_steps=6, save_strategy="steps", save_steps=3
    )
    first.train()
    resumed = _trainer(tiny_model(kind, seed=1), tmp_path / "resumed", max_steps=6)
    resumed.train(resume_from_checkpoint=str(tmp_path / "resumed" / "checkpoint-3"))
    want = dict(full.model.named_parameters())
    for name, p in resumed.model.named_parameters():
        assert torch.equal(p, want[name]), name
    assert algorithm_of(resumed.optimizer) == algorithm_of(full.optimizer)


def _swap_parameters(model) -> dict[str, torch.nn.Parameter]:
    """What accelerate's FSDP2 preparation does to the model: new parameter objects, same names."""
    new = {}
    for module_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            fresh = torch.nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            setattr(module, name, fresh)
            new[f"{module_name}.{name}" if module_name else name] = fresh
    return new


@pytest.mark.parametrize(
    "swap_groups", [True, False], ids=["accelerate-swaps-groups", "model-only"]
)
def test_fsdp2_parameter_swap_rebinds_by_name(swap_groups):
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    model, reference = tiny_model("llama"), tiny_model("llama")
    data = TokenData()
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    opts = [create_optimizer(m, splits={q_proj: 4}, **MUON_KWARGS) for m in (model, reference)]

    def train(m, opt, steps):
        for step in range(steps):
            ids = torch.stack([data[i]["input_ids"] for i in range(4 * step, 4 * step + 4)])
            opt.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()

    train(model, opts[0], 1)  # state exists before the swap: it must follow the parameters
    train(reference, opts[1], 1)
    old = {n: p for n, p in model.named_parameters()}
    for p in old.values():
        p.data_ptr = p.data_ptr()  # as accelerate does before remapping
    new = _swap_parameters(model)
    if swap_groups:
        mapping = {old[n].data_ptr: new[n] for n in old}
        fsdp2_switch_optimizer_parameters(opts[0], mapping)
    train(model, opts[0], 2)
    train(reference, opts[1], 2)
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert p is new[name]
        assert torch.equal(p, want[name]), name
    assert opts[0].param_names[id(new[q_proj])] == q_proj
    assert id(new[q_proj]) in opts[0].split_rows
    assert len(opts[0].state) == len(new)


def test_sharded_parameters_are_refused():
    """FSDP2 leaves DTensor shards in the optimizer: plain Muon must refuse, not orthogonalize
    each shard. A 1-rank gloo group is enough to make DTensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor

    from muonscale.integrations.model_params import follow_model_parameters

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = tiny_model("llama")
        opt = create_optimizer(model, **MUON_KWARGS)
        mesh = DeviceMesh("cpu", [0])
        layer = model.model.layers[0].mlp.up_proj
        layer.weight = torch.nn.Parameter(
            distribute_tensor(layer.weight.detach(), mesh, [Shard(0)])
        )
        follow_model_parameters(opt, model)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        with pytest.raises(TypeError, match="DTensorMuon"):
            opt.step()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("factory", [MuonFactory, DistributedMuonFactory])
def test_factories_follow_accelerate_fsdp_plan(factory, monkeypatch):
    """The Trainer builds the optimizer before accelerate shards the model: the factories read
    accelerate's FSDP plugin. FSDP2: a DTensorMuon (it re-binds the shards by name; the 2-rank
    test below runs it). FSDP1 flattens the parameters: refused, naming the fix."""
    from types import SimpleNamespace

    from accelerate.state import AcceleratorState

    from muonscale.distributed import DTensorMuon

    plugin = SimpleNamespace(fsdp_version=2)  # accelerate's plugin, as the factories read it
    monkeypatch.setitem(AcceleratorState._shared_state, "fsdp_plugin", plugin)
    optimizer = factory()(tiny_model("llama"), **MUON_KWARGS)
    assert type(optimizer) is DTensorMuon
    assert algorithm_of(optimizer)["lm_head.weight"] == "adamw"
    if factory is DistributedMuonFactory:
        with pytest.raises(ValueError, match="reduce_at does not apply under FSDP2"):
            factory()(tiny_model("llama"), reduce_at="step", **MUON_KWARGS)
    plugin.fsdp_version = 1
    with pytest.raises(ValueError, match="'version': 2"):
        factory()(tiny_model("llama"), **MUON_KWARGS)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama"])
def test_ddp_two_ranks_match_single_process(kind, tmp_path):
    """torchrun, 2 gloo ranks × batch 2 under Trainer's DDP = one process with batch 4."""
    out = tmp_path / "ddp.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "hf_ddp_worker.py"),
        kind,
        str(tmp_path),
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = {n: torch.tensor(v) for n, v in json.loads(out.read_text()).items()}
    reference = plain_loop(tiny_model(kind), steps=3, batch=4, max_grad_norm=1.0)
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got[name], want.detach(), rtol=0, atol=PARAM_ATOL)


@pytest.mark.timeout(360)
def test_distributed_muon_checkpoint_resume_two_ranks(tmp_path):
    """torchrun, 2 gloo ranks, DistributedMuon (DistributedMuonFactory) under the Trainer's DDP:
    the Trainer saves on rank 0 only, the callback makes the collective part happen on every
    rank; resuming from step 2 of 4 gives the uninterrupted run's parameters and optimizer
    state bit for bit, and the run matches single-process Muon (plain loop) within float
    tolerance."""
    out = tmp_path / "runs.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "hf_checkpoint_worker.py"),
        "llama",
        str(tmp_path),
        str(out),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = torch.load(out, weights_only=True)
    full, saved, resumed = runs["full"], runs["saved"], runs["resumed"]
    saved_file = torch.load(
        tmp_path / "saved" / "checkpoint-2" / "optimizer.pt", weights_only=True
    )  # written by rank 0 alone: the full state of every parameter
    assert len(saved_file["state"]) == len(full["names"])
    for other in (saved, resumed):  # saving does not perturb; resuming is exact
        assert other["names"] == full["names"]
        for name, p in full["params"].items():
            assert torch.equal(other["params"][name], p), name
        for i, entry in full["state"].items():
            for key, value in entry.items():
                assert torch.equal(other["state"][i][key], value), (full["names"][i], key)
    # 2 ranks x batch 2 = batch 4; 4 steps (PARAM_ATOL's derivation for 3 steps, x 4/3).
    reference = plain_loop(tiny_model("llama"), steps=4, batch=4, max_grad_norm=1.0)
    for name, want in reference.named_parameters():
        got = full["params"][name]
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=PARAM_ATOL * 4 / 3)


@pytest.mark.timeout(300)
def test_fsdp2_two_ranks_match_single_process(tmp_path):
    """The Trainer's FSDP2 path (accelerate's fully_shard per decoder layer and at the root,
    after MuonFactory built the optimizer, then the swap of DTensor shards into its groups):
    MuonFactory builds a DTensorMuon that follows the swap by name; torchrun, 2 gloo ranks x
    batch 1 x 2 accumulated micro-batches, clipping active = one process with batch 4 and
    plain muonscale.Muon. On CPU the worker lifts accelerate's GPU-only FSDP gate (see
    hf_fsdp_worker.py). FSDP2 averages the ranks' gradients (reduce-scatter), as DDP does, and
    the clipping norm is a sum of per-shard sums: PARAM_ATOL's derivation (two summation
    orders, float32, 3 steps) holds."""
    max_grad_norm = 0.05
    out = tmp_path / "fsdp.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, "hf_fsdp_worker.py"),
        "llama",
        str(tmp_path),
        str(out),
        str(max_grad_norm),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = torch.load(out, weights_only=True)
    got = run["params"]
    assert min(run["grad_norms"]) > 2 * max_grad_norm, "clipping must be active"
    reference = plain_loop(tiny_model("llama"), steps=3, batch=4, max_grad_norm=max_grad_norm)
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got[name], want.detach(), rtol=0, atol=PARAM_ATOL, msg=name)
    unclipped = plain_loop(tiny_model("llama"), steps=3, batch=4, max_grad_norm=None)
    far = max((got[n] - p).abs().max().item() for n, p in unclipped.named_parameters())
    assert far > 10 * PARAM_ATOL, "the unclipped run must differ, or the comparison proves nothing"
