"""Text in: corpora, tokenizers (sentencepiece or a Hugging Face tokenizer.json), tokenized
datasets and the batches of a step (DESIGN.md §4).

    cfg = DataConfig(vocab_size=2048, seq_len=256, batch_size=32)  # default corpus: Shakespeare
    tokenizer = build_tokenizer(cfg)                     # trained on the training works
    tokenizer.save(run_dir / tokenizer.file_name)        # (or data.tokenizer=PATH: loaded)
    batches = make_train_iterator(cfg, tokenizer, first_step=0)   # {"inputs", "targets",
    batch = next(batches)                                # "segment_ids", "positions"}: [B/P, T]
    for batch in make_eval_batches(cfg, tokenizer):      # + "weights" float32 [B/P, T]
        ...
    load_tokens(cfg, tokenizer, "validation").stats.bits_per_byte(mean_loss_nats)

Modules, from the bottom up: `config` (DataConfig), `storage_errors` (a failing object
storage in one line), `files` (local paths and gs:// alike), `formats` (a package: the table of
corpus formats, a file's format and its documents; a reader module per family of formats, and
`formats.common`, what they share), `shakespeare` (the archive, held-out works), `sources` (a
corpus spec as files and units of work), `tokenizers` (a package: the `Tokenizer` API and the
table of its kinds, `tokenizers.sentencepiece` and `tokenizers.huggingface`;
`tokenizers.training`, `tokenizers.loading`), `shards` (a tokenized dataset), `tokenize`
(tokenizing once, in parallel), `distributed` (what processes agree on), `pipeline` (a run's
splits), `batches` (the batches of a step). The `cem-data` command is `cem_jax.cli.data`. The
names below are imported when first used, so `import cem_jax.data.config` (or a tokenization
worker) loads no JAX.
"""

import importlib

_EXPORTS = {
    "DataConfig": "config", "Document": "formats", "FetchError": "shakespeare",
    "HELD_OUT_WORKS": "shakespeare", "MILTON_WORKS": "shakespeare",
    "SELECTION_WORKS": "shakespeare",
    "fetch_archive": "shakespeare", "Source": "sources", "Tokenizer": "tokenizers",
    "HuggingFaceTokenizer": "tokenizers.huggingface",
    "SentencePieceTokenizer": "tokenizers.sentencepiece",
    "check_fits": "tokenizers", "find_tokenizer": "tokenizers",
    "load_tokenizer": "tokenizers.loading", "train_tokenizer": "tokenizers.training",
    "BOS_ID": "tokenizers.training", "EOS_ID": "tokenizers.training",
    "PAD_ID": "tokenizers.training", "UNK_ID": "tokenizers.training",
    "DatasetError": "shards", "tokenize_dataset": "tokenize", "SplitStats": "pipeline",
    "TokenizedSplit": "pipeline", "build_tokenizer": "pipeline", "load_tokens": "pipeline",
    "make_eval_batches": "batches", "make_train_iterator": "batches",
    "packed_batch": "batches", "source_of": "pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cem_jax.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"cem_jax.data.{_EXPORTS[name]}"), name)
