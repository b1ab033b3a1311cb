"""The Python blocks of the README and ``docs/``, and the markers that say where each runs.

An HTML comment on the line before a ```` ```python ```` fence (invisible when the Markdown is
rendered) carries the block's markers, separated by ``;``::

    <!-- env: integrations; stand-ins: model, args, ds -->

* ``env: main | integrations | megatron`` — the suite whose environment runs it: the main suite
  (``tests/test_docs_code.py``, the default), ``tests/integrations`` or ``tests/megatron``;
* ``torchrun: N`` — run on N gloo processes on CPU (the block is one rank's program);
* ``gpu`` — needs CUDA: runs under ``pytest -m gpu`` only;
* ``slow`` — a measurement that takes minutes: runs under ``pytest -m slow``;
* ``stand-ins: a, b`` — names the block uses but does not define (the reader's own model, data
  or configuration); the suite defines each as a small stand-in, and a stand-in it does not
  know fails the test;
* ``fragment`` — not code to run (a partial line, shown for its shape); nothing else may be set.

A block without a comment runs in the main suite with no stand-ins.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "tests"
RUNNER = HERE / "docs_block_runner.py"
ENVS = ("main", "integrations", "megatron")
_MARKER = re.compile(r"^<!--(.*)-->$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    code: str
    env: str = "main"
    torchrun: int = 0
    gpu: bool = False
    slow: bool = False
    fragment: bool = False
    stand_ins: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _markers(comment: str, where: str) -> dict:
    out: dict = {}
    for item in filter(None, (part.strip() for part in comment.split(";"))):
        key, _, value = (s.strip() for s in item.partition(":"))
        if key == "env":
            if value not in ENVS:
                raise ValueError(f"{where}: env must be one of {ENVS}, got {value!r}")
            out["env"] = value
        elif key == "torchrun":
            if not value.isdigit() or int(value) < 2:
                raise ValueError(f"{where}: torchrun needs a process count >= 2, got {value!r}")
            out["torchrun"] = int(value)
        elif key == "stand-ins":
            out["stand_ins"] = tuple(n.strip() for n in value.split(",") if n.strip())
        elif key in ("gpu", "slow", "fragment") and not value:
            out[key] = True
        else:
            raise ValueError(f"{where}: unknown docs-test marker {item!r}")
    if out.get("fragment") and len(out) > 1:
        raise ValueError(f"{where}: a fragment carries no other marker")
    return out


def blocks() -> list[Block]:
    """Every ```` ```python ```` block of the README and ``docs/``, with its markers."""
    found = []
    for doc in documents():
        rel = doc.relative_to(ROOT).as_posix()
        lines = doc.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() != "```python":
                i += 1
                continue
            start = i
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            previous = lines[start - 1].strip() if start else ""
            match = _MARKER.match(previous)
            markers = _markers(match.group(1), f"{rel}:{start + 1}") if match else {}
            code = textwrap.dedent("\n".join(lines[start + 1 : end])) + "\n"
            found.append(Block(rel, start + 1, code, **markers))
            i = end + 1
    return found


def blocks_for(env: str, *, gpu: bool = False) -> list:
    """The runnable blocks of one suite (``gpu=True``: those marked ``gpu``), as pytest
    parameters (``slow`` ones marked so)."""
    import pytest

    return [
        pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
        for b in blocks()
        if not b.fragment and b.env == env and b.gpu == gpu
    ]


@contextlib.contextmanager
def one_rank_world():
    """A world of one gloo rank, for blocks that build a distributed optimizer in one process."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_under_torchrun(block, tmp_path, table: str, *paths: Path) -> str:
    """Run ``block`` on ``block.torchrun`` gloo processes; return their output."""
    (tmp_path / "block.py").write_text(block.code, encoding="utf-8")
    path = os.pathsep.join(str(p) for p in (ROOT, HERE, *paths))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node"]
    cmd += [str(block.torchrun), "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
    cmd += [str(RUNNER), table, block.path, str(tmp_path / "block.py"), *block.stand_ins]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{block.id}\n{done.stdout}\n{done.stderr}"
    assert done.stdout.count("docs block done") == block.torchrun, done.stdout
    return done.stdout
