"""Train (or resume) a run: `train(cfg)`, the body of `cem-train` (`cem_jax.cli.train`).

A run directory (local, or a bucket's URL: `gs://...`) holds config.yaml (resolved), its
tokenizer (tokenizer.model, or tokenizer.json and tokenizer_config.json), metrics.jsonl,
tensorboard/ and checkpoints/. Starting in one that
has a checkpoint resumes from the latest (same model and data sections required); in a finished
one, it reports the validation the run logged and trains, evaluates and logs nothing. A signal
stops it at a safe point: during start-up with nothing written (a run directory it created is
removed again), after a step with that step saved, or between validation batches with the
step's checkpoint kept (its validation is done when the run is started again). A non-finite
loss, gradient or updated parameter stops the run without saving, so the newest checkpoint
stays good. One cem-train at a time holds a run directory (a lock file, `.lock`); cem-export and
cem-import never replace a directory while it is held, nor once a run trained there (a
cem-import's run directory stops being an import output when it starts training). At the end:
validation loss, perplexity and bits per byte, and a generated sample.

The steps run in `cem_jax.train.loop.TrainLoop` with the hooks of `cem_jax.train.hooks`; a caller
adds its own with `train(cfg, hooks=...)`, and a module named under a config's `imports:` with
`register_setup_hook` (each a `SetupHook`, called once the loop is built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from cem_jax import exits
from cem_jax.attention import attention_impl
from cem_jax.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_directory,
    complete_steps,
)
from cem_jax.compilation_cache import use_compilation_cache
from cem_jax.data import (
    DataConfig,
    Tokenizer,
    files,
    load_tokens,
    make_train_iterator,
)
from cem_jax.data.distributed import check_same
from cem_jax.data.pipeline import no_validation
from cem_jax.data.storage_errors import storage_error
from cem_jax.evaluate import describe, evaluate
from cem_jax.exits import StoppedBySignal
from cem_jax.export.output import unmark_output
from cem_jax.kinds import check_decodable, check_user_kinds, model_kinds
from cem_jax.optim import check_trainable
from cem_jax.sample import SamplingConfig, generate
from cem_jax.sharding import global_batch, make_mesh, replicated
from cem_jax.train import hooks, watchdog
from cem_jax.train.goodput import Ledger
from cem_jax.train.lock import run_dir_lock
from cem_jax.train.loop import TrainingDiverged, TrainLoop
from cem_jax.train.metrics import (
    MetricsWriter,
    flops_per_token,
    logged_records,
    peak_flops,
)
from cem_jax.train.resume import (
    check_resumed_config,
    finished_result,
    init_source,
    run_tokenizer,
    validation_missing,
)
from cem_jax.train.sizing import check_expected_params, check_fits_in_memory
from cem_jax.train.step import Trainer
from cem_jax.train_config import TrainConfig, save_config

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a `SetupHook` sees once the run's step loop is built, before its first step: the
    resolved `config`, the `loop` (`TrainLoop`: `loop.add_hook(fn, every, ...)`, or wrap
    `loop.step_fn`) and the run's `checkpointer` (`wait()`: the saves in flight are done)."""

    config: TrainConfig
    loop: TrainLoop
    checkpointer: Checkpointer


SetupHook = Callable[[Setup], None]
# Called by every `train` of this process, before the caller's own hooks (register_setup_hook).
SETUP_HOOKS: tuple[SetupHook, ...] = ()


def register_setup_hook(hook: SetupHook) -> None:
    """Have every later `train` in this process call `hook(Setup)`: how a module named under a
    config's `imports:` (loaded before the run starts, in every process) adds loop hooks to
    cem-train's runs (levanter's `Trainer.add_hook`, from a plugin)."""
    global SETUP_HOOKS
    SETUP_HOOKS = (*SETUP_HOOKS, hook)


