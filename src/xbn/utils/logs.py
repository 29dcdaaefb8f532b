"""The console a person reads: xbn's own lines at INFO, other libraries' only from WARNING; `-v` brings
everything back, with the logger's name and level on every line."""

from __future__ import annotations

import logging
import os
import sys


class _ConsoleHandler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment, as logging's last resort does: a stream replaced after
    configure_logging (pytest's capture, a notebook's redirect) is followed, never written to once closed."""

    xbn_console = True  # ours: the next configure_logging replaces it

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ and setStream assign it: sys.stderr wins
        pass


class _ConsoleFormatter(logging.Formatter):
    """xbn's INFO lines as plain sentences; warnings and errors (and everything under -v) with their source."""

    def __init__(self, verbose: bool, prefix: str = ""):
        super().__init__()
        self.verbose, self.prefix = verbose, prefix

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if not self.verbose and record.levelno < logging.WARNING and record.name.startswith("xbn"):
            return f"{self.prefix}{message}"
        return f"{self.prefix}{record.levelname} {record.name}: {message}"


def configure_logging(verbose: bool = False, prefix: str = "", level: int = logging.INFO) -> None:
    """Route every logger to stderr through one handler: `level` for xbn, WARNING for the libraries (INFO for
    everyone with `verbose`). Call it before MLflow is imported: MLflow reads its level from the environment."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "INFO" if verbose else "WARNING")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true" if verbose else "false")
    root = logging.getLogger()
    for handler in list(root.handlers):  # ours from an earlier call; others' (e.g. pytest's capture) stay
        if getattr(handler, "xbn_console", False):
            root.removeHandler(handler)
    handler = _ConsoleHandler()
    handler.setFormatter(_ConsoleFormatter(verbose, prefix))
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("xbn").setLevel(logging.DEBUG if verbose else level)
    if not verbose:
        # Libraries that set their own loggers' levels on import (great-expectations, faiss's loader) still
        # get no INFO line through: the handler itself passes only xbn's INFO.
        handler.addFilter(lambda record: record.levelno >= logging.WARNING or record.name.startswith("xbn"))
    logging.captureWarnings(True)  # warnings go through the same handler, with their source
