"""JAX's persistent compilation cache for cem_jax's commands.

Every start compiles its steps again (~7 s for the `make train` model on a CPU, minutes for the
100M step on a pod after each preemption). `cem-train`, `cem-eval` and `cem-sample` keep what
XLA compiled in JAX's persistent cache (`jax_compilation_cache_dir`), so a restart with the
same model, mesh and JAX reads it back instead: by default in `<data cache>/xla` (the
folder of `data.cache_dir`, `$CEM_JAX_CACHE` or ~/.cache/cem_jax), elsewhere with
`run.compilation_cache_dir` (a local path or a `gs://` URL, which JAX reads through etils'
epath on fsspec and gcsfs, the filesystem layer of `cem_jax.data.files`); `run.compilation_cache:
false` turns it off. JAX keys an entry by the computation, the devices, the compile options
and its own version, so a changed model or another JAX never reads a stale one; it saves only
computations that took at least `jax_persistent_cache_min_compile_time_secs` (1 s) to compile.
A folder that cannot be written at the start (a file system read-only or full, a bucket without
permission) is one warning line, and the command compiles without the cache; a write that fails
later (the disk filled up) loses only that entry, silently (an entry it cannot read is JAX's
warning, and compiled again). Measured: benchmarks/results/compilation_cache_cpu.txt.
"""

from __future__ import annotations

import logging
import os
import warnings

import jax
from jax.experimental.compilation_cache import compilation_cache as jax_cache

from cem_jax.data import files
from cem_jax.data.pipeline import cache_root
from cem_jax.train_config import TrainConfig

logger = logging.getLogger(__name__)


def use_compilation_cache(cfg: TrainConfig) -> str | None:
    """Point this process's JAX at the compilation cache of a run's config: the folder
    `run.compilation_cache_dir` (None: `<data cache>/xla` of its data section; a relative path
    from the current directory), or turn it off when `run.compilation_cache` is false or the
    folder cannot be written (a warning says why); returns the folder used (None: off). Call
    it before the first compile: JAX settles on a cache at its first compile, and a call that
    changes the folder later resets it. Raises ValueError when the default folder's parent is
    a file (`cem_jax.data.pipeline.cache_root`)."""
    directory, data = cfg.run.compilation_cache_dir, cfg.data
    folder = ((directory or files.join(cache_root(data), "xla")) if cfg.run.compilation_cache
              else None)
    if folder is not None and not files.is_url(folder):
        folder = os.path.abspath(files.local(folder))
    if folder is not None:
        try:
            files.write_bytes(files.join(folder, ".writable"), b"")
        except OSError as err:
            logger.warning("the compilation cache %s cannot be written (%s): compiling without "
                           "it; set run.compilation_cache_dir to a writable folder, or "
                           "run.compilation_cache=false", folder, err)
            folder = None
    # a full disk later: the entry is lost, the run goes on (its own writes report the disk)
    warnings.filterwarnings("ignore", "Error writing persistent compilation cache entry")
    if jax.config.jax_compilation_cache_dir != folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        jax_cache.reset_cache()
    return folder
