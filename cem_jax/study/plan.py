"""The study's specification (`Study`, read from its YAML file by `load_study`) and the runs it
asks for once the runs already recorded are known (`plan`).

A run is one config name ("shakespeare_cem", or "shakespeare_cem-d48" for a config at a size of
the trend) trained at one learning rate for some steps with one seed (`RunKey`). The plan, in
the order it trains:

1. the learning-rate sweep: every config at each rate of `sweep.rates` (one grid, or a grid
   per config) for `sweep.steps` with `sweep.seed` and `sweep.overrides`; while the best rate
   is an edge of the rates tried, the next rate beyond it (the grid's ratio at that edge), up
   to `sweep.extend` rates added in all (the report marks a best rate still at an edge);
2. the seeds: every config at its best rate for `main.steps`, seeds 0..n-1 in rounds (seed 0
   of every config, then seed 1, ...), n from the power calculation (`Study.seeds`);
3. equal FLOPs: each config of `flops_configs` for round(main.steps · F_baseline / F_config)
   steps (F: training FLOPs per step, analytic), the same seeds;
4. the size trend: the sweep of each config of `sizes.configs` at each other size, then each
   at each size at its best rate, `sizes.seeds` seeds (at the configs' own size, the runs of
   2. are reused).

The best rate of a config is the rate of its lowest final validation bits per byte among its
sweep runs (the split the sweep's runs validate on: the reported one, unless `sweep.overrides`
choose another, e.g. `data.selection=validation`); a config whose sweep is not complete has no
best rate yet, and none of its later runs are planned. A sweep at the study's own steps uses a
seed none of its reported runs use, so its runs stay apart from them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path

import yaml


@dataclasses.dataclass(frozen=True, order=True)
class RunKey:
    """One run: config `name`, learning rate `lr`, `steps`, `seed`."""

    name: str
    lr: float
    steps: int
    seed: int

    @property
    def label(self) -> str:
        """The run's file stem: "shakespeare_cem_lr1e-2_steps1500_seed0"."""
        return f"{self.name}_lr{rate_text(self.lr)}_steps{self.steps}_seed{self.seed}"


@dataclasses.dataclass(frozen=True)
class Config:
    """A config of the study: `file` (YAML), its `parent` (the config it ablates, compared with
    it as well as with the baseline), and `overrides` (a size of the trend)."""

    name: str
    file: str
    parent: str | None = None
    overrides: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Study:
    """The study of one YAML file (docs/study/study.yaml and docs/study/tied_vs_llama.yaml say
    what each field means)."""

    path: Path
    records: Path
    runs_dir: str  # a local folder or a bucket's URL
    report: Path
    margin: float
    alpha: float
    power: float
    planning_sd: float
    min_seeds: int
    baseline: str
    control: str | None  # the baseline with the CEM rows' preconditioner, if the study has one
    configs: dict[str, Config]
    overrides: tuple[str, ...]
    sweep_steps: int
    sweep_eval_every: int
    sweep_seed: int
    rates: dict[str, tuple[float, ...]]  # config name (sizes included) -> its sweep's grid
    extend: int
    steps: int
    eval_every: int
    flops_configs: tuple[str, ...]
    size_configs: tuple[str, ...]
    size_seeds: int
    sizes: dict[str, tuple[str, ...]]  # size label -> overrides (() for the configs as they are)
    note: str = ""  # what the study leaves out, said in its report
    margin_reason: str = ""  # why the margin is what it is, said in the report
    sweep_overrides: tuple[str, ...] = ()  # the sweep's runs only, after `overrides`
    assumed_delta: float = 0.0  # the true |Δ| the seed count is planned for
    primary: tuple[str, str] | None = None  # (row, reference): the study's main question
    primary_named: str = ""  # when the primary comparison was named (said beside it)
    train_tokens: int | None = None  # the training split's tokens, for records that lack it

    @property
    def seeds(self) -> int:
        """Seeds per config: the TOST power calculation for `margin` at `planning_sd` and a
        true difference `assumed_delta`, at least `min_seeds`."""
        from cem_jax.stats import seeds_for_equivalence  # scipy: not for a bad study file

        return max(self.min_seeds, seeds_for_equivalence(
            self.margin, self.planning_sd, self.alpha, self.power, self.assumed_delta))

    def is_sweep(self, key: RunKey) -> bool:
        """Whether `key` is a run of a learning-rate sweep (the sweep's steps and seed), not one
        the study reports."""
        return key.steps == self.sweep_steps and key.seed == self.sweep_seed

    def sized(self, name: str, size: str) -> str:
        """The name of config `name` at `size` ("" is the config itself)."""
        return name if not self.sizes[size] else f"{name}-{size}"

    def all_configs(self) -> dict[str, Config]:
        """The configs and, for each size of the trend but the config's own, the config at it."""
        found = dict(self.configs)
        for size, overrides in self.sizes.items():
            for name in self.size_configs:
                if overrides:
                    found[self.sized(name, size)] = Config(self.sized(name, size),
                                                           self.configs[name].file,
                                                           None, overrides)
        return found


