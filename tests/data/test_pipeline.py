"""The grain pipeline: packed rows, seeded shuffling, per-process shards, exact resumption, and
evaluation batches that cover a split once."""

import json
import subprocess
import sys
import textwrap

import grain
import numpy as np
import pytest
from etils import epath

from cem_jax.data import (
    load_tokenizer,
    load_tokens,
    make_eval_batches,
    make_train_iterator,
    packed_batch,
)

KEYS = ("inputs", "targets", "segment_ids", "positions")


def take(iterator, n):
    return [next(iterator) for _ in range(n)]


def rows(batches):
    """All rows of a list of batches, as tuples of the inputs followed by the last target."""
    return [tuple(i) + (t[-1],) for b in batches for i, t in zip(b["inputs"], b["targets"],
                                                                 strict=True)]


def windows(cfg, tokenizer):
    """Every training window of the packed stream, in stream order."""
    tokens = np.asarray(load_tokens(cfg, tokenizer, "train").tokens, dtype=np.int64)
    n = (len(tokens) - 1) // cfg.seq_len
    return [tuple(tokens[w * cfg.seq_len: w * cfg.seq_len + cfg.seq_len + 1]) for w in range(n)]


def test_packed_batch_marks_documents():
    eos = 3
    rows_ = np.array([[9, 8, 3, 7, 6, 3, 5, 4, 2],
                      [3, 5, 5, 5, 5, 5, 5, 5, 5]])
    batch = packed_batch(rows_, eos)
    np.testing.assert_array_equal(batch["inputs"], rows_[:, :-1])
    np.testing.assert_array_equal(batch["targets"], rows_[:, 1:])
    np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 2, 2, 2, 3, 3, 3],
                                                         [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(batch["positions"], [[0, 1, 0, 1, 2, 0, 1, 2],
                                                       [0, 1, 2, 3, 4, 5, 6, 7]])
    assert all(v.dtype == np.int32 and v.shape == (2, 8) for v in batch.values())


def test_batches_are_int32_windows_of_the_stream(small_cfg):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    batch = next(make_train_iterator(cfg, tokenizer, process_index=0, process_count=1))
    assert sorted(batch) == sorted(KEYS)
    assert all(batch[k].shape == (4, 32) and batch[k].dtype == np.int32 for k in KEYS)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    assert set(rows([batch])) <= set(windows(cfg, tokenizer))
    for key, value in packed_batch(np.concatenate([batch["inputs"], batch["targets"][:, -1:]],
                                                  axis=1), tokenizer.eos_id).items():
        np.testing.assert_array_equal(batch[key], value)


def test_process_layout_defaults_to_jax(small_cfg):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    default = next(make_train_iterator(cfg, tokenizer))  # jax: process 0 of 1
    explicit = next(make_train_iterator(cfg, tokenizer, process_index=0, process_count=1))
    np.testing.assert_array_equal(default["inputs"], explicit["inputs"])
    assert default["inputs"].shape == (cfg.batch_size, cfg.seq_len)


def test_an_epoch_shows_every_window_once_then_reshuffles(small_cfg):
    cfg = small_cfg(batch_size=1)
    tokenizer = load_tokenizer(cfg.tokenizer)
    all_windows = windows(cfg, tokenizer)
    n = len(all_windows)
    seen = rows(take(make_train_iterator(cfg, tokenizer, process_index=0, process_count=1),
                     2 * n))
    assert sorted(seen[:n]) == sorted(all_windows) == sorted(seen[n:])
    assert seen[:n] != all_windows  # shuffled
    assert seen[:n] != seen[n:]  # a new order in the second epoch


def test_same_seed_same_batches_other_seed_other_batches(small_cfg):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    a, b = (rows(take(make_train_iterator(cfg, tokenizer, process_index=0, process_count=1), 5))
            for _ in range(2))
    c = rows(take(make_train_iterator(small_cfg(seed=8), tokenizer, process_index=0,
                                      process_count=1), 5))
    assert a == b and a != c


def test_processes_get_disjoint_shards_of_the_global_batch(small_cfg):
    cfg = small_cfg(batch_size=4)
    tokenizer = load_tokenizer(cfg.tokenizer)
    n = len(windows(cfg, tokenizer))
    steps = n // 4
    single = take(make_train_iterator(cfg, tokenizer, process_index=0, process_count=1), steps)
    shards = [take(make_train_iterator(cfg, tokenizer, process_index=p, process_count=2), steps)
              for p in (0, 1)]
    assert all(b["inputs"].shape == (2, 32) for shard in shards for b in shard)
    first, second = rows(shards[0]), rows(shards[1])
    assert not set(first) & set(second)  # disjoint within the epoch
    assert len(set(first)) == len(first) == len(second) == 2 * steps
    for step in range(steps):  # together, the processes see the single-process global batch
        assert sorted(rows([single[step]])) == sorted(rows([shards[0][step], shards[1][step]]))


def test_state_round_trips_in_process(small_cfg):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    iterator = make_train_iterator(cfg, tokenizer, process_index=1, process_count=2)
    take(iterator, 3)
    state = iterator.get_state()
    assert json.loads(json.dumps(state)) == state
    expected = take(iterator, 4)
    resumed = make_train_iterator(cfg, tokenizer, process_index=1, process_count=2)
    resumed.set_state(state)
    for got, want in zip(take(resumed, 4), expected, strict=True):
        for key in KEYS:
            np.testing.assert_array_equal(got[key], want[key])


def test_grain_checkpoint_handler_saves_and_restores_it(small_cfg, tmp_path):
    """The orbax handler a training checkpoint uses (one JSON file per process)."""
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    iterator = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
    take(iterator, 2)
    grain.checkpoint.CheckpointHandler().save(epath.Path(tmp_path), item=iterator)
    assert json.loads((tmp_path / "process_0-of-1.json").read_text()) == {"next_index": 2}
    expected = next(iterator)
    restored = grain.checkpoint.CheckpointHandler().restore(
        epath.Path(tmp_path), item=make_train_iterator(cfg, tokenizer, process_index=0,
                                                       process_count=1))
    np.testing.assert_array_equal(next(restored)["inputs"], expected["inputs"])


def test_threads_and_prefetch_do_not_change_the_batches(small_cfg):
    tokenizer = load_tokenizer(small_cfg().tokenizer)
    a, b = (rows(take(make_train_iterator(small_cfg(num_threads=threads, prefetch=prefetch),
                                          tokenizer, process_index=0, process_count=1), 6))
            for threads, prefetch in ((0, 0), (4, 16)))
    assert a == b


RESUME_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from cem_jax.data import DataConfig, load_tokenizer, make_train_iterator
    cfg = DataConfig(**json.loads(sys.argv[1]))
    iterator = make_train_iterator(cfg, load_tokenizer(cfg.tokenizer), process_index=0,
                                   process_count=1)
    with open(sys.argv[2]) as f:
        iterator.set_state(json.load(f))
    batches = [next(iterator) for _ in range(3)]
    np.savez(sys.argv[3], **{f"{i}-{k}": v for i, b in enumerate(batches) for k, v in b.items()})
""")


def test_state_round_trips_in_a_fresh_process(small_cfg, tmp_path):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    iterator = make_train_iterator(cfg, tokenizer, process_index=0, process_count=1)
    take(iterator, 5)
    (tmp_path / "state.json").write_text(json.dumps(iterator.get_state()))
    expected = take(iterator, 3)
    config = json.dumps({k: getattr(cfg, k) for k in cfg.__dataclass_fields__})
    subprocess.run([sys.executable, "-c", RESUME_SCRIPT, config, str(tmp_path / "state.json"),
                    str(tmp_path / "next.npz")], check=True, timeout=120)
    got = np.load(tmp_path / "next.npz")
    assert len(got.files) == 3 * len(KEYS)
    for i, want in enumerate(expected):
        for key in KEYS:
            np.testing.assert_array_equal(got[f"{i}-{key}"], want[key])


def test_corpus_shorter_than_one_row_is_an_error(small_cfg, tmp_path):
    (tmp_path / "short.txt").write_text("the king")
    cfg = small_cfg(corpus=str(tmp_path / "short.txt"), seq_len=64)
    with pytest.raises(ValueError, match=r"has \d+ tokens, fewer than one row of seq_len \+ 1 "
                                         r"= 65: lower seq_len or add text"):
        make_train_iterator(cfg, load_tokenizer(cfg.tokenizer), process_index=0, process_count=1)


@pytest.mark.parametrize("overrides, index, count, message", [
    ({"batch_size": 6}, 0, 4, "batch_size 6 .* not divisible by process_count 4"),
    ({}, 2, 2, r"process_index 2 is not in \[0, 2\)"),
])
def test_bad_process_layout(small_cfg, overrides, index, count, message):
    cfg = small_cfg(**overrides)
    tokenizer = load_tokenizer(cfg.tokenizer)
    for make in (make_train_iterator, make_eval_batches):
        with pytest.raises(ValueError, match=message):
            make(cfg, tokenizer, process_index=index, process_count=count)


@pytest.mark.parametrize("process_count", [1, 2])
def test_eval_batches_cover_the_split_once(small_cfg, process_count):
    cfg = small_cfg(batch_size=4, seq_len=32)
    tokenizer = load_tokenizer(cfg.tokenizer)
    stream = np.asarray(load_tokens(cfg, tokenizer, "validation").tokens)
    local = cfg.batch_size // process_count
    shards = [list(make_eval_batches(cfg, tokenizer, "validation", process_index=p,
                                     process_count=process_count))
              for p in range(process_count)]
    assert len({len(s) for s in shards}) == 1  # every process runs the same number of steps
    hits = np.zeros(len(stream), dtype=int)
    for p, shard in enumerate(shards):
        for k, batch in enumerate(shard):
            assert batch["weights"].dtype == np.float32
            assert all(batch[key].shape == (local, 32) for key in (*KEYS, "weights"))
            pad = batch["weights"] == 0
            assert (batch["segment_ids"][pad] == 0).all() and (batch["positions"][pad] == 0).all()
            assert (batch["inputs"][pad] == tokenizer.pad_id).all()
            assert (batch["segment_ids"][~pad] >= 1).all()
            for i in range(local):  # row i of this batch is global row (k·local + i)·P + p
                start = ((k * local + i) * process_count + p) * cfg.seq_len
                real = np.flatnonzero(batch["weights"][i])
                np.testing.assert_array_equal(batch["targets"][i, real], stream[start + 1 + real])
                np.testing.assert_array_equal(batch["inputs"][i, real], stream[start + real])
                hits[start + 1 + real] += 1
    assert (hits[1:] == 1).all() and hits[0] == 0  # every target exactly once
    assert sum(b["weights"].sum() for s in shards for b in s) == len(stream) - 1


def test_eval_batches_are_deterministic_and_finite(small_cfg):
    cfg = small_cfg()
    tokenizer = load_tokenizer(cfg.tokenizer)
    a = make_eval_batches(cfg, tokenizer, "validation", process_index=0, process_count=1)
    b = make_eval_batches(cfg, tokenizer, "validation", process_index=0, process_count=1)
    assert len(a) == len(list(a)) > 1
    for x, y in zip(a, b, strict=True):
        for key in x:
            np.testing.assert_array_equal(x[key], y[key])


def test_bits_per_byte(small_cfg):
    cfg = small_cfg()
    stats = load_tokens(cfg, load_tokenizer(cfg.tokenizer), "validation").stats
    assert stats.bits_per_byte(np.log(2)) == pytest.approx(stats.tokens / stats.bytes)
    assert stats.bits_per_byte(0.0) == 0.0
    assert stats.bytes_per_token == stats.bytes / stats.tokens > 1
