"""`cem-compare`: train several configs for the same number of steps (and seed) and write a
Markdown table of their parameters by part, validation loss, perplexity, bits per byte,
steady-state tokens/s and wall time, with a PNG of their validation curves beside it.

    cem-compare --configs configs/shakespeare_llama.yaml configs/shakespeare_cem*.yaml \
        --steps 400 --out docs/results.md --runs-dir runs/compare [section.key=value ...]

Each config trains in its own `python -m cem_jax.train` process, in RUNS_DIR/<config stem>
(its output in train.log there): a crash or a NaN in one run is a row marked failed, not the
end of the comparison, and every run starts from a fresh JAX runtime, so one run's memory or
compile cache does not shape the next one's speed. Run again, it reuses finished runs and
resumes unfinished ones (`cem-train` resumes from the run directory). The overrides apply to
every config. A run directory holding another run (model, data, optimizer, steps or seed) is
refused: use another --runs-dir. Whatever follows the END marker in an existing output file
(a reading of the results) is kept when the table is rewritten.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from cem_jax.train.config import TrainConfig, load_config
from cem_jax.train.dry_run import param_counts as abstract_param_counts

PARTS = ("embedding", "attention", "mlp", "norm", "preconditioner", "head", "total")
END = "<!-- end of cem-compare output: text below this line is kept on rewrite -->"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `cem-compare`; returns 0 if every run finished, 1 if one failed, 2 on bad
    arguments or configs."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="cem-compare",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--configs", nargs="+", required=True, metavar="YAML")
    parser.add_argument("--steps", type=_positive_int, required=True,
                        help="training steps of every run")
    parser.add_argument("--eval-every", type=_positive_int,
                        help="validation interval (default steps/8)")
    parser.add_argument("--out", type=Path, default=Path("docs/results.md"))
    parser.add_argument("--runs-dir", type=Path, default=Path("runs/compare"))
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_args(argv)
    eval_every = args.eval_every or max(1, args.steps // 8)
    stems = [Path(c).stem for c in args.configs]
    if len(set(stems)) != len(stems):
        parser.error(f"config file names must differ (they name the run dirs): {stems}")
    runs = {}
    try:
        for path, stem in zip(args.configs, stems, strict=True):
            run_args = ["run.progress=false", *args.overrides, f"run.steps={args.steps}",
                        f"run.eval_every={eval_every}", f"run.dir={args.runs_dir / stem}"]
            runs[stem] = (path, run_args, load_config(path, run_args))
    except (ValueError, FileNotFoundError) as err:
        print(f"cem-compare: configuration error: {err}", file=sys.stderr)
        return 2
    unwritable = _unwritable(args.out)  # found now, not after an hour of training
    if unwritable:
        parser.error(unwritable)
    rows = [train_one(stem, path, run_args, cfg) for stem, (path, run_args, cfg) in runs.items()]
    command = "cem-compare " + shlex.join(argv)
    write_report(rows, args.out, command, args.steps)
    print(f"cem-compare: wrote {args.out} and {curves_path(args.out)}")
    return 0 if all(r["ok"] for r in rows) else 1


def _positive_int(text: str) -> int:
    """`text` as an integer >= 1; raises argparse.ArgumentTypeError otherwise."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def _unwritable(out: Path) -> str:
    """Why the report cannot be written to `out` and its PNG beside it ("" if it can); creates
    the folder of `out`."""
    for path in (out, curves_path(out)):
        if path.is_dir():
            return (f"--out {path} is a directory: give the Markdown file to write, e.g. "
                    f"{path / 'results.md'}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return (f"cannot create {out.parent}, the folder of --out ({err.strerror}: "
                f"{err.filename}): choose another --out")
    if not os.access(out.parent, os.W_OK):
        return f"cannot write in {out.parent}, the folder of --out: choose another --out"
    return ""


def train_one(stem: str, path: str, run_args: list[str], cfg: TrainConfig) -> dict:
    """Train (or resume, or reuse) one run; returns its table row as a dict."""
    run_dir = Path(cfg.run.dir)
    row = {"name": stem, "params": param_counts(cfg), "ok": False, "note": ""}
    clash = _other_run(run_dir, cfg)
    if clash:
        row["note"] = clash
        print(f"cem-compare: {stem}: {clash}", file=sys.stderr)
        return row
    book = run_dir / "compare.json"  # training wall time summed over invocations
    wall = json.loads(book.read_text())["wall_s"] if book.is_file() else 0.0
    if not _finished(run_dir, cfg):
        print(f"cem-compare: training {stem} ({cfg.run.steps} steps) in {run_dir}", flush=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        with open(run_dir / "train.log", "a") as log:
            status = subprocess.run([sys.executable, "-m", "cem_jax.train", "--config", path,
                                     *run_args], stdout=log, stderr=subprocess.STDOUT).returncode
        wall += time.perf_counter() - start
        book.write_text(json.dumps({"wall_s": wall}))
        if status != 0:
            row["note"] = f"cem-train exited with status {status}; see {run_dir / 'train.log'}"
            print(f"cem-compare: {stem}: {row['note']}", file=sys.stderr)
    row.update(read_metrics(run_dir, cfg), wall_s=wall)
    row["ok"] = not row["note"] and _finished(run_dir, cfg)
    return row


def param_counts(cfg: TrainConfig) -> dict[str, int]:
    """The config's parameter counts by part (every part of `PARTS`, 0 when absent)."""
    counts = abstract_param_counts(cfg.model)
    return {part: counts.get(part, 0) for part in PARTS}


def read_metrics(run_dir: Path, cfg: TrainConfig) -> dict:
    """From `metrics.jsonl`: the final validation {"loss", "perplexity", "bits_per_byte"}
    ("eval", empty if none), the validation curve ("curve": [(step, bits per byte)]) and the
    median tokens/s of the training log windows after the first tenth of the steps."""
    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] \
        if path.is_file() else []
    by_kind = {"train": {}, "eval": {}}
    for r in records:  # a step logged again after a resume keeps its last record
        by_kind[r["kind"]][r["step"]] = r
    evals = sorted(by_kind["eval"].items())
    speeds = [r["tokens_per_s"] for step, r in by_kind["train"].items()
              if step > cfg.run.steps / 10 and "tokens_per_s" in r]
    return {"eval": evals[-1][1] if evals else {},
            "curve": [(step, r["bits_per_byte"]) for step, r in evals],
            "tokens_per_s": statistics.median(speeds) if speeds else math.nan}


def _finished(run_dir: Path, cfg: TrainConfig) -> bool:
    """The metrics hold the final validation (written once the last step is done), or, for a
    run without a validation split, the last step's training record."""
    path = run_dir / "metrics.jsonl"
    kind = "eval" if cfg.data.has_validation else "train"
    return path.is_file() and any(
        r["kind"] == kind and r["step"] == cfg.run.steps
        for r in map(json.loads, path.read_text().splitlines()))


def _other_run(run_dir: Path, cfg: TrainConfig) -> str:
    """Why `run_dir` cannot hold this run ("" if it is new or the same run)."""
    if not (run_dir / "config.yaml").is_file():
        return ""
    saved = load_config(run_dir / "config.yaml").to_dict()
    new = cfg.to_dict()
    for section in ("model", "data", "optimizer"):
        if saved[section] != new[section]:
            return f"{run_dir} holds a run with another {section} section; use another --runs-dir"
    for key in ("steps", "seed"):
        if saved["run"][key] != new["run"][key]:
            return (f"{run_dir} holds a run with run.{key}={saved['run'][key]}; use another "
                    f"--runs-dir")
    return ""


def curves_path(out: Path) -> Path:
    """The PNG written next to the Markdown file: results.md → results_curves.png."""
    return out.with_name(out.stem + "_curves.png")


def write_report(rows: list[dict], out: Path, command: str, steps: int) -> None:
    """Write the Markdown table (keeping any text after END in an existing file) and the PNG."""
    out.parent.mkdir(parents=True, exist_ok=True)
    plot_curves(rows, curves_path(out))
    head = ["config", *PARTS, "val loss", "perplexity", "bits/byte", "tokens/s", "wall time"]
    lines = ["# cem-compare results", "", "Produced by", "", "```bash", command, "```", "",
             f"{steps} steps per config. Parameters from `count_params`; validation loss in "
             "nats/token after the last step (the whole validation split unless "
             "run.eval_batches is set); tokens/s is the "
             "median over the training log windows after the first tenth of the steps "
             "(compilation and evaluation excluded); wall time of the `cem-train` process "
             "(start-up, compilation, evaluations, checkpoints and the sample included).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        e = r.get("eval", {})
        cells = [r["name"] if r["ok"] else f"{r['name']} (failed)",
                 *(f"{r['params'][p]:,}" for p in PARTS),
                 _num(e.get("loss"), 4), _num(e.get("perplexity"), 2),
                 _num(e.get("bits_per_byte"), 4), _num(r.get("tokens_per_s"), 0, ","),
                 _num(r["wall_s"] / 60, 1) + " min" if "wall_s" in r else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [f"- {r['name']}: {r['note']}" for r in rows if r["note"]]
    lines += ["", f"![validation bits per byte vs step]({curves_path(out).name})", "", END, ""]
    kept = out.read_text().split(END, 1)[1].lstrip("\n") \
        if out.is_file() and END in out.read_text() else ""
    out.write_text("\n".join(lines) + kept)


def _num(value, digits: int, sep: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "–"
    return f"{value:{sep}.{digits}f}"


def plot_curves(rows: list[dict], path: Path) -> None:
    """Validation bits per byte vs step, one line per run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for r in rows:
        if r.get("curve"):
            steps, bpb = zip(*r["curve"], strict=True)
            ax.plot(steps, bpb, marker="o", markersize=3, label=r["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation bits per byte")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
