"""Timing helpers for the benchmarks: compile once, then interleave the contenders so that the
noise of a shared machine falls on all of them alike; report the median."""

import time
from collections.abc import Callable

import jax
import numpy as np


def median_times(fns: dict[str, Callable[[], object]], repeats: int = 7,
                 number: int = 1) -> dict[str, float]:
    """Median wall time in seconds of one call of each zero-argument jitted function (after a
    warm-up call). Each of the `repeats` samples times `number` calls dispatched back to back
    (on an accelerator, number > 1 hides the host's dispatch latency between calls)."""
    for fn in fns.values():
        jax.block_until_ready(fn())
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready([fn() for _ in range(number)])
            times[name].append((time.perf_counter() - start) / number)
    return {name: float(np.median(t)) for name, t in times.items()}

