"""The filesystem layer of the data path: local paths and URLs (`gs://bucket/...`, and any other
protocol fsspec knows) through one set of calls, by fsspec (gcsfs for `gs://`).

Local paths stay plain paths (a leading `~` is the home directory); a URL is anything with a
`scheme://`. Listings are never cached (`invalidate_cache` before each), since other processes
write the same folders (a tokenization split across hosts). Writes of whole files are atomic:
locally a temporary file renamed into place (`cem_jax.fileio.atomic_file`); on a bucket an
object appears only once its upload completes. Reads of many byte ranges go out together
(`read_ranges`, what the batch reader uses for a step's rows): on a bucket as concurrent
requests, so that a step costs about one request's latency (~30 ms on `gs://`) rather than
one per row. `gs://` uses the credentials of the environment (a TPU VM's service account,
`gcloud auth application-default login`); tests point `STORAGE_EMULATOR_HOST` at a local
emulator.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import glob as stdlib_glob
import inspect
import logging
import os
import posixpath
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec

from cem_jax.data.storage_errors import NOTE, storage_error
from cem_jax.fileio import atomic_file, umask_mode

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: str) -> bool:
    """Whether `path` is a URL (`gs://...`) rather than a local path."""
    return bool(_URL.match(str(path)))


def local(path: str) -> str:
    """A local path with `~` expanded; a URL unchanged, but for `gcs://`, gcsfs's other name of
    `gs://`, written `gs://` (the one orbax's paths know)."""
    path = str(path)
    if not is_url(path):
        return os.path.expanduser(path)
    return "gs://" + path[len("gcs://"):] if path.startswith("gcs://") else path


def join(base: str, *parts: str) -> str:
    """`base/part/...` for a local path or a URL."""
    return "/".join([str(base).rstrip("/"), *parts]) if is_url(base) else \
        os.path.join(local(base), *parts)


def _fs(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, bare = fsspec.core.url_to_fs(local(path), **_options(path))
    return fs, bare


def _url(fs: fsspec.AbstractFileSystem, bare: str) -> str:
    """A path fsspec gave back as a URL of `fs`'s protocol (local: the path itself)."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return bare if protocol in ("file", "local") else f"{protocol}://{bare}"


# Storage failures end a command with one line (`cem_jax.data.storage_errors`), not a
# traceback: each call here that names a URL notes it on the exception; gcsfs's requests are
# bounded in time (`_options`), and its own log of a request out of retries (its traceback,
# then the same exception raised) is dropped.

STORAGE_CONNECT_S = 3.0  # to connect to the storage (gcsfs's default: no limit)
STORAGE_SILENCE_S = 60.0  # of silence from the storage once a request is sent (likewise)
DISCARD_S = 2.0  # at most, to cancel an upload given up (`writing`)
def _note_url(err: BaseException, path: Any) -> None:
    """Note URL `path` on storage failure `err`, unless a note names one already (the
    innermost call's is the one)."""
    if (isinstance(path, str) and is_url(path) and storage_error(err) is not None
            and not any(str(n).startswith(NOTE) for n in getattr(err, "__notes__", ()))):
        err.add_note(NOTE + path)


def _noting_url(func: Callable) -> Callable:
    """`func(path, ...)` (a function or a generator, a `contextmanager`'s), a storage failure
    it raises noted with `path` when that is a URL (`storage_error` names it; the innermost
    call's note is the one)."""

    first = next(iter(inspect.signature(func).parameters))  # `path`'s name

    def note(err: Exception, args: tuple, kwargs: dict) -> None:
        _note_url(err, args[0] if args else kwargs.get(first))

    if inspect.isgeneratorfunction(func):
        @functools.wraps(func)
        def generator(*args, **kwargs):
            try:
                return (yield from func(*args, **kwargs))
            except Exception as err:
                note(err, args, kwargs)
                raise
        return generator

    @functools.wraps(func)
    def call(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as err:
            note(err, args, kwargs)
            raise
    return call


def _options(path: str) -> dict[str, Any]:
    """The file system options of `path` beyond fsspec's configuration: gcsfs's requests given
    up after STORAGE_CONNECT_S to connect or STORAGE_SILENCE_S of silence (its default: never,
    so that a host that does not answer held each try for minutes); a try given up is retried
    as gcsfs does (6 tries, ~30 s of back-off in all, not configurable), so that a call to a
    storage that cannot be reached fails in ~35 s (a refused connection) to ~50 s (no answer
    to connect), not minutes; a storage that accepts connections but never answers, in ~7
    minutes. A `requests_timeout` in fsspec's configuration is kept."""
    protocol = str(path).split("://", 1)[0] if is_url(path) else ""
    if protocol not in ("gs", "gcs") or "requests_timeout" in fsspec.config.conf.get(protocol,
                                                                                       {}):
        return {}
    import aiohttp

    return {"requests_timeout": aiohttp.ClientTimeout(sock_connect=STORAGE_CONNECT_S,
                                                      sock_read=STORAGE_SILENCE_S)}


class _NoRetryTraceback(logging.Filter):
    """Drops gcsfs's log of a request out of retries or not retried, a traceback of ~70 lines
    at ERROR, just before gcsfs raises the same exception to its caller."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.funcName == "retry_request" and record.exc_info)


logging.getLogger("gcsfs").addFilter(_NoRetryTraceback())


@contextmanager
@_noting_url
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


@_noting_url
def read_bytes(path: str, start: int | None = None, stop: int | None = None) -> bytes:
    """Bytes [start, stop) of file `path` (all of it by default). Raises FileNotFoundError."""
    fs, bare = _fs(path)
    try:
        return fs.cat_file(bare, start=start, end=stop)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None


@_noting_url
def read_ranges(paths: str | list[str], starts: list[int], stops: list[int]) -> list[bytes]:
    """Bytes [starts[k], stops[k]) of file `paths[k]` (of the one file `paths`, a string) for
    each k, read together: local files by `os.pread`; files behind a URL by fsspec's
    `cat_ranges`, which an async file system (gcsfs, s3fs, http) runs as concurrent range
    requests on its event loop (gcsfs: up to its aiohttp session's 100 connections at once),
    so that N ranges cost about one request's latency, not N (a file system without async
    reads them one after another). A range running past a file's end stops there; starts are
    ≥ 0. Raises FileNotFoundError naming a missing file."""
    paths = [paths] * len(starts) if isinstance(paths, str) else list(paths)
    if not len(paths) == len(starts) == len(stops):
        raise ValueError(f"{len(paths)} paths, {len(starts)} starts, {len(stops)} stops")
    out: list[Any] = [None] * len(paths)
    remote: dict[str, list[int]] = {}  # the ranges of each URL scheme
    descriptors: dict[str, int] = {}
    try:
        for k, path in enumerate(paths):
            if is_url(path):
                remote.setdefault(path.split("://", 1)[0], []).append(k)
                continue
            if path not in descriptors:
                try:
                    descriptors[path] = os.open(local(path), os.O_RDONLY)
                except FileNotFoundError:
                    raise FileNotFoundError(f"{path} does not exist") from None
            out[k] = os.pread(descriptors[path], max(stops[k] - starts[k], 0), starts[k])
    finally:
        for fd in descriptors.values():
            os.close(fd)
    for ranges in remote.values():
        fs, _ = _fs(paths[ranges[0]])
        bare = {paths[k]: fs._strip_protocol(paths[k]) for k in ranges}
        try:
            got = fs.cat_ranges([bare[paths[k]] for k in ranges], [starts[k] for k in ranges],
                                [stops[k] for k in ranges], on_error="return")
        except Exception as err:
            _note_url(err, paths[ranges[0]])
            raise
        for k, data in zip(ranges, got, strict=True):
            if isinstance(data, FileNotFoundError):
                raise FileNotFoundError(f"{paths[k]} does not exist") from None
            if isinstance(data, BaseException):
                _note_url(data, paths[k])  # a list of paths: the decorator notes none
                raise data
            out[k] = data
    return out


@contextmanager
@_noting_url
def writing(path: str) -> Iterator[IO[bytes]]:
    """A binary file to write `path` through, whole or not at all: it appears at `path` once
    the block ends without an error (parent folders are made). On a URL, what the block or the
    upload raises (a stop: KeyboardInterrupt, `cem_jax.exits.StoppedBySignal`; an error; a
    storage failure) propagates as itself, the upload given up (`_give_up`: seconds at most)."""
    if not is_url(path):
        with atomic_file(local(path)) as f:
            yield f
        return
    fs, bare = _fs(path)
    f = fs.open(bare, "wb")  # the object is created when the upload completes, at close
    try:
        yield f
        f.close()
    except BaseException as err:
        _give_up(f, err)
        raise


def _give_up(f: Any, err: BaseException) -> None:
    """Nothing of upload `f` is to appear. Cancelling the upload it started, if it did, frees
    the storage's side at once (else it expires there): a courtesy, given DISCARD_S in a
    thread, skipped when `err` is a storage failure; its own failure is ignored (`err` is what
    the caller sees)."""
    f.closed = True  # first (a second Ctrl-C may come): else garbage collection would close it,
    # uploading what was written
    if storage_error(err) is None:
        def discard() -> None:
            with contextlib.suppress(Exception):
                f.discard()

        thread = threading.Thread(target=discard, name="discard an upload", daemon=True)
        thread.start()
        thread.join(DISCARD_S)


def write_bytes(path: str, data: bytes) -> None:
    """Write file `path` whole (see `writing`)."""
    with writing(path) as f:
        f.write(data)


@_noting_url
def exists(path: str) -> bool:
    """Whether a file or folder `path` exists (never from a cached listing)."""
    fs, bare = _fs(path)
    fs.invalidate_cache()
    return fs.exists(bare)


@_noting_url
def is_file(path: str) -> bool:
    """Whether `path` is an existing file (not a folder). On a URL, a storage failure raises
    (fsspec's `isfile` says False)."""
    fs, bare = _fs(path)
    fs.invalidate_cache()
    return _remote_type(fs, bare) == "file" if is_url(path) else fs.isfile(bare)


@_noting_url
def is_dir(path: str) -> bool:
    """Whether `path` is an existing folder (on a bucket: a prefix holding objects). On a URL,
    a storage failure raises (fsspec's `isdir` says False)."""
    fs, bare = _fs(path)
    fs.invalidate_cache()
    return _remote_type(fs, bare) == "directory" if is_url(path) else fs.isdir(bare)


def _remote_type(fs: fsspec.AbstractFileSystem, bare: str) -> str | None:
    """"file" or "directory": what is at `bare` on `fs` (a bucket), None when nothing is; a
    storage failure raises."""
    try:
        return fs.info(bare)["type"]
    except Exception as err:
        if storage_error(err) is not None:
            raise
        return None


@_noting_url
def info(path: str) -> dict[str, Any]:
    """{"size": bytes, "version": what changes when the file does (the object's generation on
    a bucket, the modification time in ns locally), "modified": its last change (an aware UTC
    datetime; the bucket's clock there)} of file `path`. Raises FileNotFoundError."""
    if not is_url(path):
        try:
            stat = os.stat(local(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{path} does not exist") from None
        return {"size": stat.st_size, "version": str(stat.st_mtime_ns),
                "modified": datetime.datetime.fromtimestamp(stat.st_mtime, datetime.UTC)}
    fs, bare = _fs(path)
    fs.invalidate_cache()
    try:
        details = fs.info(bare)
        modified = details.get("mtime") or fs.modified(bare)  # gcsfs's info has it
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    if modified.tzinfo is None:
        modified = modified.replace(tzinfo=datetime.UTC)
    return {**_info(details), "modified": modified}


def _info(details: dict[str, Any]) -> dict[str, Any]:
    return {"size": int(details["size"]),
            "version": str(details.get("generation") or details.get("etag")
                           or details.get("mtime") or details.get("updated"))}


@_noting_url
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


# What a run directory needs beyond the data path (`cem_jax.rundir`, `cem_jax.train`): text
# files written whole, folder listings, removal, and a file created only where none is.


def read_text(path: str) -> str:
    """The UTF-8 text of file `path`. Raises FileNotFoundError naming `path`."""
    return read_bytes(path).decode()


def write_text(path: str, text: str) -> None:
    """Write file `path` whole, as UTF-8 (see `writing`)."""
    write_bytes(path, text.encode())


def make_dirs(path: str) -> None:
    """Make folder `path` and its parents (a bucket has no folders: nothing to do there).
    Raises OSError as `os.makedirs` does."""
    if not is_url(path):
        os.makedirs(local(path), exist_ok=True)


@_noting_url
@_noting_url
def names(path: str) -> list[str]:
    """The sorted names of the files and folders directly in folder `path` ([] when it does
    not exist)."""
    fs, bare = _fs(path)
    fs.invalidate_cache()
    try:
        listed = fs.ls(bare, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted({posixpath.basename(str(p).rstrip("/")) for p in listed} - {""})


@_noting_url
@_noting_url
def remove(path: str) -> None:
    """Remove file `path` if it exists."""
    fs, bare = _fs(path)
    try:
        fs.rm_file(bare)
    except FileNotFoundError:
        pass


@_noting_url
@_noting_url
def remove_tree(path: str) -> None:
    """Remove folder `path` with everything in it, if it exists (on a bucket: every object
    under the prefix `path/`)."""
    if not is_url(path):
        shutil.rmtree(local(path), ignore_errors=True)
        return
    fs, bare = _fs(path)
    fs.invalidate_cache()
    try:
        fs.rm(bare.rstrip("/") + "/", recursive=True)
    except FileNotFoundError:
        pass


@_noting_url
@_noting_url
def create_new(path: str, data: bytes) -> bool:
    """Create file `path` holding `data` only if no file is there, atomically against other
    processes and hosts: O_EXCL locally, a generation precondition on a bucket (`gs://`:
    ifGenerationMatch=0). Returns False, writing nothing, when the file exists."""
    if not is_url(path):
        make_dirs(os.path.dirname(local(path)) or ".")
        try:
            fd = os.open(local(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, umask_mode(0o666))
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return True
    fs, bare = _fs(path)
    try:
        fs.pipe_file(bare, data, mode="create")
    except FileExistsError:
        return False
    return True
