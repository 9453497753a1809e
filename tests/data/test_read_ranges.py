"""A step's rows read together (issue 40): `files.read_ranges` and `TokenStream.read_many` give
byte for byte what one read per range gives, locally and on gs:// (the emulator), rows crossing
shards included, and so do the batches built on them; and a step's requests overlap (through
`benchmarks/data.py`'s `DelayedFileSystem`, a bucket's latency on local files).

The stock emulator serves one connection at a time with a listen backlog of 5: a call of more
concurrent requests than that waits for the kernel's SYN retries (a second or more), so the
gs:// cases here keep to a few ranges per call."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import numpy as np
import pytest

from cem_jax.data import (
    DataConfig,
    files,
    load_tokenizer,
    load_tokens,
    make_eval_batches,
    make_train_iterator,
)
from cem_jax.data.shards import (
    Manifest,
    Shard,
    ShardWriter,
    TokenStream,
    read_manifest,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[2]
HELD_OUT = 0.25
SEQ_LEN = 16


@pytest.fixture(scope="module")
def delayed_fs():
    """`DelayedFileSystem` of benchmarks/data.py (importing it registers `delayed://`)."""
    spec = importlib.util.spec_from_file_location("benchmark_data", REPO / "benchmarks/data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.DelayedFileSystem


def write_dataset(root: str, tokenizer, shard_tokens: tuple[int, ...], seed: int = 0) -> None:
    """A dataset of random documents in shards of about `shard_tokens` tokens (documents of 5
    to 20 tokens), written through `ShardWriter`; a quarter of the units held out."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype("<u2")
    listed: dict[str, list] = {"documents": [], "held_out": []}
    for unit, size in enumerate(shard_tokens):
        split = "held_out" if unit % 4 == 3 else "documents"
        with ShardWriter(root, unit, dtype, tokenizer.eos_id) as writer:
            written = 0
            while written < size:
                ids = rng.integers(4, tokenizer.vocab_size, rng.integers(5, 21)).tolist()
                writer.add(split, ids, 3 * len(ids))
                written += len(ids) + 1
        stats = writer.stats[split]
        listed[split].append(dict(unit=unit, tokens=stats["tokens"],
                                  documents=stats["documents"], bytes=stats["bytes"],
                                  sha256=stats["sha256"]))
    files.write_bytes(files.join(root, tokenizer.file_name), tokenizer.data)
    write_manifest(Manifest(
        root, f"test-{seed}", {"spec": "test", "description": "random documents"},
        {"kind": tokenizer.kind, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size,
         "eos_id": tokenizer.eos_id, "file": tokenizer.file_name}, HELD_OUT, "<u2",
        {split: tuple(Shard(**s) for s in shards) for split, shards in listed.items()}))


def whole_stream(root: str, split: str, manifest_shards, eos_id: int) -> np.ndarray:
    """The split's stream from its shard files read whole, and the final EOS."""
    parts = [np.frombuffer(files.read_bytes(files.join(root, f"{split}/{s.unit:05d}.bin")),
                           "<u2") for s in manifest_shards]
    return np.concatenate([*parts, [eos_id]]).astype(np.int32)


@pytest.fixture
def tokenizer(small_tokenizer_path):
    return load_tokenizer(str(small_tokenizer_path))


def one_request_per_range(monkeypatch):
    """`TokenStream.read_many` as the reader was: a call, and a request, per range."""
    concurrent = TokenStream.read_many
    monkeypatch.setattr(TokenStream, "read_many", lambda self, starts, stops: [
        concurrent(self, [a], [b])[0] for a, b in zip(starts, stops, strict=True)])


@pytest.mark.parametrize("where", ["local", "gs"])
def test_read_ranges_gives_what_read_bytes_gives(tmp_path, where, request):
    base = str(tmp_path) if where == "local" else request.getfixturevalue("gcs_bucket")
    data = {name: np.random.default_rng(i).bytes(5000) for i, name in enumerate("ab")}
    for name, content in data.items():
        files.write_bytes(files.join(base, name), content)
    a, b = files.join(base, "a"), files.join(base, "b")
    ranges = [(a, 0, 10), (b, 4990, 5000), (a, 100, 100), (b, 4000, 6000), (a, 1234, 3210)]
    got = files.read_ranges([p for p, _, _ in ranges], [s for _, s, _ in ranges],
                            [e for _, _, e in ranges])
    assert got == [files.read_bytes(p, s, e) for p, s, e in ranges]
    assert got[3] == data["b"][4000:] and got[2] == b""
    assert files.read_ranges(a, [7, 3], [9, 4]) == [data["a"][7:9], data["a"][3:4]]
    assert files.read_ranges(a, [], []) == []
    with pytest.raises(FileNotFoundError, match=f"{files.join(base, 'missing')} does not exist"):
        files.read_ranges([a, files.join(base, "missing")], [0, 0], [1, 1])


