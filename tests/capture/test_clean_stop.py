"""A clean stop of the OpenAI server logs no ERROR and no traceback (issue 50): vLLM's
``AsyncLLM.shutdown`` closes the engine client's output socket before it cancels its
output handler, which then logged ``EngineDeadError`` as "output_handler failed"."""

from __future__ import annotations

import logging
import threading

import pytest

from actbus.engine import frontend


def _handler_failed(logger: logging.Logger) -> None:
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        raise EngineDeadError()
    except EngineDeadError:
        logger.exception("AsyncLLM output_handler failed.")  # as vLLM's handler logs it


def _ours(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == frontend.ASYNC_LLM_LOGGER]


def test_the_output_handlers_end_at_a_requested_shutdown_is_not_an_error(monkeypatch, caplog):
    pytest.importorskip("vllm.v1.engine.async_llm")
    from vllm.v1.engine.async_llm import AsyncLLM

    assert frontend.patch()
    monkeypatch.setattr(frontend, "_STOPPING", threading.Event())
    logger = logging.getLogger(frontend.ASYNC_LLM_LOGGER)
    caplog.set_level(logging.INFO, logger=frontend.ASYNC_LLM_LOGGER)
    _handler_failed(logger)  # no shutdown asked for: the engine did die, an ERROR
    (died,) = _ours(caplog)
    assert died.levelno == logging.ERROR and died.exc_info is not None
    caplog.clear()
    AsyncLLM.shutdown(object.__new__(AsyncLLM))  # nothing started: closes nothing
    _handler_failed(logger)
    (ended,) = _ours(caplog)
    assert ended.levelno == logging.INFO and ended.exc_info is None, caplog.text
    assert ended.getMessage() == "[shutdown] AsyncLLM: outputs ended with the engine"
    assert "EngineDeadError" not in caplog.text
    caplog.clear()
    logger.error("AsyncLLM output_handler failed.", exc_info=ValueError("other"))
    assert _ours(caplog)[0].levelno == logging.ERROR  # another error stays one
