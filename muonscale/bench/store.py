"""Finished bench runs saved under ``--out``/runs/, so that the same command resumes.

Each run (one contender, one learning rate, one seed, one budget; a sweep run or a full run)
is a JSON file holding its full configuration (its key) and its result. The file name ends in
the SHA-256 of that key, so a run is reused only when everything that defines it is equal: the
``TrainConfig`` it trains with (model, data, tokenizer, lr, seed, steps, schedule, dtypes,
device, QK-clip's tau (a variant's ``qk_clip:TAU``), ...), the contender, its variant options,
torch-muon's Newton-Schulz precision, the corpus, the evaluation steps and the torch thread
count, and ``--track-max-logit`` for a contender without QK-clip. Presentation flags (plots,
progress, TensorBoard, memory probes) and ``--workers`` (same losses bitwise) are not part of
it.

Compatibility rule (options added later): a ``TrainConfig`` field (or a key entry listed in
:data:`KEY_DEFAULTS`) that an older version did not have, left at its default, is that
version's behaviour. So when no file carries the exact key, a saved run of the same kind,
contender and seed is reused when its key equals the current key without the entries the
saved key lacks, each of which must be at its default now. A saved entry with another value,
or a missing entry that is not at its default, is never reused.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from muonscale.bench.config import BenchConfig
from muonscale.bench.side_by_side import ContenderRecord

FORMAT_VERSION = 1

KEY_DEFAULTS: dict[str, Any] = {
    "variant_options": None,
    "newton_schulz_precision": None,
    "corpus": None,
}
"""Entries of a run key (outside ``"train"``) whose absence in an older saved key means this
value. An entry added to :func:`run_key` later goes here with its old-behaviour value."""


def run_key(
    bench: BenchConfig, contender: str, lr: float, *, kind: str, steps: int, eval_steps=None
) -> dict[str, Any]:
    """Everything that defines one run, as a JSON-able dict."""
    from muonscale.bench.runner import newton_schulz_precision, train_config_for

    key = {
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
    if bench.track_max_logit and bench.qk_clip_for(contender) is None:
        # training is unchanged, but only such a run's record holds the maximum logits
        key["max_logit"] = True
    return key


def compatible_key(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether a run saved under key ``saved`` is the run ``current`` by the compatibility
    rule: equal once the entries ``saved`` lacks, each at its default in ``current``, are
    removed from ``current``."""
    from muonscale.train.config import TrainConfig

    current = _plain(current)
    if not isinstance(saved, dict) or not isinstance(saved.get("train"), dict):
        return False
    if not isinstance(current.get("train"), dict):
        return False
    train_defaults = _plain(_field_defaults(TrainConfig))
    trimmed_train = _without_defaults(current["train"], saved["train"], train_defaults)
    trimmed = _without_defaults(current, saved, _plain(KEY_DEFAULTS))
    if trimmed is None or trimmed_train is None:
        return False
    return saved == {**trimmed, "train": trimmed_train}


def _without_defaults(current: dict, saved: dict, defaults: dict) -> dict | None:
    """``current`` without the entries ``saved`` lacks; None when one of them is not at its
    default (or has none)."""
    kept = {}
    for name, value in current.items():
        if name in saved:
            kept[name] = value
        elif name not in defaults or defaults[name] != value:
            return None
    return kept


def _field_defaults(cls: type) -> dict[str, Any]:
    defaults = {}
    for field in dataclasses.fields(cls):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            defaults[field.name] = field.default_factory()
    return defaults


def _plain(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists, ...)."""
    return json.loads(json.dumps(value))


class RunStore:
    """Saved runs in one folder (``None``: keep nothing, find nothing)."""

    def __init__(self, folder: str | os.PathLike | None) -> None:
        self.folder = None if folder is None else Path(folder)

    def path(self, key: dict[str, Any]) -> Path:
        text = json.dumps(key, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        return self.folder / f"{self._stem(key)}-{digest}.json"

    @staticmethod
    def _stem(key: dict[str, Any]) -> str:
        return f"{key['kind']}-{key['contender']}-seed{key['train']['seed']}"

    def load(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The saved result of the run ``key``, or None when there is none."""
        found = self.find(key)
        return None if found is None else found[1]

    def find(self, key: dict[str, Any]) -> tuple[Path, dict[str, Any]] | None:
        """``(file, result)`` of the run ``key``: the file of exactly this key, else a file of
        the same kind, contender and seed whose key is compatible (module docstring); None
        when there is none."""
        if self.folder is None:
            return None
        exact = self.path(key)
        saved = _read(exact)
        if saved is not None and saved["key"] == _plain(key):
            return exact, saved["result"]
        # else: none, a hash collision or a hand-edited file; look for an older key format
        pattern = glob.escape(str(self.folder / self._stem(key))) + "-*.json"
        candidates = []
        for path in sorted(Path(p) for p in glob.glob(pattern)):
            if path == exact:
                continue
            saved = _read(path)
            if saved is not None and compatible_key(saved["key"], key):
                candidates.append((-len(json.dumps(saved["key"])), path, saved["result"]))
        if not candidates:
            return None
        _, path, result = min(candidates, key=lambda c: c[:2])  # the most complete key
        return path, result

    def save(self, key: dict[str, Any], result: dict[str, Any]) -> None:
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "result": result}, indent=1, allow_nan=True))
        tmp.replace(path)  # never leave a half-written run behind


def _read(path: Path) -> dict[str, Any] | None:
    """A saved run file's ``{"key", "result"}``; None when unreadable or not one."""
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("key"), dict):
        return None
    if "result" not in saved:
        return None
    return saved


def record_to_dict(record: ContenderRecord) -> dict[str, Any]:
    return dataclasses.asdict(record)


def record_from_dict(values: dict[str, Any]) -> ContenderRecord:
    return ContenderRecord(**values)
