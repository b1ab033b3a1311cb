"""The mixture-of-experts reference model (``--mlp moe``) and the bench on it.

Oracles: each expert matrix's update under the train/bench optimizer equals the update a fresh
``muonscale.Muon`` gives a standalone parameter equal to that matrix (so the experts are held
in the expert view, not flattened); the MoE block's output and load-balancing loss recomputed
token by token in float64; the routed-token counts summing to the tokens seen; and the
distributed bench (2 gloo ranks, dp and fsdp) equal to the single-process runs within the
tolerance of ``tests/test_bench_distributed.py``.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from test_bench_distributed import _single_process, _tolerance

import muonscale
from muonscale.bench import run_bench
from muonscale.bench.config import BenchConfig
from muonscale.bench.distributed import run_distributed_bench
from muonscale.experts import find_experts
from muonscale.train.config import ModelConfig, TrainConfig
from muonscale.train.model import GPT, MoE
from muonscale.train.optimizers import build_optimizer, muon_options, torch_muon_split

pytestmark = pytest.mark.timeout(600)

SMALL = dict(n_layer=2, d_model=64, n_head=2)
BENCH = dict(
    **SMALL,
    mlp="moe",
    steps=4,
    tokens_per_step=512,  # 4 windows of 128, 2 per rank
    micro_batch_size=2,  # 2 micro-batches: gradient accumulation
    eval_interval=0.5,
    eval_batches=2,
    timing_warmup_steps=1,
    progress=False,
)
GATE_UP = "blocks.0.mlp.experts.gate_up_proj"
DOWN = "blocks.0.mlp.experts.down_proj"


def _config(**overrides) -> TrainConfig:
    return TrainConfig(**SMALL, mlp="moe", weight_decay=0.1, **overrides)


def test_moe_config_validated():
    assert ModelConfig(d_model=192, n_head=6, mlp="moe").hidden_dim == 256  # swiglu 512 / top 2
    with pytest.raises(ValueError, match="top_k"):
        ModelConfig(mlp="moe", experts=4, top_k=5)
    with pytest.raises(ValueError, match="--top-k"):
        BenchConfig(mlp="moe", experts=2, top_k=3)
    with pytest.raises(ValueError, match="--mlp moe does not apply with --parallel tp"):
        BenchConfig(mlp="moe", nproc=2, parallel="tp")


def test_moe_block_recomputed_token_by_token():
    """Output: each token's top-k experts (SwiGLU on [gate; up] rows), weighted by their
    renormalized probabilities; balance loss: E · Σ_i f_i · P_i; both in float64."""
    torch.manual_seed(0)
    config = ModelConfig(**SMALL, mlp="moe", experts=4, top_k=2)
    block = MoE(config).double().train()
    for p in block.experts.parameters():  # GPT's init fills them; here, alone, by hand
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 5, config.d_model, dtype=torch.float64)
    out = block(x)
    w_router = block.router.weight
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    hidden = config.hidden_dim
    want, counts, probs_all = torch.zeros_like(x).reshape(-1, x.shape[-1]), torch.zeros(4), []
    for t, token in enumerate(x.reshape(-1, x.shape[-1])):
        probs = torch.softmax(w_router @ token, dim=0)
        probs_all.append(probs)
        top = probs.topk(2)
        for p, e in zip(top.values / top.values.sum(), top.indices):
            h = gate_up[e] @ token
            want[t] += p * (down[e] @ (F.silu(h[:hidden]) * h[hidden:]))
            counts[e] += 1
    torch.testing.assert_close(out.reshape(-1, x.shape[-1]), want)
    mean_probs = torch.stack(probs_all).mean(0)
    balance = 4 * ((counts / counts.sum()) * mean_probs).sum()
    torch.testing.assert_close(block.balance_loss, balance)
    assert block.expert_tokens.tolist() == counts.long().tolist()


def test_balance_loss_of_a_split_batch_with_global_counts_is_the_whole_batchs():
    """Two halves of a batch (two data-parallel ranks), each with the counts of the whole
    batch: the mean of their balance losses is the whole batch's, and so are their gradients'
    mean (the ranks average gradients); with each half's own counts it is not."""
    torch.manual_seed(0)
    config = ModelConfig(**SMALL, mlp="moe", experts=4, top_k=2)
    block = MoE(config).double().train()
    for p in block.experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(4, 6, config.d_model, dtype=torch.float64)
    halves = x[:2], x[2:]

    def balance(inputs, reduction=None):
        """(balance loss, its gradient on the router, the counts it used) of one forward."""
        block.count_reduction = reduction
        block.zero_grad()
        block.expert_tokens.zero_()
        block(inputs)
        block.balance_loss.backward()
        grad = block.router.weight.grad.clone()
        return block.balance_loss.detach(), grad, block.expert_tokens.clone()

    whole, whole_grad, whole_counts = balance(x)
    own = [balance(h) for h in halves]  # each half's own counts
    split = [balance(h, lambda c, other=own[1 - i][2]: c.add_(other)) for i, h in enumerate(halves)]
    assert torch.equal(split[0][2], whole_counts) and torch.equal(split[1][2], whole_counts)
    eps = torch.finfo(torch.float64).eps
    torch.testing.assert_close((split[0][0] + split[1][0]) / 2, whole, rtol=0, atol=16 * eps)
    torch.testing.assert_close((split[0][1] + split[1][1]) / 2, whole_grad, rtol=0, atol=16 * eps)
    assert abs((own[0][0] + own[1][0]) / 2 - whole) > 1e3 * eps  # local counts: another loss