@exits.caught()
def train(cfg: TrainConfig, hooks: Sequence[SetupHook] = ()) -> dict[str, Any]:
    """Train (or resume) the run `cfg.run.dir`; returns a summary {"step", "eval":
    `cem_jax.evaluate.evaluate`'s figures (empty without a validation split), "sample", and
    for a run that trained "goodput": `cem_jax.train.goodput.Goodput`, every launch's}.
    `hooks`: called with the `Setup` once the step loop is built (after `SETUP_HOOKS`), to add
    loop hooks of the caller's.

    SIGINT and SIGTERM stop it at a safe point (`cem_jax.exits`): raises StoppedBySignal,
    saying where it stopped and what is saved. Raises TrainingDiverged, CheckpointError,
    RunDirInUse (another cem-train holds the directory), ValueError (config/run dir mismatch,
    run.dir a file), FileNotFoundError (a resumed run dir without its tokenizer), OSError (an
    unwritable run dir, a full disk; `CheckpointWriteError` for a checkpoint); ValueError also
    when `cfg.expected_params` is not the model's parameter count, when `model.param_dtype` is
    one the optimizer cannot train (`cem_jax.optim.check_trainable`), when the batch cannot be
    split over the mesh, and (`cem_jax.memory.DoesNotFit`) when a train step cannot fit in the
    device's memory: all checked before anything is written. A run directory this call created
    is removed again when it raises before the directory holds anything of value (a checkpoint
    or a logged step); with several processes, by the one that created it; on a bucket that
    cannot be reached (a storage failure), not (it would wait out gcsfs's retries again)."""
    if cfg.expected_params is not None:
        check_expected_params(cfg)
    check_trainable(cfg.model)
    cache = use_compilation_cache(cfg)  # before anything compiles
    if cfg.mesh.distributed:
        jax.distributed.initialize(
            cfg.mesh.coordinator_address, cfg.mesh.num_processes, cfg.mesh.process_id,
            initialization_timeout=cfg.mesh.initialization_timeout_s,
            heartbeat_timeout_seconds=cfg.mesh.heartbeat_timeout_s,
            shutdown_timeout_seconds=cfg.mesh.shutdown_timeout_s)
    watchdog.started(jax.process_index(), jax.process_count())
    m = cfg.model  # an impl this platform cannot run, or a wrong kind, fails before writing
    check_user_kinds(m)
    attention_impl(m.impl, jnp.dtype(m.dtype), m.head_width, tied=m.kinds[0] != "llama_attention")
    lead = jax.process_index() == 0
    mesh = make_mesh(cfg.mesh)
    check_fits_in_memory(cfg, mesh)  # as the next check, before anything is written
    run_dir = cfg.run.dir
    checkpoint_directory(run_dir)  # a path orbax cannot restore from
    bucket = run_dir.split("/", 3)[2] if files.is_url(run_dir) else None  # gs://BUCKET/...
    if bucket is not None and not files.exists(f"gs://{bucket}"):
        raise ValueError(f"run.dir {run_dir}: the bucket gs://{bucket} does not exist (or these "
                         f"credentials cannot see it); create it in the slice's region (gcloud "
                         f"storage buckets create gs://{bucket} --location=REGION) or give "
                         f"another run.dir")
    if files.is_file(run_dir):
        raise ValueError(f"run.dir {run_dir} is a file, not a directory; give another run.dir")
    exits.check()  # a signal while JAX was imported or initialized: stop before writing
    off = "off" if cfg.run.compilation_cache else "off (run.compilation_cache=false)"
    logger.info("compilation cache: %s", cache or off)  # once the run can start: errors alone
    created = _to_create(run_dir)  # removed if worthless
    try:
        files.make_dirs(run_dir)
    except OSError as err:
        raise OSError(f"cannot create run.dir {run_dir} ({err.strerror}: {err.filename}); give "
                      f"a run.dir in a writable place") from None
    try:
        with run_dir_lock(run_dir, lead):
            return _train(cfg, run_dir, mesh, lead, (*SETUP_HOOKS, *hooks))
    except BaseException as err:
        if not (files.is_url(run_dir) and storage_error(err) is not None):
            _remove_if_worthless(created)  # by the process that made it: any, with several
        if isinstance(err, StoppedBySignal) and not err.where:  # a stop during the start
            raise _before_first_step(err, run_dir) from None
        raise


def _to_create(run_dir: str) -> list[str]:
    """The run directory and its parents that do not exist yet, deepest first (on a bucket,
    where folders are prefixes: the run directory alone, if it holds nothing)."""
    if files.is_url(run_dir):
        return [] if files.is_dir(run_dir) else [run_dir]
    path = Path(run_dir)
    return [str(d) for d in (path, *path.parents) if not d.exists()]


def _remove_if_worthless(created: list[str]) -> None:
    """Remove the run directory `created[0]` and the parents created with it (`created`,
    deepest first) if it holds no checkpoint and no logged step: a start that failed or was
    stopped leaves nothing behind. An empty list (the directory was there before) removes
    nothing."""
    if not created or complete_steps(files.join(created[0], "checkpoints")) or \
            logged_records(created[0]):
        return
    files.remove_tree(created[0])
    for parent in created[1:]:
        try:
            os.rmdir(parent)  # only if nothing else was put there meanwhile
        except OSError:
            return


