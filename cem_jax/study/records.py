"""The study's per-run files: one JSON per run (`RunKey.label`.json in the study's `records`
folder, committed), written once its run is trained (`train_and_record`) and read back by the
report (`read_records`). A run whose file exists is never trained again.

A record holds:
  name, lr, steps, seed, config (the file), cem_train_args (after --config): what ran;
  resolved_config: the run's config.yaml as cem-train resolved it (every field);
  data: the tokenizer's SHA-256 and, per split ("train", "validation", and "milton" for the
    reported runs), its tokenized dataset's identity (the manifest's hash of source,
    tokenizer and layout) with its description, documents, tokens and bytes;
  eval_split: "validation", or "selection" for a run validated on the selection works
    (`data.selection=validation`): what `val` and `val_curve` measure;
  status: "ok" or "diverged" (cem-train stopped on a non-finite loss, exit status 3);
  params, training_flops: of the config (analytic `flops_per_token` × tokens);
  val: the final validation {"loss" (nats/token), "perplexity", "bits_per_byte"} (whole
    split); null for a run that diverged;
  val_curve: [[step, bits per byte]] of every evaluation;
  train_loss, grad_norm: per logged step, [[step, value]] (6 and 4 significant digits; null
    where non-finite);
  tokens_per_s: median over the training log windows after the first tenth of the steps;
  wall_s: of the cem-train processes;
  ood_bits_per_byte, ood_loss: on the out-of-domain text ("milton"), bits per byte and nats
    per token — the reported runs only (not a sweep's);
  descent, descent_init: for a config with a tied sub-layer, the reported runs only, the
    energy descent statistics on the first validation batches of the trained parameters and
    of the same seed's initial ones (`cem_jax.monitor.descent_statistics`);
  ran: {"date" (UTC, of its last step), "machine", "cores", "backend", "commit", and the
    versions of jax, jaxlib, flax, optax, orbax-checkpoint, grain and numpy};
  completed (only in a record completed after it was written, `complete_record`): {"commit"
    and "date" of the completion, "fields" it added}.

The runs of records written since `resolved_config` came in were trained from a clean tree:
cem-study refuses to train one from a tree whose tracked files other than its own outputs
differ from its commit (`dirty_tree`), so each record's commit is the code that trained it
(earlier records may name a "-dirty" commit).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import yaml
from flax import nnx

from cem_jax.compare.report import param_counts, step_flops
from cem_jax.compare.runs import RunSpec, read_metrics, train_one
from cem_jax.data import files, find_tokenizer, load_tokenizer, load_tokens, make_eval_batches
from cem_jax.data.shards import read_manifest
from cem_jax.evaluate import bits_per_byte_of, evaluate_run
from cem_jax.exits import ExitStatus
from cem_jax.fileio import atomic_file
from cem_jax.model import CEMTransformer
from cem_jax.monitor import descent_statistics
from cem_jax.rundir import load_run
from cem_jax.study.plan import FIGURES, RunKey, Study, figure_path, rate_text
from cem_jax.train.metrics import logged_records

DESCENT_BATCHES = 4
VERSIONS = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "numpy")


def record_path(study: Study, key: RunKey) -> Path:
    return study.records / f"{key.label}.json"


def read_records(study: Study) -> dict[RunKey, dict]:
    """Every record in the study's folder, by run. Raises ValueError naming a file that is not
    a record, or one that another study made: a config file or cem-train arguments other than
    those the study now gives its run (`run_spec`)."""
    found = {}
    configs = study.all_configs()
    for path in sorted(study.records.glob("*.json")):
        try:
            rec = json.loads(path.read_text())
            problem = _malformed(rec)
        except ValueError as err:
            problem = f"{type(err).__name__}: {err}"
        if problem:
            raise ValueError(f"{path} is not a run's record ({problem}); delete it to record "
                             "that run again (a finished run directory is reused, not trained "
                             "again)")
        key = RunKey(rec["name"], rec["lr"], rec["steps"], rec["seed"])
        if path.name != f"{key.label}.json":
            raise ValueError(f"{path} holds the record of {key.label}: rename it "
                             f"{key.label}.json or delete it")
        if key.name in configs:
            differs = _made_otherwise(rec, configs[key.name].file, list(run_spec(study, key).args))
            if differs:
                raise ValueError(f"{path} was made by another study ({differs}): move the file "
                                 f"out of {study.records} to train the run again, or restore "
                                 "the study")
        found[key] = rec
    return found


def _of(kind: type) -> Callable[[object], bool]:
    return lambda value: isinstance(value, kind) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return _of(int | float)(value) and math.isfinite(value)


def _is_curve(value) -> bool:
    """[[step, value or null], ...]"""
    return isinstance(value, list) and all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and
        (p[1] is None or _is_number(p[1])) for p in value)


def _is_descent(value) -> bool:
    """{sub-layer: {"down": [[fraction per layer], ...]}, ...}"""
    return isinstance(value, dict) and all(
        isinstance(v, dict) and isinstance(v.get("down"), list) for v in value.values())


# What the report reads of a record (the module docstring), as checks of its value; a mapping
# is a field with fields of its own.
_FIELDS = {"name": _of(str), "lr": _is_number, "steps": _of(int), "seed": _of(int),
           "config": _of(str), "cem_train_args": _of(list),
           "status": lambda v: v in ("ok", "diverged"), "params": _of(int),
           "training_flops": _is_number, "val": lambda v: v is None or isinstance(v, dict),
           "val_curve": _is_curve, "train_loss": _is_curve, "grad_norm": _is_curve,
           "tokens_per_s": lambda v: v is None or _is_number(v), "wall_s": _is_number,
           "ran": {"date": _of(str), "commit": _of(str)}}
_VAL = {"bits_per_byte": _is_number}
_MEASURES = {"ood_bits_per_byte": _is_number, "ood_loss": _is_number, "descent": _is_descent,
             "descent_init": _is_descent, "descent_tokens": _of(int),  # reported runs only
             "completed": {"commit": _of(str), "date": _of(str), "fields": _of(list)}}


def _malformed(rec) -> str:
    """What makes `rec` no record ("" when nothing): a field missing or of the wrong kind."""
    if not isinstance(rec, dict):
        return f"a {type(rec).__name__}, not a mapping of fields"
    problem = _wrong(rec, _FIELDS) or _wrong(rec, _MEASURES, optional=True)
    if problem or rec["val"] is None:
        return problem or ("val is null though status is ok" if rec["status"] == "ok" else "")
    return _wrong(rec["val"], _VAL, "val.")


def _wrong(fields: dict, checks: dict, prefix: str = "", optional: bool = False) -> str:
    """The first of `checks` that `fields` lacks (unless `optional`) or fails, in words."""
    for name, check in checks.items():
        if name not in fields:
            if optional:
                continue
            return f"no field {prefix + name!r}"
        value = fields[name]
        if isinstance(check, dict) and isinstance(value, dict):
            problem = _wrong(value, check, f"{prefix}{name}.")
            if problem:
                return problem
        elif isinstance(check, dict) or not check(value):
            return f"{prefix}{name} is {json.dumps(value)[:60]}"
    return ""


def _made_otherwise(rec: dict, config: str, args: list[str]) -> str:
    """How the record's config file and cem-train arguments differ from `config` and `args`
    ("" when they do not)."""
    if rec.get("config") != config:
        return f"config {rec.get('config')}, the study now gives {config}"
    made = rec.get("cem_train_args")
    if not isinstance(made, list) or made == args:
        return "" if made == args else f"cem_train_args {made!r}, not a list"
    old, new = [a for a in made if a not in args], [a for a in args if a not in made]
    if not old and not new:
        return f"the same arguments in another order: {' '.join(made)}"
    return (f"cem-train arguments only in the record: {' '.join(old) or 'none'}; only in the "
            f"study now: {' '.join(new) or 'none'}")


def run_spec(study: Study, key: RunKey) -> RunSpec:
    """The cem-train run of `key`: in RUNS_DIR/lr<rate>/<name>/steps<N>_seed<s>, with the
    study's overrides, the sweep's (a sweep run), the config's own (a size of the trend) and
    optimizer.lr."""
    config = study.all_configs()[key.name]
    sweep = study.is_sweep(key)
    eval_every = study.sweep_eval_every if sweep else study.eval_every
    overrides = [*study.overrides, *(study.sweep_overrides if sweep else ()), *config.overrides,
                 f"optimizer.lr={key.lr}"]
    return RunSpec.make(key.name, config.file, key.steps, key.seed, eval_every,
                        files.join(study.runs_dir, f"lr{rate_text(key.lr)}"), overrides)


def train_and_record(study: Study, key: RunKey) -> tuple[dict | None, dict]:
    """Train (or resume) the run of `key` and write its record; returns (the record, or None
    when the run neither finished nor diverged, and `train_one`'s row: its "note" says why,
    its "stopped" whether a signal stopped it)."""
    spec = run_spec(study, key)
    row = train_one(spec, "cem-study")
    if not row["ok"] and row.get("status") != ExitStatus.DIVERGED:
        return None, row
    rec = _record(study, key, spec, row)
    _write(study, key, rec)
    return rec, row


def _write(study: Study, key: RunKey, rec: dict) -> None:
    with atomic_file(record_path(study, key)) as f:
        f.write(("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in rec.items())
                 + "\n}\n").encode())  # a field a line


def lacks_measures(study: Study, key: RunKey, rec: dict) -> bool:
    """Whether the record of a reported run that finished lacks the measures of one
    (`_measure_reported`): a record written when they were taken only of runs whose steps were
    not the sweep's, though the sweep now runs at the reported budget."""
    return rec["status"] == "ok" and not study.is_sweep(key) and "ood_bits_per_byte" not in rec


