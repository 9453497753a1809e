"""The tokenizer files of a Hugging Face directory: the run's sentencepiece `tokenizer.model` and
a `tokenizer_config.json` that makes `transformers.AutoTokenizer` load it as a `LlamaTokenizer`
(converted from the sentencepiece model; needs the `sentencepiece` and `protobuf` packages).

The conversion matches `cem_jax.data.Tokenizer` id for id on ordinary text (identity
normalization, no dummy prefix, byte fallback), with one known exception: a literal "▁" (U+2581)
in the text, which `cem_jax` encodes as its three UTF-8 byte pieces so that decoding restores it,
while the converted tokenizer reads it as a space.

Special pieces in the text. sentencepiece never reads a control piece from text: a literal
"</s>", "<s>", "<pad>" or "<unk>" is encoded as its characters. The exported tokenizer does the
same (`split_special_tokens`; transformers would otherwise read such text as the control ids),
and `skip_special_tokens` keeps it. Control ids come only from the tokenizer (the document start
it adds) and from what a model generates. A known gap: transformers derives its BPE merges from
the vocabulary, special pieces included, so a vocabulary holding two pieces that join into a
special piece's text (say "</" and "s>") still merges that text into the control id.

Document start. A model is trained on documents that each start with EOS (the packing of
`cem_jax.data.pipeline`), and `cem-sample` puts EOS before every prompt. The exported tokenizer
does the same: its `bos_token` is the EOS piece and it adds it (`add_bos_token`), so that
`model.generate(**tokenizer(text, return_tensors="pt"))` continues a prompt as `cem-sample` does
(and `decode(..., skip_special_tokens=True)` drops it). The sentencepiece model's own BOS is
never used; pad is the model's pad piece, else EOS, as in `cem_jax.data.Tokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

from cem_jax.data import Tokenizer
from cem_jax.export.output import file_in

TOKENIZER_FILES = ("tokenizer.model", "tokenizer_config.json")  # what `write_tokenizer` writes


def write_tokenizer(directory: Path, tokenizer_model: bytes) -> dict[str, int]:
    """Write tokenizer.model and tokenizer_config.json into `directory`; returns the special
    ids {"bos_token_id", "eos_token_id", "pad_token_id"} that config.json and
    generation_config.json must carry (bos = eos: the document start). Raises ValueError for a
    sentencepiece model without EOS."""
    tok = Tokenizer(tokenizer_model)
    ids = {"bos_token_id": tok.eos_id, "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}
    pieces = {f"{name}_token": tok.id_to_piece(i) for name, i in
              (("bos", tok.eos_id), ("eos", tok.eos_id), ("pad", tok.pad_id), ("unk", tok.unk_id))
              if i >= 0}
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
              "add_eos_token": False, "add_prefix_space": False, "legacy": False,
              "split_special_tokens": True, "clean_up_tokenization_spaces": False,
              "model_max_length": 8192, **pieces}
    file_in(directory, "tokenizer.model").write_bytes(tokenizer_model)
    file_in(directory, "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return ids
