"""Timing for the benchmarks (never for tests)."""
from __future__ import annotations

import time
from collections.abc import Callable


def timed(fn: Callable[[], object], repeats: int = 1) -> float:
    """Best wall-clock seconds of `repeats` runs (the minimum is the least noisy estimate)."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