def test_experts_found_with_the_layout_transformers_records():
    model = GPT(_config().model_config())
    found = find_experts(model)
    assert found.layouts[GATE_UP] == muonscale.ExpertLayout(n_experts=8, gate_up="contiguous")
    assert found.layouts[DOWN] == muonscale.ExpertLayout(n_experts=8)
    assert set(found.routers) == {f"blocks.{i}.mlp.router.weight" for i in range(2)}


def test_each_expert_matrix_steps_as_a_standalone_parameter():
    """One step of the train/bench ``muon`` optimizer on the MoE model: every expert's gate, up
    and down matrix moves as under a fresh ``muonscale.Muon`` of that matrix alone (same
    options); a flattened stack would orthogonalize the experts against each other instead."""
    config = _config()
    torch.manual_seed(0)
    model = GPT(config.model_config())
    optimizer = build_optimizer("muon", model, config)
    params = dict(model.named_parameters())
    group = next(g for g in optimizer.param_groups if GATE_UP in g["param_names"])
    assert optimizer.param_table.view(params[GATE_UP], group["matrix_mode"]).experts == 8
    generator = torch.Generator().manual_seed(1)
    grads = {n: torch.randn(p.shape, generator=generator) for n, p in params.items()}
    before = {n: params[n].detach().clone() for n in (GATE_UP, DOWN)}
    for name, p in params.items():
        p.grad = grads[name].clone()
    optimizer.step()
    hidden = config.model_config().hidden_dim
    matrices = {  # (name, expert, rows) -> its (out, in) matrix
        (GATE_UP, "gate"): slice(0, hidden),
        (GATE_UP, "up"): slice(hidden, 2 * hidden),
        (DOWN, "down"): slice(None),
    }
    for (name, _role), rows in matrices.items():
        for e in range(8):
            alone = torch.nn.Parameter(before[name][e, rows].clone())
            reference = muonscale.Muon(
                [("w", alone)], lr=config.lr, momentum=config.momentum, weight_decay=0.1
            )
            alone.grad = grads[name][e, rows].clone()
            reference.step()
            got = params[name].detach()[e, rows]
            # batched or alone, the float32 Newton–Schulz sums in another order: the updated
            # weight agrees to a few float32 roundings of its largest entry
            atol = 4 * torch.finfo(torch.float32).eps * before[name][e, rows].abs().max()
            torch.testing.assert_close(got, alone.detach(), rtol=0, atol=atol)


