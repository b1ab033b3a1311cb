"""Triton kernels of Muon's two elementwise passes against the foreach passes and float64.

The kernels run on CPU tensors under the Triton interpreter (an interpreted twin of each
kernel, as for the symmetric kernels: TRITON_INTERPRET need not be set), in float32 and
float16 only (the interpreter's bfloat16 conversion does not round to nearest even).
Skipped when triton is not installed.

Tolerances. u = 2⁻²⁴ (float32 unit roundoff; opmath of every pass), u_out the unit roundoff
of the destination dtype. Each output is one lerp ``a + w'(e − a)`` (w' = w, or 1 − w in
torch's large-weight form ``e − (e − a)(1 − w)``) or one ``p₁ + step·o``, in float32, rounded
to the destination. torch and Triton on the GPU round the multiply-add once; the interpreter
rounds the product and the sum apart. Against the exact value r of the same formula on the
same rounded inputs (float64, exact for these products), either way:
    |r̂ − r| ≤ u·|w'(e − a)|  (product)  + u·|w'(e − a)|  (the difference e − a)
              + u·|r|  (float32 sum)  + u_out·|r|  (the cast)
(first order; ×1.01 covers the second-order terms). The foreach path must meet the same
bound, and the two paths then differ by at most twice it.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from muonscale import functional, matrix_step
from muonscale.kernels import (
    ELEMENTWISE_ENV,
    elementwise_backend_from_environment,
    elementwise_kernels,
    triton_available,
)
from muonscale.settings import MuonSettings

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")
U32 = torch.finfo(torch.float32).eps / 2


def _unit(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def _lerp_bound(a, e, w: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact lerp in float64, the bound of the module docstring) for float32 weight w."""
    a, e = a.double(), e.double()
    w = float(torch.tensor(w, dtype=torch.float32))  # both paths use the float32 weight
    exact = a + w * (e - a)
    w_term = (w if abs(w) < 0.5 else 1 - w) * (e - a).abs()
    bound = 2 * U32 * w_term + (U32 + _unit(out_dtype)) * exact.abs()
    return exact, 1.01 * bound + torch.finfo(out_dtype).tiny


def _within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> bool:
    return bool(((got.double() - exact).abs() <= bound).all())


SHAPES = [(2, 40, 24), (1, 7, 33)]  # rows·cols not a multiple of the block


