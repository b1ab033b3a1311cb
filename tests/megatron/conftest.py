"""Megatron-Core integration tests: run only in the Python 3.12 environment built by
``.ci/megatron_env.sh`` (megatron-core needs Python >= 3.12)::

    PYTHONPATH=. .venv-megatron/bin/python -m pytest tests/megatron -q

Elsewhere (the main 3.11 venv) this folder is skipped at collection.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

HAVE_MEGATRON = sys.version_info >= (3, 12) and importlib.util.find_spec("megatron") is not None
if HAVE_MEGATRON:
    HERE = os.path.dirname(os.path.abspath(__file__))
    for path in (HERE, os.path.dirname(HERE), os.path.dirname(os.path.dirname(HERE))):
        if path not in sys.path:
            sys.path.insert(0, path)  # megatron_workers, distributed_harness, muonscale
else:
    collect_ignore_glob = ["test_*.py", "megatron_workers.py"]


def _pool(world_size: int):
    from distributed_harness import WorkerPool

    pool = WorkerPool(world_size, pg_timeout_s=180)
    try:
        yield pool
    finally:
        pool.close(force=pool.broken)


@pytest.fixture(scope="module")
def pool2():
    """Two gloo ranks that stay up for a test module (Megatron imports once per process)."""
    yield from _pool(2)


@pytest.fixture(scope="module")
def pool4():
    yield from _pool(4)


def pytest_configure(config):
    for text in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        config.addinivalue_line("filterwarnings", f"ignore:{text}:UserWarning")


@pytest.fixture(scope="module")
def pool1():
    """One gloo rank (Megatron's optimizer factory gathers over the world group)."""
    yield from _pool(1)
