"""The level and fallback output of the `deepinfer` logger hierarchy.

Every module logs through `logging.getLogger(__name__)`, so all of them sit under the `deepinfer`
logger. `configure_logging()` runs when `deepinfer` is imported and sets that logger's level from
DEEPINFER_LOG_LEVEL (INFO when unset). A caller that knows better (the server's `--log-level`)
calls it again with an explicit level.

It does not touch the root logger or any handler an application installed: records still
propagate to the root. The one handler it adds (only when `deepinfer` has none) writes to stderr
only while the root logger has no handler, so a script that never configures logging still sees
deepinfer's INFO lines, and an application that does (`logging.basicConfig`, pytest) sees each
record once, through its own handlers.
"""
from __future__ import annotations

import logging
import sys

import deepinfer.envs as envs   # the module itself: deepinfer/__init__.py imports this file

LOGGER_NAME = "deepinfer"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _StderrUnlessRootHandles(logging.StreamHandler):
    """stderr output for deepinfer records that the root logger would otherwise drop."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return      # the record propagates to the application's handlers
        self.stream = sys.stderr    # follow redirections made after import (pytest's capsys)
        super().emit(record)


def configure_logging(level: str | int | None = None) -> logging.Logger:
    """Set the `deepinfer` logger's level: `level` if given (a name such as "debug", or a number),
    else DEEPINFER_LOG_LEVEL read now. Returns the logger."""
    if level is None:
        level = envs.get("DEEPINFER_LOG_LEVEL")
    if isinstance(level, str):
        name = level.strip().upper()
        if name not in logging.getLevelNamesMapping():
            raise ValueError(f"log level: expected a level name such as DEBUG, INFO, WARNING or ERROR, got {level!r}")
        level = logging.getLevelNamesMapping()[name]
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not logger.handlers:
        handler = _StderrUnlessRootHandles()
        handler.setFormatter(logging.Formatter(FORMAT))
        logger.addHandler(handler)
    return logger
