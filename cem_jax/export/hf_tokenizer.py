"""The tokenizer files of a Hugging Face directory: the run's own tokenizer and a
`tokenizer_config.json` that makes `transformers.AutoTokenizer` load it.

sentencepiece. `tokenizer.model` as the run has it, loaded as a `LlamaTokenizer` (converted from
the sentencepiece model; needs the `sentencepiece` and `protobuf` packages). The conversion
matches `cem_jax.data.SentencePieceTokenizer` id for id on ordinary text (identity
normalization, no dummy prefix, byte fallback), with one known exception: a literal "▁"
(U+2581) in the text, which `cem_jax` encodes as its three UTF-8 byte pieces so that decoding
restores it, while the converted tokenizer reads it as a space.

Hugging Face. `tokenizer.json` as the run has it (vocabulary, merges, normalizer,
pre-tokenizer, decoder), loaded as a `PreTrainedTokenizerFast` with the same ids for any text;
only its post-processor, which adds special tokens around a text in transformers (cem_jax never
applies it), is replaced by the document start below: transformers reads no `add_bos_token`
beside a tokenizer.json.

Special pieces in the text. Neither cem_jax tokenizer reads a special token from text: a literal
"</s>", "<s>", "<pad>", "<unk>" or "<|endoftext|>" is encoded as its characters. The exported
tokenizer does the same (`split_special_tokens`; transformers would otherwise read such text as
the control ids), and `skip_special_tokens` keeps it. Control ids come only from the tokenizer
(the document start it adds) and from what a model generates. A known gap of the sentencepiece
conversion: transformers derives its BPE merges from the vocabulary, special pieces included, so
a vocabulary holding two pieces that join into a special piece's text (say "</" and "s>") still
merges that text into the control id.

Document start. A model is trained on documents that each start with EOS (the packing of
`cem_jax.data.pipeline`), and `cem-sample` puts EOS before every prompt. The exported tokenizer
does the same: its `bos_token` is the EOS token and it adds it (`add_bos_token`, or the
tokenizer.json's post-processor), so that `model.generate(**tokenizer(text,
return_tensors="pt"))` continues a prompt as `cem-sample` does (and `decode(...,
skip_special_tokens=True)` drops it). The tokenizer's own BOS is never used; pad is its pad
token, else EOS, as in `cem_jax.data.Tokenizer`.

Padded vocabulary. A model whose vocabulary is larger than its tokenizer's has ids no text
encodes to; `generation_config` lists them as `suppress_tokens`, so that `model.generate` never
emits one (as cem-sample never does).
"""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers

from cem_jax.data import Tokenizer
from cem_jax.data.tokenizers import CONFIG_FILE
from cem_jax.export.output import file_in


def tokenizer_files(tokenizer_file: str) -> tuple[str, ...]:
    """What `write_tokenizer` writes for a run whose tokenizer is `tokenizer_file`
    ("tokenizer.model" or "tokenizer.json")."""
    return (tokenizer_file, CONFIG_FILE)


def write_tokenizer(directory: Path, tokenizer: Tokenizer) -> dict[str, int]:
    """Write the tokenizer file and tokenizer_config.json into `directory`; returns the special
    ids {"bos_token_id", "eos_token_id", "pad_token_id"} that config.json and
    generation_config.json must carry (bos = eos: the document start)."""
    ids = {"bos_token_id": tokenizer.eos_id, "eos_token_id": tokenizer.eos_id,
           "pad_token_id": tokenizer.pad_id}
    pieces = {f"{name}_token": tokenizer.id_to_piece(i) for name, i in
              (("bos", tokenizer.eos_id), ("eos", tokenizer.eos_id), ("pad", tokenizer.pad_id),
               ("unk", tokenizer.unk_id)) if i is not None}
    common = {"split_special_tokens": True, "clean_up_tokenization_spaces": False,
              "model_max_length": 8192, **pieces}
    if tokenizer.kind == "sentencepiece":
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True,
                  "add_eos_token": False, "add_prefix_space": False, "legacy": False, **common}
        data = tokenizer.data
    else:
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **common}
        data = _with_document_start(tokenizer)
    file_in(directory, tokenizer.file_name).write_bytes(data)
    file_in(directory, CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return ids


def _with_document_start(tokenizer: Tokenizer) -> bytes:
    """The tokenizer.json of `tokenizer` with a post-processor that puts EOS before a text
    (and before each of a pair), the rest of it as it is."""
    eos = tokenizer.id_to_piece(tokenizer.eos_id)
    backend = tokenizers.Tokenizer.from_str(tokenizer.data.decode("utf-8"))
    backend.post_processor = tokenizers.processors.TemplateProcessing(
        single=f"{eos}:0 $A:0", pair=f"{eos}:0 $A:0 {eos}:1 $B:1",
        special_tokens=[(eos, tokenizer.eos_id)])
    spec = json.loads(tokenizer.data)
    spec["post_processor"] = json.loads(backend.to_str())["post_processor"]
    return (json.dumps(spec, ensure_ascii=False, indent=2) + "\n").encode()


def suppress_padded(tokenizer: Tokenizer, model_vocab_size: int) -> dict:
    """The token fields of generation_config.json beside `write_tokenizer`'s ids: the ids of a
    padded vocabulary past the tokenizer's, as `suppress_tokens` (none: {})."""
    if model_vocab_size <= tokenizer.vocab_size:
        return {}
    return {"suppress_tokens": list(range(tokenizer.vocab_size, model_vocab_size))}
