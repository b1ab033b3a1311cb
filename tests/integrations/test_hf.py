"""muonscale.integrations.hf under a real Hugging Face Trainer, on tiny GPT-2, Llama and
Qwen3-MoE models (the last: expert stacks in their expert view).

Oracles: a plain torch loop with the same muonscale.Muon (clipping, accumulation, DDP, FSDP2),
an uninterrupted Trainer run (resume), and the same optimizer without the parameter swap (FSDP2
swap emulation)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest
import torch
from tiny_models import EMBEDDING_AND_HEAD, TokenData, algorithm_of, free_port, tiny_model
from transformers import Trainer, TrainingArguments

import muonscale
from muonscale.integrations.hf import (
    DistributedMuonFactory,
    MuonFactory,
    create_optimizer,
    muon_kwargs,
)

HERE = os.path.dirname(os.path.abspath(__file__))


MUON_KWARGS = {"lr": 0.02, "adamw_lr": 0.01, "scale": "match_rms_adamw"}
# float32 steps through two summation orders (micro-batches vs one batch, DDP's all-reduce vs
# one process): gradients agree to ~n·eps relative (n ≲ 100 terms per entry), and Newton–Schulz
# (5 steps, coefficients up to 3.4·(1+4.8+2.0) per step) amplifies a relative error by ≲ 10^2.
# 3 steps of lr ≤ 0.02 updates: |Δparam| ≲ 3 · 0.02 · 100 · 100 · eps ≈ 7e-5; we allow 1e-4.
PARAM_ATOL = 1e-4


def _torchrun(worker: str, *argv: str) -> list[str]:
    """The command running ``worker`` (in this folder) on 2 local ranks under torchrun."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        os.path.join(HERE, worker),
        *argv,
    ]


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


class ConvertingResumeTrainer(SequentialTrainer):
    """transformers 5.24's Trainer resumes by loading the checkpoint's safetensors with
    ``load_state_dict``, without the weight conversion that ``from_pretrained`` applies to
    mixture-of-experts checkpoints (their expert stacks are saved per expert): the stacks
    would be reported missing and keep their initial values. Loaded as ``from_pretrained``
    loads them, the resume tests the optimizer's part."""

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        loaded = type(self.model).from_pretrained(resume_from_checkpoint)
        (model or self.model).load_state_dict(loaded.state_dict())


def _trainer(model, tmp_path, cls=None, **overrides) -> SequentialTrainer:
    return (cls or SequentialTrainer)(
        model=model,
        args=_args(tmp_path, **overrides),
        train_dataset=TokenData(),
        optimizer_cls_and_kwargs=(MuonFactory, dict(MUON_KWARGS)),
    )


def test_factory_gives_expert_stacks_their_expert_view(tmp_path):
    trainer = _trainer(tiny_model("qwen3_moe"), tmp_path)
    trainer.create_optimizer()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    stacks = [p for p in trainer.model.parameters() if p.ndim == 3]
    assert stacks and all(optimizer.param_table.expert_layout(p) is not None for p in stacks)
    assert "(E=4) × gate|up (16, 32)" in optimizer.summary()


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


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen3_moe"])
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


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen3_moe"])
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


@pytest.mark.parametrize("kind", ["gpt2", "llama", "qwen3_moe"])
def test_resume_is_bit_exact(kind, tmp_path):
    full = _trainer(tiny_model(kind), tmp_path / "full", max_steps=6)
    full.train()
    first = _trainer(
        tiny_model(kind), tmp_path / "resumed", max_steps=6, save_strategy="steps", save_steps=3
    )
    first.train()
    cls = ConvertingResumeTrainer if kind == "qwen3_moe" else None
    resumed = _trainer(tiny_model(kind, seed=1), tmp_path / "resumed", cls, max_steps=6)
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
    cmd = _torchrun("hf_ddp_worker.py", kind, str(tmp_path), str(out))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    got = {n: torch.tensor(v) for n, v in json.loads(out.read_text()).items()}
    reference = plain_loop(tiny_model(kind), steps=3, batch=4, max_grad_norm=1.0)
    for name, want in reference.named_parameters():
        torch.testing.assert_close(got[name], want.detach(), rtol=0, atol=PARAM_ATOL)


