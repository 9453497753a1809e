"""What the readers of every corpus format share (`cem_jax.data.formats`): the `Document` they
yield, the `Part` of a file read alone, `decode` (strict UTF-8, then normalized: no leading
byte-order mark, LF line ends), the compression a name says (`compression_of`), what a file's
first bytes say it is (`sniff`: the magic bytes of a format of the table (Parquet, ArrayRecord),
of gzip and zstd, and binary data such as NUL), and the one-line errors of a file that is not
what its name or format says (`refusal`, `check_head`) or that is truncated or damaged
(`damaged`).

The formats' magic bytes and names in messages are read from the table of
`cem_jax.data.formats`, which imports the readers, which import this module: it is looked up
when a file is checked, not when this module is imported.
"""

from __future__ import annotations

import dataclasses
import os
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from cem_jax.data.formats import Format

ALLOW_INVALID_UTF8_HINT = ("set data.allow_invalid_utf8=true (--allow-invalid-utf8 of cem-data "
                           "and cem-eval)")
SNIFF_BYTES = 1 << 16  # how much of a file's start is checked for what it is

_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_COMPRESSION_MAGIC = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}
_CONTROL = bytes(sorted(set(range(32)) - set(b"\t\n\v\f\r\x1b")))  # never in text (but ESC)
# What a file whose first bytes show no format of the table is (compressed, text, empty or
# binary), and what to do with it.
_WHAT = {"gzip": "gzip-compressed", "zstd": "zstd-compressed", "text": "text", "empty": "empty",
         "binary": "binary data"}
_NAME_IT = {"gzip": "if it holds text or JSONL, name it so (.txt.gz, .jsonl.gz) or use the "
                    "prefix text: or jsonl:",
            "zstd": "if it holds text or JSONL, name it so (.txt.zst, .jsonl.zst) or use the "
                    "prefix text: or jsonl:",
            "text": "give it a name for what it holds (.txt, .jsonl, or .gz/.zst when "
                    "compressed) or the prefix text: or jsonl:",
            "empty": "download it again",
            "binary": "check that it is the file you meant (text in UTF-16 or UTF-32: convert "
                      "it to UTF-8)"}


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: `name` ("path", "path:LINE" of JSONL, "path[ROW]" of a Parquet row or an
    ArrayRecord record; a built-in work's name) and its normalized `text` (possibly empty)."""

    name: str
    text: str


@dataclasses.dataclass(frozen=True)
class Part:
    """A piece of one file that can be read alone: Parquet row groups [start, stop), or the whole
    file (start = stop = None); `size` in bytes (Parquet: of the text column, uncompressed; else
    the file on disk) for balancing work."""

    start: int | None
    stop: int | None
    size: int


def compression_of(path: str) -> str | None:
    """"gzip" for a name ending in .gz, "zstd" for .zst or .zstd, else None."""
    return _COMPRESSIONS.get(os.path.splitext(path.lower())[1])


def decode(data: bytes, where: str, allow_invalid_utf8: bool, offset: int = 0) -> str:
    """UTF-8 bytes -> normalized text (no leading BOM, LF line ends).

    Raises ValueError naming `where` and the byte offset (`offset` + position in `data`) of the
    first invalid byte, unless `allow_invalid_utf8` (then invalid bytes become U+FFFD).
    """
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        if not allow_invalid_utf8:
            bad = data[err.start:err.end]
            raise ValueError(
                f"{where}: invalid UTF-8 at byte offset {offset + err.start} ({err.reason}: "
                f"{bad!r}); fix the file or {ALLOW_INVALID_UTF8_HINT} to replace invalid bytes "
                "with U+FFFD") from None
        text = data.decode("utf-8", errors="replace")
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def sniff(head: bytes) -> str:
    """What a file's first bytes say it is: "empty"; the format of the table whose magic bytes
    they start with ("parquet", "arrayrecord"); "gzip" or "zstd"; "binary" (over 1% control
    bytes such as NUL, never in text), else "text"."""
    if not head:
        return "empty"
    magic = {f.name: f.magic for f in _formats().values() if f.magic} | _COMPRESSION_MAGIC
    kind = next((kind for kind, start in magic.items() if head.startswith(start)), None)
    if kind:
        return kind
    return "binary" if _control_bytes(head) * 100 > len(head) else "text"


def _control_bytes(head: bytes) -> int:
    return len(head) - len(head.translate(None, _CONTROL))


def refusal(path: str, head: bytes, wanted: str, decompressed: str | None = None) -> ValueError:
    """The one-line error of file `path` starting with `head`, which is not `wanted` (a format
    or a compression); `decompressed`: the compression `head` came out of."""
    found = sniff(head)
    what, name_it = _found(found)
    if found == "binary":
        what += (f" ({_control_bytes(head)} of its first {len(head)} bytes are control bytes "
                 "such as NUL)")
    label = (f"{wanted}-compressed as its name says" if wanted in _COMPRESSION_MAGIC
             else _formats()[wanted].label)
    if found == "text" and wanted in _COMPRESSION_MAGIC:
        return ValueError(f"{path} is text, not {label}: remove the compression suffix from "
                          "its name")
    if decompressed:
        return ValueError(f"{path} decompressed ({decompressed}) is {what}, not {label}: "
                          f"decompress it, then {name_it}")
    return ValueError(f"{path} is {what}, not {label}: {name_it}")


def _found(found: str) -> tuple[str, str]:
    """What a file that sniffs as `found` is, and what to do to read it: a file of a format of
    the table is named for it (a .parquet name or the prefix parquet:)."""
    if found in _WHAT:
        return _WHAT[found], _NAME_IT[found]
    fmt = _formats()[found]
    suffix = fmt.suffixes[0]
    article = "an" if suffix[1] in "aeiou" else "a"  # as it is read: "an .array_record name"
    return fmt.label, f"give it {article} {suffix} name or the prefix {fmt.name}:"


def _formats() -> dict[str, Format]:
    """The formats of the table by name (`cem_jax.data.formats.BY_NAME`), imported when a file
    is checked: the table names the readers, which import this module."""
    from cem_jax.data.formats import BY_NAME

    return BY_NAME


def damaged(path: str, what: str, err: object) -> ValueError:
    """The one-line error of file `path`, truncated or damaged as its reader `what` found
    (`err`: the reader's error, or the reason)."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ValueError(f"{path} is truncated or damaged ({what}: {reason}): download it again")


def check_head(f: IO[bytes], path: str, allowed: set[str], wanted: str) -> None:
    """Raise `refusal` (not `wanted`) unless the first SNIFF_BYTES of seekable file `f`, of
    `path`, sniff as one of `allowed`; `f` is left at its start."""
    head = f.read(SNIFF_BYTES)
    f.seek(0)
    if sniff(head) not in allowed:
        raise refusal(path, head, wanted)
