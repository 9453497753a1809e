"""Benchmark of the persistent compilation cache (issue #24): a `cem-train` start's time to its
first step and to its end with the cache empty (the first start), with the cache the first
start filled (the second start: a restart after a preemption), and with the cache off. Each
start is a new process and a new run directory (two steps, one validation batch, no sample);
the three kinds run interleaved, `--repeats` rounds, medians printed.

    python benchmarks/compilation_cache.py [--config configs/shakespeare_cem.yaml] [key=value]

Target: the second start reaches its first step sooner than the first (the ratio printed).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start(config: str, overrides: list[str], run_dir: Path) -> tuple[float, float]:
    """(seconds to the first step's log line, seconds to the process's end) of one cem-train."""
    args = [sys.executable, "-m", "cem_jax.train", "--config", config, *overrides,
            f"run.dir={run_dir}", "run.steps=2", "run.log_every=1", "run.eval_batches=1",
            "run.sample_tokens=0", "run.progress=false"]
    began = time.perf_counter()
    process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    first = None
    for line in process.stdout:
        if first is None and line.startswith("step 1:"):
            first = time.perf_counter() - began
    _, err = process.communicate()
    if process.returncode != 0 or first is None:
        raise RuntimeError(f"cem-train failed ({process.returncode}): {err[-2000:]}")
    return first, time.perf_counter() - began


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/shakespeare_cem.yaml")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {"first start (cache empty)": [],
                                                   "second start (cache filled)": [],
                                                   "cache off": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            cache = [f"run.compilation_cache_dir={tmp}/xla{i}"]
            times["first start (cache empty)"].append(
                start(args.config, [*args.overrides, *cache], Path(tmp, f"a{i}")))
            times["second start (cache filled)"].append(
                start(args.config, [*args.overrides, *cache], Path(tmp, f"b{i}")))
            times["cache off"].append(start(args.config, [*args.overrides,
                                                          "run.compilation_cache=false"],
                                            Path(tmp, f"c{i}")))
            entries = sorted(Path(tmp, f"xla{i}").iterdir())
        size = sum(p.stat().st_size for p in entries)
    print(f"{args.config} {' '.join(args.overrides)}; {args.repeats} rounds, medians; "
          f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}; the cache held "
          f"{len(entries)} entries, {size / 2**20:.1f} MiB")
    print(f"{'start':<30}{'to step 1 s':>12}{'to end s':>10}")
    medians = {name: (statistics.median(a for a, _ in t), statistics.median(b for _, b in t))
               for name, t in times.items()}
    for name, (first, end) in medians.items():
        print(f"{name:<30}{first:>12.2f}{end:>10.2f}")
    cold, warm = medians["first start (cache empty)"], medians["second start (cache filled)"]
    print(f"second start / first start: to step 1 {warm[0] / cold[0]:.2f}x, to the end "
          f"{warm[1] / cold[1]:.2f}x; first start / cache off: to step 1 "
          f"{cold[0] / medians['cache off'][0]:.2f}x (the cost of writing the cache)")


if __name__ == "__main__":
    main()