def test_torch_muon_takes_the_2d_matrices_and_leaves_the_experts_to_adamw():
    model = GPT(_config().model_config())
    muon, rest = torch_muon_split(model)
    assert all(dict(model.named_parameters())[n].ndim == 2 for n in muon)
    assert "blocks.0.mlp.router.weight" in muon and GATE_UP in rest and DOWN in rest
    build_optimizer("torch-muon", model, _config())  # torch.optim.Muon accepts the split


def _expert_view_checked(facts: dict, layers: int) -> None:
    views = facts["expert_views"]
    assert len(views) == 2 * layers
    for name, view in views.items():
        assert view["expert_view"] == 8, name
        # gate and up apart: 16 matrices of (F, D); down: 8 of (D, F)
        assert view["matrices"] == (16 if name.endswith("gate_up_proj") else 8), name


def test_single_process_bench_on_moe(tmp_path):
    config = BenchConfig(
        **BENCH, baselines=["torch-muon"], memory_probe_steps=0, out=str(tmp_path / "b")
    )
    report = run_bench(config, stream=open("/dev/null", "w"))
    moe = report["moe"]
    assert set(moe) == {"adamw", "muon", "torch-muon"}
    _expert_view_checked(moe["muon"], layers=2)
    assert 0 < moe["muon"]["router_newton_schulz_flop_share"] < 1
    timed = moe["muon"]["router_time_share"]
    assert 0 < timed["share"] < 1 and timed["repetitions"] >= 3
    assert "router_time_share" not in moe["torch-muon"] and "router_time_share" not in moe["adamw"]
    assert sorted(moe["torch-muon"]["left_to_adamw"]) == sorted(
        f"blocks.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")
    )
    for name, c in report["contenders"].items():
        load = c["expert_load"]
        assert load["step_min_share"] <= load["run_min_share"] <= 1 <= load["run_max_share"]
        assert load["run_min_share"] == moe[name.replace("_", "-")]["expert_load"]["run_min_share"]
        # every token goes to top_k experts in every layer, at every step
        for layer in load["tokens_per_expert"]:
            assert sum(layer) == config.steps * config.tokens_per_step * config.top_k, name
    files = {p.name for p in (tmp_path / "b").iterdir()}
    assert {"report.json", "report.md"} <= files
    assert any(f.endswith(".png") for f in files)
    text = (tmp_path / "b" / "report.md").read_text()
    assert "Mixture of experts" in text
    assert "- muon: router share of Muon's optimizer time: " in text and "FLOP share" in text


def test_router_timing_steps_copies_of_the_routers_alone_with_the_contenders_options():
    """The timed optimizers: one over the routers only, one over every parameter the
    contender's ``muonscale.Muon`` sends to Muon, both with its options (here a variant's
    ``ns_steps``), over copies: the model's parameters do not move."""
    from muonscale.bench.moe import router_time_share, router_timing_optimizers
    from muonscale.bench.runner import make_run, muon_options_for

    config = BenchConfig(**BENCH, variants=["ns3=ns_steps:3"])
    run = make_run(config, "ns3", 0.02)
    options = muon_options_for(config, "ns3", 0.02, run.model)
    assert options["ns_steps"] == 3 and muon_options_for(config, "adamw", 0.02, run.model) is None
    contender = {
        n for g in run.optimizer.param_groups if g["algorithm"] == "muon" for n in g["param_names"]
    }
    routers, everything = router_timing_optimizers(run.model, options)
    routers_names = {n for g in routers.param_groups for n in g["param_names"]}
    assert routers_names == {f"blocks.{i}.mlp.router.weight" for i in range(2)}
    assert {n for g in everything.param_groups for n in g["param_names"]} == contender
    for optimizer in (routers, everything):
        assert {g["algorithm"] for g in optimizer.param_groups} == {"muon"}
        assert {g["ns_steps"] for g in optimizer.param_groups} == {3}
        model_params = {id(p) for p in run.model.parameters()}
        assert not any(id(p) in model_params for g in optimizer.param_groups for p in g["params"])
    before = [p.detach().clone() for p in run.model.parameters()]
    timed = router_time_share(run.model, options, repetitions=3, budget_s=0)
    assert timed["repetitions"] == 3 and 0 < timed["share"] < 1
    assert all(torch.equal(a, p) for a, p in zip(before, run.model.parameters(), strict=True))


