"""muonscale.Muon against the oracles: torch.optim.Muon, torch.optim.AdamW, itself
(batched vs per matrix, resumed vs uninterrupted) and the invariants users rely on."""

import copy

import pytest
import torch
import torch.optim._muon as torch_muon_module
from torch import nn

import muonscale
from muonscale import Muon, NonFiniteGradientError, QKVLayout, newton_schulz


def _float64_zeropower(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's iteration, in float64 (patched in for the exact oracle)."""
    a, b, c = ns_coefficients
    X = grad.double()
    if grad.size(0) > grad.size(1):
        X = X.T
    X = X / X.norm().clamp(min=eps)
    for _ in range(ns_steps):
        A = X @ X.T
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        X = torch.addmm(X, B, X, beta=a)
    return X.T if grad.size(0) > grad.size(1) else X


def _pair(shapes, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    ours = [torch.randn(*s, dtype=dtype, generator=g).requires_grad_() for s in shapes]
    theirs = [p.detach().clone().requires_grad_() for p in ours]
    return ours, theirs


def _run(opt_a, params_a, opt_b, params_b, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for pa, pb in zip(params_a, params_b):
            grad = torch.randn(pa.shape, dtype=pa.dtype, generator=g)
            pa.grad, pb.grad = grad.clone(), grad.clone()
        opt_a.step()
        opt_b.step()


@pytest.mark.bare_tensors
@pytest.mark.parametrize(
    "scale,adjust", [("shape", "original"), ("match_rms_adamw", "match_rms_adamw")]
)
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_muon_exactly_in_float64(monkeypatch, scale, adjust, nesterov):
    monkeypatch.setattr(torch_muon_module, "_zeropower_via_newtonschulz", _float64_zeropower)
    shapes = [(32, 16), (16, 48), (24, 24), (32, 16)]
    ours, theirs = _pair(shapes)
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    opt_a = Muon(ours, scale=scale, ns_dtype=torch.float64, **kw)
    opt_b = torch.optim.Muon(theirs, adjust_lr_fn=adjust, **kw)
    _run(opt_a, ours, opt_b, theirs, steps=6)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.bare_tensors
def test_default_bfloat16_path_close_to_torch_muon():
    shapes = [(64, 32), (32, 96)]
    ours, theirs = _pair(shapes, dtype=torch.float32)
    start = [p.detach().clone() for p in ours]
    opt_a = Muon(ours, lr=0.02, weight_decay=0.1, scale="shape", ns_dtype=torch.bfloat16)
    opt_b = torch.optim.Muon(theirs, lr=0.02, weight_decay=0.1)
    _run(opt_a, ours, opt_b, theirs, steps=5)
    for a, b, w0 in zip(ours, theirs, start):
        rel = ((a - w0) - (b - w0)).norm() / (b - w0).norm()
        assert rel <= 3e-2


def test_adamw_half_matches_torch_adamw():
    torch.manual_seed(0)
    vec = torch.randn(40, dtype=torch.float64, requires_grad=True)
    emb = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    vec2, emb2 = vec.detach().clone().requires_grad_(), emb.detach().clone().requires_grad_()
    ours = Muon(
        [{"params": [vec, emb], "algorithm": "adamw", "weight_decay": 0.05}],
        lr=3e-3,
        adamw_betas=(0.85, 0.97),
        adamw_eps=1e-7,
    )
    theirs = torch.optim.AdamW(
        [vec2, emb2], lr=3e-3, betas=(0.85, 0.97), eps=1e-7, weight_decay=0.05
    )
    _run(ours, [vec, emb], theirs, [vec2, emb2], steps=7)
    torch.testing.assert_close(vec, vec2, rtol=0, atol=1e-14)
    torch.testing.assert_close(emb, emb2, rtol=0, atol=1e-14)
    assert float(ours.state[vec]["step"]) == 7


@pytest.mark.bare_tensors
def test_batched_equals_one_matrix_at_a_time():
    shapes = [(16, 24)] * 3 + [(24, 16)]
    together, _ = _pair(shapes)
    alone = [p.detach().clone().requires_grad_() for p in together]
    opt = Muon(together, lr=0.01, ns_dtype=torch.float64)
    singles = [Muon([p], lr=0.01, ns_dtype=torch.float64) for p in alone]
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        for p, q in zip(together, alone):
            q.grad = torch.randn(p.shape, dtype=p.dtype, generator=g)
            p.grad = q.grad.clone()
        opt.step()
        for s in singles:
            s.step()
    for p, q in zip(together, alone):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-13)


def test_chunked_update_equals_one_chunk():
    """functional.muon in chunks of bounded transient bytes gives the same bits as one chunk
    (every parameter's update is independent of the others)."""
    from muonscale import functional
    from muonscale.matrices import MatrixView
    from muonscale.settings import MuonSettings

    shapes = [(16, 24), (24, 16), (32, 32), (16, 24), (8, 40), (32, 32), (3, 16, 8)]
    g = torch.Generator().manual_seed(5)
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]

    def run(max_chunk_bytes):
        params = [
            torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)
        ]
        bufs = [torch.zeros(s) for s in shapes]
        views = [
            MatrixView.build(tuple(p.shape), mode="batch" if p.ndim > 2 else "flatten")
            for p in params
        ]
        for step_grads in grads:
            functional.muon(
                params,
                step_grads,
                bufs,
                views=views,
                lr=0.02,
                weight_decay=0.1,
                settings=MuonSettings(
                    momentum=0.95,
                    nesterov=True,
                    ns_steps=5,
                    coefficients="keller",
                    ns_dtype=torch.float32,
                    scale="match_rms_adamw",
                ),
                max_chunk_bytes=max_chunk_bytes,
            )
        return params, bufs

    whole = run(None)
    for budget in (1, 3000, 10_000):
        chunks = functional.update_chunks(
            whole[0],
            [
                MatrixView.build(tuple(p.shape), mode="batch" if p.ndim > 2 else "flatten")
                for p in whole[0]
            ],
            ns_dtype=torch.float32,
            max_chunk_bytes=budget,
        )
        assert sorted(i for c in chunks for i in c) == list(range(len(shapes)))
        for c in chunks:  # within budget, or one parameter alone
            assert len(c) == 1 or sum(whole[0][i].numel() * 8 for i in c) <= budget
        assert len(chunks) > 1
        chunked = run(budget)
        for a, b in zip(whole[0] + whole[1], chunked[0] + chunked[1]):
            assert torch.equal(a, b)


