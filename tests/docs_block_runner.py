"""One rank of a documented block under torchrun (``tests/test_docs_code.py``):

    python docs_block_runner.py TABLE DOCUMENT BLOCK_FILE [STAND_IN ...]

builds the stand-ins from the ``STAND_INS`` of module ``TABLE`` (``docs_stand_ins`` for the main
suite), runs the block as its own ``__main__`` and ends the process group the
block started."""

from __future__ import annotations

import importlib
import sys

import torch
import torch.distributed as dist
from docs_stand_ins import build


def main() -> None:
    table, document, path, *names = sys.argv[1:]
    torch.set_num_threads(1)
    ns = build(document, tuple(names), importlib.import_module(table).STAND_INS)
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), f"{document} (rank block)", "exec")
    try:
        exec(code, ns)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    print("docs block done", flush=True)


if __name__ == "__main__":
    main()
