from __future__ import annotations

import json
import logging

from gateway.logs import JsonFormatter


def test_json_lines_carry_the_call() -> None:
    logger = logging.getLogger("callgate.test")
    adapter = logging.LoggerAdapter(logger, {"call_sid": "CA1", "stream_sid": "MZ1"})
    record: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, r: logging.LogRecord) -> None:
            record.append(r)

    h = Keep()
    logger.addHandler(h)
    try:
        adapter.warning("skipped Twilio frame: %s", "bad base64")
    finally:
        logger.removeHandler(h)
    line = json.loads(JsonFormatter().format(record[0]))
    assert line["call_sid"] == "CA1" and line["stream_sid"] == "MZ1"
    assert line["msg"] == "skipped Twilio frame: bad base64"
    assert line["level"] == "warning" and line["logger"] == "callgate.test"