@pytest.mark.timeout(360)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_distributed_muon_checkpoint_resume_two_ranks(kind, tmp_path):
    """torchrun, 2 gloo ranks, DistributedMuon (DistributedMuonFactory) under the Trainer's DDP:
    the Trainer saves on rank 0 only, the callback makes the collective part happen on every
    rank; resuming from step 2 of 4 gives the uninterrupted run's parameters and optimizer
    state bit for bit, and the run matches single-process Muon (plain loop) within float
    tolerance. Qwen3-MoE: each expert stack's experts spread over both ranks."""
    out = tmp_path / "runs.pt"
    cmd = _torchrun("hf_checkpoint_worker.py", kind, str(tmp_path), str(out))
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
    reference = plain_loop(tiny_model(kind), steps=4, batch=4, max_grad_norm=1.0)
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
    cmd = _torchrun("hf_fsdp_worker.py", "llama", str(tmp_path), str(out), str(max_grad_norm))
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


def _muon_group(optimizer) -> dict:
    inner = getattr(optimizer, "optimizer", optimizer)
    return next(g for g in inner.param_groups if g["algorithm"] == "muon")


@pytest.mark.parametrize("factory", [MuonFactory, DistributedMuonFactory])
def test_factories_refuse_to_build_without_lr(factory, tmp_path):
    """The Trainer hands a factory the model and the kwargs only: without ``lr`` Muon would
    train at its own default, whatever TrainingArguments.learning_rate says."""
    with pytest.raises(ValueError, match=r"TrainingArguments\.learning_rate.*muon_kwargs"):
        factory()(tiny_model("llama"), adamw_lr=0.01)
    trainer = SequentialTrainer(
        model=tiny_model("llama"),
        args=_args(tmp_path, learning_rate=0.02),
        train_dataset=TokenData(),
        optimizer_cls_and_kwargs=(factory, {"adamw_lr": 0.01}),
    )
    with pytest.raises(ValueError, match=f"{factory.__name__}: no lr given"):
        trainer.create_optimizer()


def test_muon_kwargs_take_lr_and_weight_decay_from_training_arguments(tmp_path):
    args = _args(tmp_path, learning_rate=0.03, weight_decay=0.07)
    assert muon_kwargs(args, adamw_lr=0.01) == {"lr": 0.03, "weight_decay": 0.07, "adamw_lr": 0.01}
    assert muon_kwargs(args, lr=0.5)["lr"] == 0.5  # overrides win
    trainer = SequentialTrainer(
        model=tiny_model("llama"),
        args=args,
        train_dataset=TokenData(),
        optimizer_cls_and_kwargs=(MuonFactory, muon_kwargs(args, adamw_lr=0.01)),
    )
    trainer.create_optimizer()
    group = _muon_group(trainer.optimizer)
    assert (group["lr"], group["weight_decay"]) == (0.03, 0.07)
    with pytest.raises(TypeError, match="TrainingArguments"):
        muon_kwargs({"learning_rate": 0.03})


