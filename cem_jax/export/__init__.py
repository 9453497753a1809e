"""Carry a trained model to other tools (DESIGN.md §4), and bring Llama weights in.

    safetensors  every parameter under a stable name (`names`), config.json, the run's
                 tokenizer files; `load_safetensors` gives back the same model and tokenizer
                 (`cem_jax.export.safetensors_io`)
    hf-llama     a `transformers.LlamaForCausalLM` directory, baseline models only (`hf_llama`)
    hf           any CEM variant as a Hugging Face directory with its own PyTorch modeling code
                 (`hf`, `hf_template/`), loaded with `trust_remote_code=True`
    import       a Hugging Face Llama directory → a baseline run directory (`importer`)

Every writer builds its output in a temporary directory beside `--out` and renames it into place
at the end (`output.staged_dir`): a failure leaves nothing half-written. An existing non-empty
`--out` is only replaced with `overwrite=True`, only when it is an earlier output, and then only
the files that output wrote (its marker lists them); a directory holding a training run never.
No pickle: tensors go through safetensors. The commands `cem-export` and `cem-import` are
`cem_jax.cli.export`.
"""

from cem_jax.export.output import ExportError

__all__ = ["ExportError"]
