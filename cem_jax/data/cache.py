"""Token files: a split's packed token stream on disk, written atomically, verified when read.

Layout: a header of HEADER_BYTES bytes (MAGIC, then UTF-8 JSON padded with spaces), then the
tokens, little-endian uint16 (when V ≤ 65536) or uint32. The JSON holds the cache `key`, the
`dtype`, `num_tokens`, the `sha256` of the token bytes, and what the writer adds (split stats).
Files are written to a temporary name and renamed into place, so a crash leaves no file at the
final name; a file whose magic, key, size or checksum disagrees anyway (truncated or corrupted
on disk) raises `CacheError` on reading, and the caller rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from cem_jax.fileio import atomic_file

MAGIC = b"CEMTOKS1\n"
HEADER_BYTES = 4096


class CacheError(ValueError):
    """A cache file exists but must not be used; the message says why."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype holding ids < vocab_size."""
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


def write_tokens(path: str | Path, chunks: Iterable[np.ndarray], dtype: np.dtype,
                 header: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Stream 1-D integer arrays into a token file at `path`; returns the full header.

    `header()` is called once `chunks` is exhausted (so the chunks' producer may fill it in);
    its dict must hold a "key"; "dtype", "num_tokens" and "sha256" are added to it.
    """
    digest, count = hashlib.sha256(), 0
    with atomic_file(path) as f:
        f.write(b" " * HEADER_BYTES)
        for chunk in chunks:
            data = np.asarray(chunk).astype(dtype, copy=False).tobytes()
            digest.update(data)
            f.write(data)
            count += len(chunk)
        header = {**header(), "dtype": dtype.str, "num_tokens": count, "sha256": digest.hexdigest()}
        blob = MAGIC + json.dumps(header).encode()
        if len(blob) > HEADER_BYTES:
            raise ValueError(f"token file header of {len(blob)} bytes exceeds {HEADER_BYTES}")
        f.seek(0)
        f.write(blob)
    return header


def read_tokens(path: str | Path, key: str) -> tuple[np.ndarray, dict[str, Any]]:
    """Map a token file read-only: (tokens [N] uint16/uint32 memmap, header dict).

    Raises FileNotFoundError when absent, CacheError when its magic, key, size or checksum is
    wrong (e.g. truncated by a crash).
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or not head.startswith(MAGIC):
        raise CacheError(f"{path}: no token-file header (truncated or not a token file)")
    try:
        header = json.loads(head[len(MAGIC):].decode())
        dtype, count = np.dtype(header["dtype"]), int(header["num_tokens"])
    except (ValueError, KeyError, TypeError) as err:
        raise CacheError(f"{path}: unreadable header ({err})") from None
    if header.get("key") != key:
        raise CacheError(f"{path}: built for key {header.get('key')}, expected {key}")
    size, expected = path.stat().st_size, HEADER_BYTES + count * dtype.itemsize
    if size != expected:
        raise CacheError(f"{path}: {size} bytes, expected {expected} (truncated or corrupt)")
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    if hashlib.sha256(tokens).hexdigest() != header["sha256"]:
        raise CacheError(f"{path}: token checksum mismatch (corrupt)")
    return tokens, header
