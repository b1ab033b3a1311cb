"""What a training run reports as it goes: JSONL metrics (``metrics.jsonl``) and the progress
bar."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class MetricsLog:
    """Appends one JSON object per line (with wall-clock ``time``); no-op without a path."""

    def __init__(self, path: Path | None) -> None:
        self._file, self._path = None, path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", encoding="utf-8")

    def write(self, **record: Any) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps({"time": time.time(), **record}) + "\n")
            self._file.flush()
        except OSError as error:
            raise OSError(
                error.errno, f"could not append to {self._path}: {error.strerror or error}"
            ) from error

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def progress_bar(enabled: bool, *, total: int, initial: int):
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