def test_factory_instance_works_as_the_class(tmp_path):
    """``optimizer_cls_and_kwargs=(MuonFactory(), kwargs)``: the Trainer calls
    ``factory()(model, **kwargs)``; an instance builds what the class builds."""
    built = {}
    for how, factory in (("class", MuonFactory), ("instance", MuonFactory())):
        trainer = SequentialTrainer(
            model=tiny_model("llama"),
            args=_args(tmp_path / how),
            train_dataset=TokenData(),
            optimizer_cls_and_kwargs=(factory, dict(MUON_KWARGS)),
        )
        trainer.train()
        built[how] = (algorithm_of(trainer.optimizer), dict(trainer.model.named_parameters()))
    assert built["instance"][0] == built["class"][0]
    for name, p in built["class"][1].items():
        assert torch.equal(built["instance"][1][name], p), name
    factory = DistributedMuonFactory()
    assert factory() is factory
    with pytest.raises(TypeError, match="expected the model"):
        MuonFactory()([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.02)


def test_unnamed_parameters_inside_the_trainer_are_refused_naming_the_factory(tmp_path):
    """``optimizer_cls_and_kwargs=(muonscale.Muon, kwargs)`` gets unnamed param groups, so the
    embeddings and head would go to Muon: a framework caller is certain misrouting, refused
    with the fix a Trainer user can apply (hf.MuonFactory), and only there."""
    trainer = SequentialTrainer(
        model=tiny_model("llama"),
        args=_args(tmp_path),
        train_dataset=TokenData(),
        optimizer_cls_and_kwargs=(muonscale.Muon, dict(MUON_KWARGS)),
    )
    with pytest.raises(ValueError, match="unnamed") as refused:
        trainer.create_optimizer()
    message = str(refused.value)
    assert "muonscale.integrations.hf.MuonFactory" in message and "muon_kwargs(args)" in message
    assert "named_parameters()" not in message  # a fix the Trainer's user cannot apply
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        muonscale.Muon(list(tiny_model("llama").parameters()), lr=0.02)  # mixed: a warning
    plain = [str(w.message) for w in outside if "unnamed" in str(w.message)]
    assert plain and not any("MuonFactory" in m for m in plain)


@pytest.mark.timeout(300)
def test_distributed_factory_without_callback_fails_fast(tmp_path):
    """torchrun, 2 gloo ranks, DistributedMuonFactory without DistributedCheckpointCallback,
    saving every step, at the Trainer's default ddp_timeout: instead of the first save hanging
    (DistributedMuon.state_dict() is collective; the Trainer calls it on rank 0 only), every
    rank raises within 60 s of train(), naming the callback."""
    from dataclasses import fields

    default_timeout = next(f.default for f in fields(TrainingArguments) if f.name == "ddp_timeout")
    cmd = _torchrun("hf_no_callback_worker.py", "llama", str(tmp_path / "run"), str(tmp_path))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.monotonic()
    run = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        seconds = time.monotonic() - start
        run.send_signal(signal.SIGTERM)  # torchrun stops its ranks (each in its own session)
        try:
            run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            run.communicate()
        pytest.fail(f"hung: no result after {seconds:.0f} s")
    assert run.returncode == 0, stdout[-3000:] + stderr[-3000:]
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["ddp_timeout"] == default_timeout
        assert record["error"] is not None, f"rank {rank} trained without the callback"
        assert "DistributedCheckpointCallback" in record["error"], record["error"]
        assert record["seconds"] < 60, record
    assert not (tmp_path / "run" / "checkpoint-1").exists()


def test_step_metrics_reach_log_history_and_tensorboard(tmp_path):
    """add_step_metrics: Muon's metrics in every training entry of log_history and in the
    TensorBoard event file the Trainer's reporting callback writes (read back)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from muonscale.integrations.hf import add_step_metrics

    model = tiny_model("llama")
    trainer = _trainer(
        model,
        tmp_path,
        max_steps=4,
        logging_steps=2,
        report_to=["tensorboard"],
    )
    add_step_metrics(trainer)
    trainer.train()
    muon = [n for n, p in model.named_parameters() if p.ndim == 2]
    muon = [n for n in muon if n not in EMBEDDING_AND_HEAD["llama"]]
    ns_elements = sum(model.get_parameter(n).numel() for n in muon)
    entries = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["step"] for e in entries] == [2, 4]
    for entry in entries:
        assert entry["muon/ns_tensors"] == len(muon)
        assert entry["muon/ns_elements"] == ns_elements
        assert entry["muon/skipped_tensors"] == 0
        assert entry["muon/update_rms/group0_muon"] > 0
    (event_file,) = tmp_path.glob("runs/*/events.out.tfevents.*")  # the Trainer's default
    events = EventAccumulator(str(event_file)).Reload()
    assert "train/muon/ns_elements" in events.Tags()["scalars"]
    logged = events.Scalars("train/muon/ns_elements")
    assert [(e.step, e.value) for e in logged] == [(2, ns_elements), (4, ns_elements)]


def test_step_metrics_callback_in_callbacks_list_is_refused(tmp_path):
    from muonscale.integrations.hf import StepMetricsCallback

    trainer = _trainer(tiny_model("llama"), tmp_path, max_steps=1)
    trainer.add_callback(StepMetricsCallback())
    with pytest.raises(RuntimeError, match="add_step_metrics"):
        trainer.train()
