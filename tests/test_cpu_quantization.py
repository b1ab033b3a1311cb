"""The compiled CPU loop of the 8-bit dynamic format against the torch path it replaces: the
same codes, block absmax and decoded values, bit for bit, on every kind of entry (zeros of
both signs, subnormals, infinities, NaN, ties between table values) and every block layout;
and the torch path, with a warning, where no compiler works."""

import multiprocessing
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from muonscale.block_quantization import (
    BLOCK_SIZE,
    dequantize_dynamic,
    dynamic_values,
    quantize_dynamic_,
    scale_shape,
)
from muonscale.kernels import cpu_quantization
from muonscale.kernels.cpu_quantization import (
    compiled_library,
    cpu_kernels,
)

if not (shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")) and (
    os.environ.get("CI") != "true"
):  # CI must have a compiler: there these tests run and fail without one
    pytestmark = pytest.mark.skip(reason="no C compiler ($CC, cc, gcc): the torch path runs")

SHAPES = [(3, 2 * BLOCK_SIZE), (5, BLOCK_SIZE + 7), (2, 19), (1, 1), (0, 8), (300, 700)]


def _special_sample(shape, seed, signed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 10.0 ** torch.randint(-40, 3, shape, generator=g)
    flat = x.view(-1)
    if flat.numel() >= 16:
        values = torch.tensor(dynamic_values(signed), dtype=torch.float64)
        magnitudes = values[values >= 0].unique()
        midpoints = ((magnitudes[1:] + magnitudes[:-1]) / 2).float()  # ties, and their floats
        picks = torch.randint(0, midpoints.numel(), (flat.numel() // 4,), generator=g)
        spots = torch.randperm(flat.numel(), generator=g)[: picks.numel()]
        flat[spots] = midpoints[picks]
        flat[:8] = torch.tensor([0.0, -0.0, 1e-42, -1e-42, float("inf"), 1.0, -3.0, 2e-45])
        if flat.numel() >= 64:
            flat[40] = float("nan")
            flat[BLOCK_SIZE : 2 * BLOCK_SIZE] = 0.0  # an all-zero block
    return x if signed else x.abs()


def _encode(x, signed):
    codes = torch.empty(x.shape, dtype=torch.uint8)
    absmax = torch.empty(scale_shape(*x.shape), dtype=torch.float32)
    quantize_dynamic_(x, codes, absmax, signed=signed)
    return codes, absmax


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_compiled_loop_equals_torch_path_bitwise(shape, signed):
    assert compiled_library() is not None, "the CPU loop should compile on a machine with cc"
    x = _special_sample(shape, 1, signed)
    with cpu_kernels(False):
        codes_ref, absmax_ref = _encode(x, signed)
        values_ref = dequantize_dynamic(codes_ref, absmax_ref, signed=signed)
    with cpu_kernels(True):
        codes, absmax = _encode(x, signed)
        values = dequantize_dynamic(codes, absmax, signed=signed)
    assert torch.equal(codes, codes_ref)
    assert torch.equal(_bits(absmax), _bits(absmax_ref))
    assert torch.equal(_bits(values), _bits(values_ref))


@pytest.mark.parametrize("signed", [True, False])
def test_every_midpoint_and_its_float32_neighbours(signed):
    """Blocks of absmax exactly 1, so each entry is its own normalized value: every midpoint
    between neighbouring table values, rounded to float32, and the floats either side."""
    values = torch.tensor(dynamic_values(signed), dtype=torch.float64)
    magnitudes = values[values >= 0].unique()
    mids = ((magnitudes[1:] + magnitudes[:-1]) / 2).float()
    ties = torch.cat([mids, mids.nextafter(torch.zeros(())), mids.nextafter(torch.ones(()))])
    if signed:
        ties = torch.cat([ties, -ties])
    per_row = BLOCK_SIZE - 1
    ties = torch.cat([ties, torch.zeros(-ties.numel() % per_row)]).view(-1, per_row)
    x = torch.cat([torch.ones(ties.shape[0], 1), ties], dim=1)
    with cpu_kernels(False):
        codes_ref, absmax_ref = _encode(x, signed)
    with cpu_kernels(True):
        codes, absmax = _encode(x, signed)
    assert torch.equal(absmax, torch.ones_like(absmax))
    assert torch.equal(codes, codes_ref) and torch.equal(absmax, absmax_ref)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_row_split_between_threads_is_invisible(threads):
    previous = torch.get_num_threads()
    x = _special_sample((257, 1031), 2, True)
    try:
        with cpu_kernels(True):
            torch.set_num_threads(1)
            codes_one, absmax_one = _encode(x, True)
            torch.set_num_threads(threads)
            codes, absmax = _encode(x, True)
            out = dequantize_dynamic(codes, absmax, signed=True)
            torch.set_num_threads(1)
            out_one = dequantize_dynamic(codes_one, absmax_one, signed=True)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(codes, codes_one) and torch.equal(_bits(absmax), _bits(absmax_one))
    assert torch.equal(_bits(out), _bits(out_one))


def test_views_and_other_dtypes_take_the_torch_path():
    x = _special_sample((4, 3 * BLOCK_SIZE), 3, True)
    codes = torch.empty(x.shape, dtype=torch.uint8)
    absmax = torch.empty(scale_shape(*x.shape), dtype=torch.float32)
    buckets = torch.zeros(2**15, dtype=torch.int32)
    kw = {"signed": True, "block_size": BLOCK_SIZE}
    with cpu_kernels(True):
        assert not cpu_quantization.quantize_dynamic_cpu(x.t(), codes.t(), absmax, buckets, **kw)
        assert not cpu_quantization.quantize_dynamic_cpu(x.double(), codes, absmax, buckets, **kw)
        assert not cpu_quantization.quantize_dynamic_cpu(x, codes, absmax[:, :1], buckets, **kw)
    with cpu_kernels(False):
        assert not cpu_quantization.quantize_dynamic_cpu(x, codes, absmax, buckets, **kw)
    # a column slice (not contiguous) still encodes as the torch path does
    part = x[:, :BLOCK_SIZE]
    with cpu_kernels(True):
        codes_view, absmax_view = _encode(part, True)
    with cpu_kernels(False):
        codes_ref, absmax_ref = _encode(part.contiguous(), True)
    assert torch.equal(codes_view, codes_ref) and torch.equal(_bits(absmax_view), _bits(absmax_ref))


def test_no_compiler_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")  # a program that exists and always fails
    monkeypatch.setenv("MUONSCALE_CACHE_DIR", str(tmp_path))
    compiled_library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="MUONSCALE_CPU_KERNELS=0"):
            assert compiled_library() is None
        x = _special_sample((3, BLOCK_SIZE + 5), 4, True)
        with cpu_kernels(True), warnings.catch_warnings():
            warnings.simplefilter("error")  # the torch path, and no second warning
            codes, absmax = _encode(x, True)
        with cpu_kernels(False):
            codes_ref, absmax_ref = _encode(x, True)
        assert torch.equal(codes, codes_ref) and torch.equal(_bits(absmax), _bits(absmax_ref))
    finally:
        compiled_library.cache_clear()


def test_library_is_built_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MUONSCALE_CACHE_DIR", str(tmp_path))
    compiled_library.cache_clear()
    try:
        assert compiled_library() is not None
        built = list((tmp_path / "kernels").glob("cpu_quantization-*.so"))
        assert len(built) == 1 and not list((tmp_path / "kernels").glob(".*"))
        stamp = built[0].stat().st_mtime_ns
        compiled_library.cache_clear()
        assert compiled_library() is not None
        assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt
    finally:
        compiled_library.cache_clear()


def _encode_in_child(x, queue):
    codes, absmax = _encode(x, True)
    # no torch computation in the child: GNU OpenMP does not survive a fork, only our threads
    queue.put((codes.numpy().tobytes(), absmax.numpy().tobytes()))


def test_a_forked_child_encodes_with_its_own_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = _special_sample((128, 4 * BLOCK_SIZE), 5, True)  # work for two threads
        with cpu_kernels(True):
            codes, absmax = _encode(x, True)  # the parent's pool exists before the fork
            context = multiprocessing.get_context("fork")
            queue = context.Queue()
            child = context.Process(target=_encode_in_child, args=(x, queue))
            child.start()
            child_codes, child_absmax = queue.get(timeout=60)
            child.join(timeout=60)
    finally:
        torch.set_num_threads(previous)
    assert child.exitcode == 0
    assert child_codes == codes.numpy().tobytes() and child_absmax == absmax.numpy().tobytes()


_LOAD_AND_ENCODE = """
import warnings, torch
warnings.simplefilter("error")
from muonscale.kernels.cpu_quantization import compiled_library
from muonscale.block_quantization import quantize_dynamic_, scale_shape
assert compiled_library() is not None
x = torch.linspace(-1, 1, 3 * 300).view(3, 300)
codes, absmax = torch.empty(3, 300, dtype=torch.uint8), torch.empty(scale_shape(3, 300))
quantize_dynamic_(x, codes, absmax, signed=True)
print(codes.sum().item())
"""


def test_a_damaged_cached_library_is_built_again(tmp_path):
    """In fresh processes (a process keeps a library it loaded mapped, whatever the file
    becomes): the first builds into the cache, the second finds the file damaged, builds it
    again without a warning and encodes as the first did."""
    env = {**os.environ, "MUONSCALE_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-c", _LOAD_AND_ENCODE]
    first = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    (built,) = (tmp_path / "kernels").glob("cpu_quantization-*.so")
    built.write_bytes(b"truncated")
    second = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert second.stdout == first.stdout and built.stat().st_size > 1000


def test_an_optimizer_with_8bit_state_on_cpu_builds_the_loop_when_built(monkeypatch, tmp_path):
    import muonscale

    monkeypatch.setenv("MUONSCALE_CACHE_DIR", str(tmp_path))
    compiled_library.cache_clear()
    try:
        w, b = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.zeros(8))
        muonscale.Muon([("w", w), ("b", b)], lr=0.02, adamw_lr=1e-3)
        assert not (tmp_path / "kernels").exists()  # floating state: nothing built
        muonscale.Muon([("w", w), ("b", b)], lr=0.02, adamw_lr=1e-3, state_precision="int8")
        assert len(list((tmp_path / "kernels").glob("cpu_quantization-*.so"))) == 1
    finally:
        compiled_library.cache_clear()
