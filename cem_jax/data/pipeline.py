"""From a `DataConfig` to its splits: their sources, the tokenizer, and each split as a tokenized
dataset opened as one packed stream (`load_tokens`).

Splits. A run's "train" split is `cfg.corpus`; its "validation" split is `cfg.val_corpus`, the
held-out works of the built-in corpus (or its selection works, `cfg.selection`), or the
documents held out of the corpus (`cfg.val_fraction`); "milton" is the built-in out-of-domain
text. Each comes from a tokenized
dataset (`cem_jax.data.shards`): the one `cfg.corpus` names when it is a dataset folder
(`cem-data tokenize --out`), else the source's, tokenized once into
`cache_dir/tokens/<identity>/` (`cem_jax.data.tokenize`): no process tokenizes a dataset that
exists. With several processes (`jax.distributed`), each tokenizes its share of the units, in a
cache folder they must all see (a bucket or a shared file system: checked first); the last to
finish writes the manifest, and a process that fails says so to all of them. A split is
opened from its manifest: nothing is read or hashed at start.

Packing. A split is one token stream

    EOS d1 EOS d2 EOS ... EOS dn EOS

(an EOS starts each document, and one ends the stream); its rows and the batches of a step are
made by `cem_jax.data.batches`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import posixpath
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import jax

from cem_jax.data import files, shakespeare, shards
from cem_jax.data.config import DataConfig
from cem_jax.data.formats import Document
from cem_jax.data.shards import DatasetError, Manifest, TokenStream
from cem_jax.data.sources import Source, builtin_source, digest, user_source
from cem_jax.data.tokenize import dataset_identity, tokenize_dataset
from cem_jax.data.tokenizers import Tokenizer
from cem_jax.data.tokenizers.loading import load_tokenizer
from cem_jax.data.tokenizers.training import TRAINER_VERSION, train_tokenizer

SPLITS = ("train", "validation", "milton")
# Splits opened in this process: (dataset root, split, limit) → TokenizedSplit.
_OPENED: dict[tuple[str, str, int | None], TokenizedSplit] = {}
BARRIER_TIMEOUT_S = 48 * 3600  # processes wait this long for each other's tokenization
_COORDINATIONS = itertools.count()  # the tokenizations processes have agreed on, in order


@dataclasses.dataclass(frozen=True)
class SplitStats:
    """Size of a split: `documents`; `tokens`, the targets of one pass (document tokens plus
    one EOS per document); `bytes`, the UTF-8 bytes of the documents' text."""

    documents: int
    tokens: int
    bytes: int

    @property
    def bytes_per_token(self) -> float:
        """Mean UTF-8 bytes of text per target token (how much the tokenizer compresses)."""
        return self.bytes / self.tokens

    def bits_per_byte(self, loss_nats_per_token: float) -> float:
        """Mean loss (nats per target token) → bits per UTF-8 byte: loss·tokens / bytes / ln 2."""
        return loss_nats_per_token * self.tokens / self.bytes / math.log(2)


@dataclasses.dataclass(frozen=True)
class TokenizedSplit:
    """A split's packed stream: `stream` (`TokenStream`, len = stats.tokens + 1), its `stats`,
    the dataset folder `root` and the split's `description`."""

    name: str
    description: str
    stream: TokenStream
    stats: SplitStats
    root: str


def cache_root(cfg: DataConfig) -> str:
    """The cache folder of `cfg`: `cfg.cache_dir` (a local path or a URL), else
    `$CEM_JAX_CACHE` or ~/.cache/cem_jax. Raises ValueError when it, or a folder above it, is
    a file."""
    if cfg.cache_dir and files.is_url(cfg.cache_dir):
        return cfg.cache_dir
    root = Path(cfg.cache_dir) if cfg.cache_dir else shakespeare.default_cache_dir()
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"the cache directory {root} cannot be used: {existing} is a file; "
                         f"set data.cache_dir (cem-data --cache-dir) or "
                         f"${shakespeare.CACHE_ENV} to a directory")
    return str(root)


def is_dataset(spec: str) -> bool:
    """Whether corpus spec `spec` names a tokenized dataset folder (one with a manifest)."""
    return spec not in ("shakespeare", "milton") and files.is_file(
        files.join(spec, shards.MANIFEST))


