"""`cem-export` and `cem-import`.

    cem-export --run runs/cem [--step N] --format safetensors|hf-llama|hf --out DIR [--overwrite]
    cem-import --hf llama_dir --out runs/llama-ft [--config base.yaml] [section.key=value ...]

Exit status: 0 written; 1 the input cannot be read or the format cannot express the model
(the message names the feature); 2 bad arguments.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

FORMATS = ("safetensors", "hf-llama", "hf")


def main(argv: Sequence[str] | None = None) -> int:
    """`cem-export`: write a run's checkpoint in another format."""
    parser = argparse.ArgumentParser(prog="cem-export", description="Export a checkpoint of a "
                                     "run (safetensors, a Hugging Face Llama, or a Hugging Face "
                                     "directory with CEM modeling code).")
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --out (only once the export is complete)")
    args = parser.parse_args(argv)
    from cem_jax.export.hf import export_hf
    from cem_jax.export.hf_llama import export_hf_llama
    from cem_jax.export.output import ExportError, check_destination
    from cem_jax.export.safetensors_io import export_safetensors
    from cem_jax.rundir import load_run, quiet_checkpoint_logs
    from cem_jax.train.checkpoint import CheckpointError

    quiet_checkpoint_logs()
    writers = {"safetensors": export_safetensors, "hf-llama": export_hf_llama, "hf": export_hf}
    try:
        check_destination(args.out, args.overwrite, args.run)  # before the (slow) restore
        run = load_run(args.run, args.step)
        out = writers[args.format](run.params, run.config.model, run.tokenizer.model_proto,
                                   args.out, args.overwrite)
    except (ExportError, CheckpointError, FileNotFoundError, FileExistsError,
            ValueError) as err:
        print(f"cem-export: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.format} export of {run.directory} step {run.step} to {out}")
    return 0


def import_main(argv: Sequence[str] | None = None) -> int:
    """`cem-import`: a Hugging Face Llama directory → a baseline run directory."""
    parser = argparse.ArgumentParser(prog="cem-import", description="Turn a Hugging Face Llama "
                                     "checkpoint into a cem_jax baseline run directory.")
    parser.add_argument("--hf", required=True, help="Hugging Face Llama directory "
                        "(config.json, safetensors weights, tokenizer.model)")
    parser.add_argument("--out", required=True, help="run directory to create")
    parser.add_argument("--config", help="YAML config for the data/optimizer/run sections (the "
                        "model's architecture is the Llama's)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    from cem_jax.export.importer import import_llama
    from cem_jax.export.output import ExportError, check_destination

    try:
        check_destination(args.out, args.overwrite, args.hf)
        out = import_llama(args.hf, args.out, args.config, args.overrides, args.overwrite)
    except (ExportError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"cem-import: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote baseline run directory {out} (checkpoint 0) from {args.hf}")
    return 0
