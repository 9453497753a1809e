"""cem-train's messages: the "cem_jax" loggers on stdout, from process 0 only (warnings from
every process), prefixed with the process index in multi-host runs, written through tqdm so a
progress bar on the terminal stays below them."""

from __future__ import annotations

import logging
import sys

import jax
from tqdm import tqdm


class _ProcessFormatter(logging.Formatter):
    """The message alone; in a multi-host run, prefixed with "[process i/n]"."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if jax.distributed.is_initialized() and jax.process_count() > 1:
            return f"[process {jax.process_index()}/{jax.process_count()}] {message}"
        return message


def _lead_or_warning(record: logging.LogRecord) -> bool:
    """Process 0's messages, and every process's warnings and errors."""
    return record.levelno >= logging.WARNING or not jax.distributed.is_initialized() \
        or jax.process_index() == 0


class _StdoutHandler(logging.Handler):
    """Each record a line on stdout, through `tqdm.write` (a progress bar on the terminal is
    cleared and drawn again below it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:  # logging's contract: report the failure, never raise
            self.handleError(record)


def log_to_stdout() -> None:
    """Print the "cem_jax" loggers' messages on stdout (`cem-train`'s output; see the module
    docstring). Idempotent: a second call replaces the handler of the first."""
    root = logging.getLogger("cem_jax")
    for handler in [h for h in root.handlers if isinstance(h, _StdoutHandler)]:
        root.removeHandler(handler)
    handler = _StdoutHandler()
    handler.setFormatter(_ProcessFormatter("%(message)s"))
    handler.addFilter(_lead_or_warning)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False  # not again through handlers others put on the root logger
