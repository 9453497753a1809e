"""The persistent compilation cache (`cem_jax.compilation_cache`): a second start reads what the
first compiled into the default folder (JAX's cache-hit events), trains the same numbers, and
`run.compilation_cache: false` keeps none; a gs:// folder (the storage emulator) holds the
entries too; a folder that cannot be written is one warning."""

from __future__ import annotations

import contextlib
import logging

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache as jax_cache
from train_helpers import train_losses

from cem_jax.compilation_cache import use_compilation_cache
from cem_jax.data import files
from cem_jax.train import load_config, train


@pytest.fixture
def cache_everything():
    """Save every compile (the tiny steps compile in well under JAX's 1 s threshold); restore
    this process's cache settings after the test, for the tests that follow in it."""
    before = (jax.config.jax_compilation_cache_dir,
              jax.config.jax_persistent_cache_min_compile_time_secs)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_compilation_cache_dir", before[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", before[1])
    jax_cache.reset_cache()


@contextlib.contextmanager
def cache_hits():
    """A list that gets one entry per persistent-cache hit while the block runs."""
    hits: list[str] = []

    def listen(event: str, **_):
        if event == "/jax/compilation_cache/cache_hits":
            hits.append(event)

    jax.monitoring.register_event_listener(listen)
    try:
        yield hits
    finally:
        jax.monitoring.unregister_event_listener(listen)


@pytest.mark.slow
def test_a_second_start_reads_the_compiled_steps(tiny_overrides, tmp_path, cache_everything):
    folder = tmp_path / "data_cache" / "xla"  # the default: in the data cache
    base = [*tiny_overrides, "run.steps=4", f"data.cache_dir={tmp_path / 'data_cache'}"]
    with cache_hits() as first:
        train(load_config(None, [*base, f"run.dir={tmp_path / 'a'}"]))
    entries = sorted(p.name for p in folder.iterdir())
    assert any("train_step" in name for name in entries), entries
    with cache_hits() as second:
        train(load_config(None, [*base, f"run.dir={tmp_path / 'b'}"]))
    assert len(second) > len(first) and len(second) >= 2  # the train and eval steps at least
    assert sorted(p.name for p in folder.iterdir()) == entries  # nothing compiled anew
    assert train_losses(tmp_path / "b") == train_losses(tmp_path / "a")  # bit-exact

    off = tmp_path / "off"
    with cache_hits() as none:
        train(load_config(None, [*tiny_overrides, "run.steps=2", f"run.dir={tmp_path / 'c'}",
                                 f"run.compilation_cache_dir={off}",
                                 "run.compilation_cache=false"]))
    assert none == [] and not off.exists()


def test_a_bucket_holds_the_cache(tiny_overrides, tmp_path, gcs_bucket, cache_everything):
    folder = f"{gcs_bucket}/xla"
    base = [*tiny_overrides, "run.steps=2", f"run.compilation_cache_dir={folder}"]
    train(load_config(None, [*base, f"run.dir={tmp_path / 'a'}"]))
    entries = files.glob(f"{folder}/*")
    assert any("train_step" in name for name in entries), entries
    with cache_hits() as hits:
        train(load_config(None, [*base, f"run.dir={tmp_path / 'b'}"]))
    assert len(hits) >= 2


def test_a_folder_that_cannot_be_written_is_one_warning(tmp_path, caplog, cache_everything):
    (tmp_path / "a_file").write_text("not a folder")
    folder = tmp_path / "a_file" / "xla"
    with caplog.at_level(logging.WARNING, logger="cem_jax.compilation_cache"):
        assert use_compilation_cache(load_config(None, [
            f"run.compilation_cache_dir={folder}"])) is None
    assert [r.getMessage() for r in caplog.records] == [
        f"the compilation cache {folder} cannot be written ([Errno 20] Not a directory: "
        f"'{folder}'): compiling without it; set run.compilation_cache_dir to a writable "
        f"folder, or run.compilation_cache=false"]
    assert jax.config.jax_compilation_cache_dir is None
