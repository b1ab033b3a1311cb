"""What a training run reports as it goes: JSONL metrics (``metrics.jsonl``) and the progress
bar (tqdm, or plain lines without it)."""

from __future__ import annotations

import json
import sys
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
    """A tqdm bar, or without tqdm (an optional dependency) a :class:`PlainProgress`."""
    if not enabled:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return PlainProgress(total, "train", initial=initial)
    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)


class PlainProgress:
    """Progress without tqdm: one stderr line (steps, elapsed, ETA, figures) per postfix."""

    def __init__(self, total: int, desc: str, *, initial: int = 0) -> None:
        self.total, self.desc, self.done, self.initial = total, desc, initial, initial
        self.start = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.done += n

    def set_postfix(self, **figures: Any) -> None:
        self.set_postfix_str(", ".join(f"{k}={v}" for k, v in figures.items()))

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        elapsed = time.perf_counter() - self.start
        rate = elapsed / max(self.done - self.initial, 1)
        eta = rate * (self.total - self.done)
        print(
            f"{self.desc}: {self.done}/{self.total} steps, {elapsed:.0f}s elapsed, "
            f"ETA {eta:.0f}s  {text}",
            file=sys.stderr,
            flush=True,
        )

    def write(self, text: str) -> None:
        print(text, flush=True)

    def close(self) -> None:
        pass