@pytest.mark.parametrize("where", ["local", "gs"])
def test_read_many_crosses_shards_as_one_read_per_range_does(tmp_path, tokenizer, where,
                                                             request):
    root = str(tmp_path / "d") if where == "local" else \
        f"{request.getfixturevalue('gcs_bucket')}/d"
    write_dataset(root, tokenizer, (40, 30, 50))  # units 0-2: all in "documents"
    manifest = read_manifest(root)
    stream = TokenStream(manifest, "documents", tokenizer.vocab_size)
    want = whole_stream(root, "documents", manifest.splits["documents"], tokenizer.eos_id)
    assert len(stream) == len(want)
    first, second = (int(x) for x in stream.starts[1:3])  # where shards 1 and 2 begin
    # crossing one boundary, crossing two, the last tokens with the final EOS, empty
    ranges = [(first - 3, first + 5), (first - 1, second + 2), (len(want) - 4, len(want)),
              (5, 5)]
    got = stream.read_many([a for a, _ in ranges], [b for _, b in ranges])
    for (a, b), tokens in zip(ranges, got, strict=True):
        assert tokens.dtype == np.int32
        np.testing.assert_array_equal(tokens, want[a:b])
        np.testing.assert_array_equal(tokens, stream.read(a, b))
    with pytest.raises(IndexError, match=r"tokens \[0, 999\) of a stream of"):
        stream.read_many([0, 0], [1, 999])


def batches(cfg, tokenizer, steps=3):
    train = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
    evaluation = make_eval_batches(cfg, tokenizer, "validation", process_index=0,
                                   process_count=1)
    return [next(train) for _ in range(steps)] + list(evaluation)[:2]


def assert_same(got, want):
    assert len(got) == len(want)
    for x, y in zip(got, want, strict=True):
        assert sorted(x) == sorted(y)
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


def test_batches_are_those_of_one_read_per_row_locally_and_on_gs(tmp_path, tokenizer,
                                                                 small_tokenizer_path,
                                                                 gcs_bucket, monkeypatch):
    """Training and evaluation batches, rows crossing shards (of 30 to 50 tokens, rows of 17):
    read a step at once from local shards and from gs://, and a row at a time as before."""
    sizes = (40, 30, 50, 35, 45, 30, 40, 30)  # units 3 and 7 held out
    roots = {"local": str(tmp_path / "d"), "gs": f"{gcs_bucket}/d"}
    for root in roots.values():
        write_dataset(root, tokenizer, sizes)
    common = dict(tokenizer=str(small_tokenizer_path), seq_len=SEQ_LEN, batch_size=4,
                  val_fraction=HELD_OUT, num_threads=1, prefetch=1, seed=3)
    together = {name: batches(DataConfig(corpus=root, **common), tokenizer)
                for name, root in roots.items()}
    with monkeypatch.context() as patch:
        one_request_per_range(patch)
        row_by_row = batches(DataConfig(corpus=roots["local"], **common), tokenizer)
    assert_same(together["local"], row_by_row)
    assert_same(together["gs"], row_by_row)
    split = load_tokens(DataConfig(corpus=roots["local"], **common), tokenizer, "train")
    want = whole_stream(roots["local"], "documents", split.stream.shards, tokenizer.eos_id)
    window_at = {tuple(want[s:s + SEQ_LEN + 1]): s for s in range(0, len(want) - SEQ_LEN,
                                                                  SEQ_LEN)}
    boundaries = [int(x) for x in split.stream.starts[1:-1]]
    crossing = 0
    for batch in together["local"][:3]:
        for inputs, targets in zip(batch["inputs"], batch["targets"], strict=True):
            start = window_at[tuple(np.concatenate([inputs, targets[-1:]]))]
            crossing += any(start < b < start + SEQ_LEN + 1 for b in boundaries)
    assert crossing >= 2  # the case that matters: rows read from two shards


def test_a_steps_requests_overlap(tmp_path, tokenizer, small_tokenizer_path, delayed_fs,
                                  monkeypatch):
    """A step of 64 rows at 50 ms a request takes well under 64 x 50 ms (a wide bound: the
    machine is shared), and gives the batch that local shards give."""
    monkeypatch.setattr(delayed_fs, "delay_s", 0.05)
    root = tmp_path / "d"
    write_dataset(str(root), tokenizer, (700, 600, 800, 100))
    common = dict(tokenizer=str(small_tokenizer_path), seq_len=SEQ_LEN, batch_size=64,
                  val_fraction=HELD_OUT, num_threads=0, prefetch=0)  # read when asked
    local = make_train_iterator(DataConfig(corpus=str(root), **common), tokenizer,
                                process_index=0, process_count=1)
    delayed = make_train_iterator(DataConfig(corpus=f"delayed://{root}", **common), tokenizer,
                                  process_index=0, process_count=1)
    assert_same([next(delayed)], [next(local)])  # the first also opens the dataset
    monkeypatch.setattr(delayed_fs, "peak", 0)
    monkeypatch.setattr(delayed_fs, "requests", 0)
    start = time.perf_counter()
    got = next(delayed)
    elapsed = time.perf_counter() - start
    assert_same([got], [next(local)])
    assert delayed_fs.requests >= 64 and delayed_fs.peak >= 32
    assert elapsed < 0.25 * delayed_fs.requests * 0.05, elapsed
