"""The plugin routes this package's log records (the hook's start-up line) to vLLM's own log handlers."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from nemo_gym_tok.vllm import plugin


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def loggers(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[logging.Logger, _Collect]]:
    ours, vllm_logger = logging.getLogger("nemo_gym_tok"), logging.getLogger("vllm")
    saved = (list(ours.handlers), ours.level, ours.propagate, list(vllm_logger.handlers))
    ours.handlers, ours.level, ours.propagate = [], logging.NOTSET, True
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    yield ours, _Collect()
    ours.handlers, ours.level, ours.propagate = saved[0], saved[1], saved[2]
    vllm_logger.handlers = saved[3]


def test_info_lines_reach_handlers_vllm_configures_later(loggers) -> None:
    ours, collect = loggers
    plugin._log_through_vllm()
    logging.getLogger("vllm").handlers = [collect]  # vLLM configures its handlers after plugins load
    logging.getLogger("nemo_gym_tok.vllm.hook").info("nemo_gym_tok prefix-splice hook active: %s", "closers")
    assert collect.lines == ["nemo_gym_tok prefix-splice hook active: closers"]
    plugin._log_through_vllm()  # idempotent
    assert len(ours.handlers) == 1


def test_left_alone_when_vllm_logging_is_off_or_ours_is_configured(loggers, monkeypatch: pytest.MonkeyPatch) -> None:
    ours, _ = loggers
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    plugin._log_through_vllm()
    assert ours.handlers == []
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING")
    ours.setLevel(logging.DEBUG)
    plugin._log_through_vllm()
    assert ours.handlers == []
