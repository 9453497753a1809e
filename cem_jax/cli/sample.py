"""`cem-sample --run DIR [--step N] --prompt "..."`: print continuations of prompts by a run's
model (`cem_jax.sample.generate`). The arguments are parsed before JAX is imported, so `--help`
and a usage error (exit status 2) answer at once; the library is imported once they are.

The decode runs in chunks of about `CHUNK_S` seconds each (one compiled loop for all), so that
a long one shows its progress (a bar on stderr while stdout is a terminal; `--no-progress`: none)
and a Ctrl-C stops it between two chunks: what was decoded is printed, then one line on
stderr, exit status 130. The tokens are those of one unchunked decode.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence

from cem_jax.cli.arguments import sample_parser
from cem_jax.cli.failures import failed


def main(argv: Sequence[str] | None = None) -> int:
    """`cem-sample`; returns the exit status (0 ok; 1 a crash, or object storage unreachable or
    failing: one line; 2 a usage error or a run that cannot be sampled as asked: a missing or
    unreadable run directory or checkpoint, a bad option value, a decode that does not fit in
    memory; 130 stopped by SIGINT, what was decoded printed)."""
    return run_command(sample_parser().parse_args(argv))


def run_command(args: argparse.Namespace) -> int:
    """`main` on parsed arguments (`cem_jax.cli.arguments.sample_parser`)."""
    import jax
    from tqdm import tqdm

    from cem_jax.checkpoint import CheckpointError
    from cem_jax.compilation_cache import use_compilation_cache
    from cem_jax.memory import is_out_of_memory
    from cem_jax.rundir import load_run, quiet_checkpoint_logs
    from cem_jax.sample import SamplingConfig, generate

    quiet_checkpoint_logs()
    try:
        run = load_run(args.run, args.step)
        use_compilation_cache(run.config)
    except Exception as err:
        return failed("cem-sample", err, (FileNotFoundError, CheckpointError, ValueError))
    tok = run.tokenizer
    try:
        sampling = SamplingConfig(args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                                  tok.eos_id, not args.no_stop_at_eos, tok.pad_id, args.seed,
                                  vocab_size=tok.vocab_size)
    except ValueError as err:
        print(f"cem-sample: error: {err}", file=sys.stderr)
        return 2
    texts = args.prompt or [""]
    prompts = [[tok.eos_id] + tok.encode(t) for t in texts]  # EOS starts a document
    model_cfg = run.config.model
    if args.steps is not None:  # test-time recursion (DESIGN.md §1: the steps share weights)
        model_cfg = dataclasses.replace(model_cfg, steps=args.steps)
    try:
        with _interruptible() as interrupted, tqdm(
                total=sampling.max_new_tokens, unit="tok", file=sys.stderr, leave=False,
                disable=args.no_progress or not sys.stdout.isatty()) as bar:
            out = generate(run.params, model_cfg, prompts, sampling,
                           chunks=_chunks(bar, interrupted))
    except KeyboardInterrupt:  # a second SIGINT, inside a chunk: leave now
        print("cem-sample: stopped by a second SIGINT; nothing was printed", file=sys.stderr)
        return 130
    except ValueError as err:  # DoesNotFit: refused before anything was allocated
        print(f"cem-sample: error: {err}", file=sys.stderr)
        return 2
    except jax.errors.JaxRuntimeError as err:
        if not is_out_of_memory(err):
            raise
        print(f"cem-sample: error: decoding needs more memory than the device has "
              f"({str(err).splitlines()[0]}); lower --max-new-tokens or the number of prompts",
              file=sys.stderr)
        return 2
    longest = max(len(p) + n for p, n in zip(prompts, out.lengths, strict=True))
    if longest > run.config.data.seq_len:
        print(f"cem-sample: note: the longest prompt and its continuation make "
              f"{longest} tokens, past the {run.config.data.seq_len}-token windows the "
              f"model was trained on (data.seq_len): the text past them may lose coherence",
              file=sys.stderr)
    for text, row, n in zip(texts, out.tokens, out.lengths, strict=True):
        print(text + tok.decode(row[:n]))
        print("-" * 40)
    if out.stopped:
        print(f"cem-sample: stopped by SIGINT after {out.tokens.shape[1]:,} of "
              f"{sampling.max_new_tokens:,} new tokens; printed what was decoded",
              file=sys.stderr)
        return 130
    return 0


CHUNK_S = 0.25  # seconds of decoding between two looks at the progress and at Ctrl-C


@contextlib.contextmanager
def _interruptible() -> Iterator[threading.Event]:
    """An Event set by SIGINT inside the block (a second SIGINT interrupts as usual)."""
    interrupted = threading.Event()

    def handle(signum, frame):
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()

    previous = signal.signal(signal.SIGINT, handle)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _chunks(bar, interrupted: threading.Event):
    """`generate`'s `chunks`: about CHUNK_S seconds of tokens each (8 first: its compile), the
    bar moved, None once interrupted."""
    last = {"done": 0, "time": time.monotonic(), "size": 8}

    def next_chunk(done: int, total: int) -> int | None:
        if interrupted.is_set():
            return None
        now = time.monotonic()
        if done > last["done"]:
            bar.update(done - last["done"])
            rate = (done - last["done"]) / max(now - last["time"], 1e-6)
            last["size"] = max(1, min(int(rate * CHUNK_S), total))
        last["done"], last["time"] = done, now
        return last["size"]

    return next_chunk


if __name__ == "__main__":
    sys.exit(main())
