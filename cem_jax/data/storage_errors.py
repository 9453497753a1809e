"""Whether an error means that object storage could not be reached or failed (a network cut, an
outage, a stopped emulator), and the one line a command prints for it instead of a traceback
(`storage_error`). `cem_jax.data.files` notes the URL a failed call was reading or writing on
the exception (`NOTE`); the commands (cem-data, cem-train, cem-eval, cem-sample, cem-export,
cem-import) print the line and exit with status 1, cem-train with 75, which its launchers
relaunch (docs/exit_statuses.md).
"""

from __future__ import annotations

import re
import sys

NOTE = "storage URL: "  # the note on an exception naming the URL it happened at
_STATUS_TEXT = re.compile(r"\b(?:UNAVAILABLE|DEADLINE_EXCEEDED): |\bCURL error\b|"
                          r"retry attempts failed")  # TensorStore's (orbax's arrays) words
_URL_IN_TEXT = re.compile(r"\bgc?s://[^\s\"'`,;()\[\]]+")
_STORAGE_MODULES = ("gcsfs", "fsspec", "aiohttp", "google.auth", "google.api_core",
                    "google.cloud.storage", "tensorstore", "requests", "urllib3",
                    "cem_jax.data.files")


def storage_error(err: BaseException) -> str | None:
    """One line saying that object storage could not be reached or failed, when that is what
    `err` is or what caused it (its `__cause__`/`__context__` chain); None for any other error,
    and for a stop (KeyboardInterrupt, `cem_jax.exits.StoppedBySignal`).

    Recognised: aiohttp's ClientError (ClientConnectorError: nothing listens; a reset, a
    timeout), gcsfs's HttpError of a retried status (5xx, 408, 429: what is left after gcsfs's
    retries), google-auth's TransportError (no token: the metadata server unreachable),
    google-api-core's server errors, TensorStore's "UNAVAILABLE: ", "DEADLINE_EXCEEDED: " and
    retries-exhausted ValueError (orbax's checkpoints), and a ConnectionError or TimeoutError
    raised through a storage library or this module (a connection refused, an fsspec timeout).

        object storage unreachable or failing at gs://b/tokens/manifest.json
        (ClientConnectorError: Cannot connect to host ...): nothing was lost; run the same
        command again

    (one line). The URL is the one a call of this module was reading or writing, else a gs://
    URL in the error's text (TensorStore names its own), else left out. What was written before
    the failure is kept, and a file being written does not appear (`writing`): the same
    command, run again once the storage answers, goes on from there.
    """
    if not isinstance(err, Exception):
        return None
    chain = _chain(err)
    failures = [e for e in chain if _is_storage_failure(e)]
    if not failures:
        return None
    failure = next((e for e in failures if str(e).strip()), failures[0])  # one that says why
    url = next((note[len(NOTE):] for e in chain for note in getattr(e, "__notes__", ())
                if isinstance(note, str) and note.startswith(NOTE)), None)
    if url is None:
        url = next((m.group() for e in chain if (m := _URL_IN_TEXT.search(str(e)))), None)
    retry = sys.modules.get("gcsfs.retry")
    if retry is not None and isinstance(failure, retry.HttpError):
        reason = f"HTTP status {failure.code}"
    else:
        text = " ".join(str(failure).split())
        reason = type(failure).__name__ + (f": {text}" if text else "")
    if len(reason) > 240:
        reason = reason[:239] + "…"
    return (f"object storage unreachable or failing{f' at {url}' if url else ''} ({reason}): "
            f"nothing was lost; run the same command again")


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and what caused it: its `__cause__`s and (unless suppressed) `__context__`s."""
    chain: list[BaseException] = []
    todo: list[BaseException | None] = [err]
    while todo:
        e = todo.pop(0)
        if e is None or any(e is seen for seen in chain):
            continue
        chain.append(e)
        todo.append(e.__cause__)
        if not e.__suppress_context__:
            todo.append(e.__context__)
    return chain


def _is_storage_failure(e: BaseException) -> bool:
    """Whether `e` itself says that object storage is unreachable or failed (see
    `storage_error`). A library not imported cannot have raised it: none is imported here."""
    modules = sys.modules
    if (aiohttp := modules.get("aiohttp")) is not None and isinstance(e, aiohttp.ClientError):
        return True
    if (retry := modules.get("gcsfs.retry")) is not None and isinstance(e, retry.HttpError):
        return e.code is None or e.code in retry.errs
    auth = modules.get("google.auth.exceptions")
    if auth is not None and isinstance(e, auth.TransportError):
        return True
    api = modules.get("google.api_core.exceptions")
    if api is not None and isinstance(e, (api.ServerError, api.TooManyRequests,
                                          api.RetryError)):
        return True
    if isinstance(e, ValueError) and _STATUS_TEXT.search(str(e)):
        return True
    requests = modules.get("requests.exceptions")
    network = (ConnectionError, TimeoutError) + (
        (requests.ConnectionError, requests.Timeout) if requests is not None else ())
    return isinstance(e, network) and _raised_through_storage(e)


def _raised_through_storage(e: BaseException) -> bool:
    """Whether `e` was raised in, or passed through, a storage library or this module."""
    tb = e.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_globals.get("__name__", "")
        if any(name == m or name.startswith(m + ".") for m in _STORAGE_MODULES):
            return True
        tb = tb.tb_next
    return False