def test_update_chunk_defaults_per_device(monkeypatch):
    from muonscale.memory import PER_DEVICE, chunk_bytes_for

    assert chunk_bytes_for(PER_DEVICE, torch.device("cpu")) == 128 * 2**20
    assert chunk_bytes_for(PER_DEVICE, torch.device("cuda", 0)) == 1024 * 2**20
    assert chunk_bytes_for(PER_DEVICE, None) == 128 * 2**20
    assert chunk_bytes_for(4096, torch.device("cuda", 0)) == 4096
    assert chunk_bytes_for(None, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        chunk_bytes_for(-1, torch.device("cpu"))


@pytest.mark.bare_tensors
def test_memory_budget_is_read_from_the_environment_at_construction(monkeypatch):
    """The environment variables are read once, when the optimizer is built; the functional
    layer receives plain numbers (and never reads the environment)."""
    from muonscale.memory import (
        DEFAULT_NS_WORKSPACE_BYTES,
        NS_WORKSPACE_ENV,
        PER_DEVICE,
        UPDATE_CHUNK_ENV,
        MemoryBudget,
    )

    monkeypatch.delenv(UPDATE_CHUNK_ENV, raising=False)
    monkeypatch.delenv(NS_WORKSPACE_ENV, raising=False)
    p = nn.Parameter(torch.randn(8, 12))
    assert Muon([p]).memory == MemoryBudget(PER_DEVICE, DEFAULT_NS_WORKSPACE_BYTES)
    monkeypatch.setenv(UPDATE_CHUNK_ENV, "64")
    monkeypatch.setenv(NS_WORKSPACE_ENV, "0.5")
    opt = Muon([p])
    assert opt.memory == MemoryBudget(64 * 2**20, 2**19)
    monkeypatch.setenv(UPDATE_CHUNK_ENV, "1")  # later changes do not reach a built optimizer
    assert opt.memory.update_chunk_bytes == 64 * 2**20
    monkeypatch.setenv(UPDATE_CHUNK_ENV, "lots")
    with pytest.raises(ValueError, match=UPDATE_CHUNK_ENV):
        Muon([p])


def test_elementwise_backend_is_read_at_construction_and_restored_like_memory(monkeypatch):
    """``MUONSCALE_ELEMENTWISE`` is read once, at construction, like the memory budget. A
    pickle carries neither, so an unpickled optimizer (or one from before the attribute
    existed) reads the environment once more; ``load_state_dict`` keeps the built choice."""
    import pickle

    from muonscale.kernels import ELEMENTWISE_ENV

    p = nn.Parameter(torch.randn(8, 12))
    monkeypatch.setenv(ELEMENTWISE_ENV, "auto")
    opt = Muon([("w", p)])
    assert opt.elementwise_backend == "auto"
    monkeypatch.setenv(ELEMENTWISE_ENV, "foreach")
    assert pickle.loads(pickle.dumps(opt)).elementwise_backend == "foreach"
    monkeypatch.setenv(ELEMENTWISE_ENV, "fast")  # not read by load_state_dict
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert opt.elementwise_backend == "auto"
    with pytest.raises(ValueError, match=ELEMENTWISE_ENV):
        pickle.loads(pickle.dumps(opt))
    monkeypatch.delenv(ELEMENTWISE_ENV)
    assert copy.deepcopy(opt).elementwise_backend == "foreach"  # the default


@pytest.mark.parametrize("budget", [4, 100, 1000, 5000])
def test_chunked_adamw_equals_one_chunk(budget):
    """AdamW's denominators built in flat segments of bounded bytes: the same bits as all at
    once, including a non-contiguous parameter (taken whole)."""
    from muonscale import functional

    shapes = [(16, 24), (7,), (40, 9), (3,)]

    def run(max_chunk_bytes):
        gen = torch.Generator().manual_seed(7)
        params = [torch.randn(s, generator=gen) for s in shapes]
        params.append(torch.randn(9, 40, generator=gen).t())  # non-contiguous
        avgs = [torch.zeros_like(p) for p in params]
        sqs = [torch.zeros_like(p) for p in params]
        steps = [torch.tensor(0.0) for _ in params]
        grads = [
            torch.randn(p.shape, generator=torch.Generator().manual_seed(i))
            for i, p in enumerate(params)
        ]
        for _ in range(3):
            functional.adamw(
                params,
                grads,
                avgs,
                sqs,
                steps,
                lr=1e-2,
                beta1=0.9,
                beta2=0.95,
                eps=1e-8,
                weight_decay=0.1,
                max_chunk_bytes=max_chunk_bytes,
            )
        return params + avgs + sqs

    for a, b in zip(run(None), run(budget)):
        assert torch.equal(a, b)


@pytest.mark.bare_tensors
def test_step_releases_newton_schulz_workspaces():
    """NS scratch is not held between steps (it would sit on top of the next forward/backward's
    activations); within a step it is reused."""
    from muonscale.kernels import cached_workspace_bytes

    p = nn.Parameter(torch.randn(32, 48))
    opt = Muon([p], lr=0.01, ns_dtype=torch.float32)
    for _ in range(2):
        p.grad = torch.randn(32, 48)
        before = p.detach().clone()
        opt.step()
        assert not torch.equal(before, p)
        assert cached_workspace_bytes() == 0


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 11, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.proj(torch.relu(self.fc(x)))
        return self.lm_head(self.norm(x))


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 11, (4, 5), generator=g)
    return nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())


