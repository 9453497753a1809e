"""`cem-export` and `cem-import`, the commands of `cem_jax.export`: a run's checkpoint written in
another format, and a Hugging Face Llama directory turned into a run directory.

    cem-export --run runs/cem [--step N] --format safetensors|hf-llama|hf --out DIR [--overwrite]
    cem-import --hf llama_dir --out runs/llama-ft [--config base.yaml] [section.key=value ...]

Exit status (docs/exit_statuses.md): 0 written; 1 a crash (its traceback), or object storage
unreachable or failing (one line, `cem_jax.data.storage_errors.storage_error`: run it again); 2
a usage error, or what running it again will not change (one line): the input cannot be read
(a missing run directory, checkpoint or file, a bad config), the format cannot express the
model (the message names the feature), --out may not be written
(`cem_jax.export.output.check_destination`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from cem_jax.cli.failures import failed

FORMATS = ("safetensors", "hf-llama", "hf")
OVERWRITE_HELP = ("replace an earlier cem-export or cem-import output in --out, once the new one "
                  "is complete: the files it wrote, not the ones added since, and never a run "
                  "that has trained or is training")


def main(argv: Sequence[str] | None = None) -> int:
    """`cem-export`: write a run's checkpoint in another format."""
    parser = argparse.ArgumentParser(prog="cem-export", description="Export a checkpoint of a "
                                     "run (safetensors, a Hugging Face Llama, or a Hugging Face "
                                     "directory with CEM modeling code).")
    parser.add_argument("--run", required=True, help="run directory")
    parser.add_argument("--step", type=int, help="checkpoint step (default: the newest)")
    parser.add_argument("--format", required=True, choices=FORMATS,
                        help="safetensors: the parameters, config.json and the tokenizer; hf: a "
                             "transformers model with its own modeling code "
                             "(trust_remote_code); hf-llama: a LlamaForCausalLM, for the untied "
                             "baseline only")
    parser.add_argument("--out", required=True, help="output directory (new or empty)")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = parser.parse_args(argv)
    from cem_jax.checkpoint import CheckpointError
    from cem_jax.data import find_tokenizer
    from cem_jax.export import hf, hf_llama, safetensors_io
    from cem_jax.export.output import ExportError, check_destination
    from cem_jax.rundir import check_run_dir, load_run, quiet_checkpoint_logs

    quiet_checkpoint_logs()
    writers = {"safetensors": (safetensors_io.export_safetensors, safetensors_io.files),
               "hf-llama": (hf_llama.export_hf_llama, hf_llama.files),
               "hf": (hf.export_hf, hf.files)}
    write, files = writers[args.format]
    try:
        check_run_dir(args.run)  # in the words of cem-sample and cem-eval
        check_destination(args.out, args.overwrite, args.run,  # before the slow restore
                          files(os.path.basename(find_tokenizer(args.run))))
        run = load_run(args.run, args.step)
        out = write(run.params, run.config.model, run.tokenizer, args.out, args.overwrite)
    except Exception as err:  # a storage failure first: TensorStore's are ValueErrors
        return failed("cem-export", err, (ExportError, CheckpointError, FileNotFoundError,
                                           FileExistsError, ValueError))
    print(f"wrote {args.format} export of {run.directory} step {run.step} to {out}")
    return 0


def import_main(argv: Sequence[str] | None = None) -> int:
    """`cem-import`: a Hugging Face Llama directory → a baseline run directory."""
    parser = argparse.ArgumentParser(prog="cem-import", description="Turn a Hugging Face Llama "
                                     "checkpoint into a cem_jax baseline run directory.")
    parser.add_argument("--hf", required=True, help="Hugging Face Llama directory "
                        "(config.json, safetensors weights, tokenizer.model or tokenizer.json)")
    parser.add_argument("--out", required=True, help="run directory to create")
    parser.add_argument("--config", help="YAML config for the data/optimizer/run sections (the "
                        "model's architecture is the Llama's)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="overrides of the data, optimizer and run sections (as cem-train's)")
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    args = parser.parse_args(argv)
    from cem_jax.data import find_tokenizer
    from cem_jax.export.importer import files, import_llama
    from cem_jax.export.output import ExportError, check_destination

    try:
        tokenizer_name = os.path.basename(find_tokenizer(args.hf))
        check_destination(args.out, args.overwrite, args.hf, files(tokenizer_name))
        out = import_llama(args.hf, args.out, args.config, args.overrides, args.overwrite)
    except Exception as err:
        return failed("cem-import", err, (ExportError, FileNotFoundError, FileExistsError,
                                           ValueError))
    print(f"wrote baseline run directory {out} (checkpoint 0) from {args.hf}")
    return 0
