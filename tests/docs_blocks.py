"""The Python blocks of the README and ``docs/``, and the markers that say where each runs.

An HTML comment on the line before a ```` ```python ```` fence (invisible when the Markdown is
rendered) carries the block's markers, separated by ``;``::

    <!-- env: integrations; stand-ins: model, args, ds -->

* ``env: main | integrations | megatron`` — the suite whose environment runs it: the main suite
  (``tests/test_docs_code.py``, the default), ``tests/integrations`` or ``tests/megatron``;
* ``torchrun: N`` — run on N gloo processes on CPU (the block is one rank's program);
* ``gpu`` — needs CUDA: runs under ``pytest -m gpu`` only;
* ``stand-ins: a, b`` — names the block uses but does not define (the reader's own model, data
  or configuration); the suite defines each as a small stand-in, and a stand-in it does not
  know fails the test;
* ``fragment`` — not code to run (a partial line, shown for its shape); nothing else may be set.

A block without a comment runs in the main suite with no stand-ins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
        elif key in ("gpu", "fragment") and not value:
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
            code = "\n".join(lines[start + 1 : end]) + "\n"
            found.append(Block(rel, start + 1, code, **markers))
            i = end + 1
    return found


def blocks_for(env: str, *, gpu: bool = False) -> list[Block]:
    """The runnable blocks of one suite (``gpu=True``: those marked ``gpu``)."""
    return [b for b in blocks() if not b.fragment and b.env == env and b.gpu == gpu]