FIELDS = {"margin", "alpha", "power", "planning_sd", "min_seeds", "records", "runs_dir", "report",
          "baseline", "control", "overrides", "configs", "sweep", "main", "sizes", "note",
          "margin_reason", "assumed_delta", "primary", "train_tokens"}
SECTIONS = {"sweep": {"steps", "eval_every", "seed", "rates", "extend", "overrides"},
            "main": {"steps", "eval_every", "flops_configs"},
            "sizes": {"configs", "seeds", "scales"}}
HELP = ("the fields are those of docs/study/study.yaml and docs/study/tied_vs_llama.yaml in "
        "the cem_jax repository (their comments say what each means)")


def _integer(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError
    return value


def _number(value) -> float:
    """A finite float; also from a string (YAML 1.1, which PyYAML reads, takes `1e-2` for
    text). Raises TypeError or ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise TypeError
    if not math.isfinite(number := float(value)):
        raise ValueError
    return number


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError
    return value


def _texts(value) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError
    return tuple(value)


_KIND_WORDS = {_integer: "an integer", _number: "a finite number", _text: "a string",
               _texts: "a list of strings", dict: "a mapping", list: "a list"}


def load_study(path: str | Path) -> Study:
    """The `Study` of a YAML file; raises ValueError naming the file and the missing, unknown
    or wrong field, or the file that is missing or not YAML. Paths in it (configs' files,
    records, runs_dir, report) are relative to the current directory."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist: give the study's YAML file, e.g. "
                         "docs/study/study.yaml")
    try:
        spec = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{path} is not YAML ({getattr(err, 'problem', None) or 'unreadable'}"
                         f"{where}); {HELP}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path} holds no mapping of fields; {HELP}")
    unknown = sorted(set(spec) - FIELDS)
    for section, fields in SECTIONS.items():
        if isinstance(spec.get(section), dict):
            unknown += [f"{section}.{k}" for k in sorted(set(spec[section]) - fields)]
    if unknown:
        raise ValueError(f"{path}: unknown field {unknown[0]!r}; {HELP}")

    def get(dotted: str, kind=_text, check=lambda v: True, rule: str = "", default=None):
        value = spec
        for part in dotted.split("."):
            if not isinstance(value, dict) or (part not in value and default is None):
                raise ValueError(f"{path}: {dotted} is missing; {HELP}")
            value = value.get(part, default)
        try:
            value = kind(value)
        except (TypeError, ValueError):
            raise ValueError(f"{path}: {dotted} is {value!r}, not {_KIND_WORDS[kind]}; "
                             f"{HELP}") from None
        if not check(value):
            raise ValueError(f"{path}: {dotted} is {value!r}; it must be {rule}")
        return value

    positive = (lambda v: v > 0, "> 0")
    fraction = (lambda v: 0 < v < 1, "between 0 and 1")
    entries = get("configs", dict, bool, "a non-empty mapping of name: {file, parent}")
    configs = {}
    for name, entry in entries.items():
        if not isinstance(entry, dict) or "file" not in entry or set(entry) - {"file", "parent"}:
            raise ValueError(f"{path}: configs.{name} must be {{file: ..., parent: ...}} (the "
                             "parent is optional)")
        configs[name] = Config(name, get(f"configs.{name}.file"),
                               get(f"configs.{name}.parent", default="") or None)
        if not Path(configs[name].file).is_file():
            raise ValueError(f"{path}: configs.{name}.file {configs[name].file} does not exist "
                             f"(a study file's paths are relative to the directory cem-study "
                             f"runs in, {Path.cwd()})")
        if configs[name].parent == name:
            raise ValueError(f"{path}: configs.{name} names itself as its parent")
    sizes = {}
    for size, overrides in get("sizes.scales", dict, bool, "a mapping of size: overrides").items():
        try:
            sizes[str(size)] = _texts(overrides or [])
        except TypeError:
            raise ValueError(f"{path}: sizes.scales.{size} is {overrides!r}, not a list of "
                             "overrides (key=value strings)") from None
    rates = _rates(path, spec.get("sweep", {}).get("rates"), [
        *configs, *(f"{name}-{size}" for size, overrides in sizes.items() if overrides
                    for name in spec.get("sizes", {}).get("configs", []))])
    primary = None
    if "primary" in spec:
        entry = spec["primary"]
        if not isinstance(entry, dict) or set(entry) != {"row", "ref", "named"}:
            raise ValueError(f"{path}: primary must be {{row: CONFIG, ref: CONFIG, named: "
                             "WHEN}} (the comparison the study answers, and when it was named)")
        primary = (get("primary.row"), get("primary.ref"))
    study = Study(
        path=path, records=Path(get("records")), runs_dir=str(get("runs_dir")),
        report=Path(get("report")), margin=get("margin", _number, *positive),
        alpha=get("alpha", _number, *fraction), power=get("power", _number, *fraction),
        planning_sd=get("planning_sd", _number, *positive),
        min_seeds=get("min_seeds", _integer, lambda v: v >= 2, ">= 2"),
        baseline=get("baseline"), control=get("control", default="") or None,
        configs=configs, overrides=get("overrides", _texts, default=[]),
        sweep_overrides=get("sweep.overrides", _texts, default=[]),
        assumed_delta=get("assumed_delta", _number, lambda v: v >= 0, ">= 0", default=0.0),
        primary=primary, primary_named=get("primary.named", default="") if primary else "",
        train_tokens=get("train_tokens", _integer, lambda v: v > 0 or "train_tokens" not in spec,
                         "> 0", default=0) or None,
        sweep_steps=get("sweep.steps", _integer, *positive),
        sweep_eval_every=get("sweep.eval_every", _integer, *positive),
        sweep_seed=get("sweep.seed", _integer, lambda v: v >= 0, ">= 0"), rates=rates,
        extend=get("sweep.extend", _integer, lambda v: v >= 0, ">= 0"),
        steps=get("main.steps", _integer, *positive),
        eval_every=get("main.eval_every", _integer, *positive),
        flops_configs=get("main.flops_configs", _texts, default=[]),
        size_configs=get("sizes.configs", _texts), size_seeds=get("sizes.seeds", _integer,
                                                                 *positive),
        sizes=sizes, note=" ".join(get("note", default="").split()),
        margin_reason=" ".join(get("margin_reason", default="").split()))
    if study.assumed_delta >= study.margin:
        raise ValueError(f"{path}: assumed_delta {study.assumed_delta} must be below the margin "
                         f"{study.margin} (no number of seeds shows equivalence at a true "
                         "difference as large as the margin)")
    try:
        seeds = study.seeds
    except ValueError as err:
        raise ValueError(f"{path}: margin, planning_sd, alpha, power and assumed_delta plan no "
                         f"study: {err}") from None
    if study.steps == study.sweep_steps and study.sweep_seed < seeds:
        raise ValueError(f"{path}: sweep.seed {study.sweep_seed} is one of the reported seeds "
                         f"0-{seeds - 1}, and the sweep has their steps: give the sweep "
                         f"a seed >= {seeds} (a run is named by its rate, steps and seed)")
    named = {study.baseline, *([study.control] if study.control else []),
             *study.flops_configs, *study.size_configs, *(primary or []),
             *(c.parent for c in configs.values() if c.parent)}
    unknown = sorted(named - set(configs))
    if unknown:
        raise ValueError(f"{path}: {unknown[0]} is named but is not one of its configs "
                         f"({', '.join(configs)})")
    if primary and primary[0] == primary[1]:
        raise ValueError(f"{path}: primary compares {primary[0]} with itself")
    if study.control == study.baseline:
        raise ValueError(f"{path}: control is the baseline {study.baseline}; it must be another "
                         "config (the baseline with the CEM rows' preconditioner)")
    if study.baseline not in study.size_configs or len(set(study.size_configs)) < 2:
        raise ValueError(f"{path}: sizes.configs must hold the baseline {study.baseline} and "
                         "at least one other config (the trend is their gap)")
    if list(study.sizes.values()).count(()) != 1:
        raise ValueError(f"{path}: sizes.scales needs exactly one size without overrides (the "
                         "configs as they are)")
    return study


