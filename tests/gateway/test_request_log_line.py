"""The request log's line (`InferenceCall._observe`): the record `logger.info` made, file, line and function included,
made without `Logger.findCaller`'s walk of the stack."""

import gc
import logging
import types
from datetime import UTC, datetime

import pytest
from django.conf import settings

from endpoints.gateway import call as call_module
from endpoints.gateway.call import InferenceCall
from endpoints.gateway.tally import UsageTally

# Every attribute of a record a format may name (`logging.LogRecord`), the call site's included.
EVERY_FIELD = (
    "%(asctime)s|%(created)f|%(filename)s|%(funcName)s|%(levelname)s|%(levelno)s|%(lineno)d|%(message)s|"
    "%(module)s|%(msecs)d|%(name)s|%(pathname)s|%(process)d|%(processName)s|%(relativeCreated)d|"
    "%(thread)d|%(threadName)s"
)


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept():
    handler, level = _Kept(), call_module.logger.level
    call_module.logger.addHandler(handler)
    call_module.logger.setLevel(
        logging.INFO
    )  # NOTE: `setLevel`, which clears the loggers' cache of `isEnabledFor`
    yield handler
    call_module.logger.setLevel(level)
    call_module.logger.removeHandler(handler)


def a_finished_call(*, replica: bool = True) -> InferenceCall:
    usage = UsageTally()
    usage.take_totals(
        {"prompt_tokens": 7, "completion_tokens": 16, "prompt_tokens_details": {"cached_tokens": 3}}
    )
    return InferenceCall(
        request_id="req_0123456789abcdef",
        request=types.SimpleNamespace(stream=False, progress=False),
        caller=types.SimpleNamespace(organization_id=41, api_key_id=6),
        endpoint=types.SimpleNamespace(name="mock"),
        client=None,
        receive=None,
        send=None,
        started_at=datetime.now(UTC),
        usage=usage,
        cold_start_s=1.23456,
        replica=types.SimpleNamespace(id="3d769e6b-67d7-4d3d-8f0b-321feaa3a888") if replica else None,
        metrics=types.SimpleNamespace(observe_request=lambda *args: None),
    )


def logged(call: InferenceCall, kept: _Kept, outcome: str = "ok") -> logging.LogRecord:
    kept.records.clear()
    call._observe(outcome=outcome)
    [record] = kept.records
    return record


def as_logger_info_made_it(record: logging.LogRecord, kept: _Kept) -> logging.LogRecord:
    """The same line through `logger.info`, from the same call site and at the same time."""
    kept.records.clear()
    call_module.logger.info(record.msg, *record.args)
    [reference] = kept.records
    for name in (
        "pathname",
        "filename",
        "module",
        "lineno",
        "funcName",
        "created",
        "msecs",
        "relativeCreated",
    ):
        setattr(reference, name, getattr(record, name))
    return reference


@pytest.mark.parametrize("replica", [True, False])
def test_the_request_line_is_written_byte_for_byte_as_logger_info_wrote_it(kept, replica):
    record = logged(a_finished_call(replica=replica), kept)
    reference = as_logger_info_made_it(record, kept)
    plain = logging.Formatter(settings.LOGGING["formatters"]["plain"]["format"])
    assert plain.format(record) == plain.format(reference)
    assert logging.Formatter(EVERY_FIELD).format(record) == logging.Formatter(EVERY_FIELD).format(reference)
    assert vars(record) == vars(reference)
    assert record.getMessage().startswith(
        "request_id=req_0123456789abcdef org=41 key=6 endpoint=mock replica="
    )
    assert record.getMessage().endswith(
        " status=ok prompt=7 cached=3 completion=16 cold_start_s=1.235 duration_s="
        + record.getMessage().rpartition("=")[2]
    )


def test_the_request_lines_record_names_its_own_call_site(kept):
    record = logged(a_finished_call(), kept)
    code = InferenceCall._observe.__code__
    lines = [line for _, _, line in code.co_lines() if line is not None]
    assert (record.pathname, record.filename, record.module, record.funcName) == (
        code.co_filename,
        "call.py",
        "call",
        "_observe",
    )
    assert min(lines) <= record.lineno <= max(lines)


def test_the_request_line_is_made_without_walking_the_stack_for_its_caller(kept, monkeypatch):
    walks = []
    find_caller = logging.Logger.findCaller

    def counted(self, *args, **kwargs):
        walks.append(self.name)
        return find_caller(self, *args, **kwargs)

    monkeypatch.setattr(logging.Logger, "findCaller", counted)
    logged(a_finished_call(), kept)
    assert walks == []


def test_no_request_line_is_made_when_its_logger_is_above_info(kept):
    call_module.logger.setLevel(logging.WARNING)
    kept.records.clear()
    a_finished_call()._observe(outcome="ok")
    assert kept.records == []


def test_the_request_line_leaves_no_reference_cycle_for_the_collector(kept):
    """The gateway runs with a young-generation threshold of 20,000 (`endpoints.gateway.app`): a cycle a call (a frame
    holding itself, and with it the call) would keep every finished call until a collection."""
    gc.collect()
    gc.disable()
    try:
        call = a_finished_call()
        call._observe(outcome="ok")
        del call
        assert gc.collect() == 0
    finally:
        gc.enable()
