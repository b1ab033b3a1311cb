"""The torch.optim.Muon baseline with float32 Newton-Schulz (muonscale.bench.torch_muon).

Oracle: torch.optim.Muon's update written out from its documented algorithm (momentum lerp,
Nesterov, Keller's quintic Newton-Schulz on the wide orientation after Frobenius
normalization, match_rms_adamw lr adjustment, decoupled weight decay) with the iteration in
float32, in the same operation order as torch; and the same in float64 for the precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim import _muon

from muonscale.bench.config import BenchConfig
from muonscale.bench.runner import make_run
from muonscale.bench.torch_muon import Float32NewtonSchulzRun, float32_newton_schulz

COEFFS = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)


def reference_step(param, grad, buf, *, lr, wd, momentum, dtype):
    """One torch.optim.Muon step (nesterov, match_rms_adamw) with NS in ``dtype``."""
    buf = buf.lerp(grad, 1 - momentum)
    update = grad.lerp(buf, momentum).to(dtype)
    x = update.T if update.size(0) > update.size(1) else update
    x = x / x.norm().clamp(min=_muon.EPS)
    a, b, c = COEFFS
    for _ in range(_muon.DEFAULT_NS_STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    ortho = x.T if update.size(0) > update.size(1) else x
    adjusted = lr * 0.2 * math.sqrt(max(param.shape))
    new = param.to(dtype) * (1 - lr * wd) - adjusted * ortho
    return new, buf


@pytest.mark.parametrize("shape", [(12, 7), (5, 9)])
def test_float32_path_is_torchs_update_with_float32_newton_schulz(shape):
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(shape))
    grads = [torch.randn(shape) for _ in range(3)]
    optimizer = torch.optim.Muon([param], lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    ref32, ref64 = param.detach().clone(), param.detach().double()
    buf32, buf64 = torch.zeros(shape), torch.zeros(shape, dtype=torch.float64)
    for grad in grads:
        param.grad = grad.clone()
        with float32_newton_schulz():
            optimizer.step()
        assert torch.equal(param.grad, grad)  # torch's in-place division hit a copy only
        ref32, buf32 = reference_step(
            ref32, grad, buf32, lr=0.02, wd=0.1, momentum=0.95, dtype=torch.float32
        )
        ref64, buf64 = reference_step(
            ref64, grad.double(), buf64, lr=0.02, wd=0.1, momentum=0.95, dtype=torch.float64
        )
    assert param.dtype == torch.float32
    # Same float32 operations in the same order: equal up to a few rounding steps of |param|
    # (eps32 ~ 1.2e-7, ~10 roundings on O(1) values per step, 3 steps).
    eps32 = torch.finfo(torch.float32).eps
    scale = ref64.abs().max().item()
    assert (param.detach() - ref32).abs().max().item() <= 30 * eps32 * scale
    # and within float32 precision of the float64 iteration (5 NS steps amplify rounding
    # by at most the polynomial's slope a=3.4445 per step: 3.4445**5 ~ 490)
    assert (param.detach().double() - ref64).abs().max().item() <= 500 * eps32 * scale * 3


def test_bfloat16_path_outside_the_block_differs():
    torch.manual_seed(1)
    grad = torch.randn(16, 8)
    outside = _muon._zeropower_via_newtonschulz(grad, COEFFS, 5, _muon.EPS)
    with float32_newton_schulz():
        inside = _muon._zeropower_via_newtonschulz(grad, COEFFS, 5, _muon.EPS)
    assert outside.dtype == torch.bfloat16 and inside.dtype == torch.float32
    # bfloat16 keeps 8 bits of mantissa: differences of order 2**-8 relative, far above float32
    assert (outside.float() - inside).abs().max().item() > 100 * torch.finfo(torch.float32).eps


def test_torch_function_is_restored_even_after_an_error():
    original = _muon._zeropower_via_newtonschulz
    with pytest.raises(RuntimeError, match="boom"):
        with float32_newton_schulz():
            assert _muon._zeropower_via_newtonschulz is not original
            raise RuntimeError("boom")
    assert _muon._zeropower_via_newtonschulz is original


def test_bench_contenders_use_float32_on_cpu_and_bf16_for_torch_muon_bf16():
    bench = BenchConfig(
        n_layer=1,
        d_model=32,
        n_head=2,
        tokens_per_step=256,
        eval_batches=1,
        lr_warmup_steps=1,
        steps=3,
        baselines=["torch-muon", "torch-muon-bf16"],
    )
    f32 = make_run(bench, "torch-muon", 0.03)
    bf16 = make_run(bench, "torch-muon-bf16", 0.03)
    manual = make_run(bench, "torch-muon-bf16", 0.03)  # torch-muon stepped by hand in float32
    assert isinstance(f32, Float32NewtonSchulzRun) and not isinstance(bf16, Float32NewtonSchulzRun)
    for _ in range(2):  # interleaved, as in the bench
        f32.step()
        bf16.step()
        with float32_newton_schulz():
            manual.step()
    pairs = list(zip(f32.model.parameters(), manual.model.parameters(), bf16.model.parameters()))
    assert all(torch.equal(a, m) for a, m, _ in pairs)
    assert any(not torch.equal(a, b) for a, _, b in pairs)
