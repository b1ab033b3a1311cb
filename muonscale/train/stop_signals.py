"""Stopping a training run at a step boundary: SIGINT and SIGTERM are recorded instead of
raised, so the loop finishes the current step and saves a checkpoint."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Any


class StopSignals:
    """While active (main thread only), SIGINT and SIGTERM set ``signal`` instead of raising:
    the loop stops at the next step boundary and saves; later signals are only reported."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: str | None = None
        self.saving = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for number in self.SIGNALS:
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.saving:
            what = f"{name} deferred: writing the checkpoint first"
        elif self.signal is None:
            what = f"{name}: stopping after the current step, then saving a checkpoint"
        else:
            what = f"{name} again: still finishing the step (SIGKILL abandons it unsaved)"
        self.signal = self.signal or name
        print(f"muonscale train: {what}", file=sys.stderr, flush=True)
