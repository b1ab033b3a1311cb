"""Finished bench runs saved under ``--out``/runs/, so that the same command resumes.

Each run (one contender, one learning rate, one seed, one budget; a sweep run or a full run)
is a JSON file holding its full configuration and its result. The file name ends in the
SHA-256 of that configuration, so a run is reused only when everything that defines it is
equal: the ``TrainConfig`` it trains with (model, data, tokenizer, lr, seed, steps, schedule,
dtypes, device, QK-clip's tau (a variant's ``qk_clip:TAU``), ...), the contender, its variant
options, torch-muon's Newton-Schulz precision, the corpus, the evaluation steps and the torch
thread count. Presentation flags (plots, progress, TensorBoard, memory probes) are not part
of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from muonscale.bench.config import BenchConfig
from muonscale.bench.side_by_side import ContenderRecord

FORMAT_VERSION = 1


def run_key(
    bench: BenchConfig, contender: str, lr: float, *, kind: str, steps: int, eval_steps=None
) -> dict[str, Any]:
    """Everything that defines one run, as a JSON-able dict."""
    from muonscale.bench.runner import newton_schulz_precision, train_config_for

    return {
        "format": FORMAT_VERSION,
        "kind": kind,
        "contender": contender,
        "variant_options": bench.variant_options(contender),
        "newton_schulz_precision": newton_schulz_precision(bench, contender),
        "corpus": bench.corpus,
        "train": train_config_for(bench, contender, lr, steps=steps).to_dict(),
        "eval_steps": None if eval_steps is None else list(eval_steps),
        "threads": bench.threads,
    }


class RunStore:
    """Saved runs in one folder (``None``: keep nothing, find nothing)."""

    def __init__(self, folder: str | os.PathLike | None) -> None:
        self.folder = None if folder is None else Path(folder)

    def path(self, key: dict[str, Any]) -> Path:
        text = json.dumps(key, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        seed = key["train"]["seed"]
        return self.folder / f"{key['kind']}-{key['contender']}-seed{seed}-{digest}.json"

    def load(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The saved result of the run ``key``, or None when there is none."""
        if self.folder is None:
            return None
        path = self.path(key)
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if saved.get("key") != json.loads(json.dumps(key)):
            return None  # a hash collision or a hand-edited file: not this run
        return saved["result"]

    def save(self, key: dict[str, Any], result: dict[str, Any]) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "result": result}, indent=1, allow_nan=True))
        tmp.replace(path)  # never leave a half-written run behind


def record_to_dict(record: ContenderRecord) -> dict[str, Any]:
    return dataclasses.asdict(record)


def record_from_dict(values: dict[str, Any]) -> ContenderRecord:
    return ContenderRecord(**values)
