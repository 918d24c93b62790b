"""deltarl's vLLM plugin turns vLLM's ERROR log of a deltarl "ask again" answer into one DEBUG line,
and lets every other record through (the filter on vLLM's RPC error loggers, without vLLM)."""

from __future__ import annotations

import logging
import sys

import pytest

from deltarl.integrations.vllm.plugin import RPC_ERROR_LOGGERS, AskAgainFilter, quiet_ask_again


def _record(level: int, err: BaseException | None) -> logging.LogRecord:
    exc_info = None
    if err is not None:
        try:
            raise err
        except BaseException:
            exc_info = sys.exc_info()
    return logging.LogRecord("vllm.v1.executor.multiproc_executor", level, __file__, 1, "WorkerProc hit an exception.",
                             None, exc_info)


@pytest.mark.parametrize("kind", ["NotStaged", "NotPublished"])
def test_an_ask_again_answer_is_one_debug_line(kind: str, caplog: pytest.LogCaptureFixture) -> None:
    err = RuntimeError(f"Worker failed with error '[deltarl:{kind}] version 3 is being staged in the background: ask again'")
    with caplog.at_level(logging.DEBUG, logger="deltarl.integrations.vllm.plugin"):
        assert AskAgainFilter().filter(_record(logging.ERROR, err)) is False
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert f"[deltarl:{kind}] version 3" in caplog.records[0].getMessage()


@pytest.mark.parametrize(("level", "err"), [
    (logging.ERROR, RuntimeError("Worker failed with error '[deltarl:IntegrityError] piece 4 of segment 2'")),
    (logging.ERROR, RuntimeError("CUDA out of memory")),
    (logging.ERROR, None),
    (logging.WARNING, RuntimeError("[deltarl:NotStaged] version 3 is being staged")),
])
def test_everything_else_passes(level: int, err: BaseException | None) -> None:
    assert AskAgainFilter().filter(_record(level, err)) is True


def test_the_filter_goes_on_vllms_rpc_error_loggers_once() -> None:
    quiet_ask_again()
    quiet_ask_again()
    try:
        for name in RPC_ERROR_LOGGERS:
            assert sum(isinstance(f, AskAgainFilter) for f in logging.getLogger(name).filters) == 1
    finally:
        for name in RPC_ERROR_LOGGERS:
            logger = logging.getLogger(name)
            for f in [f for f in logger.filters if isinstance(f, AskAgainFilter)]:
                logger.removeFilter(f)