def complete_record(study: Study, key: RunKey, rec: dict) -> dict:
    """Add to the record of a finished reported run the measures it lacks (`lacks_measures`),
    taken from the final checkpoint in its run directory as `_record` takes them, with
    `completed`: {"commit" (`code_commit`), "date", "fields"}; rewrites its file and returns
    it. Raises FileNotFoundError or ValueError when the run directory, or its final checkpoint,
    is gone (train the run again: delete the record)."""
    spec = run_spec(study, key)
    try:
        measures, milton = _measure_reported(spec.cfg, spec.cfg.run.dir, key.steps)
    except (FileNotFoundError, ValueError) as err:
        raise type(err)(f"cannot complete {record_path(study, key)} from its run directory "
                        f"({err}); delete the record to train the run again") from None
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    done = {**rec, "data": {**rec["data"], "milton": milton}, **measures,
            "completed": {"commit": code_commit(outputs=outputs(study)), "date": date,
                          "fields": ["data.milton", *measures]}}
    _write(study, key, done)
    return done


def _record(study: Study, key: RunKey, spec: RunSpec, row: dict) -> dict:
    cfg, run_dir = spec.cfg, row["dir"]
    config = study.all_configs()[key.name]
    train = {r["step"]: r for r in logged_records(run_dir) if r["kind"] == "train"}
    rec = {"name": key.name, "lr": key.lr, "steps": key.steps, "seed": key.seed,
           "config": config.file, "cem_train_args": list(spec.args),
           "resolved_config": yaml.safe_load(files.read_text(files.join(run_dir,
                                                                        "config.yaml"))),
           "data": _data_identity(run_dir, cfg),
           "eval_split": "selection" if cfg.data.selection == "validation" else "validation",
           "status": "ok" if row["ok"] else "diverged",
           "params": param_counts(cfg)["total"], "training_flops": key.steps * step_flops(cfg),
           "val": {k: row["eval"][k] for k in ("loss", "perplexity")} if row["ok"] else None,
           "val_curve": [[s, v] for s, v in read_metrics(run_dir, cfg)["curve"]],
           "train_loss": [[s, _finite(r.get("loss"), 6)] for s, r in sorted(train.items())],
           "grad_norm": [[s, _finite(r.get("grad_norm"), 4)] for s, r in sorted(train.items())],
           "tokens_per_s": _finite(row["tokens_per_s"]), "wall_s": row["wall_s"],
           "ran": _ran(max(r["time"] for r in train.values()), outputs(study))}
    if row["ok"]:
        rec["val"]["bits_per_byte"] = bits_per_byte_of(row["eval"])
    if row["ok"] and not study.is_sweep(key):
        measures, rec["data"]["milton"] = _measure_reported(cfg, run_dir, key.steps)
        rec.update(measures)
    return rec


