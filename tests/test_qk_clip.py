"""QK-clip: the exact logit probe, the per-head rescale rule (MHA / GQA, fused / separate),
data-parallel (MAX over 2 gloo ranks) and tensor-parallel (2 head shards) against one process,
and a short training run where plain Muon's max logit grows past tau and QK-clip holds it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from distributed_harness import shared_pool

import muonscale
from muonscale.qk_clip import FusedQKV, QKClip, SeparateQK, clip_factors, max_attention_logits
from muonscale.qkv import QKVLayout
from muonscale.train.config import ModelConfig
from muonscale.train.data import ByteTokenizer, load_corpus
from muonscale.train.model import GPT

pytestmark = pytest.mark.timeout(120)

EPS32 = torch.finfo(torch.float32).eps


def _dense_max_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """float64, every (i, j <= i) pair materialized, key head h // p for query head h."""
    q, k = q.double(), k.double()
    p = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(p, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
    return logits.masked_fill(~mask, -math.inf).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("n_groups", [4, 2, 1])
@pytest.mark.parametrize("chunk_elements", [1, 300, 1 << 22])
def test_probe_matches_dense_float64(n_groups, chunk_elements):
    torch.manual_seed(0)
    q = torch.randn(3, 4, 13, 8) * 3
    k = torch.randn(3, n_groups, 13, 8) * 3
    # float32 dot products of 8 terms of size ~9: error <= 8 * eps * sum|q_i k_i| ~ 8 * eps * 72
    torch.testing.assert_close(
        max_attention_logits(q, k, chunk_elements=chunk_elements).double(),
        _dense_max_logits(q, k),
        rtol=0,
        atol=8 * EPS32 * 72 * 4,
    )
    # the causal mask matters: the unmasked maximum is larger here
    unmasked = max_attention_logits(q, k, causal=False)
    assert (unmasked >= max_attention_logits(q, k)).all()
    assert (unmasked > max_attention_logits(q, k)).any()


def _small(**overrides) -> ModelConfig:
    values = dict(vocab_size=256, context_length=16, n_layer=2, d_model=48, n_head=6)
    return ModelConfig(**{**values, **overrides})


@pytest.mark.parametrize(
    "overrides", [dict(), dict(n_kv_head=2, position="rotary", bias=True, norm="rmsnorm")]
)
def test_model_probe_is_off_by_default_exact_and_a_running_max(overrides):
    torch.manual_seed(0)
    config = _small(**overrides)
    model = GPT(config)
    for block in model.blocks:
        torch.nn.init.normal_(block.attn.qkv.weight, std=0.2)
    captured = {}
    attn = model.blocks[1].attn
    hook = attn.register_forward_hook(lambda m, args, out: captured.update(x=args[0], rot=args[1]))
    idx_a, idx_b = torch.randint(0, 256, (2, 2, 16))
    logits_plain, _ = model(idx_a)
    assert attn.max_logits is None  # default: no probe
    with pytest.raises(RuntimeError, match="probe_max_logits"):
        model.pop_max_attention_logits()
    logits_probed, _ = model(idx_a, probe_max_logits=True)
    torch.testing.assert_close(logits_probed, logits_plain, rtol=0, atol=0)  # output unchanged

    def reference(x, rotary):
        q, k, _ = attn.layout.split_activations(attn.qkv(x))
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if rotary is not None:
            from muonscale.train.model import apply_rotary

            cos, sin = (t[: x.shape[1]] for t in rotary)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return _dense_max_logits(q, k)

    first = reference(captured["x"], captured["rot"])
    model(idx_b, probe_max_logits=True)  # a second micro-batch: the maximum accumulates
    second = reference(captured["x"], captured["rot"])
    hook.remove()
    maxima = model.pop_max_attention_logits()
    assert len(maxima) == 2 and maxima[1].shape == (config.n_head,)
    # float32 logits of head_dim = 8 terms, O(1) values: agreement to ~1e-5
    torch.testing.assert_close(
        maxima[1].double(), torch.maximum(first, second), rtol=1e-5, atol=1e-5
    )
    assert attn.max_logits is None  # pop resets


def test_clip_factors_follow_the_k2_rule():
    tau = 10.0
    s = torch.tensor([5.0, 10.0, 40.0, 25.0], dtype=torch.float64)
    gamma = torch.tensor([1.0, 1.0, 0.25, 0.4], dtype=torch.float64)
    q, k = clip_factors(s, tau=tau, q_per_group=1)  # MHA: sqrt(gamma) on q and k
    torch.testing.assert_close(q, gamma.sqrt())
    torch.testing.assert_close(k, gamma.sqrt())
    q, k = clip_factors(s, tau=tau, q_per_group=2)  # GQA: gamma on q, shared key untouched
    torch.testing.assert_close(q, gamma)
    torch.testing.assert_close(k, torch.ones(2, dtype=torch.float64))


def _random_fused(layout: QKVLayout, groups: int, d: int, *, bias: bool) -> FusedQKV:
    weight = torch.randn(groups * layout.rows_per_group, d, dtype=torch.float64)
    return FusedQKV(
        weight, layout, torch.randn(weight.shape[0], dtype=torch.float64) if bias else None
    )


def _fused_max_logits(target: FusedQKV, x: torch.Tensor) -> torch.Tensor:
    out = x @ target.weight.T + (0 if target.bias is None else target.bias)
    q, k, _ = target.layout.split_activations(out)
    return max_attention_logits(q.transpose(1, 2), k.transpose(1, 2))


@pytest.mark.parametrize("q_per_group", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_rescale_caps_every_head_at_tau_and_leaves_v_alone(q_per_group, bias):
    torch.manual_seed(0)
    layout = QKVLayout(n_query_groups=2, q_per_group=q_per_group, head_dim=4)
    target = _random_fused(layout, 2, 16, bias=bias)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    before = _fused_max_logits(target, x)
    tau = before.median().item()  # some heads above, some below
    original = target.weight.clone()
    QKClip([target], tau=tau)([before])
    after = _fused_max_logits(target, x)
    # logits of head h scale by exactly gamma_h; float64 rounding only
    torch.testing.assert_close(after, before.clamp(max=tau), rtol=1e-12, atol=0)
    v = layout.v_rows()
    assert torch.equal(target.weight[v], original[v])
    if q_per_group > 1:
        k = layout.k_rows()
        assert torch.equal(target.weight[k], original[k])  # shared keys are never rescaled


def test_separate_projections_get_the_same_rescale_as_fused():
    torch.manual_seed(0)
    layout = QKVLayout(n_query_groups=2, q_per_group=2, head_dim=4)
    fused = _random_fused(layout, 2, 16, bias=True)
    separate = SeparateQK(
        fused.weight[layout.q_rows()].clone(),
        fused.weight[layout.k_rows()].clone(),
        head_dim=4,
        q_bias=fused.bias[layout.q_rows()].clone(),
        k_bias=fused.bias[layout.k_rows()].clone(),
    )
    maxima = torch.tensor([3.0, 50.0, 8.0, 20.0], dtype=torch.float64)
    QKClip([fused, separate], tau=10.0)([maxima, maxima])
    assert torch.equal(separate.q_weight, fused.weight[layout.q_rows()])
    assert torch.equal(separate.k_weight, fused.weight[layout.k_rows()])
    assert torch.equal(separate.q_bias, fused.bias[layout.q_rows()])


def test_bad_input_names_the_parameter():
    layout = QKVLayout(n_query_groups=2, q_per_group=1, head_dim=4)
    target = _random_fused(layout, 2, 8, bias=False)
    for tau in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="tau"):
            QKClip([target], tau=tau)
    with pytest.raises(ValueError, match="max_logits"):
        QKClip([target], tau=1.0)([])
    with pytest.raises(ValueError, match="max_logits\\[0\\] has 3 values"):
        QKClip([target], tau=1.0)([torch.ones(3)])
    with pytest.raises(ValueError, match="rows per key/value group"):
        FusedQKV(torch.ones(13, 8), layout)
    with pytest.raises(ValueError, match="head_dim"):
        SeparateQK(torch.ones(8, 4), torch.ones(3, 4), head_dim=4)
    with pytest.raises(TypeError, match="FusedQKV or SeparateQK"):
        QKClip([torch.ones(8, 4)], tau=1.0)


# ---- data parallel and tensor parallel ---------------------------------------------------------
LAYOUT = QKVLayout(n_query_groups=4, q_per_group=2, head_dim=4)
TAU = 10.0


def _full_weight() -> torch.Tensor:
    return torch.randn(LAYOUT.rows, 16, generator=torch.Generator().manual_seed(1))


def _rank_maxima(rank: int) -> torch.Tensor:
    """Each rank's batch gives different maxima; heads 1, 4, 6 exceed TAU on one rank only."""
    maxima = torch.full((LAYOUT.n_heads,), 5.0)
    maxima[[1, 4, 6][rank::2]] = 40.0 if rank == 0 else 20.0
    maxima[6] = 12.0 + rank
    return maxima


def _dp_worker(rank, world_size):
    weight = _full_weight()
    clip = QKClip([FusedQKV(weight, LAYOUT)], tau=TAU)
    reduced = clip([_rank_maxima(rank)])
    return weight, reduced, clip.comm.counter.breakdown()


def test_data_parallel_max_is_all_reduced_and_rescale_identical():
    results = shared_pool(2).run(_dp_worker)
    expected_max = torch.maximum(_rank_maxima(0), _rank_maxima(1))
    expected = _full_weight()
    QKClip([FusedQKV(expected, LAYOUT)], tau=TAU)([expected_max])
    for weight, reduced, breakdown in results:
        assert torch.equal(reduced, expected_max.double())
        assert torch.equal(weight, expected)  # bitwise: same inputs, same arithmetic
        # one all-reduce of 8 float64 maxima, ring model 2 (N-1)/N * S with N = 2
        assert breakdown == {"qk_clip/all_reduce": 2 * 1 * (8 * 8) // 2}
    assert not torch.equal(expected, _full_weight())  # the rescale did something


def _tp_worker(rank, world_size):
    # every rank is its own data-parallel group (TP ranks hold different heads: no reduction)
    singletons = [dist.new_group([r]) for r in range(world_size)]
    groups_per_rank = LAYOUT.n_query_groups // world_size
    rows = slice(rank * groups_per_rank * LAYOUT.rows_per_group, None)
    rows = slice(rows.start, rows.start + groups_per_rank * LAYOUT.rows_per_group)
    heads = slice(rank * groups_per_rank * LAYOUT.q_per_group, None)
    heads = slice(heads.start, heads.start + groups_per_rank * LAYOUT.q_per_group)
    shard = _full_weight()[rows].clone()
    maxima = torch.maximum(_rank_maxima(0), _rank_maxima(1))[heads]
    QKClip([FusedQKV(shard, LAYOUT)], tau=TAU, process_group=singletons[rank])([maxima])
    return shard


def test_tensor_parallel_shards_equal_the_full_rescale():
    shards = shared_pool(2).run(_tp_worker)
    expected = _full_weight()
    QKClip([FusedQKV(expected, LAYOUT)], tau=TAU)([torch.maximum(_rank_maxima(0), _rank_maxima(1))])
    assert torch.equal(torch.cat(shards), expected)


# ---- FSDP2: DTensor weights, row shards that cut through a head ----------------------------
FSDP_LAYOUTS = [
    QKVLayout(n_query_groups=3, q_per_group=1, head_dim=4),  # MHA: 36 rows, shards of 18
    QKVLayout(n_query_groups=1, q_per_group=3, head_dim=4),  # GQA (one key): 20 rows, 10
]


def _fsdp_worker(rank, world_size, layout):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    linear = torch.nn.Linear(16, layout.rows)  # same full weight and bias on every rank
    fully_shard(linear, mesh=init_device_mesh("cpu", (world_size,)))
    maxima = torch.full((layout.n_heads,), 5.0)
    maxima[rank % layout.n_heads] = 40.0 + rank  # each head over tau on one rank at most
    clip = QKClip([FusedQKV(linear.weight.data, layout, linear.bias.data)], tau=TAU)
    reduced = clip([maxima])
    return linear.weight.full_tensor(), linear.bias.full_tensor(), reduced


@pytest.mark.parametrize("layout", FSDP_LAYOUTS, ids=["mha", "gqa"])
def test_fsdp2_shards_equal_the_full_rescale(layout):
    """fully_shard over 2 gloo ranks splits the rows at R/2, inside a head's block (the
    rescale of a head spans both shards): the gathered result equals the single-process rescale
    with the MAX of both ranks' maxima, bitwise (each element is multiplied by the same
    factor)."""
    assert (layout.rows // 2) % layout.head_dim != 0  # the shard boundary cuts a head
    results = shared_pool(2).run(_fsdp_worker, layout)
    torch.manual_seed(3)
    reference = torch.nn.Linear(16, layout.rows)
    maxima = [torch.full((layout.n_heads,), 5.0) for _ in range(2)]
    for rank in range(2):
        maxima[rank][rank % layout.n_heads] = 40.0 + rank
    expected_max = torch.maximum(*maxima)
    with torch.no_grad():
        start = (reference.weight.clone(), reference.bias.clone())
    QKClip([FusedQKV(reference.weight.data, layout, reference.bias.data)], tau=TAU)([expected_max])
    assert not torch.equal(reference.weight, start[0])  # the rescale did something
    for weight, bias, reduced in results:
        assert torch.equal(reduced, expected_max.double())
        assert torch.equal(weight, reference.weight.data)
        assert torch.equal(bias, reference.bias.data)


# ---- training: plain Muon's max logit grows, QK-clip holds it ------------------------------------
def _train(tau: float | None, *, steps: int = 50, lr: float = 0.1, seed: int = 0):
    """One-layer GPT without QK-norm, Muon at a high lr. Every step the maxima are measured on a
    fixed probe batch after ``step()`` and handed to QK-clip, so the post-clip bound is exact
    (one layer: the attention input does not depend on the clipped weights)."""
    torch.manual_seed(seed)
    seq, batch = 32, 8
    model = GPT(ModelConfig(vocab_size=256, context_length=seq, n_layer=1, d_model=64, n_head=4))
    optimizer = muonscale.Muon(
        model.named_parameters(),
        lr=lr,
        adamw_lr=3e-3,
        splits={name: model.qkv_layout for name in model.qkv_param_names()},
    )
    clip = QKClip(model.qk_clip_targets(), tau=tau) if tau is not None else None
    tokens = ByteTokenizer().encode(load_corpus()[:100_000]).long()
    gen = torch.Generator().manual_seed(seed)

    def windows(n):
        starts = torch.randint(0, len(tokens) - seq - 1, (n,), generator=gen)
        x = torch.stack([tokens[s : s + seq] for s in starts])
        return x, torch.stack([tokens[s + 1 : s + seq + 1] for s in starts])

    probe, val = windows(batch), windows(64)
    history = []
    for _ in range(steps):
        x, y = windows(batch)
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            model(probe[0], probe_max_logits=True)
        maxima = model.pop_max_attention_logits()
        if clip is not None:
            clip(maxima)
        with torch.no_grad():
            model(probe[0], probe_max_logits=True)
        history.append(model.pop_max_attention_logits()[0].max().item())
    with torch.no_grad():
        val_loss = model(*val)[1].item()
    return history, val_loss


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    # Models this small gain nothing from threads, and on a busy 2-core machine OpenMP
    # spin-waiting makes them many times slower. Restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_plain_muon_logits_grow_past_tau_and_qk_clip_holds_them():
    tau = 15.0
    plain, plain_loss = _train(None)
    clipped, clipped_loss = _train(tau)
    assert plain[0] < tau < max(plain) and plain[-1] > 2 * tau  # growing, well past tau
    # after the rescale, logit h of the probe batch is gamma_h * S_h = tau up to float32
    # rounding: sqrt(gamma) rounded on q and k, dot products of head_dim = 16 terms (x4 margin)
    assert max(clipped) <= tau * (1 + 4 * (16 + 2) * EPS32)
    assert max(clipped) > tau * (1 - 1e-3)  # the clip was active, not idle
    assert clipped_loss <= plain_loss
