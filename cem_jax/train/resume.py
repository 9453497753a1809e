"""What a start of cem-train finds in its run directory, and takes from it: a resumed run's checks
(the same model and data; a finished run; a validation due at the resume step), a new run's
tokenizer, and the run it starts from (`run.init_from`)."""

from __future__ import annotations

import dataclasses
import logging

import jax

from cem_jax import exits
from cem_jax.config import NOT_IN_MATH, ModelConfig
from cem_jax.data import Tokenizer, build_tokenizer, files, load_tokenizer
from cem_jax.data.config import token_stream_fields
from cem_jax.data.tokenizers import find_tokenizer
from cem_jax.rundir import Run, load_run
from cem_jax.train.metrics import logged_values
from cem_jax.train_config import TrainConfig, load_config

logger = logging.getLogger(__name__)


def check_resumed_config(cfg: TrainConfig, run_dir: str, resume_step: int,
                          report: bool = True) -> TrainConfig:
    """A resumed run keeps the model and data config of its config.yaml (model fields that only
    choose how the same function is computed aside, `cem_jax.config.NOT_IN_MATH`, and data
    fields outside the token stream, `token_stream_fields`: `NOT_IN_TOKEN_STREAM`, and
    data.vocab_size beside a given tokenizer; any data at step 0, a cem-import's checkpoint,
    before a token was read), and run.steps is at least the
    resume step (ValueError otherwise). A change of any `optimizer` field, of `run.steps` (to
    train longer, say; the optimizer state does not depend on them, `cem_jax.optim`) or
    of the `NOT_IN_MATH` model fields is allowed, and reported when `report` (a run with steps
    left to train): it applies, learning-rate schedule included, from the resume step on.
    Returns `cfg` with the saved `run.init_from` and `run.init_step`: they say how the run
    began, which a resume does not change (other ones given are reported, and not used)."""
    if cfg.run.steps < resume_step:
        raise ValueError(f"run.steps = {cfg.run.steps} but the run in {run_dir} has taken "
                         f"{resume_step} steps already; give run.steps >= {resume_step}, or "
                         "another run.dir")
    saved_cfg = load_config(files.join(run_dir, "config.yaml"))
    saved, given = saved_cfg.to_dict(), cfg.to_dict()

    def diff(section, keys=None):  # keys None: all of the section's
        keys = saved[section] if keys is None else keys
        if section == "model":
            return model_changes(saved_cfg.model, cfg.model, keys)
        old, new = saved[section], given[section]
        return {f"{section}.{k}": (old[k], new[k]) for k in keys if old[k] != new[k]}

    model_keys = [k for k in saved["model"] if k not in NOT_IN_MATH]
    in_stream = token_stream_fields(saved_cfg.data).keys() | token_stream_fields(cfg.data)
    # At step 0 (cem-import's checkpoint) no token was read yet: the data may change.
    data_keys = [k for k in saved["data"] if k in in_stream] if resume_step else []
    for section, keys in (("model", model_keys), ("data", data_keys)):
        if changed := diff(section, keys):
            raise ValueError(f"{run_dir} holds a run with a different {section} config "
                             f"(saved, given): {changed}; use another run.dir (with "
                             f"run.init_from={run_dir} to start from its parameters)")
    changed = {**diff("optimizer"), **diff("run", ["steps"]), **diff("model", NOT_IN_MATH)}
    if changed and report:
        logger.warning("resuming with changed settings (saved, given): %s; they apply, the "
                       "learning-rate schedule included, from the resume step on", changed)
    if (ignored := diff("run", ["init_from", "init_step"])) and report:
        logger.warning("%s resumes from its own checkpoint of step %d: run.init_from and "
                       "run.init_step start a new run only, so these are not used and its "
                       "config.yaml keeps the saved ones (saved, given): %s", run_dir,
                       resume_step, ignored)
    return dataclasses.replace(cfg, run=dataclasses.replace(
        cfg.run, init_from=saved_cfg.run.init_from, init_step=saved_cfg.run.init_step))


def model_changes(old: ModelConfig, new: ModelConfig, keys) -> dict[str, tuple]:
    """{"model.KEY": (old value, new value)} of the fields `keys` that differ between two model
    sections where the models differ too: a null and the value it stands for (num_kv_heads,
    head_dim: `ModelConfig.resolved`) are the same model."""
    raw = [dataclasses.asdict(m) for m in (old, new)]
    res = [dataclasses.asdict(m.resolved()) for m in (old, new)]
    return {f"model.{k}": (raw[0][k], raw[1][k]) for k in keys
            if raw[0][k] != raw[1][k] and res[0][k] != res[1][k]}


def init_source(cfg: TrainConfig) -> Run:
    """The run `run.init_from` at checkpoint `run.init_step` (None: its newest), whose model
    section must be `cfg`'s (the `NOT_IN_MATH` fields aside): ValueError naming the fields
    that differ. Raises as `cem_jax.rundir.load_run` (a missing run or step, a corrupt
    checkpoint)."""
    source = load_run(cfg.run.init_from, cfg.run.init_step)
    keys = [k for k in dataclasses.asdict(cfg.model) if k not in NOT_IN_MATH]
    if changed := model_changes(source.config.model, cfg.model, keys):
        raise ValueError(f"run.init_from {source.directory} holds a model with a different "
                         f"model section (its, given): {changed}; give the model section of "
                         f"{files.join(source.directory, 'config.yaml')}")
    return source


def finished_result(cfg: TrainConfig, run_dir: str,
                     resume_step: int | None) -> dict[str, float] | None:
    """A run started again after its last step: the final validation it logged ({} without a
    validation split). None while it has steps to take, or when its final evaluation was never
    logged (killed during it, or stopped by a signal at the last step): it is evaluated then."""
    if resume_step != cfg.run.steps:
        return None
    return logged_values(run_dir, resume_step, "eval") if cfg.data.has_validation else {}


def run_tokenizer(cfg: TrainConfig, run_dir: str, resumed: bool,
                   source: Run | None = None) -> Tokenizer:
    """A resumed run's own tokenizer (its tokenizer.model or tokenizer.json); a new run's
    tokenizer from the data config, or the tokenizer of the run it starts from (`source`, where
    a `data.tokenizer` given must be that file: ValueError otherwise), saved into the run
    directory. Each must fit the model's vocabulary (ValueError otherwise, before anything is
    saved)."""
    if resumed:
        return load_tokenizer(find_tokenizer(run_dir), cfg.model.vocab_size)
    if source is None:
        tokenizer = build_tokenizer(cfg.data, cfg.model.vocab_size, exits.check)
    else:
        tokenizer = source.tokenizer
        given = cfg.data.tokenizer and build_tokenizer(cfg.data, cfg.model.vocab_size)
        if given and given.sha256 != tokenizer.sha256:
            raise ValueError(f"data.tokenizer {cfg.data.tokenizer} is not the tokenizer of "
                             f"run.init_from {source.directory} (SHA-256 differs): leave "
                             f"data.tokenizer null to use that run's")
    if jax.process_index() == 0:
        tokenizer.save(files.join(run_dir, tokenizer.file_name))
    return tokenizer


def validation_missing(cfg: TrainConfig, step: int) -> bool:
    """Whether resume step `step` had a periodic validation due that metrics.jsonl lacks (a run
    stopped at that step, or during its validation, saves the step but not the validation)."""
    return (cfg.data.has_validation and 0 < step < cfg.run.steps
            and step % cfg.run.eval_every == 0
            and logged_values(cfg.run.dir, step, "eval") is None)
