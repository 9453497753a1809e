"""Text in: corpora, tokenizers (sentencepiece or a Hugging Face tokenizer.json) and resumable
grain pipelines (DESIGN.md §4).

    cfg = DataConfig(vocab_size=2048, seq_len=256, batch_size=32)  # default corpus: Shakespeare
    tokenizer = build_tokenizer(cfg)                     # trained on the training works
    tokenizer.save(run_dir / tokenizer.file_name)        # (or data.tokenizer=PATH: loaded)
    batches = make_train_iterator(cfg, tokenizer)        # {"inputs", "targets", "segment_ids",
    batch = next(batches)                                #  "positions"}: int32 [B/P, T]
    state = batches.get_state()                          # JSON; set_state(state) resumes
    for batch in make_eval_batches(cfg, tokenizer):      # + "weights" float32 [B/P, T]
        ...
    load_tokens(cfg, tokenizer, "validation").stats.bits_per_byte(mean_loss_nats)

Modules: `config` (DataConfig), `shakespeare` (the archive, held-out works), `corpus` (splits
and documents), `tokenizer`, `cache` (token files), `pipeline` (batches), `cli` (cem-data).
"""

from cem_jax.data.config import DataConfig
from cem_jax.data.corpus import Document, Split, resolve_split
from cem_jax.data.pipeline import (
    SplitStats,
    TokenizedSplit,
    build_tokenizer,
    load_tokens,
    make_eval_batches,
    make_train_iterator,
    packed_batch,
)
from cem_jax.data.shakespeare import HELD_OUT_WORKS, MILTON_WORKS, FetchError, fetch_archive
from cem_jax.data.tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    HuggingFaceTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    check_fits,
    find_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

__all__ = [
    "BOS_ID", "EOS_ID", "HELD_OUT_WORKS", "MILTON_WORKS", "PAD_ID", "UNK_ID", "DataConfig",
    "Document", "FetchError", "HuggingFaceTokenizer", "SentencePieceTokenizer", "Split",
    "SplitStats", "TokenizedSplit", "Tokenizer", "build_tokenizer", "check_fits",
    "fetch_archive", "find_tokenizer", "load_tokenizer", "load_tokens", "make_eval_batches",
    "make_train_iterator", "packed_batch", "resolve_split", "train_tokenizer",
]