def _train(cfg: TrainConfig, run_dir: str, mesh: jax.sharding.Mesh, lead: bool,
           hooks: Sequence[SetupHook]) -> dict[str, Any]:
    with contextlib.ExitStack() as closing:  # closed on errors too
        checkpointer = Checkpointer(run_dir, cfg.run.keep_checkpoints)
        closing.callback(checkpointer.close)
        closing.push(watchdog.leave_if_peer_lost)  # before that close waits for the peer
        watchdog.drop_peer_lost_echoes()
        resume_step = checkpointer.latest_step()
        if resume_step is not None:
            watchdog.saved(resume_step)
        finished = finished_result(cfg, run_dir, resume_step)
        if lead and finished is None and not files.is_url(run_dir) and \
                not os.access(run_dir, os.W_OK):
            raise PermissionError(f"cannot write in run.dir {run_dir} (read-only or not yours); "
                                  f"copy it to a writable place and train there, or give "
                                  f"another run.dir")
        if resume_step is not None:
            cfg = check_resumed_config(cfg, run_dir, resume_step, report=finished is None)
        if finished is None and cfg.optimizer.warmup_steps > cfg.run.steps:
            logger.warning("optimizer.warmup_steps = %d is more than run.steps = %d: the warmup "
                           "is cut to %d steps, so the rate reaches optimizer.lr only at the "
                           "last step and never decays; lower optimizer.warmup_steps",
                           cfg.optimizer.warmup_steps, cfg.run.steps, cfg.run.steps)
        source = init_source(cfg) if resume_step is None and cfg.run.init_from else None
        tokenizer = run_tokenizer(cfg, run_dir, resumed=resume_step is not None,
                                   source=source)
        _load_splits(cfg.data, tokenizer, report=finished is None)
        trainer = Trainer(cfg.model, cfg.optimizer, cfg.run.steps, mesh)
        iterator = make_train_iterator(cfg.data, tokenizer, first_step=resume_step or 0)
        if source is not None:
            state = trainer.init_from_params(source.params)
            logger.info("initialized from the parameters of %s at step %d (a fresh optimizer "
                        "state)", source.directory, source.step)
        elif resume_step is None:
            state = trainer.init(cfg.run.seed)
        else:
            state, meta = checkpointer.restore(resume_step, trainer.abstract_state())
            if meta["tokenizer_sha256"] != tokenizer.sha256:
                raise CheckpointError(f"{files.join(run_dir, tokenizer.file_name)} is not the "
                                      f"tokenizer the checkpoint was trained with")
            if resume_step == 0:  # training saves from step 1 on: cem-import wrote it
                logger.info("starting %s from its imported parameters (checkpoint 0)", run_dir)
            else:
                logger.info("resumed %s from step %d", run_dir, resume_step)
        exits.check()
        if lead and finished is None:  # once the checkpoint is known good, and to be trained
            if not files.is_url(run_dir):  # cem-import writes local directories only
                unmark_output(Path(run_dir))  # its run: one no --overwrite replaces from now
            save_config(cfg, files.join(run_dir, "config.yaml"))
        first = resume_step or 0
        if finished is not None:  # started again after its end: report, write nothing
            logger.info("%s has taken its %d steps already; nothing to train", run_dir, first)
            if cfg.data.has_validation:
                logger.info("validation after %d steps: %s", first, describe(finished))
            summary = {"step": first, "eval": finished, "sample": ""}
        else:
            summary = _train_steps(cfg, trainer, state, iterator, tokenizer, checkpointer,
                                   mesh, first, closing, hooks)
            state = summary.pop("state")
    if cfg.run.sample_tokens:
        summary["sample"] = _sample(cfg, state["params"], tokenizer, mesh)
        logger.info("sample:\n%s%s", cfg.run.sample_prompt, summary["sample"])
    return summary


def _load_splits(cfg: DataConfig, tokenizer: Tokenizer, report: bool) -> None:
    """Open (tokenizing once, if needed) the training and validation splits, so that a bad
    corpus fails now, not after training; check that every process sees the same ones; say
    when the run has no validation split (`report`: it has steps to train)."""
    splits = [load_tokens(cfg, tokenizer, "train", exits.check)]
    if cfg.has_validation:
        splits.append(load_tokens(cfg, tokenizer, "validation", exits.check))
    elif report:
        logger.warning("the run reports no validation: %s", no_validation(cfg))
    if jax.process_count() > 1:
        check_same("cem_jax/data/identity", " ".join(
            [tokenizer.sha256, *(s.stream.manifest.identity for s in splits)]),
            "a dataset or tokenizer")


