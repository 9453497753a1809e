"""The tokenizer files of a Hugging Face directory: the run's sentencepiece `tokenizer.model` and
a `tokenizer_config.json` that makes `transformers.AutoTokenizer` load it as a `LlamaTokenizer`
(converted from the sentencepiece model; needs the `sentencepiece` and `protobuf` packages).

The conversion matches `cem_jax.data.Tokenizer` id for id on ordinary text (identity
normalization, no dummy prefix, byte fallback), with one known exception: a literal "▁" (U+2581)
in the text, which `cem_jax` encodes as its three UTF-8 byte pieces so that decoding restores it,
while the converted tokenizer reads it as a space.
"""

from __future__ import annotations

import json
from pathlib import Path

import sentencepiece as spm

from cem_jax.export.output import file_in


def special_ids(tokenizer_model: bytes) -> dict[str, int | None]:
    """{"bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"} of a sentencepiece model
    (None where it has no such token)."""
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_model)

    def known(i: int) -> int | None:
        return i if i >= 0 else None

    return {"bos_token_id": known(sp.bos_id()), "eos_token_id": known(sp.eos_id()),
            "pad_token_id": known(sp.pad_id()), "unk_token_id": known(sp.unk_id())}


def write_tokenizer(directory: Path, tokenizer_model: bytes) -> dict[str, int | None]:
    """Write tokenizer.model and tokenizer_config.json into `directory`; returns the special
    ids (`special_ids`) for the model's config.json."""
    sp = spm.SentencePieceProcessor(model_proto=tokenizer_model)
    ids = special_ids(tokenizer_model)
    tokens = {f"{name}_token": sp.id_to_piece(ids[f"{name}_token_id"])
              for name in ("bos", "eos", "pad", "unk") if ids[f"{name}_token_id"] is not None}
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
              "add_eos_token": False, "add_prefix_space": False, "legacy": False,
              "clean_up_tokenization_spaces": False, "model_max_length": 8192, **tokens}
    file_in(directory, "tokenizer.model").write_bytes(tokenizer_model)
    file_in(directory, "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return {k: v for k, v in ids.items() if k != "unk_token_id"}
