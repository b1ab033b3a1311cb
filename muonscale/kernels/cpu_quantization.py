"""The 8-bit dynamic format (AdamW's moments) as a compiled loop on CPU.

The torch path of :mod:`muonscale.block_quantization` takes about ten passes over memory per
encoded entry, one of them a single-threaded table look-up; ``cpu_quantization.c`` encodes a
block in two passes while it sits in cache, with the same float32 operations and integer
code arithmetic, so the codes and scales are the same bits. The C file needs no Python or
torch headers: it is compiled when first needed (:func:`prepare_cpu_kernels`, when an optimizer
with quantized state on CPU is built) with the system C compiler (``$CC``, else ``cc``) into
the user cache folder (:func:`muonscale.user_cache.cache_dir`), keyed by the source and
the compiler, and loaded with :mod:`ctypes`. Rows are split between
``torch.get_num_threads()`` Python threads (a ctypes call releases the GIL).

Where no compiler works, a warning says so once and the torch path runs (same results,
slower). ``MUONSCALE_CPU_KERNELS=0`` (read at import) turns the compiled loop off.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from muonscale.user_cache import cache_dir

__all__ = [
    "CPU_KERNELS_ENV",
    "compiled_library",
    "cpu_kernels",
    "dequantize_dynamic_cpu",
    "prepare_cpu_kernels",
    "quantize_dynamic_cpu",
]

CPU_KERNELS_ENV = "MUONSCALE_CPU_KERNELS"
"""``0`` turns the compiled CPU loop off (the torch path runs); read once, at import."""

SOURCE = Path(__file__).with_name("cpu_quantization.c")
COMPILE_FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared")
"""No contraction into fused multiply-adds and no reassociation: each float32 operation is
the correctly rounded one, as in torch's elementwise kernels."""

ENTRIES_PER_THREAD = 1 << 16
"""A matrix smaller than this many entries per extra thread runs on the calling thread."""

