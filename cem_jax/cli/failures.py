"""How a command other than cem-train ends on an error (docs/exit_statuses.md): one line on
stderr, "cem-X: error: ...", and its exit status."""

from __future__ import annotations

import sys

from cem_jax.data.storage_errors import storage_error


def failed(program: str, err: Exception, refusals: tuple[type[Exception], ...]) -> int:
    """The exit status of a command that `err` ended, after its one line on stderr: 1 for a
    storage failure (`cem_jax.data.storage_errors.storage_error`: run it again; checked first,
    as TensorStore's failures are ValueErrors), 2 for one of `refusals` (the input or the
    options as given); any other error is a crash: raised again (its traceback, status 1)."""
    if (said := storage_error(err)) is not None:
        print(f"{program}: error: {said}", file=sys.stderr)
        return 1
    if not isinstance(err, refusals):
        raise err
    print(f"{program}: error: {err}", file=sys.stderr)
    return 2
