"""What the processes of a multi-process run (`jax.distributed`) agree on before they train:
that they share the cache folder they tokenize into, that they see the same data, and when
each other's work is done. Through JAX's coordination service (its key-value store and
barriers), not device collectives: a barrier may wait for hours of tokenization."""

from __future__ import annotations

import secrets

import jax
from jax._src import distributed as jax_distributed

from cem_jax.data import files
from cem_jax.data.shards import DatasetError


def _client():
    client = jax_distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized (mesh.distributed=true)")
    return client


def gather(key: str, value: str, timeout_s: float = 600) -> list[str]:
    """Every process's `value` for `key`, in process order (each process gives its own)."""
    client = _client()
    client.key_value_set(f"{key}/{jax.process_index()}", value)
    return [client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000))
            for p in range(jax.process_count())]


def check_shared(folder: str, key: str) -> None:
    """Raise DatasetError in every process unless all of them see what process 0 writes in
    `folder` (the cache folder every process tokenizes its share into)."""
    probe = files.join(folder, ".shared-probe")
    nonce = secrets.token_hex(8)
    if jax.process_index() == 0:
        files.write_bytes(probe, nonce.encode())
    written = gather(f"{key}/probe", nonce)[0]
    try:
        seen = files.read_bytes(probe).decode() == written
    except (FileNotFoundError, UnicodeDecodeError):
        seen = False
    blind = [p for p, ok in enumerate(gather(f"{key}/seen", str(int(seen)))) if ok != "1"]
    if blind:
        raise DatasetError(
            f"processes {blind} do not see the cache folder {folder} that process 0 writes: "
            f"the processes must share it to tokenize the corpus together. Run `cem-data "
            f"tokenize --out DIR` once into a place every process reads (a gs:// bucket, a "
            f"shared file system), then train with data.corpus=DIR; or set data.cache_dir to "
            f"such a place")


def check_same(key: str, value: str, what: str) -> None:
    """Raise DatasetError naming the processes whose `value` differs from process 0's."""
    values = gather(key, value)
    if differ := [p for p, v in enumerate(values) if v != values[0]]:
        raise DatasetError(f"processes {differ} see {what} other than process 0's "
                           f"({values[differ[0]][:16]}… vs {values[0][:16]}…): give every "
                           f"process the same data section and files")