def build_tokenizer(cfg: DataConfig, model_vocab_size: int | None = None,
                    check: Callable[[], None] | None = None) -> Tokenizer:
    """The tokenizer of `cfg`: `cfg.tokenizer` loaded (a sentencepiece model or a Hugging Face
    tokenizer.json, `load_tokenizer`); the tokenizer of the dataset `cfg.corpus` names; or a
    sentencepiece BPE model of `cfg.vocab_size` pieces trained on the training split (cached
    under `cache_dir/tokenizers/`, keyed by the split's fingerprint). Save it with the run:
    `tok.save(run_dir / tok.file_name)`.

    model_vocab_size: the vocabulary of the model it is for, which must hold every id of a
      loaded tokenizer (`check_fits`; None: unchecked). check: called before each document is
      read for the training (a stop check: what it raises ends the build, nothing is cached).
    Raises FileNotFoundError / ValueError as `load_tokenizer`, `train_tokenizer` and
    `source_of` do, ValueError when a tokenizer is to be trained and `cfg.vocab_size` is
    None, and what `check` raises.
    """
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer, model_vocab_size)
    if is_dataset(cfg.corpus):
        manifest = shards.read_manifest(cfg.corpus)
        return load_tokenizer(files.join(cfg.corpus, manifest.tokenizer["file"]),
                              model_vocab_size)
    if cfg.vocab_size is None:
        raise ValueError("data.vocab_size is null and data.tokenizer is null: set "
                         "data.vocab_size to the size of the tokenizer to train (cem-train "
                         "takes model.vocab_size), or give a tokenizer as data.tokenizer")
    source = source_of(cfg, "train")
    key = digest([TRAINER_VERSION, source.fingerprint(), cfg.vocab_size])
    path = files.join(cache_root(cfg), "tokenizers", f"bpe{cfg.vocab_size}-{key[:16]}.model")
    if files.is_file(path):
        try:
            tokenizer = load_tokenizer(path)
            if tokenizer.vocab_size == cfg.vocab_size:
                return tokenizer
            raise ValueError(f"{tokenizer.vocab_size} pieces, not {cfg.vocab_size}")
        except ValueError as err:
            warnings.warn(f"cached tokenizer unusable ({err}); training it again", stacklevel=2)
    tokenizer = train_tokenizer((doc.text for doc in _checked(source.documents(), check)),
                                cfg.vocab_size)
    files.write_bytes(path, tokenizer.data)  # a local path or a URL alike
    return tokenizer