_enabled = os.environ.get(CPU_KERNELS_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


@contextlib.contextmanager
def cpu_kernels(enabled: bool) -> Iterator[None]:
    """Within: the compiled loop used where it applies (True) or the torch path (False)."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    try:
        yield
    finally:
        _enabled = previous


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _library_path(compiler: str) -> Path:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=False
    ).stdout
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), version.encode(), " ".join(COMPILE_FLAGS).encode()):
        key.update(part)
    key.update(platform.machine().encode())
    return cache_dir() / "kernels" / f"cpu_quantization-{key.hexdigest()[:16]}.so"


def _build(compiler: str, target: Path) -> None:
    """Compile into a private file next to ``target``, then rename it into place (atomic:
    processes compiling at once each write their own file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, private = tempfile.mkstemp(prefix=f".{target.stem}-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run(
            [compiler, *COMPILE_FLAGS, str(SOURCE), "-o", private],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(private, target)
    finally:
        if os.path.exists(private):
            os.unlink(private)


def _declare(library: ctypes.CDLL) -> ctypes.CDLL:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    library.muonscale_quantize_dynamic.argtypes = [p, p, p, i64, i64, i64, p, ctypes.c_int]
    library.muonscale_quantize_dynamic.restype = None
    library.muonscale_dequantize_dynamic.argtypes = [p, p, p, i64, i64, i64, p]
    library.muonscale_dequantize_dynamic.restype = None
    return library


def _build_where_writable(compiler: str, target: Path) -> Path:
    """:func:`_build` into ``target``, or into a private temporary folder where the cache
    cannot be written; the path built."""
    try:
        _build(compiler, target)
        return target
    except OSError:
        private = Path(tempfile.mkdtemp(prefix="muonscale-kernels-")) / target.name
        _build(compiler, private)
        return private


@functools.cache
def compiled_library() -> ctypes.CDLL | None:
    """The compiled loop (built on the first call of the process, and into the cache once per
    source and compiler; a cached file that does not load is built again), or None with a
    warning where it cannot be built or loaded."""
    compiler = _compiler()
    try:
        if compiler is None:
            raise OSError("no C compiler found ($CC, cc, gcc)")
        target = _library_path(compiler)
        if not target.exists():
            target = _build_where_writable(compiler, target)
        try:
            library = ctypes.CDLL(str(target))
        except OSError:  # a damaged cached file (a truncated write, another machine's)
            library = ctypes.CDLL(str(_build_where_writable(compiler, target)))
        return _declare(library)
    except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as error:
        warnings.warn(
            f"muonscale: the compiled CPU loop for 8-bit optimizer state is unavailable "
            f"({error}); the torch path runs instead (same results, slower). Set "
            f"{CPU_KERNELS_ENV}=0 to silence this.",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def prepare_cpu_kernels() -> None:
    """Build or load the compiled loop now, if it is enabled (an optimizer with quantized state
    on CPU calls this when built, so no step compiles or reads the environment)."""
    if _enabled:
        compiled_library()


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="muonscale-cpu")


# A forked child has none of the parent's threads: it starts its own pools.
os.register_at_fork(after_in_child=_pool.cache_clear)


def _applies(
    values: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
) -> bool:
    """Whether the loop takes these: enabled, not tracing, CPU and contiguous, float32 values
    and scales and uint8 codes of one (rows, cols) shape, a scale per block of each row."""
    tensors = (values, codes, scales, table)
    return (
        _enabled
        and not torch.compiler.is_compiling()
        and all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
        and values.dtype == scales.dtype == torch.float32
        and codes.dtype == torch.uint8
        and codes.dim() == 2
        and values.shape == codes.shape
        and scales.shape == (codes.shape[0], -(-codes.shape[1] // block_size))
    )


def _by_rows(function, matrices: list[torch.Tensor], *tail) -> None:
    """``function(pointers of matrices, rows, cols, *tail)`` over ranges of rows (the (rows,
    cols) ``matrices[0]`` and its scales, row-major), on up to ``torch.get_num_threads()``
    threads."""
    rows, cols = matrices[0].shape
    row_bytes = [m.stride(0) * m.element_size() for m in matrices]

    def call(start: int, stop: int) -> None:
        pointers = [m.data_ptr() + start * step for m, step in zip(matrices, row_bytes)]
        function(*pointers, stop - start, cols, *tail)

    threads = max(1, min(torch.get_num_threads(), rows, rows * cols // ENTRIES_PER_THREAD))
    if threads == 1:
        call(0, rows)
        return
    bounds = [rows * t // threads for t in range(threads + 1)]
    futures = [_pool(threads).submit(call, bounds[t], bounds[t + 1]) for t in range(threads)]
    for future in futures:
        future.result()


def quantize_dynamic_cpu(
    x: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    buckets: torch.Tensor,
    *,
    signed: bool,
    block_size: int,
) -> bool:
    """Write ``codes`` and ``absmax`` of the float32 (rows, cols) ``x`` with the compiled loop
    (``buckets``: the int32 bucket table); False (nothing written) where it does not apply:
    another device or dtype, a non-contiguous tensor, tracing, or no compiled loop."""
    if not (_applies(x, codes, absmax, buckets, block_size) and buckets.dtype == torch.int32):
        return False
    library = compiled_library()
    if library is None:
        return False
    tail = (block_size, buckets.data_ptr(), int(signed))
    _by_rows(library.muonscale_quantize_dynamic, [x, codes, absmax], *tail)
    return True


def dequantize_dynamic_cpu(
    codes: torch.Tensor,
    absmax: torch.Tensor,
    table: torch.Tensor,
    out: torch.Tensor,
    block_size: int,
) -> bool:
    """Write table[q] · absmax of the uint8 (rows, cols) ``codes`` into the float32 ``out``
    with the compiled loop; False (nothing written) where it does not apply."""
    if not (_applies(out, codes, absmax, table, block_size) and table.dtype == torch.float32):
        return False
    library = compiled_library()
    if library is None:
        return False
    tail = (block_size, table.data_ptr())
    _by_rows(library.muonscale_dequantize_dynamic, [codes, absmax, out], *tail)
    return True