def _train_steps(cfg: TrainConfig, trainer: Trainer, state: dict, iterator,
                 tokenizer: Tokenizer, checkpointer: Checkpointer, mesh: jax.sharding.Mesh,
                 first: int, closing: contextlib.ExitStack,
                 hooks: Sequence[SetupHook]) -> dict[str, Any]:
    """Steps `first`+1 … `run.steps` and the final validation; returns the summary of `train`
    with the final "state". A resume step whose validation was due but never logged (the run
    was stopped at it) is validated first. Raises StoppedBySignal saying where the loop or the
    final validation stopped (a stop before the loop: as it came)."""
    writer = closing.enter_context(MetricsWriter(cfg.run.dir, first, cfg))
    if validation_missing(cfg, first):
        result = _validate(cfg, trainer, state["params"], tokenizer, mesh)
        writer.write(first, "eval", result)
        logger.info("step %d: validation %s", first, describe(result))
    ledger = Ledger(writer.logged("goodput"), first)
    loop = make_loop(cfg, trainer, state, iterator, tokenizer, checkpointer, writer, ledger,
                     mesh, first, closing)
    for hook in hooks:
        hook(Setup(cfg, loop, checkpointer))
    exits.check()  # the last safe point before the first step
    try:
        state, step, stopped = loop.run()
    except TrainingDiverged as err:
        checkpointer.wait()
        good = checkpointer.latest_step()
        saved = (f"the latest good checkpoint is step {good} in {checkpointer.directory}"
                 if good is not None else f"no checkpoint was written yet in {cfg.run.dir}")
        raise TrainingDiverged(
            f"{err}. Nothing was saved after it: {saved}. Lower optimizer.lr or raise "
            f"optimizer.warmup_steps, then {'resume' if good is not None else 'start again'}."
        ) from None
    except StoppedBySignal as stop:  # due at the first step: the step is dropped
        raise _stopped_at(stop, loop.step, first, checkpointer) from None
    if stopped:
        raise _stopped_at(StoppedBySignal(exits.received() or signal.SIGTERM), step, first,
                          checkpointer)
    watchdog.enter(f"the wait for the checkpoint of step {step}", "checkpoint")
    checkpointer.wait()
    summary = {"step": step, "eval": {}, "sample": "", "state": state}
    if cfg.data.has_validation:
        watchdog.enter(f"the final evaluation at step {step}", "evaluation")
        try:
            summary["eval"] = _validate(cfg, trainer, state["params"], tokenizer, mesh)
        except StoppedBySignal as stop:
            raise stop.at(f"during the final validation; the checkpoint of step {step} is kept "
                          f"in {checkpointer.directory}: start it again to validate") from None
        writer.write(step, "eval", summary["eval"])
        logger.info("validation after %d steps: %s", step, describe(summary["eval"]))
    writer.write(step, "goodput", ledger.record(step, ended=True))
    summary["goodput"] = ledger.run
    logger.info("%s", ledger.run.describe())
    return summary


def _before_first_step(stop: StoppedBySignal, run_dir: str) -> StoppedBySignal:
    """`stop`, saying that it came before the first step of this start, which saved nothing:
    the run stays at its newest checkpoint (none for a new run)."""
    checkpoints = str(checkpoint_directory(run_dir))
    if not (steps := complete_steps(checkpoints)):
        return stop.at("before the first step; nothing was trained")
    return stop.at(f"before its first step; the run stays at step {steps[-1]} ({checkpoints}): "
                   f"start it again to resume")


def _stopped_at(stop: StoppedBySignal, step: int, first: int,
                checkpointer: Checkpointer) -> StoppedBySignal:
    """`stop`, saying at which step the loop stopped and which checkpoint is the newest (a
    stop at the first step of this start drops that step: before the first step)."""
    checkpointer.wait()
    good = checkpointer.latest_step()
    if (good or 0) <= first and step <= first + 1:
        return _before_first_step(stop, str(checkpointer.directory.parent))
    if good == step:
        kept = f"checkpoint saved in {checkpointer.directory}"
    elif good is None:
        kept = "no checkpoint was written yet"
    else:
        kept = f"its newest checkpoint is step {good} in {checkpointer.directory}"
    return stop.at(f"at step {step}; {kept}: start it again to resume")


