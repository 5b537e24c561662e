"""Logging set-up: human-readable lines, or one JSON object per line for log pipelines.

Every record a call logs carries ``call_sid`` and ``stream_sid`` (the call controller logs
through a ``LoggerAdapter``), so one call's story can be pulled out of a busy gateway's logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["JsonFormatter", "RateLimitedLog", "setup_logging"]

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """``{"ts", "level", "logger", "msg", "call_sid", "stream_sid", ...extra}`` per line."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "call_sid": getattr(record, "call_sid", None),
            "stream_sid": getattr(record, "stream_sid", None),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in out:
                out[key] = value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        sid = getattr(record, "call_sid", None)
        return f"{line} [{sid}]" if sid else line


def setup_logging(level: str = "INFO", *, json_lines: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else _TextFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class RateLimitedLog:
    """At most one warning per ``interval_s``, which counts the ones left out since the last.

    For what a peer can make happen as often as it likes (malformed frames, binary frames,
    sockets that never start): one warning per frame was ~110 KB/s of log at 3,000 bad frames
    a second, enough to fill a disk or drown every other line. The first occurrence is logged
    at once; the rest of the interval is only counted, and when it ends one line says how many
    were left out (:meth:`flush`, scheduled on the running loop; without one, the next line
    logged carries the count). One instance per kind
    of event, shared by every call of the process, so a flood over many sockets is still one
    line per interval. Not thread-safe (the event loop's thread only).
    """

    def __init__(self, logger: logging.Logger, what: str, *, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
            logger: where the lines go (at WARNING).
            what: the occurrences, plural, for the count lines ("skipped Twilio frames").
            interval_s: at most one line per this many seconds.
            clock: monotonic seconds, injectable so tests move time without sleeping.
        """
        if not interval_s > 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        self._logger = logger
        self._what = what
        self._interval_s = interval_s
        self._clock = clock
        self._next = float("-inf")
        self._left_out = 0
        self.total = 0
        """Every occurrence reported, logged or not."""

    def warning(self, msg: str, *args: object, extra: Mapping[str, object] | None = None) -> bool:
        """Report one occurrence; returns whether it was logged."""
        self.total += 1
        now = self._clock()
        if now < self._next:
            self._left_out += 1
            if self._left_out == 1:
                # The count goes out when the interval ends, even if the flood stopped.
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    pass
                else:
                    loop.call_later(self._next - now, self.flush)
            return False
        self._next = now + self._interval_s
        left_out, self._left_out = self._left_out, 0
        if left_out:
            msg = (f"{msg} (and {left_out} more {self._what} not logged in the last "
                   f"{self._interval_s:g} s)")
        self._logger.warning(msg, *args, extra=extra)
        return True

    def flush(self) -> None:
        """Log the count of occurrences left out, if any (say, when a call ends)."""
        if self._left_out:
            self._logger.warning("%d more %s not logged in the last %g s", self._left_out,
                                 self._what, self._interval_s)
            self._left_out = 0