def _train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        opt.zero_grad()
        _loss(model, i).backward()
        opt.step()


def test_routing_of_a_model():
    torch.manual_seed(0)
    model = TinyNet()
    opt = Muon(model.named_parameters(), lr=1e-3, weight_decay=0.1)
    algo = {n: d.algorithm for n, d in opt.routing.items()}
    assert algo == {
        "wte.weight": "adamw",
        "fc.weight": "muon",
        "fc.bias": "adamw",
        "proj.weight": "muon",
        "proj.bias": "adamw",
        "norm.weight": "adamw",
        "norm.bias": "adamw",
        "lm_head.weight": "adamw",
    }
    wd = {g["algorithm"] + str(len(g["params"])): g["weight_decay"] for g in opt.param_groups}
    assert wd == {"muon2": 0.1, "adamw2": 0.1, "adamw4": 0.0}  # ≥2-D AdamW decays, 0/1-D not
    assert "muon" in opt.summary() and "lm_head.weight" in opt.summary()


def test_resume_is_bit_identical():
    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    opt = Muon(model.named_parameters(), lr=3e-3, weight_decay=0.1, momentum_dtype=torch.bfloat16)
    _train(model, opt, 6)

    opt2 = Muon(twin.named_parameters(), lr=3e-3, weight_decay=0.1, momentum_dtype=torch.bfloat16)
    _train(twin, opt2, 3)
    saved_model, saved_opt = copy.deepcopy(twin.state_dict()), copy.deepcopy(opt2.state_dict())
    resumed = TinyNet()
    resumed.load_state_dict(saved_model)
    opt3 = Muon(
        resumed.named_parameters(), lr=3e-3, weight_decay=0.1, momentum_dtype=torch.bfloat16
    )
    opt3.load_state_dict(saved_opt)
    buf = next(s["momentum_buffer"] for s in opt3.state.values() if "momentum_buffer" in s)
    assert buf.dtype == torch.bfloat16
    _train(resumed, opt3, 3, start=3)
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