def _rates(path: Path, listed, names: list[str]) -> dict[str, tuple[float, ...]]:
    """{config: its sweep's rates, ascending} from `sweep.rates`: one list for every config,
    or a mapping with a list for each of `names` (the configs, and each at each size); raises
    ValueError naming what is missing or not a rate."""
    if listed is None:
        raise ValueError(f"{path}: sweep.rates is missing; {HELP}")
    grids = listed if isinstance(listed, dict) else {name: listed for name in names}
    missing = [name for name in names if name not in grids]
    if missing or set(grids) - set(names):
        wrong = missing[0] if missing else sorted(set(grids) - set(names))[0]
        raise ValueError(f"{path}: sweep.rates {'has no list for' if missing else 'names'} "
                         f"{wrong}; give one list of rates for every config, or a list for "
                         f"each of {', '.join(names)}")
    found = {}
    for name, grid in grids.items():
        try:
            found[name] = tuple(sorted(_number(r) for r in grid))
        except (TypeError, ValueError):
            found[name] = ()
        if not found[name] or min(found[name]) <= 0:
            raise ValueError(f"{path}: sweep.rates {grid!r} must be a list of learning rates "
                             "> 0" + (f" (for {name})" if isinstance(listed, dict) else ""))
    return found


FIGURES = ("sweep", "sweep_curves", "curves", "sizes", "descent")  # the report's, by name


