"""The filesystem layer of the data path: local paths and URLs (`gs://bucket/...`, and any other
protocol fsspec knows) through one set of calls, by fsspec (gcsfs for `gs://`).

Local paths stay plain paths (a leading `~` is the home directory); a URL is anything with a
`scheme://`. Listings are never cached (`invalidate_cache` before each), since other processes
write the same folders (a tokenization split across hosts). Writes of whole files are atomic:
locally a temporary file renamed into place (`cem_jax.fileio.atomic_file`); on a bucket an
object appears only once its upload completes. `gs://` uses the credentials of the environment
(a TPU VM's service account, `gcloud auth application-default login`); tests point
`STORAGE_EMULATOR_HOST` at a local emulator.
"""

from __future__ import annotations

import glob as stdlib_glob
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec

from cem_jax.fileio import atomic_file

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """Whether `path` is a URL (`gs://...`) rather than a local path."""
    return bool(_URL.match(str(path)))


def local(path: str) -> str:
    """A local path with `~` expanded; a URL unchanged."""
    return str(path) if is_url(path) else os.path.expanduser(str(path))


def join(base: str, *parts: str) -> str:
    """`base/part/...` for a local path or a URL."""
    return "/".join([str(base).rstrip("/"), *parts]) if is_url(base) else \
        os.path.join(local(base), *parts)


def _fs(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, bare = fsspec.core.url_to_fs(local(path))
    return fs, bare


def _url(fs: fsspec.AbstractFileSystem, bare: str) -> str:
    """A path fsspec gave back as a URL of `fs`'s protocol (local: the path itself)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return bare if protocol in ("file", "local") else f"{protocol}://{bare}"


@contextmanager
def open_file(path: str, mode: str = "rb") -> Iterator[IO[Any]]:
    """The file `path` opened for reading ("rb", "r") or writing ("wb"; not atomic: use
    `write_bytes` for whole files). Raises FileNotFoundError naming `path`."""
    fs, bare = _fs(path)
    try:
        f = fs.open(bare, mode)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    with f:
        yield f


def read_bytes(path: str, start: int | None = None, stop: int | None = None) -> bytes:
    """Bytes [start, stop) of file `path` (all of it by default). Raises FileNotFoundError."""
    fs, bare = _fs(path)
    try:
        return fs.cat_file(bare, start=start, end=stop)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None


@contextmanager
def writing(path: str) -> Iterator[IO[bytes]]:
    """A binary file to write `path` through, whole or not at all: it appears at `path` once
    the block ends without an error (parent folders are made)."""
    if not is_url(path):
        with atomic_file(local(path)) as f:
            yield f
        return
    fs, bare = _fs(path)
    f = fs.open(bare, "wb")  # the object is created when the upload completes, at close
    try:
        yield f
    except BaseException:
        f.discard()  # the upload started, if any
        f.closed = True  # else garbage collection would close it: upload what was written
        raise
    f.close()


def write_bytes(path: str, data: bytes) -> None:
    """Write file `path` whole (see `writing`)."""
    with writing(path) as f:
        f.write(data)


def exists(path: str) -> bool:
    """Whether a file or folder `path` exists (never from a cached listing)."""
    fs, bare = _fs(path)
    fs.invalidate_cache()
    return fs.exists(bare)


def is_file(path: str) -> bool:
    """Whether `path` is an existing file (not a folder)."""
    fs, bare = _fs(path)
    fs.invalidate_cache()
    return fs.isfile(bare)


def is_dir(path: str) -> bool:
    """Whether `path` is an existing folder (on a bucket: a prefix holding objects)."""
    fs, bare = _fs(path)
    fs.invalidate_cache()
    return fs.isdir(bare)


def info(path: str) -> dict[str, Any]:
    """{"size": bytes, "version": what changes when the file does (the object's generation on
    a bucket, the modification time in ns locally)} of file `path`. Raises FileNotFoundError."""
    if not is_url(path):
        try:
            stat = os.stat(local(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} does not exist") from None
        return {"size": stat.st_size, "version": str(stat.st_mtime_ns)}
    fs, bare = _fs(path)
    fs.invalidate_cache()
    try:
        return _info(fs.info(bare))
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None


def _info(details: dict[str, Any]) -> dict[str, Any]:
    return {"size": int(details["size"]),
            "version": str(details.get("generation") or details.get("etag")
                           or details.get("mtime") or details.get("updated"))}


def glob(pattern: str) -> dict[str, dict[str, Any]]:
    """{path: `info`} of the files (not folders) matching `pattern` (`*`, `?`, `[...]`,
    recursive `**`), sorted by path; paths are relative if `pattern` is, URLs if it is one (a
    bucket lists them with their sizes and generations in one request)."""
    if not is_url(pattern):
        return {p: info(p) for p in sorted(stdlib_glob.glob(local(pattern), recursive=True))
                if os.path.isfile(p)}
    fs, bare = _fs(pattern)
    fs.invalidate_cache()
    found = fs.glob(bare, detail=True)
    return {_url(fs, name): _info(details) for name, details in sorted(found.items())
            if details.get("type") == "file"}