def test_old_checkpoint_without_new_options_loads():
    model = TinyNet()
    opt = Muon(model.named_parameters(), lr=1e-3)
    _train(model, opt, 1)
    sd = opt.state_dict()
    for group in sd["param_groups"]:
        for key in ("matrix_mode", "ns_eps", "momentum_dtype", "ns_method"):
            group.pop(key, None)
    fresh = Muon(model.named_parameters(), lr=1e-3)
    fresh.load_state_dict(sd)
    _train(model, fresh, 1, start=1)


def test_get_state_dict_on_fresh_optimizer_leaves_parameters_bitwise_unchanged():
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = TinyNet()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = Muon(model.named_parameters(), lr=1e-2, weight_decay=0.1)
    _, optim_sd = get_state_dict(model, opt)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
    assert optim_sd["state"]  # state was initialized
    assert all(g["lr"] == 1e-2 for g in opt.param_groups)


def test_lr_scheduler_scales_both_halves():
    model = TinyNet()
    opt = Muon(model.named_parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    _train(model, opt, 1)
    sched.step()
    sched.step()
    assert {g["algorithm"]: g["lr"] for g in opt.param_groups} == {"muon": 2.5e-3, "adamw": 2.5e-3}


def test_nonfinite_raise_leaves_everything_untouched():
    model = TinyNet()
    opt = Muon(model.named_parameters(), lr=1e-2)
    _train(model, opt, 2)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = copy.deepcopy(opt.state_dict())
    opt.zero_grad()
    _loss(model, 5).backward()
    model.proj.weight.grad[0, 0] = float("nan")
    with pytest.raises(NonFiniteGradientError, match="proj.weight"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n])
    after = opt.state_dict()
    for k, v in state["state"].items():
        for key, t in v.items():
            assert torch.equal(t, after["state"][k][key])


def test_nonfinite_skip_counts_and_skips():
    model = TinyNet()
    opt = Muon(model.named_parameters(), lr=1e-2, nonfinite="skip")
    _loss(model, 0).backward()
    model.norm.bias.grad[0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert opt.skipped_steps == 1 and not opt.state
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_closure_and_add_param_group():
    model = TinyNet()
    extra = nn.Parameter(torch.randn(6, 4))
    opt = Muon(model.named_parameters(), lr=1e-2)
    opt.add_param_group({"params": [("extra", extra)], "lr": 5e-3})  # named, as the others
    assert opt.param_groups[-1]["algorithm"] == "muon" and opt.param_groups[-1]["momentum"] == 0.95
    extra.grad = torch.randn(6, 4)

    def closure():
        opt.zero_grad(set_to_none=False)
        loss = _loss(model, 0)
        loss.backward()
        extra.grad = torch.randn(6, 4)
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and "momentum_buffer" in opt.state[extra]


def test_qkv_split_orthogonalizes_each_block_alone():
    layout = QKVLayout(n_query_groups=2, q_per_group=2, head_dim=3)  # 24 rows
    W = torch.randn(layout.rows, 8, dtype=torch.float64, requires_grad=True)
    opt = Muon(
        [("attn.qkv.weight", W)],
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,  # the oracle has no decay
        nesterov=False,
        scale="none",
        ns_dtype=torch.float64,
        splits={"attn.qkv.weight": layout},
    )
    G = torch.randn_like(W)
    W0 = W.detach().clone()
    W.grad = G.clone()
    opt.step()
    expected = W0.clone()
    for rows in layout.row_partition("qkv"):
        expected[rows] -= 0.1 * newton_schulz(G[rows], ns_dtype=torch.float64)
    torch.testing.assert_close(W.detach(), expected, rtol=0, atol=1e-12)
    assert layout.q_rows().tolist()[:6] == [0, 1, 2, 3, 4, 5] and layout.k_rows().tolist()[:3] == [
        6,
        7,
        8,
    ]


@pytest.mark.bare_tensors
def test_equal_row_blocks_and_higher_dim_modes():
    conv = torch.randn(8, 3, 2, 2, dtype=torch.float64, requires_grad=True)
    experts = torch.randn(3, 5, 7, dtype=torch.float64, requires_grad=True)
    heads = torch.randn(12, 6, dtype=torch.float64, requires_grad=True)
    opt_flat = Muon(
        [conv],
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,
        nesterov=False,
        scale="none",
        ns_dtype=torch.float64,
    )
    opt_batch = Muon(
        [experts],
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,  # the oracle has no decay
        nesterov=False,
        scale="none",
        ns_dtype=torch.float64,
        matrix_mode="batch",
    )
    opt_heads = Muon(
        [("h", heads)],
        lr=0.1,
        momentum=0.0,
        weight_decay=0.0,  # the oracle has no decay
        nesterov=False,
        scale="none",
        ns_dtype=torch.float64,
        splits={"h": 3},
    )
    for p, opt in ((conv, opt_flat), (experts, opt_batch), (heads, opt_heads)):
        p.grad = torch.randn_like(p)
        p0 = p.detach().clone()
        opt.step()
        if p is conv:
            expected = p0 - 0.1 * newton_schulz(
                p.grad.reshape(8, 12), ns_dtype=torch.float64
            ).reshape(p.shape)
        elif p is experts:
            expected = p0 - 0.1 * newton_schulz(p.grad, ns_dtype=torch.float64)
        else:
            expected = p0 - 0.1 * torch.cat(
                [newton_schulz(b, ns_dtype=torch.float64) for b in p.grad.split(4)]
            )
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-12)


