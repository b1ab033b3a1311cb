"""``qk_lr_scale``: the query and key blocks of a split fused QKV weight take a larger step,
against a float64 reference written block by block (tests/reference_variants.py), and the
option's life in the optimizer (state_dict, pickle, rebinding, bad values, nothing to act on)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from reference_variants import muon_step, ns_frobenius

from muonscale import Muon, QKVLayout
from muonscale.newton_schulz import resolve_coefficients
from muonscale.scaling import update_scale

# float32 Newton–Schulz of 5 steps on ≤ 20-wide blocks: ~n·2⁻²⁴ per product, amplified by the
# polynomial's slope (≤ ~10) over 5 steps; three steps of lr·s·c ≈ 0.05 · 0.2 · √20 · 3 ≈ 0.13:
# 1e-4 absolute keeps a 10× margin (as tests/test_variants.py F32_NS_TOL).
F32_NS_TOL = 1e-4
LAYOUT = QKVLayout(n_query_groups=2, q_per_group=2, head_dim=4)  # 32 rows, interleaved
COLS = 20


def _train(c: float, mode: str, steps: int = 3, *, transposed: bool = False):
    g = torch.Generator().manual_seed(7)
    shape = (COLS, LAYOUT.rows) if transposed else (LAYOUT.rows, COLS)
    w = torch.nn.Parameter(torch.randn(*shape, generator=g))
    other = torch.nn.Parameter(torch.randn(12, COLS, generator=g))
    init = (w.detach().clone(), other.detach().clone())
    opt = Muon(
        [("attn.qkv.weight", w), ("mlp.fc.weight", other)],
        lr=0.05,
        weight_decay=0.5,
        ns_dtype=torch.float32,
        splits={"attn.qkv.weight": LAYOUT},
        qkv_split=mode,
        qk_lr_scale=c,
        transposed=["attn.qkv.weight"] if transposed else [],
    )
    grads = [
        (torch.randn(*shape, generator=g), torch.randn(12, COLS, generator=g)) for _ in range(steps)
    ]
    for gw, go in grads:
        w.grad, other.grad = gw.clone(), go.clone()
        opt.step()
    return opt, w, other, init, grads


def _reference(c: float, mode: str, init, grads, *, transposed: bool = False) -> torch.Tensor:
    """The fused weight after the steps, in float64: each block of ``row_partition(mode)`` a
    Muon matrix of its own, its update scaled by s(rows, cols) · (c for q and k blocks)."""
    W = init[0].double().clone()
    W = W.T.clone() if transposed else W
    B = torch.zeros_like(W)
    schedule = resolve_coefficients("keller", 5)
    for gw, _ in grads:
        G = gw.double().T if transposed else gw.double()
        for rows, role in zip(LAYOUT.row_partition(mode), LAYOUT.block_roles(mode)):
            factor = c if role in ("q", "k") else 1.0
            W[rows], B[rows], _ = muon_step(
                W[rows],
                G[rows],
                B[rows],
                None,
                lr=0.05,
                wd=0.5,
                mu=0.95,
                nesterov=True,
                orth=lambda U: ns_frobenius(U, schedule),
                scale=update_scale("match_rms_adamw", len(rows), COLS) * factor,
                normalize=False,
                cautious=False,
            )
    return W.T if transposed else W


@pytest.mark.parametrize("mode", ["qkv", "head"])
@pytest.mark.parametrize("c", [1.0, 2.5])
def test_qk_lr_scale_matches_float64_reference(mode, c):
    _, w, _, init, grads = _train(c, mode)
    ref = _reference(c, mode, init, grads)
    assert torch.allclose(w.detach().double(), ref, atol=F32_NS_TOL * max(c, 1.0))


def test_qk_lr_scale_on_a_transposed_weight_matches_float64_reference():
    _, w, _, init, grads = _train(2.0, "qkv", transposed=True)
    ref = _reference(2.0, "qkv", init, grads, transposed=True)
    assert torch.allclose(w.detach().double(), ref, atol=2 * F32_NS_TOL)


@pytest.mark.parametrize("mode", ["qkv", "head"])
def test_only_query_and_key_rows_move_further(mode):
    """One step from the same state: Q and K rows move c times as far, V rows and other
    matrices exactly as far, and the momentum is the same."""
    opt1, w1, o1, init, _ = _train(1.0, mode, steps=1)
    opt2, w2, o2, _, _ = _train(3.0, mode, steps=1)
    d1, d2 = w1.detach() - init[0], w2.detach() - init[0]
    decay = -0.05 * 0.5 * init[0]  # decoupled weight decay keeps the group's lr
    qk = torch.cat([LAYOUT.q_rows(), LAYOUT.k_rows()])
    # Each Δ is a difference of float32 weights (half an ulp of |W| each): the bound on 3Δ₁ − Δ₂
    ulp = torch.finfo(torch.float32).eps * float(init[0].abs().max())
    assert torch.allclose(d2[qk] - decay[qk], 3.0 * (d1[qk] - decay[qk]), rtol=0, atol=4 * ulp)
    assert torch.equal(d2[LAYOUT.v_rows()], d1[LAYOUT.v_rows()])
    assert torch.equal(o1, o2)
    assert torch.equal(opt1.state[w1]["momentum_buffer"], opt2.state[w2]["momentum_buffer"])


def test_qk_lr_scale_travels_with_state_dict_pickle_and_rebinding():
    opt, w, other, _, grads = _train(2.0, "qkv", steps=2)
    assert opt.param_groups[0]["qk_lr_scale"] == 2.0
    for clone in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        (qkv, _) = clone.param_groups[0]["params"]
        assert clone.split_roles[id(qkv)] == ("q", "k", "v")
        assert clone.param_groups[0]["qk_lr_scale"] == 2.0
    # a state_dict written before the option existed takes the loading optimizer's option
    saved = opt.state_dict()
    del saved["param_groups"][0]["qk_lr_scale"]
    for built_with in (1.0, 3.0):
        fresh = _train(built_with, "qkv", steps=0)[0]
        fresh.load_state_dict(saved)
        assert fresh.param_groups[0]["qk_lr_scale"] == built_with
    # rebinding to new parameter objects keeps the roles of the split weight
    new_w = torch.nn.Parameter(w.detach().clone())
    new_o = torch.nn.Parameter(other.detach().clone())
    opt.rebind_parameters([("attn.qkv.weight", new_w), ("mlp.fc.weight", new_o)])
    assert opt.split_roles == {id(new_w): ("q", "k", "v")}


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf"), "2", True])
def test_bad_qk_lr_scale_names_the_option(bad):
    with pytest.raises(ValueError, match="qk_lr_scale"):
        Muon([("h.weight", torch.nn.Parameter(torch.randn(4, 4)))], qk_lr_scale=bad)


def test_qk_lr_scale_without_query_or_key_blocks_warns():
    w = torch.nn.Parameter(torch.randn(12, 6))
    with pytest.warns(UserWarning, match="qk_lr_scale=2.0 .*acts on no parameter"):
        Muon([("h.weight", w)], qk_lr_scale=2.0, splits={"h.weight": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([("h.weight", w)], qk_lr_scale=1.0)
        Muon(
            [("h.weight", w)],
            qk_lr_scale=2.0,
            splits={"h.weight": QKVLayout(n_query_groups=1, q_per_group=2, head_dim=3)},
        )
