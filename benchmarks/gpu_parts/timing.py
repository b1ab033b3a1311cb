"""Timing (CUDA events on CUDA, perf_counter on CPU; variants interleaved, medians) and the
plain-text tables the sections print."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class Clock:
    """Seconds of ``fn()``: CUDA events on CUDA (synchronized), perf_counter on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def interleaved(
        self, fns: dict[str, Callable[[], object]], *, warmup: int, reps: int, budget_s: float = 1e9
    ) -> dict[str, float]:
        """Median seconds per variant; rounds A B C, A B C, …; stops early past ``budget_s``."""
        for _ in range(warmup):
            for fn in fns.values():
                fn()
        self.sync()
        times: dict[str, list[float]] = {k: [] for k in fns}
        t_end = time.perf_counter() + budget_s
        for r in range(reps):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for k in order:
                times[k].append(self.time(fns[k]))
            if time.perf_counter() > t_end and r >= 1:
                break
        return {k: _median(v) for k, v in times.items()}


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def print_table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    widths = [max(len(c), *(len(fmt(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)))
