"""What the readers of every corpus format share (`cem_jax.data.formats`): the `Document` they
yield, `decode` (strict UTF-8, then normalized: no leading byte-order mark, LF line ends), the
compression a name says (`compression_of`), what a file's first bytes say it is (`sniff`: the
magic bytes of Parquet, ArrayRecord (riegeli), gzip and zstd, and binary data such as NUL), and
the one-line errors of a file that is not what its name or format says (`refusal`,
`check_head`) or that is truncated or damaged (`damaged`).
"""

from __future__ import annotations

import dataclasses
import os
from typing import IO

ALLOW_INVALID_UTF8_HINT = ("set data.allow_invalid_utf8=true (--allow-invalid-utf8 of cem-data "
                           "and cem-eval)")
SNIFF_BYTES = 1 << 16  # how much of a file's start is checked for what it is

_COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_MAGIC = ((b"PAR1", "parquet"), (bytes.fromhex("83af70d10d884a3f"), "arrayrecord"),
          (b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"))
_CONTROL = bytes(sorted(set(range(32)) - set(b"\t\n\v\f\r\x1b")))  # never in text (but ESC)
_LABEL = {"text": "text", "jsonl": "JSONL", "parquet": "a Parquet file",
          "arrayrecord": "an ArrayRecord file", "gzip": "gzip-compressed as its name says",
          "zstd": "zstd-compressed as its name says"}
_WHAT = {"parquet": "a Parquet file", "arrayrecord": "an ArrayRecord file",
         "gzip": "gzip-compressed", "zstd": "zstd-compressed", "text": "text", "empty": "empty",
         "binary": "binary data"}
_NAME_IT = {"parquet": "give it a .parquet name or the prefix parquet:",
            "arrayrecord": "give it an .array_record name or the prefix arrayrecord:",
            "gzip": "if it holds text or JSONL, name it so (.txt.gz, .jsonl.gz) or use the "
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
    """What a file's first bytes say it is: "empty", "parquet", "arrayrecord", "gzip", "zstd",
    "binary" (over 1% control bytes such as NUL, never in text), else "text"."""
    if not head:
        return "empty"
    kind = next((kind for magic, kind in _MAGIC if head.startswith(magic)), None)
    if kind:
        return kind
    return "binary" if _control_bytes(head) * 100 > len(head) else "text"


def _control_bytes(head: bytes) -> int:
    return len(head) - len(head.translate(None, _CONTROL))


def refusal(path: str, head: bytes, wanted: str, decompressed: str | None = None) -> ValueError:
    """The one-line error of file `path` starting with `head`, which is not `wanted` (a format
    or a compression); `decompressed`: the compression `head` came out of."""
    found = sniff(head)
    what = _WHAT[found]
    if found == "binary":
        what += (f" ({_control_bytes(head)} of its first {len(head)} bytes are control bytes "
                 "such as NUL)")
    if found == "text" and wanted in _COMPRESSIONS.values():
        return ValueError(f"{path} is text, not {_LABEL[wanted]}: remove the compression "
                          "suffix from its name")
    if decompressed:
        return ValueError(f"{path} decompressed ({decompressed}) is {what}, not {_LABEL[wanted]}:"
                          f" decompress it, then {_NAME_IT[found]}")
    return ValueError(f"{path} is {what}, not {_LABEL[wanted]}: {_NAME_IT[found]}")


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
