"""Run functions on N real gloo processes (CPU) for multi-process tests.

Two ways:

* ``run_workers(fn, world_size, *args)``: spawn ``world_size`` processes, initialize a gloo
  process group, call ``fn(rank, world_size, *args)`` on each, tear down, return the per-rank
  results (rank order).
* ``WorkerPool(world_size)`` / ``shared_pool(world_size)``: the same, but the processes (and
  their process group) stay up across calls (and, for ``shared_pool``, across test modules).

``fn`` must be a module-level function (pickled by reference). Results travel back through
``torch.save``, so tensors arrive as plain copies. A failure on any rank raises
:class:`WorkerFailure` in the caller with every failing rank's traceback (or, with
``return_exceptions=True``, comes back as a :class:`RemoteError` in that rank's slot). Workers
always run ``gc.collect()``, a barrier (when healthy) and ``destroy_process_group()`` on exit.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from dataclasses import dataclass

import torch

_STOP = "__stop__"


@dataclass
class RemoteError:
    """An exception raised on one rank, as text (the object may not pickle)."""

    rank: int
    type_name: str
    message: str
    traceback: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.type_name}: {self.message}"


class WorkerFailure(AssertionError):
    pass


def save_checkpoint(model, opt, path: str) -> None:
    """The model's and the optimizer's state through ``torch.distributed.checkpoint`` (the
    ``get_state_dict`` form: keyed by parameter names)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)


def load_checkpoint(model, opt, path: str) -> None:
    """:func:`save_checkpoint`'s state at ``path`` loaded into ``model`` and ``opt`` (their
    state dicts, of this process's layout, read from the checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


@contextlib.contextmanager
def one_thread():
    """In this process, the ranks' one CPU thread (:func:`_worker_main`): a float32 matmul's
    bits may depend on the number of threads, so a reference the ranks must equal bitwise is
    computed as they compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker_main(rank, world_size, port, pg_timeout_s, tasks, results):
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    healthy = True
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        while True:
            task = tasks.get()
            if task == _STOP:
                break
            fn, args = task
            try:
                payload = ("ok", _dumps(fn(rank, world_size, *args)))
            except BaseException as exc:  # noqa: BLE001 - reported to the parent
                healthy = False
                err = RemoteError(rank, type(exc).__name__, str(exc), traceback.format_exc())
                payload = ("error", _dumps(err))
            results.put((rank, payload))
    finally:
        gc.collect()
        if dist.is_initialized():
            if healthy:
                try:
                    dist.barrier()
                except Exception:  # noqa: BLE001 - peers may be gone
                    pass
            dist.destroy_process_group()
        # Everything is cleaned up and the results are delivered: skip the interpreter teardown
        # (seconds per process on a busy 2-core machine).
        results.close()
        results.join_thread()
        os._exit(0)


class WorkerPool:
    """``world_size`` gloo processes that run one function at a time on every rank."""

    def __init__(self, world_size: int, *, pg_timeout_s: float = 60.0):
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        # fork: workers start in milliseconds with everything already imported (they run one
        # thread each, so the parent's OpenMP pool is not an issue); spawn elsewhere, or with
        # MUONSCALE_TEST_START_METHOD=spawn.
        method = os.environ.get("MUONSCALE_TEST_START_METHOD") or (
            "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        )
        ctx = mp.get_context(method)
        import torch._dynamo  # noqa: F401 - torch.optim imports it lazily (seconds); do it once here

        port = free_port()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, pg_timeout_s, self._tasks[rank], self._results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.broken = False

    def run(self, fn, *args, timeout: float = 120.0, return_exceptions: bool = False) -> list:
        """``fn(rank, world_size, *args)`` on every rank; per-rank results in rank order."""
        if self.broken:
            raise WorkerFailure("worker pool is broken by an earlier failure")
        for q in self._tasks:
            q.put((fn, args))
        out: list = [None] * self.world_size
        received = 0
        deadline = timeout
        while received < self.world_size:
            try:
                rank, (status, data) = self._results.get(timeout=deadline)
            except queue.Empty:
                self.broken = True
                self.close(force=True)
                missing = [r for r in range(self.world_size) if out[r] is None]
                raise WorkerFailure(
                    f"{fn.__name__}: ranks {missing} did not finish in {timeout} s"
                ) from None
            out[rank] = _loads(data)
            if status == "error":
                self.broken = True
            received += 1
        errors = [r for r in out if isinstance(r, RemoteError)]
        if errors and not return_exceptions:
            self.close()
            details = "\n".join(f"--- rank {e.rank} ---\n{e.traceback}" for e in errors)
            raise WorkerFailure(
                f"{fn.__name__} failed on ranks {[e.rank for e in errors]}:\n{details}"
            )
        return out

    def close(self, force: bool = False) -> None:
        """Stop the workers (they clean up their process group); ``force``: just terminate."""
        if not force:
            for q in self._tasks:
                q.put(_STOP)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        self._procs = []

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_workers(
    fn,
    world_size: int,
    *args,
    timeout: float = 120.0,
    pg_timeout_s: float = 60.0,
    return_exceptions: bool = False,
) -> list:
    """Spawn ``world_size`` gloo processes, run ``fn(rank, world_size, *args)``, tear down."""
    pool = WorkerPool(world_size, pg_timeout_s=pg_timeout_s)
    try:
        return pool.run(fn, *args, timeout=timeout, return_exceptions=return_exceptions)
    finally:
        pool.close()


_POOLS: dict[int, WorkerPool] = {}


def shared_pool(world_size: int) -> WorkerPool:
    """A pool of ``world_size`` ranks shared by every test in this pytest process (started on
    first use, restarted if an earlier test broke it, stopped at interpreter exit)."""
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool


@atexit.register
def _close_shared_pools() -> None:
    for pool in _POOLS.values():
        pool.close(force=pool.broken)
    _POOLS.clear()