def figure_path(report: Path, name: str) -> Path:
    """Where the report `report` (REPORT.md) keeps its figure `name` (one of `FIGURES`):
    REPORT_name.png beside it."""
    return report.with_name(f"{report.stem}_{name}.png")


def rate_text(lr: float) -> str:
    """A rate as the study writes it in names: 0.01 → "1e-2", 0.0025 → "2.5e-3"."""
    mantissa, exponent = f"{lr:e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def sweep_rates(study: Study, name: str, results: Mapping[float, float | None]
                ) -> list[float]:
    """The rates of config `name`'s sweep given its results so far ({rate: final validation
    bits per byte, None if it diverged}): its grid and, while the best rate is at an edge of
    the rates so far (or every rate diverged: the lower edge), the next rate beyond it by the
    grid's ratio at that edge (×2 or ÷2 for a grid of one rate), up to `extend` rates added in
    all (rounded to 3 significant digits, as a study file would write them)."""
    grid = study.rates[name]
    up = grid[-1] / grid[-2] if len(grid) > 1 else 2.0
    down = grid[1] / grid[0] if len(grid) > 1 else 2.0
    rates = list(grid)
    for _ in range(study.extend):
        if any(r not in results for r in rates):
            break
        best = best_rate(rates, results)
        if best is None:  # every rate diverged
            rates.insert(0, float(f"{rates[0] / down:.3g}"))
        elif best == rates[-1]:
            rates.append(float(f"{rates[-1] * up:.3g}"))
        elif best == rates[0]:
            rates.insert(0, float(f"{rates[0] / down:.3g}"))
        else:
            break
    return rates


def best_rate(rates: list[float], results: Mapping[float, float | None]) -> float | None:
    """The rate of the lowest result among `rates` (a diverged run, None, never wins); None
    until every rate has a result, or if all diverged."""
    if any(r not in results for r in rates):
        return None
    finite = {r: results[r] for r in rates if results[r] is not None}
    return min(finite, key=finite.get) if finite else None


def plan(study: Study, sweeps: Mapping[str, Mapping[float, float | None]],
         flops: Mapping[str, float]) -> list[RunKey]:
    """Every run the study asks for given the sweep results so far (`sweeps[name]`: as
    `sweep_rates`) and each config's training FLOPs per step (`flops[name]`), in training
    order (see the module docstring); runs already recorded are among them."""
    best, sweep = {}, {}
    for name in study.all_configs():
        results = sweeps.get(name, {})
        rates = sweep_rates(study, name, results)
        sweep[name] = [RunKey(name, r, study.sweep_steps, study.sweep_seed) for r in rates]
        best[name] = best_rate(rates, results)
    runs = [k for name in study.configs for k in sweep[name]]
    core = [n for n in study.configs if best[n] is not None]
    for seed in range(study.seeds):
        runs += [RunKey(n, best[n], study.steps, seed) for n in core]
    at_flops = flops_steps(study, flops)
    for seed in range(study.seeds):
        runs += [RunKey(n, best[n], steps, seed) for n, steps in at_flops.items()
                 if best[n] is not None]
    runs += [k for name in sweep if name not in study.configs for k in sweep[name]]
    for seed in range(study.size_seeds):
        for size in study.sizes:
            runs += [RunKey(study.sized(n, size), best[study.sized(n, size)], study.steps, seed)
                     for n in study.size_configs if best[study.sized(n, size)] is not None]
    return list(dict.fromkeys(runs))  # a run two parts share (the middle size) trains once


def flops_steps(study: Study, flops: Mapping[str, float]) -> dict[str, int]:
    """{config: max(1, round(steps · F_baseline / F_config))} of the `flops_configs`: their
    steps at the baseline's training FLOPs (`flops[name]`: training FLOPs per step); a config
    whose steps are the study's reuses its runs at equal steps."""
    target = study.steps * flops[study.baseline]
    return {n: max(1, round(target / flops[n])) for n in study.flops_configs}
