"""Benchmark of the training loop (issue #17): what the loop around the train step costs.

The whole loop of `cem-train` (`cem_jax.train.run.make_loop`: batches from the grain pipeline,
the real hooks, a metrics record at every step: `run.log_every=1`) against the bare compiled
step over the same number of batches already on the device, dispatched back to back. Segments
of `--steps` steps alternate between the two (the machine's noise falls on both alike), each
timed until its last step's metrics are on the host (the loop's end-of-run checkpoint, which
a run takes once, is left out); the median segment gives tokens/s. Target: loop / bare ≥ 0.97.

With `--read-delay-ms 30`, the loop's batches are read at a bucket's latency: the config's
training split (its tokenized dataset) through `benchmarks/data.py`'s `DelayedFileSystem`, each
request 30 ms, a step's rows requested at once (the bare step's batches are read before timing).

Run: `python benchmarks/loop.py [--config configs/shakespeare_cem.yaml] [--read-delay-ms 30]
[key=value ...]` (needs the config's corpus; the default one is fetched on first use).
"""

import argparse
import contextlib
import tempfile
import time

import jax
import numpy as np

from cem_jax.checkpoint import Checkpointer
from cem_jax.data import build_tokenizer, load_tokens, make_train_iterator
from cem_jax.sharding import global_batch, make_mesh
from cem_jax.train.goodput import Ledger
from cem_jax.train.metrics import MetricsWriter
from cem_jax.train.run import make_loop
from cem_jax.train.step import Trainer
from cem_jax.train_config import load_config


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/shakespeare_cem.yaml")
    parser.add_argument("--steps", type=int, default=30, help="steps per timed segment")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--read-delay-ms", type=float, default=None,
                        help="read the training split at this latency per request")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run_dir = tempfile.mkdtemp(prefix="cem-loop-bench-")
    fixed = [f"run.dir={run_dir}", "run.log_every=1", "run.eval_every=1000000",
             "run.checkpoint_every=1000000", "run.progress=false"]
    cfg = load_config(args.config, [*args.overrides, *fixed])
    reader = f"{cfg.data.corpus} as it is"
    if args.read_delay_ms is not None:
        from data import DelayedFileSystem  # benchmarks/data.py: registers delayed://

        DelayedFileSystem.delay_s = args.read_delay_ms / 1e3
        root = load_tokens(cfg.data, build_tokenizer(cfg.data), "train").root
        args.overrides = [*args.overrides, f"data.corpus=delayed://{root}"]
        cfg = load_config(args.config, [*args.overrides, *fixed])
        reader = (f"{args.read_delay_ms:g} ms per request (DelayedFileSystem), "
                  f"num_threads {cfg.data.num_threads}, prefetch {cfg.data.prefetch}")
    mesh = make_mesh(cfg.mesh)
    trainer = Trainer(cfg.model, cfg.optimizer, 1_000_000, mesh)
    tokenizer = build_tokenizer(cfg.data)
    iterator = make_train_iterator(cfg.data, tokenizer)
    on_device = [global_batch(next(iterator), mesh) for _ in range(args.steps)]
    state = trainer.init(0)
    state, metrics = trainer.train_step(state, on_device[0])  # compile
    jax.block_until_ready(metrics)
    step, times = 1, {"bare": [], "loop": []}
    with contextlib.ExitStack() as closing:
        checkpointer = Checkpointer(run_dir, keep=1)
        closing.callback(checkpointer.close)
        writer = MetricsWriter(run_dir)
        closing.callback(writer.close)
        for _ in range(args.repeats):
            start = time.perf_counter()
            for batch in on_device:
                state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(metrics)
            times["bare"].append(time.perf_counter() - start)
            step += args.steps
            segment = load_config(args.config, [*args.overrides, f"run.dir={run_dir}",
                                                f"run.steps={step + args.steps}",
                                                "run.log_every=1", "run.eval_every=1000000",
                                                "run.checkpoint_every=1000000",
                                                "run.progress=false"])
            loop = make_loop(segment, trainer, state, iterator, tokenizer, checkpointer, writer,
                             Ledger([], step), mesh, step, closing)
            arrived: list[float] = []  # when each step's metrics reached the host
            loop.add_hook(lambda info, arrived=arrived: arrived.append(time.perf_counter()))
            start = time.perf_counter()
            state, step, _ = loop.run()
            checkpointer.wait()
            times["loop"].append(arrived[-1] - start)
    tokens = args.steps * cfg.data.batch_size * cfg.data.seq_len
    speed = {name: tokens / float(np.median(t)) for name, t in times.items()}
    paired = np.array(times["bare"]) / np.array(times["loop"])  # neighbours in time
    print(f"train loop vs bare step, {args.steps}-step segments x {args.repeats} "
          f"(median), {cfg.data.batch_size}x{cfg.data.seq_len} tokens/step, "
          f"{jax.device_count()} {jax.devices()[0].device_kind} device(s); the loop reads "
          f"from {reader}")
    for name in ("bare", "loop"):
        print(f"  {name:5s} {speed[name]:10,.0f} tokens/s")
    print(f"loop / bare: {speed['loop'] / speed['bare']:.3f}x of the medians; per repeat "
          f"(a loop segment against the bare one before it) median {np.median(paired):.3f}x, "
          f"range {paired.min():.3f}-{paired.max():.3f} (target >= 0.97)")


if __name__ == "__main__":
    main()
