"""Corpora as sources of documents: a corpus spec resolved to its files and format, cut into
units of work (what one tokenization worker does at a time), fingerprinted from metadata.

A spec is "shakespeare" (the built-in corpus of `cem_jax.data.shakespeare`; "milton" is its
out-of-domain split) or `[FORMAT:]PATH_OR_GLOB`, a local path or a URL (`gs://bucket/*.parquet`),
FORMAT one of `cem_jax.data.formats.FORMATS` (without it, the format follows each file's name,
`formats.format_of`). A spec naming an existing file is that file, whatever its name holds; any
other spec with `*`, `?` or `[` is a glob (`**` recursive), its files sorted.

Units. A unit is a run of consecutive files (or, for the built-in corpus, of works) holding
about `UNIT_BYTES` of data, or a run of the parts of a file larger than that whose format splits
(`formats.Format.parts`: a Parquet file's row groups); any other file larger than that is a unit
alone. Units depend on the files' names and sizes (and a large Parquet file's row-group sizes)
only, so every process and every run cuts a source alike: a tokenized dataset has one shard per
unit and split, and an interrupted tokenization resumes at its first unfinished unit.

Fingerprint: what identifies the text without reading it: the archive's SHA-256 and the works
for the built-in corpus; every file's path, size and version (modification time, or a bucket
object's generation) for a user's corpus; the format and reading options.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterator

from cem_jax.data import files, formats, shakespeare
from cem_jax.data.formats import BY_NAME, FORMATS, Document, Part
from cem_jax.data.formats.common import decode

BUILTIN = ("shakespeare", "milton")
UNIT_BYTES = 64 * 2**20  # a unit of work holds about this much (files are not cut)
BUILTIN_UNIT_BYTES = 2**20  # the built-in corpus (5 MB) in units of about 1 MB of works
READING_VERSION = 2  # bump when reading or normalization changes: it invalidates datasets


def digest(identity: list) -> str:
    """Hex SHA-256 of `identity` (JSON values) as JSON: how sources, datasets and cached
    tokenizers are named."""
    return hashlib.sha256(json.dumps(identity).encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Unit:
    """A unit of work: the files `first` … `last` of its source (works, for a built-in one),
    or, with `part`, the part `part` (Parquet: row groups) of the file `first` (= `last`);
    `size` bytes of them in all."""

    index: int
    first: int
    last: int
    size: int
    part: Part | None = None


@dataclasses.dataclass(frozen=True)
class Source:
    """One corpus spec resolved: `kind` is "shakespeare", "milton" or a format of `FORMATS`;
    "auto" when the files' names give different formats (each file is read as its name says).
    `files` are the user's files (paths or URLs) with their `sizes` and `versions`, or the
    verified archive for a built-in kind, whose `works` it holds."""

    spec: str
    kind: str
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    versions: tuple[str, ...]
    works: tuple[str, ...] = ()
    text_column: str = "text"
    allow_invalid_utf8: bool = False

    @property
    def description(self) -> str:
        """A one-line human-readable summary."""
        if self.kind in BUILTIN:
            name = "Milton" if self.kind == "milton" else "Shakespeare"
            return f"{name} ({len(self.works)} works)"
        n, kind = len(self.files), "" if self.kind == "auto" else f"{self.kind} "
        return f"{kind}corpus {self.spec!r} ({n} file{'' if n == 1 else 's'})"

    def fingerprint(self) -> str:
        """Hex SHA-256 identifying the text this source yields (from metadata, nothing read)."""
        if self.kind in BUILTIN:
            identity = [shakespeare.ARCHIVE_SHA256, list(self.works)]
        else:
            identity = [[_absolute(f), size, str(version)] for f, size, version
                        in zip(self.files, self.sizes, self.versions, strict=True)]
        return digest([READING_VERSION, self.kind, identity, self.text_column,
                       self.allow_invalid_utf8])

    def units(self) -> tuple[Unit, ...]:
        """The units of work in document order (see the module docstring). Raises ValueError
        (one line naming the file) for a large Parquet file that is not one."""
        if self.kind in BUILTIN:
            works = shakespeare.read_works(self.files[0], _folder(self.kind))
            sizes, target = [len(works[w]) for w in self.works], BUILTIN_UNIT_BYTES
        else:
            sizes, target = list(self.sizes), UNIT_BYTES
        units: list[Unit] = []
        first, held = 0, 0
        for i, size in enumerate(sizes):
            if size > target:  # alone: the files before it close their unit first
                if held:
                    units.append(Unit(len(units), first, i - 1, held))
                if parts := self._parts(i):
                    units += self._part_units(i, len(units), parts)
                else:
                    units.append(Unit(len(units), i, i, size))
                first, held = i + 1, 0
                continue
            held += size
            if held >= target or i == len(sizes) - 1:
                units.append(Unit(len(units), first, i, held))
                first, held = i + 1, 0
        return tuple(units)

    def _format(self, i: int) -> str:
        return formats.format_of(self.files[i]) if self.kind == "auto" else self.kind

    def _parts(self, i: int) -> Callable[..., list[Part]] | None:
        """How file `i` splits into parts (`formats.Format.parts`); None: it is read whole (a
        built-in corpus's works too)."""
        row = BY_NAME.get(self._format(i))
        return row.parts if row else None

    def _part_units(self, i: int, index: int, parts: Callable[..., list[Part]]) -> list[Unit]:
        """Units of about UNIT_BYTES of text of the parts (Parquet: row groups) of file `i`."""
        units, start, held = [], 0, 0
        groups = parts(self.files[i], text_column=self.text_column)
        for g, group in enumerate(groups):
            held += group.size
            if held >= UNIT_BYTES or g == len(groups) - 1:
                units.append(Unit(index + len(units), i, i, held,
                                  Part(groups[start].start, group.stop, held)))
                start, held = g + 1, 0
        return units

    def documents(self, unit: Unit | None = None) -> Iterator[Document]:
        """The documents of `unit` (None: of the whole source) in order, empty ones included.
        Raises ValueError naming the file (and line or record) of text that cannot be read."""
        units = self.units() if unit is None else (unit,)
        for u in units:
            if self.kind in BUILTIN:
                works = shakespeare.read_works(self.files[0], _folder(self.kind))
                for work in self.works[u.first:u.last + 1]:
                    yield Document(work, decode(works[work], work, self.allow_invalid_utf8))
                continue
            for i in range(u.first, u.last + 1):
                yield from formats.documents(self.files[i], self._format(i), part=u.part,
                                             text_column=self.text_column,
                                             allow_invalid_utf8=self.allow_invalid_utf8)


def builtin_source(kind: str, archive: str, works: tuple[str, ...]) -> Source:
    """The built-in `kind` ("shakespeare" or "milton") holding `works` of the verified
    `archive`."""
    return Source(kind, kind, (str(archive),), (0,), ("",), works)


def user_source(spec: str, *, text_column: str = "text",
                allow_invalid_utf8: bool = False) -> Source:
    """The `Source` of a user's corpus spec `[FORMAT:]PATH_OR_GLOB`.

    Raises FileNotFoundError (no such file, a glob matching no file, a folder), ValueError (an
    unknown FORMAT prefix: the message names the formats)."""
    kind, pattern = _format_prefix(spec)
    if files.is_file(pattern):  # an existing file is itself, whatever its name holds
        found = {files.local(pattern): files.info(pattern)}
    elif any(c in pattern for c in "*?["):
        found = files.glob(pattern)
        if not found:
            raise FileNotFoundError(f"corpus pattern {pattern!r} matched no files")
    elif files.is_dir(pattern) and files.is_dir(files.join(pattern, "units")):
        raise FileNotFoundError(f"corpus path {pattern!r} is a tokenized dataset whose "
                                f"tokenization has not finished (no manifest.json): run the "
                                f"same `cem-data tokenize --out {pattern}` again (each --part "
                                f"I/N, if it was split), then train on it")
    elif files.is_dir(pattern):
        raise FileNotFoundError(f"corpus path {pattern!r} is a directory: give a file or a "
                                f"glob such as {files.join(pattern, '*.txt')!r}")
    else:
        raise FileNotFoundError(f"corpus file {pattern!r} does not exist")
    if kind == "auto":  # one format if the names agree (the description names it)
        kinds = {formats.format_of(p) for p in found}
        kind = kinds.pop() if len(kinds) == 1 else "auto"
    return Source(spec, kind, tuple(found), tuple(d["size"] for d in found.values()),
                  tuple(d["version"] for d in found.values()), text_column=text_column,
                  allow_invalid_utf8=allow_invalid_utf8)


def _format_prefix(spec: str) -> tuple[str, str]:
    """("auto" or a FORMAT, the path or glob) of a spec; ValueError for an unknown prefix."""
    prefix, sep, rest = spec.partition(":")
    if not sep or files.is_url(spec) or os.path.exists(spec) or len(prefix) <= 1:
        return "auto", spec  # a path, a URL, or a Windows drive letter
    if prefix in FORMATS:
        return prefix, rest
    if "/" in prefix or "*" in prefix:
        return "auto", spec
    raise ValueError(f"corpus {spec!r} names the unknown format {prefix!r}: the formats are "
                     f"{', '.join(FORMATS)} (as FORMAT:PATH; without a prefix the format "
                     f"follows the file name), and a corpus may also be a tokenized dataset "
                     f"folder (cem-data tokenize --out)")


def _folder(kind: str) -> str:
    return shakespeare.MILTON_DIR if kind == "milton" else shakespeare.SHAKESPEARE_DIR


def _absolute(path: str) -> str:
    return path if files.is_url(path) else os.path.abspath(path)