def make_loop(cfg: TrainConfig, trainer: Trainer, state: dict, iterator, tokenizer: Tokenizer,
              checkpointer: Checkpointer, writer: MetricsWriter, ledger: Ledger,
              mesh: jax.sharding.Mesh, first: int, closing: contextlib.ExitStack) -> TrainLoop:
    """cem-train's step loop from step `first` to `run.steps`, with its hooks
    (`cem_jax.train.hooks`; `ledger` for their goodput records); `closing` gets what must be
    closed after it (the bar, and the signal handlers of `cem_jax.exits` unless the caller has
    them already). Also what `benchmarks/loop.py` times."""
    run = cfg.run
    flops = flops_per_token(cfg.model, cfg.data.seq_len)
    peak, peak_source = peak_flops(run.peak_flops)
    logger.info("%d layers, D=%d: %s parameters; %.1f MFLOPs/token (train); peak %.0f GFLOP/s "
                "(%s); mesh %s", cfg.model.num_layers, cfg.model.d_model,
                f"{sum(x.size for x in jax.tree.leaves(state['params'])):,}", flops / 1e6,
                peak / 1e9, peak_source, dict(mesh.shape))
    batches = (global_batch(batch, mesh) for batch in iterator)
    loop = TrainLoop(trainer.train_step, state, batches, first_step=first, last_step=run.steps)
    progress = hooks.Progress(first, run.steps, cfg.data.batch_size * cfg.data.seq_len,
                              run.progress)
    closing.callback(progress.close)
    loop.add_hook(progress)
    loop.add_hook(hooks.LogMetrics(writer, progress, flops, peak), run.log_every,
                  at_last=True)
    log_goodput = hooks.LogGoodput(writer, ledger)
    loop.add_hook(log_goodput, run.log_every)
    closing.enter_context(exits.caught())  # cem-train's own, or this loop's while it runs
    loop.add_hook(hooks.StopOnSignal(agree_every=run.log_every, first_step=first),
                  reads="state")
    if cfg.data.has_validation:
        validate = hooks.Validate(
            lambda params: _validate(cfg, trainer, params, tokenizer, mesh), writer)
        loop.add_hook(validate, run.eval_every, reads="state")
    watch = watchdog.SaveWatch(checkpointer.manager.is_saving_in_progress,
                               checkpointer.is_complete, run.save_timeout_s)
    closing.callback(watch.wait)  # before the checkpointer's close

    def save(step: int, state: dict) -> None:
        watch.save(step, lambda: checkpointer.save(step, state, cfg.to_dict(), tokenizer))

    loop.add_hook(log_goodput, run.checkpoint_every, reads="state", at_last=True)
    loop.add_hook(hooks.SaveCheckpoint(save, writer), run.checkpoint_every, reads="state",
                  at_last=True)
    profile = hooks.Profile(run, first)  # a window from step first + 1 on starts now
    closing.callback(profile.close)  # a trace the loop left running
    loop.add_hook(profile, reads="state")
    return loop


def _validate(cfg: TrainConfig, trainer: Trainer, params: dict, tokenizer: Tokenizer,
              mesh: jax.sharding.Mesh) -> dict[str, float]:
    """`cem_jax.evaluate.evaluate` on the validation split (its first `run.eval_batches`
    batches, if set) with the trainer's compiled eval step. A signal stops it between batches
    (StoppedBySignal) when it runs in one process (on several, every process would have to
    agree on the batch: it runs to its end, and the loop stops after the step)."""
    check = exits.check if jax.process_count() == 1 else None
    return evaluate(params, cfg.model, cfg.data, tokenizer, mesh,
                    max_batches=cfg.run.eval_batches, eval_step=trainer.eval_step, check=check)


def _sample(cfg: TrainConfig, params: dict, tokenizer: Tokenizer,
            mesh: jax.sharding.Mesh) -> str:
    """A document continuing `run.sample_prompt` (`cem_jax.sample.generate`, the parameters as
    sharded on the mesh, the tokens replicated for every process)."""
    sampling = SamplingConfig(cfg.run.sample_tokens, cfg.run.sample_temperature,
                              eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                              seed=cfg.run.seed, vocab_size=tokenizer.vocab_size)
    try:
        for kind in model_kinds(cfg.model):
            check_decodable(kind, cfg.model)
    except ValueError as err:
        logger.warning("no sample: %s (set run.sample_tokens=0 to skip it)", err)
        return ""
    prompt = [tokenizer.eos_id] + tokenizer.encode(cfg.run.sample_prompt)  # a document start
    out = generate(params, cfg.model, [prompt], sampling, out_sharding=replicated(mesh))
    return tokenizer.decode(out.tokens[0, :out.lengths[0]])


