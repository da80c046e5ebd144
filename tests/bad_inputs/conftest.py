"""Watches the log while the bad-input suite runs: a gym server that logs a traceback (or an unexpected error) fails."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

WATCHED = ("uvicorn.error", "nemo_gym_tok.servers", "")
"""uvicorn logs an app's exception on uvicorn.error (which does not propagate to the root); the gym's own guard
logs on nemo_gym_tok.servers; the root catches the rest (asyncio's "exception was never retrieved")."""


class _Watch(logging.Filter):
    """A filter, not a handler: uvicorn's logging setup (run again by every in-process server) drops handlers it did
    not configure, but keeps filters."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if (
            record.exc_info
            or "Traceback" in text
            or record.name == "nemo_gym_tok.servers"
            and record.levelno >= logging.ERROR
        ):
            self.bad.append(f"{record.name}: {text[:300]}")
        return True


@pytest.fixture(autouse=True)
def no_traceback_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Every test of the suite ends with no traceback and no unexpected-error line from any gym server."""
    watch = _Watch()
    loggers = [logging.getLogger(name) for name in WATCHED]
    for logger in loggers:
        logger.addFilter(watch)
    caplog.handler.addFilter(watch)  # records that propagate to the root reach caplog's handler
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(watch)
        caplog.handler.removeFilter(watch)
    assert not watch.bad, "a gym server logged a traceback or an unexpected error:\n" + "\n".join(watch.bad)
