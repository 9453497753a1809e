"""The run's configuration: `model`, `data`, `optimizer`, `mesh` and `run` sections of one YAML
file (which may inherit from another through `base:`, see `cem_jax.config_files.load_yaml`), with
`section.key=value` overrides, validated (each error names the field) and saved resolved as
`config.yaml` in the run directory.

    cfg = load_config("configs/shakespeare_cem.yaml", ["run.steps=20", "optimizer.lr=3e-3"])
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from cem_jax.config import ModelConfig
from cem_jax.config_files import (
    UnknownFieldError,
    apply_overrides,
    check_field_types,
    check_module_names,
    from_dict,
    import_modules,
    load_yaml,
    naming_the_file,
    require,
)
from cem_jax.data import DataConfig, files
from cem_jax.data.config import with_vocab_size


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW with linear warmup then cosine decay, global-norm clipping.

    lr: peak learning rate, reached after `warmup_steps`; it then decays along a cosine to
      `lr * min_lr_ratio` at `run.steps`. b1, b2, eps: Adam's moments. weight_decay: decoupled
      decay on matrices only (not on norms, biases, DPLR diagonals or preconditioner
      parameters). clip_norm: global gradient-norm clip (0 or null = off; null is read as 0).
    accumulation_steps: micro-batches per step (the global batch is split into this many and
      their gradients averaged inside one compiled step).
    """

    lr: float = 1e-2
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0
    accumulation_steps: int = 1

    def __post_init__(self):
        check_field_types(self)
        if self.clip_norm is None:
            object.__setattr__(self, "clip_norm", 0.0)  # off, as 0 is
        require(self.lr > 0, "lr", self.lr, "> 0")
        require(self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", self.min_lr_ratio, "in [0, 1]")
        for name in ("b1", "b2"):
            require(0 <= getattr(self, name) < 1, name, getattr(self, name), "in [0, 1)")
        for name in ("eps", "weight_decay"):
            require(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        require(self.clip_norm >= 0, "clip_norm", self.clip_norm,
                ">= 0 (0 or null turns clipping off)")
        require(self.accumulation_steps >= 1, "accumulation_steps", self.accumulation_steps,
                 "a positive integer")


class MeshAxis(NamedTuple):
    """One axis of the device mesh: its name (a field of `MeshConfig`), whether the rows of
    batches are split over it, the logical axes of weights it shards (the rules of
    `cem_jax.sharding.LOGICAL_RULES`), and whether it spans slices (its collectives, and only
    its, cross the data-center network between slices: the gradient all-reduce of data
    parallelism)."""

    name: str
    splits_batch: bool
    shards: tuple[str, ...]
    spans_slices: bool = False


# The mesh axes in mesh order: a new axis is a row here and a field of `MeshConfig`.
MESH_AXIS_TABLE = (
    MeshAxis("data", splits_batch=True, shards=(), spans_slices=True),
    MeshAxis("fsdp", splits_batch=True, shards=("embed",)),
    MeshAxis("tensor", splits_batch=False, shards=("vocab", "heads", "kv_heads", "mlp")),
)
MESH_AXES = tuple(axis.name for axis in MESH_AXIS_TABLE)
BATCH_AXES = tuple(axis.name for axis in MESH_AXIS_TABLE if axis.splits_batch)
PARAM_AXES = tuple(axis.name for axis in MESH_AXIS_TABLE if axis.shards)
SLICE_AXIS = next(axis.name for axis in MESH_AXIS_TABLE if axis.spans_slices)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh axes `data` × `fsdp` × `tensor` (one may be -1: all remaining devices).

    Batches are split over data and fsdp; parameters are sharded over fsdp (their "embed"
    axis) and tensor ("heads", "kv_heads", "mlp", "vocab"), see `cem_jax.sharding`.
    `num_slices`: TPU slices joined by the data-center network (DCN, multislice); `data` spans
    them (each slice holds data / num_slices of it, its devices contiguous along data) and
    fsdp and tensor stay inside a slice, so only data parallelism's gradient all-reduce crosses
    the slower network (MaxText's `dcn_data_parallelism`).
    Multi-host: `coordinator_address` ("host:port"), `num_processes` and `process_id` are passed
    to `jax.distributed.initialize`; with `distributed: true` and them left null, JAX finds them
    in the cluster's environment (TPU pods, SLURM, ...). `distributed: false` (default) runs
    one process. JAX's coordination service (in process 0) bounds how a lost process ends the
    others (`jax.distributed.initialize`'s timeouts, seconds): heartbeat_timeout_s, a process
    silent for this long is dead (a SIGKILL, a host gone, a stalled one) and every other one
    ends, status 75 (docs/training.md, "When a host fails"); initialization_timeout_s, how long
    the processes wait for each other at the start; shutdown_timeout_s, how long a process
    that ends waits for the others at the end.
    """

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    num_slices: int = 1
    distributed: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout_s: int = 30
    initialization_timeout_s: int = 300
    shutdown_timeout_s: int = 60

    def __post_init__(self):
        check_field_types(self)
        for name, size in zip(MESH_AXES, self.sizes(), strict=True):
            require(size == -1 or size >= 1, name, size, "a positive integer or -1")
        require(self.num_slices >= 1, "num_slices", self.num_slices, "a positive integer")
        for name in ("heartbeat_timeout_s", "initialization_timeout_s", "shutdown_timeout_s"):
            require(getattr(self, name) >= 1, name, getattr(self, name),
                    "a positive number of seconds")
        free = [name for name, size in zip(MESH_AXES, self.sizes(), strict=True) if size == -1]
        if len(free) > 1:
            require(False, free[1], -1, f"a positive integer, since {free[0]} is -1 already "
                    "(one axis takes the devices the others leave)")

    def sizes(self) -> tuple[int, ...]:
        """The axes' sizes as configured, in `MESH_AXES` order (-1: the remaining devices)."""
        return tuple(getattr(self, name) for name in MESH_AXES)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the loop does and where it writes.

    dir: the run directory (config, tokenizer, metrics, checkpoints); an existing one with a
      checkpoint is resumed. A local path (a leading `~` is the home directory) or a bucket's
      URL, `gs://bucket/runs/x` (orbax writes the checkpoints there itself; docs/pod_training.md
      says how each file is kept there); no '[' or ']' in its path
      (`cem_jax.checkpoint.checkpoint_directory`). steps: optimizer steps in all.
      seed: parameter init seed.
    init_from / init_step: start a new run from the parameters of the run directory
      `init_from` at its checkpoint `init_step` (null: its newest), as nanoGPT's `init_from`
      does: the same model section (the fields of `cem_jax.config.NOT_IN_MATH` aside) and that
      run's tokenizer (a `data.tokenizer` given must be the same file), a fresh optimizer state
      from step 0, any data and optimizer. Only for a new run: a run directory that has a
      checkpoint resumes from it.
    compilation_cache / compilation_cache_dir: keep compiled steps in JAX's persistent cache so
      that a restart skips the compile (`cem_jax.compilation_cache`), in compilation_cache_dir
      (a local path or a gs:// URL; null: `<data cache>/xla`).
    log_every / eval_every / checkpoint_every: in steps (eval and checkpoint also at the end).
    eval_batches: validation batches per evaluation (null: the whole split, exact bits per byte).
    keep_checkpoints: the newest K kept. peak_flops: the device's peak FLOP/s for MFU (null:
      a table for TPU/GPU kinds, a measured jitted matmul on CPU).
    sample_tokens / sample_prompt / sample_temperature: the sample printed at the end (0 =
      greedy).
    progress: show a tqdm progress bar.
    save_timeout_s: a checkpoint save still unfinished after this many seconds, or three
      times the longest save before it if that is longer, is abandoned and the process ends
      with status 75 (its storage gone: TensorStore would retry for many minutes); the newest
      complete checkpoint stays the one a relaunch resumes from (`cem_jax.train.watchdog`).
    profile_start / profile_steps / profile_all_processes: a `jax.profiler` trace of steps
      profile_start … profile_start + profile_steps - 1 (1-based optimizer steps; null: none),
      on process 0 only unless profile_all_processes, in `dir`/tensorboard/plugins/profile
      (`cem_jax.train.hooks.Profile`).
    wandb_project / wandb_entity / wandb_mode: also log the metrics and the config to Weights &
      Biases, project `wandb_project` (null: off) of `wandb_entity` (null: the account's
      default), "online" or "offline" (files under `dir`/wandb for `wandb sync`); needs the
      extra `wandb` (`cem_jax.train.metrics.open_wandb_run`).
    """

    dir: str = "runs/default"
    steps: int = 1500
    seed: int = 0
    init_from: str | None = None
    init_step: int | None = None
    compilation_cache: bool = True
    compilation_cache_dir: str | None = None
    log_every: int = 10
    eval_every: int = 250
    eval_batches: int | None = None
    checkpoint_every: int = 250
    keep_checkpoints: int = 3
    peak_flops: float | None = None
    sample_tokens: int = 200
    sample_prompt: str = "ROMEO:"
    sample_temperature: float = 0.8
    progress: bool = True
    save_timeout_s: float = 60.0
    profile_start: int | None = None
    profile_steps: int = 3
    profile_all_processes: bool = False
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_mode: str = "online"

    def __post_init__(self):
        check_field_types(self)
        require(self.dir.strip() != "", "dir", self.dir, "a non-empty path")
        object.__setattr__(self, "dir", files.local(self.dir))  # `~` as a shell would
        require(not files.is_url(self.dir) or self.dir.startswith("gs://"), "dir", self.dir,
                "a local path or a gs:// URL (a run directory on other storage: mount it)")
        for name in ("steps", "log_every", "eval_every", "checkpoint_every",
                     "keep_checkpoints", "profile_steps"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "a positive integer")
        require(self.eval_batches is None or self.eval_batches >= 1, "eval_batches",
                 self.eval_batches, "a positive integer or null")
        require(self.init_step is None or self.init_step >= 0, "init_step", self.init_step,
                "a checkpoint step (>= 0) of run.init_from, or null (its newest)")
        require(self.init_step is None or self.init_from is not None, "init_step",
                self.init_step, "null unless run.init_from names the run to start from")
        if self.init_from is not None:
            object.__setattr__(self, "init_from", files.local(self.init_from))
            require(not files.is_url(self.init_from) or self.init_from.startswith("gs://"),
                    "init_from", self.init_from, "a local path or a gs:// URL")
        require(self.profile_start is None or self.profile_start >= 1, "profile_start",
                self.profile_start, "a positive step number or null (no profile)")
        require(self.wandb_mode in ("online", "offline"), "wandb_mode", self.wandb_mode,
                "one of 'online', 'offline'")
        require(self.sample_tokens >= 0, "sample_tokens", self.sample_tokens, ">= 0")
        require(self.save_timeout_s > 0, "save_timeout_s", self.save_timeout_s,
                "a positive number of seconds")
        require(self.sample_temperature >= 0, "sample_temperature", self.sample_temperature,
                 ">= 0")
        require(self.peak_flops is None or self.peak_flops > 0, "peak_flops", self.peak_flops,
                "a positive FLOP/s figure, or null (measured or from the device table)")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "optimizer": OptimizerConfig,
            "mesh": MeshConfig, "run": RunConfig}
TOP_LEVEL_KEYS = ("expected_params", "imports")  # plain values beside the sections
# Fields of configs that earlier versions wrote (a run directory's config.yaml) and that no
# longer exist: read and dropped. The debug_* fields injected test faults (tests/faults.py
# does, from outside the product).
RETIRED = {"run": ("debug_nan_step", "debug_signal_step", "debug_signal")}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """All sections of a run; `__post_init__` checks what spans sections, and gives a null
    `data.vocab_size` of a tokenizer to train the model's `vocab_size` (`with_vocab_size`).
    The model's vocabulary must hold the tokenizer's ids: a trained tokenizer's size
    (`data.vocab_size`) is checked here, a given one's when it is loaded.

    expected_params: optional top-level key, the model's exact total parameter count (as
      `cem_jax.model.count_params` gives it). `cem-train` (and `--dry-run`) compares it with
      the model built from the `model` section before anything else and stops with both
      numbers on a mismatch (`cem_jax.train.sizing.check_expected_params`); null: no check.
    imports: optional top-level key, the modules imported before the sections are read (your
      own code: an activation of `cem_jax.energies.register_activation`, say; importable
      module names, as `import` takes them). Reading the config (cem-train, a resume,
      `load_run`, cem-eval, cem-sample, cem-export) runs their code, in every process and
      wherever the run is read: keep them installed or on PYTHONPATH there
      (`cem_jax.config_files.import_modules`).
    """

    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    mesh: MeshConfig
    run: RunConfig
    expected_params: int | None = None
    imports: tuple[str, ...] = ()

    def __post_init__(self):
        check_module_names(self.imports)
        ok = self.expected_params is None or (isinstance(self.expected_params, int)
                                              and not isinstance(self.expected_params, bool)
                                              and self.expected_params >= 1)
        require(ok, "expected_params", self.expected_params, "a positive integer or null")
        object.__setattr__(self, "data", with_vocab_size(self.data, self.model.vocab_size))
        if self.data.tokenizer is None and self.data.vocab_size > self.model.vocab_size:
            raise ValueError(f"data.vocab_size = {self.data.vocab_size} is larger than "
                             f"model.vocab_size = {self.model.vocab_size}: the model must hold "
                             f"every id of the tokenizer trained; lower data.vocab_size (or "
                             f"leave it null: the model's) or raise model.vocab_size")
        if self.data.batch_size % self.optimizer.accumulation_steps:
            raise ValueError(f"data.batch_size = {self.data.batch_size} is not divisible by "
                             f"optimizer.accumulation_steps = "
                             f"{self.optimizer.accumulation_steps}")

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict of every field (the resolved config)."""
        return {**{name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS},
                "expected_params": self.expected_params, "imports": list(self.imports)}


def config_from_dict(values: dict[str, Any]) -> TrainConfig:
    """Nested dict → `TrainConfig` (`RETIRED` fields dropped); unknown sections or fields raise
    `ValueError`."""
    unknown = set(values) - set(SECTIONS) - set(TOP_LEVEL_KEYS)
    if unknown:
        raise UnknownFieldError(min(unknown), f"unknown config section(s) {sorted(unknown)} "
                                f"(known: {', '.join(SECTIONS)}; top-level keys: "
                                f"{', '.join(TOP_LEVEL_KEYS)})")
    imports = tuple(check_module_names(values.get("imports") or []))
    import_modules(imports)  # first: the sections may name what they register
    sections = {name: {k: v for k, v in (values.get(name) or {}).items()
                       if k not in RETIRED.get(name, ())} for name in SECTIONS}
    return TrainConfig(**{name: from_dict(cls, sections[name], section=name)
                          for name, cls in SECTIONS.items()},
                       expected_params=values.get("expected_params"), imports=imports)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Read YAML `path` (None: all defaults, which train what configs/shakespeare_cem.yaml and
    `make train` do, in runs/default; its `base:` chain resolved) and apply `section.key=value`
    overrides.

    Raises FileNotFoundError (no such file or base) or ValueError (bad YAML, a cycle of bases,
    an unknown or invalid field: one set in a file names the file of the chain that sets it).
    """
    if path is not None and files.is_url(str(path)):  # a run directory's config.yaml
        return config_from_dict(apply_overrides(_read_url_yaml(str(path)), list(overrides),
                                                SECTIONS))
    values = load_yaml(path) if path is not None else {}
    with naming_the_file(path, overrides):
        return config_from_dict(apply_overrides(values, list(overrides), SECTIONS))


def _read_url_yaml(url: str) -> dict[str, Any]:
    """A YAML config file at a URL (no `base:` there: a resolved config holds none)."""
    try:
        values = yaml.safe_load(files.read_text(url)) or {}
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        raise ValueError(f"config file {url!r} is not valid UTF-8 YAML: {err}") from err
    if not isinstance(values, dict) or "base" in values:
        raise ValueError(f"config file {url!r} must hold a mapping without base: (a config on a "
                         f"bucket is a resolved one; keep configs with bases on a local disk)")
    return values


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (loadable by `load_config`), whole, locally or to a
    URL (`cem_jax.data.files.write_text`)."""
    files.write_text(str(path), yaml.safe_dump(cfg.to_dict(), sort_keys=False))
