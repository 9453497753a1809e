"""`cem-train`: train a CEM (or Llama) language model on a device mesh, resumably.

    cem-train --config configs/shakespeare_cem.yaml run.steps=200 optimizer.lr=3e-3
    python -m cem_jax.train --config configs/shakespeare_llama.yaml run.dir=runs/llama
    cem-train --config configs/cem_full_100m.yaml --dry-run   # compile only: memory, FLOPs

A run directory holds config.yaml (resolved), tokenizer.model, metrics.jsonl, tensorboard/ and
checkpoints/. Starting in one that has a checkpoint resumes from the latest (same model and data
sections required). SIGTERM or SIGINT saves a checkpoint and exits (status 0); a non-finite loss,
gradient or updated parameter stops the run (status 1) without saving, so the newest checkpoint
stays good. One cem-train at a time holds a run directory (a lock file, `.lock`). At the end:
validation loss, perplexity and bits per byte, and a generated sample.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import math
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from cem_jax.data import (
    Tokenizer,
    build_tokenizer,
    load_tokenizer,
    load_tokens,
    make_eval_batches,
    make_train_iterator,
)
from cem_jax.data.config import NOT_IN_TOKEN_STREAM
from cem_jax.data.shakespeare import FetchError
from cem_jax.train.checkpoint import Checkpointer, CheckpointError
from cem_jax.train.config import TrainConfig, load_config, save_config
from cem_jax.train.dry_run import check_batch_split, check_expected_params, dry_run
from cem_jax.train.metrics import MetricsWriter, flops_per_token, peak_flops
from cem_jax.train.optim import learning_rate
from cem_jax.train.sample import generate
from cem_jax.train.sharding import global_batch, make_mesh, replicated
from cem_jax.train.step import Trainer


class RunDirInUse(RuntimeError):
    """Another cem-train holds the run directory."""


class TrainingDiverged(RuntimeError):
    """The loss, the gradient norm or the updated parameters became NaN or infinite."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-train`; returns the exit status (0 done or stopped by a signal after saving,
    1 diverged or failed, 2 bad configuration)."""
    parser = argparse.ArgumentParser(prog="cem-train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML config file (default: all defaults)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override config fields, e.g. run.steps=20 optimizer.lr=3e-3")
    parser.add_argument("--dry-run", action="store_true",
                        help="compile one train step on abstract inputs and print parameters, "
                             "mesh, batch, per-device memory and FLOPs; reads no data and "
                             "writes nothing")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ValueError, FileNotFoundError) as err:
        print(f"cem-train: configuration error: {err}", file=sys.stderr)
        return 2
    try:
        if args.dry_run:
            dry_run(cfg)
        else:
            train(cfg)
    except (TrainingDiverged, RunDirInUse, CheckpointError, FetchError, OSError,
            ValueError) as err:
        print(f"cem-train: error: {err}", file=sys.stderr)
        return 1
    return 0


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train (or resume) the run `cfg.run.dir`; returns a summary {"step", "stopped_early",
    "eval": {"loss", "perplexity", "bits_per_byte"} (empty without a validation split),
    "sample"}. Raises TrainingDiverged, CheckpointError, RunDirInUse (another cem-train holds
    the directory), ValueError (config/run dir mismatch, run.dir a file), FileNotFoundError (a
    resumed run dir without tokenizer.model), OSError (an unwritable run dir, a full disk);
    ValueError also when `cfg.expected_params` is not the model's parameter count (checked
    before anything is written)."""
    if cfg.expected_params is not None:
        check_expected_params(cfg)
    if cfg.mesh.distributed:
        jax.distributed.initialize(cfg.mesh.coordinator_address, cfg.mesh.num_processes,
                                   cfg.mesh.process_id)
    lead = jax.process_index() == 0
    run_dir = Path(cfg.run.dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run.dir {run_dir} is a file, not a directory; give another run.dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    with _run_dir_lock(run_dir, lead):
        return _train(cfg, run_dir, lead)


@contextlib.contextmanager
def _run_dir_lock(run_dir: Path, lead: bool) -> Iterator[None]:
    """Hold an advisory lock on `run_dir/.lock` (process 0) while training, so that a second
    cem-train on the same directory stops at once (RunDirInUse) instead of interleaving its
    checkpoints and metrics. A file system without locks (some FUSE mounts) runs unlocked."""
    if not lead:
        yield
        return
    with open(run_dir / ".lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise RunDirInUse(f"{run_dir} is in use by another cem-train ({f.read().strip()}); "
                              "wait for it to finish or give another run.dir") from None
        except OSError:  # no flock here: nothing to hold
            pass
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}")
        f.flush()
        yield