@needs_triton
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("momentum_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("transposed_out", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_momentum_and_ns_input(shape, transposed_out, momentum_dtype, ns_dtype, nesterov):
    from muonscale.kernels.triton_elementwise import momentum_and_ns_input_

    torch.manual_seed(0)
    k, rows, cols = shape
    mu = 0.95
    grads = [torch.randn(rows, cols) for _ in range(k)]
    # momentum buffers are views into a stack, as the optimizer keeps them; every other one
    stack = torch.randn(2 * k, rows, cols).to(momentum_dtype)
    start = stack.clone()
    bufs_triton = list(stack.unbind(0))[::2]
    bufs_foreach = [b.clone() for b in bufs_triton]

    def new_out():
        return (
            torch.empty(k, cols, rows, dtype=ns_dtype).mT
            if transposed_out
            else (torch.empty(k, rows, cols, dtype=ns_dtype))
        )

    X_triton, X_foreach = new_out(), new_out()
    momentum_and_ns_input_(grads, bufs_triton, X_triton, momentum=mu, nesterov=nesterov)
    functional.update_momentum_(grads, bufs_foreach, momentum=mu)
    functional.write_directions_(
        grads, bufs_foreach, list(X_foreach.unbind(0)), momentum=mu, nesterov=nesterov
    )
    assert torch.equal(stack[1::2], start[1::2])  # the other members are untouched
    for j in range(k):
        old = start[2 * j]
        exact, bound = _lerp_bound(old, grads[j].to(momentum_dtype), 1 - mu, momentum_dtype)
        for bufs, X in ((bufs_triton, X_triton), (bufs_foreach, X_foreach)):
            assert _within(bufs[j], exact, bound)
            if nesterov:  # U from the path's own new momentum
                u_exact, u_bound = _lerp_bound(grads[j], bufs[j].float(), mu, ns_dtype)
                assert _within(X[j], u_exact, u_bound)
            else:
                assert torch.equal(X[j], bufs[j].to(ns_dtype))


@needs_triton
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("update_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("transposed_updates", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_apply_update(shape, transposed_updates, param_dtype, update_dtype, weight_decay):
    from muonscale.kernels.triton_elementwise import apply_update_

    torch.manual_seed(1)
    k, rows, cols = shape
    lr, alpha = 0.02, -1.3
    params = [torch.randn(rows, cols).to(param_dtype) for _ in range(k)]
    start = [p.clone() for p in params]
    if transposed_updates:
        O = torch.randn(k, cols, rows).to(update_dtype).mT
    else:
        O = torch.randn(k, rows, cols).to(update_dtype)
    foreach = [p.clone() for p in params]
    apply_update_(params, O, lr=lr, weight_decay=weight_decay, alpha=alpha)
    matrix_step.apply_updates_(
        foreach, list(O.unbind(0)), [alpha] * k, lr=lr, weight_decay=weight_decay
    )
    step = float(torch.tensor(lr * alpha, dtype=torch.float32))
    for j in range(k):
        # W · (1 − lr λ) is one float32 product rounded to W's dtype on either path
        decayed = start[j]
        if weight_decay:
            decayed = (start[j].float() * (1 - lr * weight_decay)).to(param_dtype)
        product = step * O[j].double()
        exact = decayed.double() + product
        bound = U32 * product.abs() + (U32 + _unit(param_dtype)) * exact.abs()
        bound = 1.01 * bound + torch.finfo(param_dtype).tiny
        assert _within(params[j], exact, bound)
        if weight_decay and param_dtype == torch.float16:
            # torch's CPU foreach fallback rounds the scalar 1 − lr λ to float16 first (CUDA's
            # foreach kernels keep it in float32, as the Triton kernel does): not comparable
            continue
        assert _within(foreach[j], exact, bound)


@needs_triton
def test_kernels_reject_mismatched_members():
    from muonscale.kernels.triton_elementwise import apply_update_, momentum_and_ns_input_

    g = [torch.randn(4, 6), torch.randn(4, 6)]
    b = [torch.zeros(4, 6), torch.zeros(4, 6)]
    with pytest.raises(ValueError, match="stack"):
        momentum_and_ns_input_(g, b, torch.empty(3, 4, 6), momentum=0.9, nesterov=True)
    with pytest.raises(ValueError, match="contiguous"):
        momentum_and_ns_input_(
            g, [torch.zeros(6, 4).mT] * 2, torch.empty(2, 4, 6), momentum=0.9, nesterov=True
        )
    with pytest.raises(TypeError, match="lr"):
        apply_update_(b, torch.empty(2, 4, 6), lr=torch.tensor(0.1), weight_decay=0.0, alpha=-1)


def test_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert elementwise_kernels(cpu, "foreach") is None
    assert elementwise_kernels(cuda, "foreach") is None  # the default, until timed on a GPU
    assert elementwise_kernels(cpu, "auto") is None  # auto: CUDA tensors only
    with pytest.raises(ValueError, match="elementwise_backend.*'auto', 'foreach' or 'triton'"):
        elementwise_kernels(cpu, "fast")
    if triton_available():
        assert elementwise_kernels(cpu, "triton") is not None


def test_backend_from_environment(monkeypatch):
    monkeypatch.delenv(ELEMENTWISE_ENV, raising=False)
    assert elementwise_backend_from_environment() == "foreach"  # default
    for value in ("auto", "foreach", "triton"):
        assert elementwise_backend_from_environment({ELEMENTWISE_ENV: value}) == value
        monkeypatch.setenv(ELEMENTWISE_ENV, value)
        assert elementwise_backend_from_environment() == value
    with pytest.raises(ValueError, match=f"{ELEMENTWISE_ENV}.*'auto', 'foreach' or 'triton'"):
        elementwise_backend_from_environment({ELEMENTWISE_ENV: "fast"})


def _record_backends(monkeypatch) -> list[str]:
    """The backend of every ``elementwise_kernels`` call ``functional.muon`` makes."""
    seen: list[str] = []

    def recording(device, backend):
        seen.append(backend)
        return elementwise_kernels(device, backend)

    monkeypatch.setattr(functional, "elementwise_kernels", recording)
    return seen


def _named(params) -> list[tuple[str, torch.nn.Parameter]]:
    return [(f"blocks.{i}.weight", p) for i, p in enumerate(params)]


def _one_step(opt, params) -> None:
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


def test_bad_value_raises_at_construction(monkeypatch):
    import muonscale

    monkeypatch.setenv(ELEMENTWISE_ENV, "fast")
    with pytest.raises(ValueError, match=f"{ELEMENTWISE_ENV}.*'auto', 'foreach' or 'triton'"):
        muonscale.Muon(_named([torch.nn.Parameter(torch.randn(8, 12))]))


def test_choice_is_read_at_construction_only(monkeypatch):
    """Changing the variable after construction changes nothing: the step neither reads it
    (a bad value no longer raises) nor uses it (the backend passed down is the one read when
    the optimizer was built)."""
    import muonscale

    seen = _record_backends(monkeypatch)
    for built_with, later in [(None, "triton"), ("auto", "foreach"), ("foreach", "fast")]:
        if built_with is None:
            monkeypatch.delenv(ELEMENTWISE_ENV, raising=False)
        else:
            monkeypatch.setenv(ELEMENTWISE_ENV, built_with)
        params = [torch.nn.Parameter(torch.randn(8, 12))]
        opt = muonscale.Muon(_named(params))
        assert opt.elementwise_backend == (built_with or "foreach")
        monkeypatch.setenv(ELEMENTWISE_ENV, later)
        seen.clear()
        _one_step(opt, params)
        assert seen == [built_with or "foreach"]


def test_functional_muon_defaults_to_foreach(monkeypatch):
    """Direct callers of ``functional.muon`` get the documented default, whatever the
    environment says."""
    from muonscale.matrices import MatrixView

    seen = _record_backends(monkeypatch)
    monkeypatch.setenv(ELEMENTWISE_ENV, "fast")
    p, g, b = torch.randn(8, 12), torch.randn(8, 12), torch.zeros(8, 12)
    kw = dict(views=[MatrixView.build(p.shape)], lr=0.02, weight_decay=0.0)
    kw.update(settings=MuonSettings(momentum=0.95, nesterov=True, ns_steps=5, scale="shape"))
    functional.muon([p], [g], [b], **kw)
    assert seen == ["foreach"]
    with pytest.raises(ValueError, match="elementwise_backend"):
        functional.muon([p], [g], [b], elementwise_backend="x", **kw)


def _count_kernel_launches(monkeypatch) -> list[int]:
    """Members of every ``momentum_and_ns_input_`` launch."""
    from muonscale.kernels import triton_elementwise

    calls: list[int] = []
    real = triton_elementwise.momentum_and_ns_input_

    def counting(*args, **kw):
        calls.append(len(args[0]))
        return real(*args, **kw)

    monkeypatch.setattr(triton_elementwise, "momentum_and_ns_input_", counting)
    return calls


@needs_triton
def test_built_with_triton_takes_the_triton_path(monkeypatch):
    """Built with ``triton`` (CPU tensors: the interpreter twins, no TRITON_INTERPRET needed),
    the step launches the kernels even after the variable is unset; built with the default,
    it does not even when the variable says ``triton`` by then."""
    import muonscale

    calls = _count_kernel_launches(monkeypatch)
    monkeypatch.setenv(ELEMENTWISE_ENV, "triton")
    params = [torch.nn.Parameter(torch.randn(8, 12)) for _ in range(2)]
    opt = muonscale.Muon(_named(params))
    monkeypatch.delenv(ELEMENTWISE_ENV)
    _one_step(opt, params)
    assert calls == [2]  # one stack of two members
    default = muonscale.Muon(_named(params))
    monkeypatch.setenv(ELEMENTWISE_ENV, "triton")
    _one_step(default, params)
    assert calls == [2]


@pytest.mark.timeout(120)
def test_choice_reaches_distributed_layouts(monkeypatch, tmp_path):
    """``DistributedMuon`` and ``DTensorMuon`` (world size 1: a one-rank gloo group in this
    process, for the DTensor mesh) read the variable at construction as ``Muon`` does: a bad
    value raises there, and ``DistributedMuon``'s owner update (``functional.muon``) gets the
    choice made at construction. ``DTensorMuon`` runs its elementwise passes on local shards
    with foreach (outside ``functional.muon``); it keeps the choice all the same."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonscale import DistributedMuon, DTensorMuon

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    seen = _record_backends(monkeypatch)
    calls = _count_kernel_launches(monkeypatch) if triton_available() else []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for build, make in [
            (DistributedMuon, lambda: torch.nn.Parameter(torch.randn(8, 12))),
            (
                DTensorMuon,
                lambda: torch.nn.Parameter(distribute_tensor(torch.randn(8, 12), mesh, [Shard(0)])),
            ),
        ]:
            monkeypatch.setenv(ELEMENTWISE_ENV, "fast")
            with pytest.raises(ValueError, match=ELEMENTWISE_ENV):
                build(_named([make()]), lr=0.02)
            chosen = "triton" if triton_available() else "auto"
            monkeypatch.setenv(ELEMENTWISE_ENV, chosen)
            params = [make(), make()]
            opt = build(_named(params), lr=0.02)
            assert opt.elementwise_backend == chosen
            monkeypatch.setenv(ELEMENTWISE_ENV, "fast")  # after construction: not read
            seen.clear()
            calls.clear()
            _one_step(opt, params)
            if build is DistributedMuon:
                assert seen == [chosen]
                if triton_available():
                    assert calls == [2]  # the Triton path ran on the owner's stack
                opt.remove_hooks()
            else:
                assert seen == [] and calls == []
            del opt, params
            gc.collect()
    finally:
        dist.destroy_process_group()


def _muon_run(*, momentum, lr, scale, nesterov, env, monkeypatch, calls=None, device="cpu"):
    """Three Muon steps on stacks of every orientation plus a parameter of the per-matrix
    path, one parameter without a gradient at step 2; returns parameters and momenta."""
    import muonscale

    if env is None:
        monkeypatch.delenv(ELEMENTWISE_ENV, raising=False)
    else:
        monkeypatch.setenv(ELEMENTWISE_ENV, env)
    g = torch.Generator().manual_seed(0)
    shapes = [(24, 40)] * 3 + [(40, 24)] * 2 + [(8, 4, 3, 3)]
    # dyadic values with few bits (k/64): with μ = 1/2 every momentum lerp is exact
    params = [
        torch.nn.Parameter((torch.randint(-64, 64, s, generator=g) / 64).to(device)) for s in shapes
    ]
    grads = [
        [(torch.randint(-64, 64, s, generator=g) / 64).to(device) for s in shapes] for _ in range(3)
    ]
    opt = muonscale.Muon(
        params,
        lr=lr,
        momentum=momentum,
        nesterov=nesterov,
        weight_decay=0.1,
        scale=scale,
        ns_dtype=torch.float32,
    )
    for t in range(3):
        for i, p in enumerate(params):
            p.grad = None if (t == 1 and i == 1) else grads[t][i]
        opt.step()
    return [p.detach().cpu() for p in params], [
        opt.state[p]["momentum_buffer"].cpu() for p in params
    ]


@needs_triton
@pytest.mark.bare_tensors
@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_triton_forced_equals_foreach_bitwise(monkeypatch, nesterov):
    """μ = 1/2, dyadic gradients and lr · s(m, n) a power of two (scale "none"): every
    operation whose rounding could differ (lerp, the multiply-add of the update) is exact,
    so the two paths agree bitwise; this checks the wiring (members, orientation, strides,
    chunks). Rounding itself is checked above against float64."""
    calls = []
    from muonscale.kernels import triton_elementwise

    real = triton_elementwise.momentum_and_ns_input_

    def counting(*args, **kw):
        calls.append(len(args[0]))
        return real(*args, **kw)

    monkeypatch.setattr(triton_elementwise, "momentum_and_ns_input_", counting)
    kw = dict(momentum=0.5, lr=2.0**-5, scale="none", nesterov=nesterov)
    p_tri, m_tri = _muon_run(env="triton", monkeypatch=monkeypatch, **kw)
    # one launch per stack ((24, 40), (40, 24), (8, 36)) and step; one member without a
    # gradient at step 2
    assert calls == [3, 2, 1, 2, 2, 1, 3, 2, 1]
    p_ref, m_ref = _muon_run(env=None, monkeypatch=monkeypatch, **kw)
    assert len(calls) == 9  # the default CPU path did not use the kernels
    for a, b in zip(p_tri + m_tri, p_ref + m_ref):
        assert torch.equal(a, b)
    assert not torch.equal(p_ref[0], torch.zeros_like(p_ref[0]))


@needs_triton
@pytest.mark.bare_tensors
@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            ],
        ),
    ],
)
def test_muon_step_triton_forced_close_to_foreach(monkeypatch, device):
    """Default settings (μ = 0.95, Nesterov, scale "shape"): the kernels' rounding differs
    from foreach by at most the bound above per pass (a few float32 ulps of U); Newton–Schulz
    amplifies a relative input perturbation by at most a⁵ ≈ 488 (a = 3.4445 = max |p′(σ)|,
    Keller, 5 steps) and the update is lr · s · O, so after 3 steps the parameters differ by
    ≤ 3 · lr · s · 488 · 16u · ‖O‖ (16u: the relative perturbation of U, whose norm is ~1/8
    of the gradient's with μ = 0.95) plus 3 float32 roundings of W."""
    kw = dict(momentum=0.95, lr=0.02, scale="shape", nesterov=True)
    p_tri, _ = _muon_run(env="triton", monkeypatch=monkeypatch, device=device, **kw)
    p_ref, _ = _muon_run(env=None, monkeypatch=monkeypatch, device=device, **kw)
    for a, b in zip(p_tri, p_ref):
        rows, cols = b.shape[0], b[0].numel()
        s = max(1.0, rows / cols) ** 0.5
        o_norm = min(rows, cols) ** 0.5
        tol = 3 * (0.02 * s * 488 * 16 * U32 * o_norm + 2 * U32 * b.norm().item())
        assert (a - b).norm().item() <= tol


@needs_triton
@pytest.mark.bare_tensors
def test_auto_falls_back_to_foreach_when_a_kernel_fails(monkeypatch):
    """Under "auto", a kernel that fails to compile (before writing anything) warns once and
    the step finishes with the foreach passes: the same result as foreach throughout."""
    from muonscale.kernels import process_state, triton_elementwise

    def broken(*args, **kw):
        raise RuntimeError("simulated compile failure")

    monkeypatch.setattr(triton_elementwise, "momentum_and_ns_input_", broken)
    monkeypatch.setitem(process_state._triton_elementwise, "ok", True)
    monkeypatch.setitem(process_state._triton_elementwise, "module", triton_elementwise)
    # "auto" on CPU would not pick the kernels: pretend the tensors were on CUDA
    monkeypatch.setattr(
        functional,
        "elementwise_kernels",
        lambda device, backend: process_state.elementwise_kernels(torch.device("cuda"), backend),
    )
    kw = dict(momentum=0.95, lr=0.02, scale="shape", nesterov=True)
    with pytest.warns(RuntimeWarning, match="simulated compile failure"):
        p_auto, m_auto = _muon_run(env="auto", monkeypatch=monkeypatch, **kw)
    assert process_state._triton_elementwise["ok"] is False
    monkeypatch.setattr(functional, "elementwise_kernels", lambda device, backend: None)
    p_ref, m_ref = _muon_run(env=None, monkeypatch=monkeypatch, **kw)
    for a, b in zip(p_auto + m_auto, p_ref + m_ref):
        assert torch.equal(a, b)


_COMPILE_SM90 = """
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from muonscale.kernels import triton_elementwise as te
cases = [
    (te._momentum_ns_input_kernel,
     {"G_DTYPE": tl.float32, "B_DTYPE": tl.bfloat16, "NESTEROV": True, "BETA_SMALL": True,
      "NESTEROV_SMALL": False, "X_CONTIGUOUS": False, "BLOCK": te.BLOCK},
     {"G_PTRS": "*i64", "B_PTRS": "*i64", "X": "*bf16", "beta_weight": "fp32",
      "nesterov_weight": "fp32"}),
    (te._apply_update_kernel,
     {"P_DTYPE": tl.float32, "HAS_DECAY": True, "O_CONTIGUOUS": True, "BLOCK": te.BLOCK},
     {"P_PTRS": "*i64", "O": "*bf16", "decay": "fp32", "step": "fp32"}),
]
for kernel, const, kinds in cases:
    signature = {n: "constexpr" if n in const else kinds.get(n, "i32") for n in kernel.arg_names}
    constexprs = {(kernel.arg_names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = compiled.asm["ptx"]
    print("FMA" if "fma.rn.f32" in ptx else "NO-FMA", len(compiled.asm["cubin"]))
"""


@needs_triton
def test_kernels_compile_for_hopper_without_a_gpu():
    """Compile both kernels (bf16 stacks, float32 members) to sm_90 cubins with Triton's
    bundled ptxas: GPU-only compile errors show on CPU CI; the multiply-adds are single
    fma.rn instructions. In a subprocess (this process may run triton in interpreter mode)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_SM90], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0 and "ptxas" in proc.stderr:
        pytest.skip(f"no usable ptxas: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["FMA", proc.stdout.split()[1], "FMA", proc.stdout.split()[3]]