def source_of(cfg: DataConfig, split: str) -> Source:
    """The source of `split` ("train", "validation" held out as its own corpus, or "milton").

    Raises ValueError (unknown split; a validation split the config does not have),
    FileNotFoundError (missing files), `shakespeare.FetchError` (the archive unavailable)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}: expected one of {', '.join(SPLITS)}")
    if split == "milton":
        return _builtin(cfg, "milton", shakespeare.MILTON_WORKS)
    spec = cfg.corpus if split == "train" else cfg.val_corpus
    if spec is None:
        if cfg.corpus != "shakespeare":
            raise ValueError(no_validation(cfg))
        return _builtin(cfg, "shakespeare", shakespeare.SELECTION_WORKS
                        if cfg.selection == "validation" else shakespeare.HELD_OUT_WORKS)
    if spec == "shakespeare":
        archive = fetch_archive(cfg)
        works = shakespeare.read_works(archive, shakespeare.SHAKESPEARE_DIR)
        left_out = shakespeare.HELD_OUT_WORKS + (
            shakespeare.SELECTION_WORKS if cfg.selection != "none" else ())
        return builtin_source("shakespeare", str(archive), tuple(
            w for w in works if w not in left_out))
    return user_source(spec, text_column=cfg.text_column,
                       allow_invalid_utf8=cfg.allow_invalid_utf8)


def no_validation(cfg: DataConfig) -> str:
    """The one line saying that `cfg` has no validation split, and how to give it one."""
    return (f"corpus {cfg.corpus!r} has no validation split: set data.val_corpus (same syntax "
            f"as data.corpus) or data.val_fraction (documents held out of the corpus, e.g. "
            f"0.01)")


def _builtin(cfg: DataConfig, kind: str, works: tuple[str, ...]) -> Source:
    return builtin_source(kind, str(fetch_archive(cfg)), works)


def fetch_archive(cfg: DataConfig) -> Path:
    """The verified Shakespeare archive (`shakespeare.fetch_archive`, which raises), in the
    cache folder, or in the local default one when that is a URL: it is read as a local file."""
    root = cache_root(cfg)
    local = shakespeare.default_cache_dir() if files.is_url(root) else root
    return shakespeare.fetch_archive(local, cfg.shakespeare_archive)


def load_tokens(cfg: DataConfig, tokenizer: Tokenizer, split: str,
                check: Callable[[], None] | None = None) -> TokenizedSplit:
    """The packed token stream of `split` ("train", "validation", "milton") of `cfg`, from its
    tokenized dataset (tokenized first if it does not exist; see the module docstring).
    "validation" holds the first whole documents up to `cfg.val_tokens` tokens when set.
    Every process of a multi-process run calls it, for the same splits in the same order.
    `check`: a stop check called while it tokenizes (`tokenize_dataset`): what it raises ends
    the tokenization, the finished units kept.

    Raises as `source_of` and `Source.documents` do (missing files, unreadable text, an empty
    corpus), and DatasetError (a dataset of another tokenizer, one whose held-out fraction is
    not `cfg.val_fraction`, a damaged one, processes that see different datasets), and what
    `check` raises."""
    root, part = _dataset(cfg, tokenizer, split, check)
    limit = cfg.val_tokens if split == "validation" else None
    key = (root, part, limit)
    if key not in _OPENED:
        manifest = shards.read_manifest(root)
        if manifest.tokenizer["sha256"] != tokenizer.sha256:
            raise DatasetError(f"the tokenized dataset {root} was made with another tokenizer "
                               f"than this run's: give data.tokenizer its tokenizer "
                               f"({files.join(root, manifest.tokenizer['file'])}), or tokenize "
                               f"the corpus again with this one")
        _OPENED[key] = _open(manifest, part, tokenizer, limit, split)
    return _OPENED[key]


def _open(manifest: Manifest, part: str, tokenizer: Tokenizer, limit: int | None,
          name: str) -> TokenizedSplit:
    if part not in manifest.splits and part == "documents":  # all held out: a tiny corpus
        held_out = sum(s.documents for s in manifest.splits["held_out"])
        raise DatasetError(f"data.val_fraction = {manifest.held_out_fraction} held out every "
                           f"one of the {held_out:,} documents of {manifest.root}: lower "
                           f"data.val_fraction, or add documents")
    if part not in manifest.splits:  # a fraction too small for the corpus
        documents = sum(s.documents for s in manifest.splits["documents"])
        raise DatasetError(f"data.val_fraction = {manifest.held_out_fraction} held out none of "
                           f"the {documents:,} documents of {manifest.root}: raise "
                           f"data.val_fraction, or give a validation corpus as data.val_corpus")
    shards_of = manifest.splits[part]
    stats = SplitStats(sum(s.documents for s in shards_of), sum(s.tokens for s in shards_of),
                       sum(s.bytes for s in shards_of))
    stream = TokenStream(manifest, part, tokenizer.vocab_size)
    if limit is not None and limit < stats.tokens:
        documents = tokens = size = 0
        for doc_tokens, doc_bytes in stream.document_sizes():
            if tokens + doc_tokens > limit and documents:
                break
            documents, tokens, size = documents + 1, tokens + doc_tokens, size + doc_bytes
        stats, stream = SplitStats(documents, tokens, size), TokenStream(
            manifest, part, tokenizer.vocab_size, limit=tokens)
    description = manifest.source["description"] + (" (held out)" if part == "held_out" else "")
    return TokenizedSplit(name, description, stream, stats, manifest.root)


def _dataset(cfg: DataConfig, tokenizer: Tokenizer, split: str,
             check: Callable[[], None] | None) -> tuple[str, str]:
    """(dataset folder, its split "documents" or "held_out") holding `split` of `cfg`,
    tokenized first when needed."""
    held_out = split == "validation" and cfg.val_corpus is None and cfg.corpus != "shakespeare"
    if held_out and cfg.val_fraction <= 0 and not is_dataset(cfg.corpus):
        raise ValueError(no_validation(cfg))
    spec = cfg.corpus if split == "train" or held_out else None
    if spec is not None and is_dataset(spec):
        manifest = shards.read_manifest(spec)
        if manifest.held_out_fraction != cfg.val_fraction:
            raise DatasetError(f"the tokenized dataset {spec} holds out a fraction "
                               f"{manifest.held_out_fraction} of its documents for validation, "
                               f"but data.val_fraction is {cfg.val_fraction}: set "
                               f"data.val_fraction={manifest.held_out_fraction}")
        return spec, "held_out" if held_out else "documents"
    source = source_of(cfg, "train" if held_out else split)
    fraction = cfg.val_fraction if split == "train" or held_out else 0.0
    root = cache_dataset_root(cfg, source, tokenizer, fraction)
    _tokenize_once(source, tokenizer, root, fraction, check)
    return root, "held_out" if held_out else "documents"


def cache_dataset_root(cfg: DataConfig, source: Source, tokenizer: Tokenizer,
                       held_out_fraction: float) -> str:
    """The cache folder of the dataset of `source` (`cache_dir/tokens/<identity>`)."""
    return files.join(cache_root(cfg), "tokens",
                      dataset_identity(source, tokenizer, held_out_fraction)[:24])


def _tokenize_once(source: Source, tokenizer: Tokenizer, root: str, fraction: float,
                   check: Callable[[], None] | None) -> None:
    """Make sure the dataset `root` exists: tokenized here (one process), or by every process
    of a multi-process run, each its share of the units, then process 0 alone writes the
    manifest (so a corpus without text is process 0's error, told to the others). The
    processes first agree that they tokenize the same source with the same tokenizer (a
    mismatch names the processes) and that they share `root` (checked by a probe file); a
    failure in one is raised in all (`_together`)."""
    done = files.is_file(files.join(root, shards.MANIFEST))
    if jax.process_count() == 1:
        if not done:
            tokenize_dataset(source, tokenizer, root, held_out_fraction=fraction, check=check)
        return
    from cem_jax.data import distributed

    key = f"cem_jax/tokenize/{next(_COORDINATIONS)}"  # the same in every process, in order
    distributed.check_same(f"{key}/identity", posixpath.basename(root),
                           "a corpus, a tokenizer or a held-out fraction")
    if all(d == "1" for d in distributed.gather(f"{key}/done", str(int(done)))):
        return
    distributed.check_shared(root, key)
    index, count = jax.process_index(), jax.process_count()
    _together(f"{key}/units", lambda: tokenize_dataset(
        source, tokenizer, root, held_out_fraction=fraction, part=(index, count), check=check,
        write_manifest=False))

    def join() -> None:  # every unit is finished: the manifest
        if index == 0:
            tokenize_dataset(source, tokenizer, root, held_out_fraction=fraction)

    _together(f"{key}/manifest", join)


def _together(key: str, work: Callable[[], object]) -> None:
    """Every process does `work`, then they wait for each other and learn how it went: a
    process whose work raised raises it again (a stop too), the others DatasetError naming it
    (so that no process waits for one that has stopped)."""
    from cem_jax.data import distributed

    failure: BaseException | None = None
    try:
        work()
    except BaseException as err:
        failure = err
    said = distributed.gather(key, "" if failure is None else str(failure) or repr(failure),
                              BARRIER_TIMEOUT_S)
    if failure is not None:
        raise failure
    failed = [p for p, message in enumerate(said) if message]
    if failed:
        raise DatasetError(f"processes {failed} could not tokenize the corpus (process "
                           f"{failed[0]}: {said[failed[0]]}); what this one tokenized is kept "
                           f"for the next start")


def _checked(documents: Iterator[Document], check: Callable[[], None] | None
             ) -> Iterator[Document]:
    """`documents`, calling `check` (if given) before each."""
    for doc in documents:
        if check is not None:
            check()
        yield doc