def _train(cfg: TrainConfig, run_dir: Path, lead: bool) -> dict[str, Any]:
    mesh = make_mesh(cfg.mesh)
    check_batch_split(cfg, mesh)
    with contextlib.ExitStack() as closing:  # closed on errors too
        checkpointer = Checkpointer(run_dir, cfg.run.keep_checkpoints)
        closing.callback(checkpointer.close)
        resume_step = checkpointer.latest_step()
        if resume_step is not None:
            _check_resumed_config(cfg, run_dir, resume_step, lead)
        tokenizer = _run_tokenizer(cfg, run_dir, resumed=resume_step is not None)
        if cfg.data.has_validation:  # a bad validation corpus fails now, not after training
            load_tokens(cfg.data, tokenizer, "validation")
        if lead:
            save_config(cfg, run_dir / "config.yaml")
        trainer = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, mesh, cfg.run.debug_nan_step)
        iterator = make_train_iterator(cfg.data, tokenizer)
        if resume_step is None:
            state = trainer.init(cfg.run.seed)
        else:
            state, meta = checkpointer.restore(resume_step, trainer.abstract_state(), iterator)
            if meta["tokenizer_sha256"] != tokenizer.sha256:
                raise CheckpointError(f"{run_dir / 'tokenizer.model'} is not the tokenizer the "
                                      f"checkpoint was trained with")
            _say(lead, f"resumed {run_dir} from step {resume_step}")
        writer = MetricsWriter(run_dir, resume_step)
        closing.callback(writer.close)
        stop = _StopFlag()
        closing.callback(stop.restore)
        state, step, stopped = _loop(cfg, trainer, state, iterator, tokenizer, checkpointer,
                                     writer, stop, mesh)
        summary = {"step": step, "stopped_early": stopped, "eval": {}, "sample": ""}
        if stopped:
            _say(lead, f"stopped by a signal at step {step}; checkpoint saved in "
                       f"{checkpointer.directory}")
            return summary
        if cfg.data.has_validation:
            summary["eval"] = evaluate(cfg, trainer, state["params"], tokenizer, mesh)
            writer.write(step, "eval", summary["eval"])
            _say(lead, f"validation after {step} steps: {_describe(summary['eval'])}")
    if cfg.run.sample_tokens:
        summary["sample"] = generate(
            lambda p, t: trainer.model(p)(t), state["params"], tokenizer, cfg.run.sample_prompt,
            cfg.run.sample_tokens, window=cfg.data.seq_len,
            temperature=cfg.run.sample_temperature, seed=cfg.run.seed,
            out_sharding=replicated(mesh))
        _say(lead, f"sample:\n{cfg.run.sample_prompt}{summary['sample']}")
    return summary


def _loop(cfg, trainer, state, iterator, tokenizer, checkpointer, writer, stop, mesh):
    """The step loop; returns (state, step, stopped early by a signal)."""
    lead, run = jax.process_index() == 0, cfg.run
    step = int(jax.device_get(state["step"]))
    lr = learning_rate(cfg.optimizer, run.steps)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = peak_flops(run.peak_flops)
    _say(lead, f"{cfg.model.num_layers} layers, D={cfg.model.d_model}: "
               f"{sum(x.size for x in jax.tree.leaves(state['params'])):,} parameters; "
               f"{flops / 1e6:.1f} MFLOPs/token (train); peak {peak / 1e9:.0f} GFLOP/s "
               f"({peak_source}); mesh {dict(mesh.shape)}")
    progress = tqdm(total=run.steps, initial=step, disable=not (lead and run.progress),
                    unit="step", dynamic_ncols=True, mininterval=1.0)
    window_start, window_steps, compiled = time.perf_counter(), 0, False
    while step < run.steps:
        batch = global_batch(next(iterator), mesh)
        state, metrics = trainer.train_step(state, batch)
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        step += 1
        if not all(math.isfinite(v) for v in metrics.values()):
            checkpointer.wait()
            raise TrainingDiverged(
                f"non-finite training metrics at step {step}: loss {metrics['loss']}, gradient "
                f"norm {metrics['grad_norm']}, norm of the updated parameters "
                f"{metrics['param_norm']}. Nothing was saved after it: the latest good "
                f"checkpoint is step {checkpointer.latest_step()} in {checkpointer.directory}. "
                f"Lower optimizer.lr or raise optimizer.warmup_steps, then resume.")
        window_steps += 1
        if not compiled:  # the first step's time is mostly compilation: leave it out
            compiled, window_start, window_steps = True, time.perf_counter(), 0
        elapsed = time.perf_counter() - window_start
        tokens_per_s = window_steps * tokens_per_step / elapsed if window_steps else math.nan
        progress.update(1)
        progress.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                             refresh=False)
        if step % run.log_every == 0 or step == run.steps:
            speed = {"tokens_per_s": tokens_per_s, "mfu": flops * tokens_per_s / peak} \
                if window_steps else {}
            writer.write(step, "train", {**metrics, "lr": float(lr(step - 1)), **speed})
            window_start, window_steps = time.perf_counter(), 0
        if step % run.eval_every == 0 and step < run.steps and cfg.data.has_validation:
            result = evaluate(cfg, trainer, state["params"], tokenizer, mesh)
            writer.write(step, "eval", result)
            _say(lead, f"step {step}: validation {_describe(result)}")
            window_start, window_steps = time.perf_counter(), 0
        if step == run.debug_signal_step:
            os.kill(os.getpid(), getattr(signal, run.debug_signal))
        stopping = stop.agreed()
        if step % run.checkpoint_every == 0 or step == run.steps or stopping:
            checkpointer.save(step, state, iterator, cfg.to_dict(), tokenizer)
        if stopping:
            checkpointer.wait()
            progress.close()
            return state, step, True
    progress.close()
    checkpointer.wait()
    return state, step, False