def _measure_reported(cfg, run_dir: str, steps: int) -> tuple[dict, dict]:
    """What a reported run's record holds beyond a sweep run's, measured on the checkpoint of
    step `steps` in `run_dir`: ({"ood_bits_per_byte", "ood_loss"} and, for a config with a
    tied sub-layer, {"descent", "descent_init", "descent_tokens"}; Milton's data identity).
    Raises ValueError when the newest checkpoint is not of step `steps`."""
    run = load_run(run_dir)
    if run.step != steps:
        raise ValueError(f"its newest checkpoint is of step {run.step}, not {steps}")
    ood = evaluate_run(run, corpus="milton", progress=False)
    found = {"ood_bits_per_byte": bits_per_byte_of(ood), "ood_loss": ood["loss"]}
    if cfg.model.kinds != ("llama_attention", "swiglu"):
        data = make_eval_batches(cfg.data, run.tokenizer, "validation")
        sample = [data[i] for i in range(min(DESCENT_BATCHES, len(data)))]
        init = nnx.to_pure_dict(nnx.state(CEMTransformer(cfg.model,
                                                         rngs=nnx.Rngs(cfg.run.seed))))
        found["descent"] = _json(descent_statistics(cfg.model, run.params, sample))
        found["descent_init"] = _json(descent_statistics(cfg.model, init, sample))
        found["descent_tokens"] = int(sum(np.sum(b["weights"] > 0) for b in sample))
    return found, _split_identity(cfg, run.tokenizer, "milton")