def test_optimizer_state_bytes_counts_state_tensors():
    model = TinyNet()
    opt = Muon(model.named_parameters(), lr=1e-2, momentum_dtype=torch.bfloat16)
    _train(model, opt, 1)
    muon_elems = model.fc.weight.numel() + model.proj.weight.numel()
    adamw_elems = sum(p.numel() for p in model.parameters()) - muon_elems
    n_adamw = sum(1 for p in model.parameters()) - 2
    assert opt.optimizer_state_bytes() == 2 * muon_elems + 8 * adamw_elems + 4 * n_adamw


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=1.0), "momentum"),
        (dict(momentum=-0.1), "momentum"),
        (dict(ns_steps=0), "ns_steps"),
        (dict(coefficients="nope"), "valid presets"),
        (dict(scale="huge"), "scale"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(adamw_betas=(0.9, 1.0)), "adamw_betas"),
        (dict(adamw_eps=-1.0), "adamw_eps"),
        (dict(nonfinite="warn"), "nonfinite"),
        (dict(ns_dtype=torch.int32), "ns_dtype"),
        (dict(matrix_mode="stack"), "matrix_mode"),
        (dict(scale="shape"), "adamw_lr is required"),
        (dict(splits={"nope.weight": 2}), "no Muon parameter"),
        (dict(splits={"fc.weight": 5}), "do not divide"),
        (dict(rules=[(r"fc", "sgd")]), "expected one of"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Muon(TinyNet().named_parameters(), **kwargs)


def test_scale_other_than_match_rms_with_adamw_lr_is_fine():
    opt = Muon(TinyNet().named_parameters(), scale="shape", lr=0.02, adamw_lr=3e-4)
    assert {g["algorithm"]: g["lr"] for g in opt.param_groups} == {"muon": 0.02, "adamw": 3e-4}


def test_unorthogonalizable_parameters_are_named():
    z = torch.randn(4, 4, dtype=torch.complex64, requires_grad=True)
    with pytest.raises(ValueError, match="complex parameter 'z'"):
        Muon([{"params": [("z", z)], "algorithm": "muon"}])
    emb = nn.Embedding(10, 4, sparse=True)
    opt = Muon([{"params": [("emb.w", emb.weight)], "algorithm": "muon"}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="emb.w.*sparse"):
        opt.step()


def test_route_rules():
    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = nn.ModuleDict({"output": nn.ModuleDict({"dense": nn.Linear(4, 4)})})
            self.output = nn.Linear(4, 9)
            self.tok = nn.Embedding(9, 4)
            self.out = nn.Linear(4, 9, bias=False)
            self.out.weight = self.tok.weight  # tied head, detected by module type

    model = HF()
    decisions = muonscale.route(model)
    assert decisions["attention.output.dense.weight"].algorithm == "muon"  # not a substring match
    assert decisions["output.weight"].algorithm == "adamw"
    assert decisions["tok.weight"].algorithm == "adamw"
    assert "out.weight" not in decisions  # tied: one tensor, listed once
    by_name = muonscale.route(model.named_parameters(), rules=[(r"^output\.", "muon")])
    assert (
        by_name["output.weight"].algorithm == "muon" and "user" in by_name["output.weight"].reason
    )
    by_callable = muonscale.route(
        model.named_parameters(), rules=[lambda n, p: "adamw" if p.shape[0] == 4 else None]
    )
    assert by_callable["attention.output.dense.weight"].algorithm == "adamw"