def evaluate(cfg: TrainConfig, trainer: Trainer, params: dict, tokenizer: Tokenizer,
             mesh: jax.sharding.Mesh) -> dict[str, float]:
    """Validation {"loss" (nats/token), "perplexity", "bits_per_byte"} over the whole split
    (or its first `run.eval_batches` batches: bits per byte then uses the whole split's
    bytes per token)."""
    batches = make_eval_batches(cfg.data, tokenizer, "validation")
    count = len(batches) if cfg.run.eval_batches is None else min(cfg.run.eval_batches,
                                                                   len(batches))
    loss_sum = weight_sum = 0.0
    for i in range(count):
        loss, weight = jax.device_get(trainer.eval_step(params, global_batch(batches[i], mesh)))
        loss_sum, weight_sum = loss_sum + float(loss), weight_sum + float(weight)
    loss = loss_sum / weight_sum
    stats = load_tokens(cfg.data, tokenizer, "validation").stats
    return {"loss": loss, "perplexity": math.exp(loss), "bits_per_byte": stats.bits_per_byte(loss)}


def _check_resumed_config(cfg: TrainConfig, run_dir: Path, resume_step: int,
                          lead: bool) -> None:
    """A resumed run keeps the model and data config of its config.yaml (data fields outside
    the token stream aside, `NOT_IN_TOKEN_STREAM`), and run.steps is at least the
    resume step (ValueError otherwise). A changed `optimizer` section or `run.steps` is allowed
    (to train longer, say), but it reshapes the learning-rate schedule from the resume step on,
    so it is reported."""
    if cfg.run.steps < resume_step:
        raise ValueError(f"run.steps = {cfg.run.steps} but the run in {run_dir} has taken "
                         f"{resume_step} steps already; give run.steps >= {resume_step}, or "
                         "another run.dir")
    saved, given = load_config(run_dir / "config.yaml").to_dict(), cfg.to_dict()

    def diff(section, keys=None):
        old, new = saved[section], given[section]
        return {f"{section}.{k}": (old[k], new[k]) for k in keys or old if old[k] != new[k]}

    data_keys = [k for k in saved["data"] if k not in NOT_IN_TOKEN_STREAM]
    for section, keys in (("model", None), ("data", data_keys)):
        if changed := diff(section, keys):
            raise ValueError(f"{run_dir} holds a run with a different {section} config "
                             f"(saved, given): {changed}; use another run.dir")
    if changed := {**diff("optimizer"), **diff("run", ["steps"])}:
        _say(lead, f"warning: resuming with a changed schedule (saved, given): {changed}; the "
                   "learning rate follows the new one from the resume step on")


def _run_tokenizer(cfg: TrainConfig, run_dir: Path, resumed: bool) -> Tokenizer:
    """A resumed run's own tokenizer.model; a new run's tokenizer from the data config, saved
    into the run directory."""
    path = run_dir / "tokenizer.model"
    if resumed:
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the run directory being resumed; "
                                    f"restore it or start a new run.dir")
        return load_tokenizer(path, expected_vocab_size=cfg.data.vocab_size)
    tokenizer = build_tokenizer(cfg.data)
    if jax.process_index() == 0:
        tokenizer.save(path)
    return tokenizer


def _describe(result: dict[str, float]) -> str:
    return (f"loss {result['loss']:.4f} nats/token, perplexity {result['perplexity']:.2f}, "
            f"bits per byte {result['bits_per_byte']:.4f}")


def _say(lead: bool, message: str) -> None:
    if lead:
        tqdm.write(message)


class _StopFlag:
    """Set by SIGTERM/SIGINT; `agreed()` is True on every process once any process got one.
    A second SIGINT raises KeyboardInterrupt (leave at once, without a final checkpoint)."""

    def __init__(self):
        self.raised = False
        self.previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM,
                                                                     signal.SIGINT)}

    def _handle(self, signum, frame):
        if self.raised and signum == signal.SIGINT:  # a second Ctrl-C: stop without saving
            raise KeyboardInterrupt
        self.raised = True

    def agreed(self) -> bool:
        if jax.process_count() == 1:
            return self.raised
        return bool(np.any(multihost_utils.process_allgather(np.int32(self.raised))))

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