@pytest.mark.parametrize("parallel", ["dp", "fsdp"])
def test_distributed_bench_on_moe_equals_one_process(parallel, tmp_path):
    """The balance loss's counts are the global batch's on every rank, so each contender's
    losses equal the single-process run's (the tolerance of the dense distributed bench)."""
    config = BenchConfig(**BENCH, nproc=2, parallel=parallel, plots=False, out=str(tmp_path))
    rows = run_distributed_bench(config, reduce_dtypes=("float32",), print_table=False)["rows"]
    single = dataclasses.replace(config, nproc=1, parallel="dp")
    pairs = {"muon": "muon", "adamw": "adamw"}
    if parallel == "dp":
        pairs = {"muon": "muon", "adamw-ddp": "adamw"}
    for name, reference in pairs.items():
        losses, val, _ = _single_process(single, reference)
        tol = _tolerance(losses)
        assert rows[name]["train_losses"] == pytest.approx(losses, abs=tol, rel=0), name
        assert rows[name]["val_losses"] == pytest.approx(val, abs=tol, rel=0), name
    _expert_view_checked(rows["muon"]["moe"], layers=2)
    load = rows["muon"]["expert_load"]
    for layer in load["tokens_per_expert"]:  # the global batch's tokens, not one rank's
        assert sum(layer) == config.steps * config.tokens_per_step * config.top_k
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["rows"]["muon"]["expert_load"] == load


def _train_steps(config: TrainConfig, text: str) -> tuple[list[float], list]:
    from muonscale.train.trainer import TrainingRun

    run = TrainingRun(config, text=text)
    try:
        results = [run.step() for _ in range(config.steps)]
    finally:
        run.close()
    return [r.loss for r in results], [r.expert_tokens for r in results]


def _train_rank(rank: int, world_size: int, config: TrainConfig, text: str):
    return _train_steps(config, text)


@pytest.mark.parametrize("parallel", ["dp", "fsdp"])
def test_train_parallel_on_moe_gives_the_losses_and_counts_of_one_process(parallel):
    """``muonscale train --parallel`` (``Parallelism``) sums the blocks' token counts over the
    ranks: each step's counts are the global batch's, and the losses the single-process ones."""
    from distributed_harness import shared_pool

    from muonscale.bench.runner import bundled_corpus_text

    text = bundled_corpus_text("shakespeare")[:100_000]
    config = _config(steps=3, micro_batch_size=4, tokens_per_step=1024, out_dir=None, lr=0.02)
    losses, counts = _train_steps(config, text)
    ranks = shared_pool(2).run(_train_rank, dataclasses.replace(config, parallel=parallel), text)
    for rank_losses, rank_counts in ranks:
        assert rank_counts == counts
        assert rank_losses == pytest.approx(losses, abs=_tolerance(losses), rel=0)


def test_train_optimizer_summary_names_the_expert_stacks_and_routers():
    """``muonscale train --mlp moe`` builds its Muon on the model, so its summary labels the
    expert stacks and routers as ``muonscale.Muon(model)`` does, with the same param groups
    as over ``named_parameters()``."""
    model = GPT(_config().model_config())
    optimizer = build_optimizer("muon", model, _config())
    lines = {line.split()[1]: line for line in optimizer.summary().splitlines()[2:]}
    assert "expert weights (Experts)" in lines[GATE_UP] and "(E=8) × gate|up" in lines[GATE_UP]
    assert "expert weights (Experts)" in lines[DOWN]
    assert "router (E=8)" in lines["blocks.0.mlp.router.weight"]
    assert "hidden weight" not in lines[GATE_UP] + lines[DOWN]
    named = muonscale.Muon(list(model.named_parameters()), **muon_options(model, _config()))
    for built, listed in zip(optimizer.param_groups, named.param_groups, strict=True):
        assert built["param_names"] == listed["param_names"]
        assert {k: v for k, v in built.items() if k != "params"} == {
            k: v for k, v in listed.items() if k != "params"
        }