def _data_identity(run_dir: str, cfg) -> dict:
    """The tokenizer's SHA-256 and the train and validation splits' dataset identity and size
    (module docstring)."""
    tokenizer = load_tokenizer(find_tokenizer(run_dir))
    return {"tokenizer_sha256": tokenizer.sha256,
            **{split: _split_identity(cfg, tokenizer, split) for split in ("train", "validation")}}


def _split_identity(cfg, tokenizer, split: str) -> dict:
    tokens = load_tokens(cfg.data, tokenizer, split)
    return {"identity": read_manifest(tokens.root).identity, "description": tokens.description,
            "documents": tokens.stats.documents, "tokens": tokens.stats.tokens,
            "bytes": tokens.stats.bytes}


def outputs(study: Study) -> tuple[Path, ...]:
    """What cem-study writes into the code's tree: the folder of the study's records, and its
    report with the figures beside it (`FIGURES`)."""
    return (study.records, study.report,
            *(figure_path(study.report, name) for name in FIGURES))


def dirty_tree(code: Path = Path(__file__).parent, outputs: tuple[Path, ...] = ()) -> str:
    """Why the tree holding `code` (this package) cannot record runs: tracked files other than
    the study's own `outputs` (those files, and what lies in those folders: its records, its
    report and figures) differ from its commit ("" when none do; a tree that is not a git
    checkout says so). The study file itself is code: a plan edited after its runs is not
    theirs."""
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                                  cwd=code).stdout

        root = Path(git("rev-parse", "--show-toplevel").strip())
        lines = git("status", "--porcelain", "--untracked-files=no").split("\n")
    except (OSError, subprocess.CalledProcessError):
        return (f"the code in {code} is not in a git checkout, so a record could not name the "
                "commit that trained it")
    mine = [p.resolve() for p in outputs]
    changed = [line[3:] for line in lines if line.strip()
               and not any((root / line[3:]).resolve().is_relative_to(p) for p in mine)]
    verb = "differs" if len(changed) == 1 else "differ"
    return (f"{len(changed)} tracked file{'s' * (len(changed) != 1)} {verb} from the commit "
            f"({', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}): commit or stash "
            "them, so that each record names the code that trained its run") if changed else ""


def _json(stats: dict) -> dict:
    return {kind: {k: np.asarray(v).tolist() for k, v in s.items()} for kind, s in stats.items()}


def _finite(value, digits: int = 17) -> float | None:
    """`value` to `digits` significant digits; None if missing or not finite."""
    return float(f"{value:.{digits}g}") if value is not None and math.isfinite(value) else None


def code_commit(code: Path = Path(__file__).parent, outputs: tuple[Path, ...] = ()) -> str:
    """The commit of the tree holding `code` (`git describe --always`; "unknown" outside a git
    checkout), with "-dirty" when tracked files other than the study's `outputs` differ from
    it (`dirty_tree`: the report cem-study rewrites is not code)."""
    try:
        commit = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True,
                                check=True, cwd=code).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + "-dirty" * bool(dirty_tree(code, outputs))


def _ran(finished: float, written: tuple[Path, ...]) -> dict:
    """Where and when the run ran: `finished` (UNIX time of its last training step), this
    machine, JAX and the code's commit when the record is written (`code_commit`, the study
    having written `written`)."""
    commit = code_commit(outputs=written)
    date = datetime.datetime.fromtimestamp(finished, datetime.UTC)
    return {"date": date.strftime("%Y-%m-%d %H:%M UTC"),
            "machine": _cpu() or platform.machine(), "cores": os.cpu_count(),
            "jax": jax.__version__, "backend": jax.default_backend(), "commit": commit,
            "versions": {name: _version(name) for name in VERSIONS}}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu() -> str:
    """The CPU's name with its family and model numbers ("AMD EPYC, family 23, model 1"): a
    virtual machine may show only the vendor's name, the same for CPUs of different speeds."""
    try:
        info = dict(line.split(":", 1) for line in
                    Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                    if ":" in line)
    except OSError:
        return ""
    info = {k.strip(): v.strip() for k, v in info.items()}
    numbers = [f"family {info['cpu family']}"] if "cpu family" in info else []
    numbers += [f"model {info['model']}"] if "model" in info else []
    name = info.get("model name", "")
    return ", ".join([name, *numbers]) if name else ""
